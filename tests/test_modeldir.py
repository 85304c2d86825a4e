"""The model directory: bitwise round trip, and clean failures on bad directories."""

import json
import pickle

import pytest
import torch

from frawdllm import FrawdLLM, ModelConfig, get_config
from frawdllm.errors import FrawdError
from frawdllm.modeldir import CONFIG_FILE, FORMAT_VERSION, WEIGHTS_FILE


def tiny(**kw) -> FrawdLLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, n_embd=16, n_layer=2, n_head=2, context_length=16,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    return FrawdLLM(cfg)


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": False}, {"pos_encoding": "rope", "use_rmsnorm": True,
                                                                  "use_swiglu": True, "n_kv_head": 1}])
def test_save_load_round_trip_is_bitwise(tmp_path, kw):
    model = tiny(**kw)
    model.save_pretrained(tmp_path / "m")
    loaded = FrawdLLM.from_pretrained(tmp_path / "m")
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    if model.config.tie_embeddings:
        assert loaded.lm_head.weight.data_ptr() == loaded.embed.tok.weight.data_ptr()
    ids = torch.randint(0, 50, (1, 8))
    assert torch.equal(model.eval()(ids)[0], loaded.eval()(ids)[0])


def test_directory_holds_config_with_format_version_and_no_temp_files(tmp_path):
    tiny().save_pretrained(tmp_path)
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["format_version"] == FORMAT_VERSION
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_anything_is_written(tmp_path):
    from frawdllm.tokenizer import train_tokenizer

    tok = train_tokenizer(["".join(chr(0x400 + i) for i in range(60))], "char")  # 60 + 7 specials > 50
    for given in (tok, tok.backend, tmp_path / "tok.json"):
        tok.save(tmp_path / "tok.json")
        with pytest.raises(FrawdError, match=f"cannot save {tmp_path / 'm'}: the tokenizer has 67 ids but the "
                                             "model only 50"):
            tiny().save_pretrained(tmp_path / "m", tokenizer=given)
        assert not (tmp_path / "m").exists()
    small = train_tokenizer(["abc"], "char")
    tiny().save_pretrained(tmp_path / "m", tokenizer=small)  # 10 ids: fits
    assert FrawdLLM.from_pretrained(tmp_path / "m").config.vocab_size == 50


def test_a_tokenizer_given_as_its_folder_is_saved_with_the_model(tmp_path):
    """`tokenizer=FOLDER` (as Tokenizer.load and Engine take it): the copy failed with a bare
    IsADirectoryError after the weights were written, leaving an existing folder with the
    new model and the old tokenizer."""
    from frawdllm.tokenizer import Tokenizer, byte_tokenizer, train_tokenizer

    old, new = byte_tokenizer(), train_tokenizer(["abc"], "char")
    new.save(tmp_path / "tok" / "tokenizer.json")
    tiny().save_pretrained(tmp_path / "m", tokenizer=train_tokenizer(["xyz"], "char"))
    for folder in (tmp_path / "m", tmp_path / "fresh"):
        tiny(tie_embeddings=False).save_pretrained(folder, tokenizer=tmp_path / "tok")
        assert Tokenizer.load(folder).fingerprint == new.fingerprint != old.fingerprint
        assert not FrawdLLM.from_pretrained(folder).config.tie_embeddings


