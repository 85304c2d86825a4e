"""`frawd import --from-hf` of a transformers checkpoint whose config.json is wrong.

Whatever config.json says, the answer is one `frawd: error:` line naming the file and the
field, never a traceback, and nothing is allocated (the config is checked against the
safetensors header first) or written (no --out folder appears). Before these checks, a
value transformers' strict config classes reject was a huggingface_hub traceback, and a
huge vocab_size / n_positions / max_position_embeddings ran out of memory (tens to
hundreds of GB) building the model.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest

from cli_helpers import run_cli
from frawdllm import FrawdLLM, get_config

pytest.importorskip("transformers")

TINY = dict(vocab_size=101, n_embd=64, n_layer=1, n_head=4, context_length=32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A valid tiny GPT-2 and Llama transformers directory (as `frawd export --format hf` writes)."""
    from frawdllm.export.hf_dir import write_hf_dir

    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name, preset in (("gpt2", "tiny"), ("llama", "tiny-llama")):
        dirs[name] = root / name
        dirs[name].mkdir()
        write_hf_dir(FrawdLLM(get_config(preset, **TINY)), None, dirs[name])
    return dirs


def edited(checkpoint: Path, where: Path, **fields) -> Path:
    """A copy of `checkpoint` in `where` with `fields` set in its config.json."""
    where.mkdir()
    for path in checkpoint.iterdir():
        (where / path.name).write_bytes(path.read_bytes())
    config = json.loads((where / "config.json").read_text())
    config.update(fields)
    (where / "config.json").write_text(json.dumps(config))
    return where


def import_one_line(capsys, source: Path, out: Path) -> str:
    """The one error line `frawd import` prints for `source`; checks that nothing was written."""
    beside = sorted(p.name for p in out.parent.iterdir())
    code, stdout, err = run_cli(capsys, "import", "--from-hf", source, "--out", out)
    assert code == 1, (code, stdout, err)
    assert "Traceback" not in err and "Traceback" not in stdout, err
    assert err.startswith("frawd: error: ") and err.count("\n") == 1, err
    assert not out.exists(), "the output folder was created"
    assert sorted(p.name for p in out.parent.iterdir()) == beside, "something was written beside --out"
    return err


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# (checkpoint, config.json changes, words the one line must contain)
CASES = [
    # transformers' own validation (huggingface_hub strict dataclasses) refuses these
    ("llama", {"num_attention_heads": 3}, ["config.json", "attention heads (3)"]),
    # counts below 1: named (0 was "integer modulo by zero", -4 "head_dim=16 has no equivalent")
    ("llama", {"num_attention_heads": 0}, ["config.json: num_attention_heads=0 must be at least 1"]),
    ("llama", {"num_attention_heads": -4}, ["config.json: num_attention_heads=-4 must be at least 1"]),
    ("gpt2", {"n_layer": 0}, ["config.json: n_layer=0 must be at least 1"]),
    ("llama", {"hidden_size": "64"}, ["config.json", "hidden_size", "expected int"]),
    ("gpt2", {"n_embd": "64"}, ["config.json", "n_embd"]),
    # sizes that asked for tens to hundreds of GB before the weights were compared
    ("llama", {"max_position_embeddings": 1_000_000_000}, ["config.json", "max_position_embeddings"]),
    ("llama", {"vocab_size": 2_000_000_000}, ["config.json", "vocab_size", "101"]),
    ("gpt2", {"vocab_size": 2_000_000_000}, ["config.json", "vocab_size", "101"]),
    ("gpt2", {"n_positions": 2_000_000_000}, ["config.json", "n_positions", "32"]),
    ("llama", {"intermediate_size": 100_000_000}, ["gate_proj", "intermediate_size"]),
    # sizes that fit in memory: refused from the header, naming the field, not a tensor
    ("gpt2", {"vocab_size": 1000}, ["config.json", "vocab_size 1,000", "101"]),
    ("gpt2", {"n_positions": 64}, ["config.json", "n_positions 64", "32"]),
    ("gpt2", {"n_embd": 128}, ["config.json", "n_embd 128", "64"]),
    ("llama", {"num_hidden_layers": 1000}, ["config.json", "num_hidden_layers 1,000", "1 layer"]),
    ("gpt2", {"n_inner": 512}, ["mlp.c_fc", "n_inner"]),
    ("llama", {"num_key_value_heads": 2}, ["k_proj", "num_key_value_heads"]),
    # transformers' GPT-2 defaults (50256) kept with a smaller vocabulary: named pad_token_id
    # (unset here) after two transformers warnings
    ("gpt2", {"bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": None},
     ["config.json", "bos_token_id=50256, eos_token_id=50256 outside the vocabulary (vocab_size=101)"]),
    ("llama", {"pad_token_id": 101}, ["config.json", "pad_token_id=101 outside the vocabulary"]),
    # one bias flag on, the other off (both on, or both off, import): both values shown
    ("llama", {"attention_bias": True, "mlp_bias": False},
     ["config.json", "llama config with attention_bias/mlp_bias=True/False has no FrawdLLM equivalent"]),
    ("llama", {"attention_bias": False, "mlp_bias": True}, ["attention_bias/mlp_bias=False/True"]),
    ("gpt2", {"add_cross_attention": True}, ["config.json", "add_cross_attention", "no FrawdLLM equivalent"]),
    # attention computed another way than FrawdLLM's (the logits would differ, silently)
    ("gpt2", {"scale_attn_weights": False}, ["config.json: gpt2 config with scale_attn_weights=False has no"]),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx=True has no FrawdLLM"]),
]