def test_a_save_to_an_empty_path_is_refused(tmp_path, monkeypatch):
    """Path("") is ".": save_pretrained("") wrote into the current folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FrawdError, match="^cannot save: the directory is an empty path$"):
        tiny().save_pretrained("")
    assert not list(tmp_path.iterdir())


def test_a_save_without_a_tokenizer_over_one_that_no_longer_fits_is_refused(tmp_path):
    """The folder's tokenizer.json from an earlier save stays; a smaller model saved over
    it without a tokenizer made a folder no command could load, without a word."""
    from frawdllm.tokenizer import train_tokenizer

    big = train_tokenizer(["".join(chr(0x400 + i) for i in range(60))], "char")  # 67 ids
    big_model = FrawdLLM(get_config("tiny", vocab_size=67, n_layer=1, n_embd=32, n_head=2, context_length=16))
    big_model.save_pretrained(tmp_path / "m", tokenizer=big)
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    with pytest.raises(FrawdError, match=f"cannot save {tmp_path / 'm'}: its tokenizer.json .from an earlier "
                                         "save. has 67 ids but this model only 50"):
        tiny().save_pretrained(tmp_path / "m")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before  # nothing written
    big_model.save_pretrained(tmp_path / "m")  # the kept tokenizer fits: saved, tokenizer kept
    assert (tmp_path / "m" / "tokenizer.json").read_bytes() == before["tokenizer.json"]


SAVE_MISUSE = r"""
import sys
from pathlib import Path
from frawdllm import FrawdError, FrawdLLM, get_config
m = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=300, context_length=32))
file = Path(sys.argv[1]) / "a_file"
file.write_text("x")
for call in [lambda: m.save_pretrained(file), lambda: m.save_pretrained(file.parent / "m", tokenizer=123)]:
    try:
        call()
        print("saved")
    except (FrawdError, TypeError) as exc:
        print(type(exc).__name__, exc)
print(sorted(p.name for p in file.parent.iterdir()))
"""


def test_saving_onto_a_file_or_with_a_tokenizer_of_no_kind_is_one_line(tmp_path):
    """A file as the target was a raw FileExistsError; tokenizer=123 an AttributeError after
    the weights were written."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SAVE_MISUSE, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"FrawdError cannot save {tmp_path / 'a_file'}: it exists and is not a directory",
        "TypeError tokenizer must be a Tokenizer, a tokenizers.Tokenizer or the path of a tokenizer.json; got int",
        "['a_file']",
    ]


class Boom:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


def test_pickle_named_safetensors_is_refused_without_running_it(tmp_path, monkeypatch):
    tiny().save_pretrained(tmp_path)
    (tmp_path / WEIGHTS_FILE).write_bytes(pickle.dumps({"w": Boom()}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FrawdError, match="safetensors"):
        FrawdLLM.from_pretrained(tmp_path)
    assert not (tmp_path / "PWNED").exists()


def test_truncated_weights_fail_cleanly(tmp_path):
    tiny().save_pretrained(tmp_path)
    data = (tmp_path / WEIGHTS_FILE).read_bytes()
    (tmp_path / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(FrawdError, match=WEIGHTS_FILE):
        FrawdLLM.from_pretrained(tmp_path)


def test_missing_files_and_newer_format_fail_with_a_clear_message(tmp_path):
    with pytest.raises(FrawdError, match="not found"):
        FrawdLLM.from_pretrained(tmp_path / "nope")
    tiny().save_pretrained(tmp_path)
    (tmp_path / WEIGHTS_FILE).unlink()
    with pytest.raises(FrawdError, match="missing weights"):
        FrawdLLM.from_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    config["format_version"] = FORMAT_VERSION + 1
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(FrawdError, match="newer"):
        FrawdLLM.from_pretrained(tmp_path)
    (tmp_path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(FrawdError, match="JSON"):
        FrawdLLM.from_pretrained(tmp_path)


def test_config_weights_shape_mismatch_names_the_tensor(tmp_path):
    tiny().save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    config["vocab_size"] = 60
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(FrawdError, match=r"embed\.tok\.weight.*\(50, 16\)"):
        FrawdLLM.from_pretrained(tmp_path)


def test_a_layer_count_mismatch_lists_some_names_and_counts_the_rest(tmp_path):
    tiny().save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    config["n_layer"] = 4  # two layers' tensors missing: more names than the message shows
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(FrawdError, match=r"missing: blocks\.2\.\S+(, \S+){4} and \d+ more; unexpected: -\)"):
        FrawdLLM.from_pretrained(tmp_path)


def test_a_model_no_loader_would_build_is_not_saved(tmp_path):
    """RoPE tables of a 600k context over a 32-wide model: 73 MiB, more than the weights and
    64 MiB. save_pretrained wrote it and every loader refused it."""
    cfg = get_config("tiny-llama", n_layer=1, n_embd=32, n_head=2, n_kv_head=2, vocab_size=64,
                     context_length=600_000)
    with pytest.raises(FrawdError, match=r"cannot save .*: context_length 600,000 needs position tables of 73 MiB as "
                                         r"built, more than the weights \(0\.\d MiB\) and 64 MiB"):
        FrawdLLM(cfg).save_pretrained(tmp_path / "m")
    assert not (tmp_path / "m").exists()
    FrawdLLM(cfg.replace(context_length=500_000)).save_pretrained(tmp_path / "ok")  # 61 MiB: saved and read back
    assert FrawdLLM.from_pretrained(tmp_path / "ok").config.context_length == 500_000


def test_load_model_refuses_an_unknown_kind_naming_the_choices(tmp_path):
    """kind="bogus" was a bare KeyError: 'bogus'."""
    from frawdllm.modeldir import load_model

    tiny().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^kind must be one of 'decoder', 'seq2seq' or None, got 'bogus'$"):
        load_model(tmp_path, kind="bogus")
    assert isinstance(load_model(tmp_path, kind="decoder"), FrawdLLM)


def test_loaded_models_are_in_eval_mode_and_a_tied_head_stored_twice_loads(tmp_path):
    """load_model promises eval mode (a model saved with dropout ran it in every caller that
    did not call .eval()); some writers store a tied head beside the embedding it equals."""
    from safetensors.torch import load_file, save_file

    from frawdllm.modeldir import load_model

    tiny(dropout=0.1).save_pretrained(tmp_path / "m")
    assert not load_model(tmp_path / "m").training
    state = load_file(tmp_path / "m" / WEIGHTS_FILE)
    assert "lm_head.weight" not in state
    save_file({**state, "lm_head.weight": state["embed.tok.weight"].clone()}, tmp_path / "m" / WEIGHTS_FILE)
    loaded = load_model(tmp_path / "m")
    assert torch.equal(loaded.lm_head.weight, state["embed.tok.weight"])
    # a stored head that differs (an untied model's config.json edited to tied) is not dropped silently
    other = {**state, "lm_head.weight": state["embed.tok.weight"] + 0.5}
    save_file(other, tmp_path / "m" / WEIGHTS_FILE)
    with pytest.raises(FrawdError, match=r"holds an lm_head.weight that differs from embed.tok.weight, but "
                                         r"config.json ties them \(tie_embeddings: true\): set it to false"):
        load_model(tmp_path / "m")


def test_unreadable_weights_are_said_so_not_called_missing(tmp_path, monkeypatch):
    """safetensors calls a file it may not read "No such file or directory"."""
    from frawdllm import modeldir
    from frawdllm.modeldir import load_model

    tiny().save_pretrained(tmp_path / "m")
    real_open = open

    def denied(file, *args, **kwargs):  # (the tests run as root: chmod 000 still reads)
        if str(file).endswith(WEIGHTS_FILE):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(modeldir, "open", denied, raising=False)
    with pytest.raises(FrawdError, match=rf"{WEIGHTS_FILE}: cannot read \(Permission denied\)$"):
        load_model(tmp_path / "m")


def test_float64_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny().save_pretrained(tmp_path)
    state = load_file(tmp_path / WEIGHTS_FILE)
    save_file({k: v.double() for k, v in state.items()}, tmp_path / WEIGHTS_FILE)
    with pytest.raises(FrawdError, match=r"is F64; weights must be F32, F16, BF16$"):
        FrawdLLM.from_pretrained(tmp_path)