@pytest.mark.parametrize("kind, changes, words", CASES,
                         ids=[f"{k}-{'-'.join(f'{f}={v}' for f, v in c.items())}" for k, c, _ in CASES])
def test_import_refuses_a_bad_config_in_one_line(checkpoints, tmp_path, capsys, kind, changes, words):
    source = edited(checkpoints[kind], tmp_path / "hf", **changes)
    err = import_one_line(capsys, source, tmp_path / "out")
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("name, said", [
    ("config.json", "is a file, not a transformers model directory"),
    ("m.gguf", "is a file, not a transformers model directory (import a GGUF file with --from-gguf)"),
])
def test_a_file_given_to_import_is_named_a_file(checkpoints, tmp_path, capsys, name, said):
    """`--from-hf DIR/config.json` said "DIR/config.json: no config.json"."""
    (tmp_path / name).write_bytes((checkpoints["gpt2"] / "config.json").read_bytes())
    err = import_one_line(capsys, tmp_path / name, tmp_path / "out")
    assert err == f"frawd: error: {tmp_path / name} {said}\n"


@pytest.mark.parametrize("text, said", [(b"[1, 2]", "config.json: not a JSON object (a list)"),
                                         (b"{bad", "config.json: not a JSON file (Expecting property name"),
                                         (b'{"model_type": "gpt2\xff"}', "config.json: not a JSON file (")])
def test_a_config_that_is_no_json_object_is_said_so(checkpoints, tmp_path, capsys, text, said):
    """A list was "Unrecognized model in DIR. Should have a `model_type` key", invalid JSON
    named the file twice."""
    source = edited(checkpoints["gpt2"], tmp_path / "src")
    (source / "config.json").write_bytes(text)
    err = import_one_line(capsys, source, tmp_path / "out")
    assert f"frawd: error: {source / said}" in err and err.count("config.json") == 1, err


def test_a_huge_config_is_refused_without_allocating(checkpoints, tmp_path, capsys):
    """The 512 GB GPT-2 embedding of vocab_size 2e9 is refused from the header alone."""
    before = peak_rss_mb()
    for field in ("vocab_size", "n_positions"):
        source = edited(checkpoints["gpt2"], tmp_path / field, **{field: 2_000_000_000})
        import_one_line(capsys, source, tmp_path / f"out-{field}")
    assert peak_rss_mb() - before < 200


def test_the_unedited_checkpoints_still_import(checkpoints, tmp_path, capsys):
    for kind, source in checkpoints.items():
        code, stdout, err = run_cli(capsys, "import", "--from-hf", source, "--out", tmp_path / kind)
        # (these checkpoints have no tokenizer: the one warning saying so, nothing else)
        assert code == 0 and err.splitlines() == [f"warning: {source} has no tokenizer.json (nor any other tokenizer "
                                                  "file): imported without a tokenizer, so it runs on token ids from "
                                                  "Python alone (FrawdLLM.from_pretrained: frawd generate, chat, serve "
                                                  "and the Engine need a tokenizer) and exports; copy the "
                                                  "tokenizer.json of the model it came from into the import"]
        assert "imported" in stdout, err
        FrawdLLM.from_pretrained(tmp_path / kind)


def test_transformers_warnings_about_the_config_stay_off_stderr(checkpoints, tmp_path):
    """transformers warned twice about ids outside the vocabulary before our one line (a
    subprocess: in the test session its log handler writes past capsys)."""
    import subprocess
    import sys

    source = edited(checkpoints["gpt2"], tmp_path / "hf", bos_token_id=50256, eos_token_id=50256, pad_token_id=None)
    done = subprocess.run([sys.executable, "-m", "frawdllm.cli", "import", "--from-hf", str(source), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "bos_token_id=50256" in done.stderr


def test_a_config_without_special_ids_takes_them_from_the_other_files_or_is_refused(checkpoints, tmp_path, capsys):
    """bos, eos and pad all null imported as id 0, an ordinary token, without a word: generation
    stopped at it. Now the ids come from the files that give them (generation_config.json,
    tokenizer_config.json, the tokenizer's end-of-text token), with a warning; without any, one
    line names eos_token_id."""
    from frawdllm.export.hf_dir import write_hf_dir
    from frawdllm.tokenizer import byte_tokenizer

    def imported_ids(source: Path, out: str, says: str) -> tuple[int, int, int]:
        code, _, err = run_cli(capsys, "import", "--from-hf", source, "--out", tmp_path / out)
        assert code == 0 and says in err, err
        cfg = FrawdLLM.from_pretrained(tmp_path / out).config
        return cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id

    null_ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    source = edited(checkpoints["llama"], tmp_path / "bare", **null_ids)
    assert imported_ids(source, "gen", "took bos_token_id 2 from generation_config.json") == (2, 3, 0)
    (source / "generation_config.json").unlink()
    err = import_one_line(capsys, source, tmp_path / "refused")
    assert "config.json: llama config has no eos_token_id (null)" in err, err

    tok = byte_tokenizer()  # its tokenizer_config.json names <|bos|> 2, <|eos|> 3, <|pad|> 0
    (tmp_path / "tok").mkdir()
    write_hf_dir(FrawdLLM(get_config("tiny-llama", **{**TINY, "vocab_size": tok.vocab_size})), tok, tmp_path / "tok")
    source = edited(tmp_path / "tok", tmp_path / "named", **null_ids)
    (source / "generation_config.json").unlink()
    assert imported_ids(source, "ours", "has no bos_token_id, eos_token_id, pad_token_id: took bos_token_id 2 "
                                        "(<|bos|>) from tokenizer_config.json; eos_token_id 3") == (2, 3, 0)
    (source / "tokenizer_config.json").unlink()  # only tokenizer.json's <|eos|> names an id (bos, pad: the eos)
    assert imported_ids(source, "end", "has no eos_token_id: took eos_token_id 3 (<|eos|>) from tokenizer.json") == \
        (3, 3, 3)


@pytest.mark.parametrize("generation, said", [
    (None, "config.json: end token id 500 (eos_token_id) is outside the vocabulary (vocab_size 101)"),
    ({"eos_token_id": [3, 500]}, "generation_config.json: end token id 500 (eos_token_id) is outside the vocabulary"),
    ({"do_sample": True, "temperature": -1}, "generation_config.json: temperature must be 0 (greedy) or a finite"),
])
def test_sampling_defaults_the_engine_would_refuse_are_refused_at_import(checkpoints, tmp_path, capsys, generation,
                                                                         said):
    """An end id past the vocabulary among several imported as a stop id the engine then
    refused on every use ("stop token id 500 is outside the vocabulary")."""
    source = edited(checkpoints["llama"], tmp_path / "hf", eos_token_id=[3, 500])
    (source / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (source / "generation_config.json").write_text(json.dumps(generation))
    assert said in import_one_line(capsys, source, tmp_path / "out")


def test_original_gpt2_tensor_names_and_attention_buffers_import(checkpoints, tmp_path, capsys):
    """The Hub's first GPT-2 files name tensors without `transformer.` and hold the causal
    mask buffers (`attn.bias`, `attn.masked_bias`): the same model, the same logits."""
    import torch
    from safetensors.torch import load_file, save_file

    source = edited(checkpoints["gpt2"], tmp_path / "hf")
    weights = load_file(source / "model.safetensors")
    old = {name.removeprefix("transformer."): value for name, value in weights.items()}
    old["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    old["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    assert not any(name.startswith("transformer.") for name in old)
    save_file({k: v.contiguous() for k, v in old.items()}, source / "model.safetensors")
    code, _, err = run_cli(capsys, "import", "--from-hf", checkpoints["gpt2"], "--out", tmp_path / "new")
    assert code == 0, err
    code, _, err = run_cli(capsys, "import", "--from-hf", source, "--out", tmp_path / "old")
    assert code == 0, err
    ids = torch.tensor([[1, 5, 9, 40, 100, 7]])
    new_model, old_model = FrawdLLM.from_pretrained(tmp_path / "new"), FrawdLLM.from_pretrained(tmp_path / "old")
    assert torch.equal(new_model(ids)[0], old_model(ids)[0])


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_a_weights_file_that_is_a_folder_is_named(checkpoints, tmp_path, capsys, name):
    """It said "no model.safetensors (or model.safetensors.index.json)" beside a folder of that name."""
    source = edited(checkpoints["llama"], tmp_path / "hf")
    (source / "model.safetensors").unlink()
    (source / name).mkdir()
    assert f"{source / name} is not a file" in import_one_line(capsys, source, tmp_path / "out")
