"""`frawd pretrain` before the first step: settings checked before any work (a bad start
fails at once and leaves nothing on disk), and `--init-from` an existing model directory."""

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from frawdllm import FrawdLLM, Seq2SeqTransformer, get_config
from frawdllm.cli import main
from frawdllm.data import RandomWindowLoader, read_shard
from frawdllm.errors import FrawdError
from frawdllm.tokenizer import train_tokenizer
from frawdllm.train import PretrainConfig, run_pretraining
from frawdllm.train import pretrain as pretrain_module
from frawdllm.train.checkpoint import latest_checkpoint
from frawdllm.train.rundir import read_metrics

TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "context_length": 32}
WORDS = "the king shall speak of war and peace to his people while rain falls on old stone".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """30 kB of sentences over a small vocabulary: a char model learns it in a few steps."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
             for _ in range(600)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tiny_config(corpus, out, **overrides) -> PretrainConfig:
    values = dict(data=str(corpus), out=str(out), tokenizer="char", doc_split="file", val_fraction=0.1,
                  model=dict(TINY_MODEL), batch_size=8, lr=1e-2, warmup_steps=2, max_steps=30, dtype="fp32",
                  compile=False, device="cpu", eval_interval=0, eval_batches=2, log_interval=1, sample_tokens=0,
                  peak_tflops=1.0, progress=False)
    values.update(overrides)
    return PretrainConfig(**values)


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a start trains a tokenizer or tokenizes the corpus."""
    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the settings were checked")

    monkeypatch.setattr(pretrain_module, "train_tokenizer", forbidden)
    monkeypatch.setattr(pretrain_module, "prepare_shards", forbidden)


def frawd(capsys, *args) -> tuple[int, str, float]:
    """Run `frawd ARGS` in this process: (exit status, stderr, seconds)."""
    start = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        main(list(args))
    elapsed = time.perf_counter() - start
    return info.value.code, capsys.readouterr().err, elapsed


@pytest.fixture(scope="module")
def char_tokenizer(corpus, tmp_path_factory):
    tok = train_tokenizer([corpus.read_text(encoding="utf-8")], kind="char")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(path)
    return path


BAD_STARTS = {
    "no budget": ([], "give a budget"),
    "unknown --set field": (["--max-steps", "5", "--set", "n_layr=2"], "n_layr"),
    "invalid --set value": (["--max-steps", "5", "--set", "n_head=3"], "divisible by n_head"),
    "unparsable --set": (["--max-steps", "5", "--set", "n_layer=two"], "n_layer"),
    "unknown preset": (["--max-steps", "5", "--preset", "huge"], "unknown preset 'huge'"),
    "missing data": (["--max-steps", "5", "--data", "{tmp}/nowhere.txt"], "data source not found"),
    "missing tokenizer": (["--max-steps", "5", "--tokenizer", "{tmp}/tok.json"], "neither a kind"),
    "small bpe vocab": (["--max-steps", "5", "--tokenizer", "bpe", "--vocab-size", "100"], "between 263"),
    "huge bpe vocab": (["--max-steps", "5", "--tokenizer", "bpe", "--vocab-size", "10000000000"], "1,048,576"),
    "vocab below the tokenizer's": (["--max-steps", "5", "--tokenizer", "{tok}", "--set", "vocab_size=10"],
                                    "smaller than the tokenizer's"),
    "resume without a run": (["--max-steps", "5", "--resume"], "no run to resume"),
    "a batch no memory holds": (["--max-steps", "5", "--batch-size", "100000000"], "GiB to train"),
    "negative seed": (["--max-steps", "5", "--seed", "-1"], "seed must be an integer in [0, 2**63)"),
    "huge seed": (["--max-steps", "5", "--seed", str(2**70)], "seed must be an integer in [0, 2**63)"),
}


@pytest.mark.parametrize("case", list(BAD_STARTS))
def test_a_bad_start_fails_at_once_and_writes_nothing(case, corpus, char_tokenizer, tmp_path, capsys, no_work):
    args, message = BAD_STARTS[case]
    args = [a.format(tmp=tmp_path, tok=char_tokenizer) for a in args]
    out = tmp_path / "runs" / "run"
    base = ["pretrain", "--data", str(corpus), "--tokenizer", "char", "--out", str(out), "--no-progress"]
    code, err, seconds = frawd(capsys, *base, *args)
    assert code == 1 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()
    assert seconds < 1.0  # checks only: nothing was tokenized (no_work) or trained


def test_an_existing_run_or_a_file_as_out_is_refused_untouched(corpus, tmp_path, capsys, no_work):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("old\n")
    code, err, _ = frawd(capsys, "pretrain", "--data", str(corpus), "--out", str(run), "--max-steps", "5")
    assert code == 1 and "holds a run that stopped before its first checkpoint" in err
    assert [p.name for p in run.iterdir()] == ["config.yaml"] and (run / "config.yaml").read_text() == "old\n"
    (tmp_path / "file").write_text("x")
    code, err, _ = frawd(capsys, "pretrain", "--data", str(corpus), "--out", str(tmp_path / "file"),
                         "--max-steps", "5")
    assert code == 1 and "is a file" in err


def test_an_out_that_cannot_be_a_folder_names_the_real_cause(corpus, tmp_path, capsys, no_work):
    """`--out afile/run` said "not a directory: afile/run" (afile is the file), and an OUT
    the OS cannot create said "no such file or directory", as if it were missing."""
    (tmp_path / "afile").write_text("x")
    base = ["pretrain", "--data", str(corpus), "--tokenizer", "char", "--max-steps", "2", "--no-progress"]
    for out in (tmp_path / "afile" / "run", tmp_path / "afile" / "a" / "run"):
        for dry in ([], ["--dry-run"]):
            code, err, _ = frawd(capsys, *base, "--out", str(out), *dry)
            assert (code, err) == (1, f"frawd: error: --out {out}: {tmp_path / 'afile'} is a file, not a folder\n")
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc: no folder the OS refuses to create")
    code, err, _ = frawd(capsys, *base, "--out", "/proc/frawd-run")
    assert (code, err) == (1, "frawd: error: --out /proc/frawd-run: cannot create the folder there "
                              "(no such file or directory)\n")


def test_a_start_that_fails_after_the_checks_leaves_nothing_in_the_way(corpus, tmp_path, monkeypatch):
    class Broken(Exception):
        pass

    def broken_trainer(*args, **kwargs):
        raise Broken()

    monkeypatch.setattr(pretrain_module, "Trainer", broken_trainer)
    out = tmp_path / "new" / "run"
    with pytest.raises(Broken):
        run_pretraining(tiny_config(corpus, out, max_steps=2))
    assert not (tmp_path / "new").exists()  # this start made OUT and its parent: both gone
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(Broken):
        run_pretraining(tiny_config(corpus, existing, max_steps=2))
    assert not (existing / "config.yaml").exists()  # the reusable tokenizer and shards may stay
    from frawdllm.train.rundir import lock_holder

    assert lock_holder(existing) is None  # let go: another process (a CLI run) may start there
    monkeypatch.undo()
    for directory in (out, existing):  # the retry needs no --overwrite
        assert run_pretraining(tiny_config(corpus, directory, max_steps=2)).steps == 2


# ---- --init-from -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A finished run's model directory: 30 steps, well below a fresh model's loss."""
    run = tmp_path_factory.mktemp("trained") / "run"
    run_pretraining(tiny_config(corpus, run, max_steps=30))
    return run / "model"


def first_batch_loss(model, run_dir, cfg: PretrainConfig, context_length: int) -> float:
    """The loss of `model` on the first training batch of the run in `run_dir`."""
    train = read_shard(run_dir / "data" / "train.bin")
    x, y = RandomWindowLoader(np.asarray(train), cfg.batch_size, context_length, seed=cfg.seed).next_batch()
    with torch.no_grad():
        return float(model.eval()(x, y)[1])


def test_init_from_starts_at_the_saved_models_loss_trains_and_saves(corpus, trained, tmp_path):
    cfg = tiny_config(corpus, tmp_path / "more", tokenizer=None, model={}, init_from=str(trained), max_steps=5)
    result = run_pretraining(cfg)
    first = [r["loss"] for r in read_metrics(tmp_path / "more") if "loss" in r][0]
    saved = FrawdLLM.from_pretrained(trained)
    assert first == pytest.approx(first_batch_loss(saved, tmp_path / "more", cfg, 32), rel=1e-5)
    torch.manual_seed(cfg.seed)
    fresh = FrawdLLM(saved.config)
    assert first < first_batch_loss(fresh, tmp_path / "more", cfg, 32) - 0.5  # not a fresh initialisation
    assert result.steps == 5
    more = FrawdLLM.from_pretrained(tmp_path / "more" / "model")
    assert more.config == saved.config
    assert not torch.equal(more.state_dict()["blocks.0.attn.qkv.weight"], saved.state_dict()["blocks.0.attn.qkv.weight"])
    # the model's tokenizer came along
    assert (tmp_path / "more" / "model" / "tokenizer.json").read_bytes() == (trained / "tokenizer.json").read_bytes()


def test_init_from_keeps_the_models_sampling_defaults(corpus, trained, tmp_path):
    """An imported model's generation_config.json (temperature 0.6, top-p 0.9) was dropped:
    generate and chat on the trained model fell back to temperature 1."""
    import json
    import shutil

    base = tmp_path / "base"
    shutil.copytree(trained, base)
    (base / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    run_pretraining(tiny_config(corpus, tmp_path / "more", tokenizer=None, model={}, init_from=str(base),
                                max_steps=2))
    for saved in (tmp_path / "more" / "model", latest_checkpoint(tmp_path / "more") / "model"):
        assert json.loads((saved / "generation_config.json").read_text()) == {"temperature": 0.6, "top_p": 0.9}
    assert not (trained / "generation_config.json").exists()  # (and a model without one gives none)
    run_pretraining(tiny_config(corpus, tmp_path / "plain", tokenizer=None, model={}, init_from=str(trained),
                                max_steps=1))
    assert not (tmp_path / "plain" / "model" / "generation_config.json").exists()


def test_init_from_trains_on_shorter_windows_and_keeps_the_models_context(corpus, trained, tmp_path):
    cfg = tiny_config(corpus, tmp_path / "short", tokenizer=str(trained), model={"context_length": 16},
                      init_from=str(trained), max_steps=2)
    run_pretraining(cfg)
    first = [r["loss"] for r in read_metrics(tmp_path / "short") if "loss" in r][0]
    assert first == pytest.approx(first_batch_loss(FrawdLLM.from_pretrained(trained), tmp_path / "short", cfg, 16),
                                  rel=1e-5)
    assert FrawdLLM.from_pretrained(tmp_path / "short" / "model").config.context_length == 32


def test_init_from_with_another_tokenizer_of_the_same_size_or_smaller_is_warned_about(corpus, trained, tmp_path,
                                                                                       capsys):
    """A 69-id char tokenizer on a model of another char vocabulary was accepted without a word."""
    from frawdllm.tokenizer import train_tokenizer

    other = tmp_path / "other.json"
    train_tokenizer(["abc def"], kind="char").save(other)
    cfg = tiny_config(corpus, tmp_path / "other", tokenizer=str(other), model={}, init_from=str(trained), max_steps=1)
    run_pretraining(cfg)
    assert f"warning: --tokenizer {other} is not the tokenizer of --init-from {trained}" in capsys.readouterr().err
    cfg = tiny_config(corpus, tmp_path / "same", tokenizer=str(trained / "tokenizer.json"), model={},
                      init_from=str(trained), max_steps=1)
    run_pretraining(cfg)  # its own tokenizer, named: no warning
    assert "is not the tokenizer of" not in capsys.readouterr().err


def test_init_from_may_change_dropout(corpus, trained, tmp_path):
    cfg = tiny_config(corpus, tmp_path / "drop", tokenizer=None, model={**TINY_MODEL, "dropout": 0.1},
                      init_from=str(trained), max_steps=1)
    run_pretraining(cfg)
    assert FrawdLLM.from_pretrained(tmp_path / "drop" / "model").config.dropout == 0.1


INIT_ERRORS = {
    "conflicting --set": (["--set", "n_layer=3"], "n_layer=3 (the model has 2)"),
    "longer context": (["--set", "context_length=64"], "context_length 64 exceeds"),
    "a kind to train": (["--tokenizer", "bpe"], "with --tokenizer (or none, for the model's), not a kind to train"),
    "a kind, and the model has no tokenizer": (["--init-from", "{bare}", "--tokenizer", "bpe"],
                                               "give a tokenizer.json with --tokenizer, not a kind to train (bpe)"),
    "a preset as well": (["--preset", "tiny"], "--preset and --init-from"),
    "a bigger tokenizer": (["--tokenizer", "{big}"], "use the model's tokenizer"),
    "no tokenizer.json": (["--init-from", "{bare}"], "has no tokenizer.json"),
    "no model": (["--init-from", "{tmp}/nowhere"], "model directory not found"),
    "other weights": (["--init-from", "{wrong}"], "model.safetensors: holds 2 weights but config.json describes"),
    "a translation model": (["--init-from", "{mt}"], "holds an encoder-decoder translation model"),
}


@pytest.mark.parametrize("case", list(INIT_ERRORS))
def test_init_from_errors_are_one_line_before_any_work(case, corpus, trained, tmp_path, capsys, no_work):
    big = tmp_path / "big.json"
    train_tokenizer([corpus.read_text(encoding="utf-8") + "0123456789XYZ"], kind="char").save(big)
    bare = tmp_path / "bare"
    FrawdLLM.from_pretrained(trained).save_pretrained(bare)
    wrong = tmp_path / "wrong"  # the trained model's config and tokenizer, another file's weights
    shutil.copytree(trained, wrong)
    save_file({"x": torch.zeros(2)}, wrong / "model.safetensors")
    mt = tmp_path / "mt"  # an encoder-decoder model with the trained model's tokenizer
    Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=FrawdLLM.from_pretrained(trained).config.vocab_size,
                                  n_embd=32, n_head=2, n_layer=1, n_encoder_layer=1)).save_pretrained(mt)
    shutil.copy(trained / "tokenizer.json", mt / "tokenizer.json")
    args, message = INIT_ERRORS[case]
    args = [a.format(big=big, bare=bare, tmp=tmp_path, wrong=wrong, mt=mt) for a in args]
    out = tmp_path / "run"
    code, err, seconds = frawd(capsys, "pretrain", "--data", str(corpus), "--init-from", str(trained),
                               "--max-steps", "2", "--out", str(out), *args)
    assert code == 1 and message in err and err.count("\n") == 1, err
    assert not out.exists() and seconds < 1.0


def test_the_vocabulary_and_context_checks_hold_at_their_bounds(corpus, trained, tmp_path, capsys, no_work):
    """Each start check at its bound, before any work: a vocab_size equal to the tokenizer's
    is taken, one below refused (the byte tokenizer's 256 bytes and 7 specials counted); a
    tokenizer one id past an --init-from model's vocabulary is refused, as is a context one
    past the model's, and the model's own context is taken."""
    from frawdllm.tokenizer import SPECIAL_TOKENS, Tokenizer

    def start(*args):
        try:
            main(["pretrain", "--data", str(corpus), "--max-steps", "2", "--dry-run", "--out", str(tmp_path / "run"),
                  *args])
            code = 0
        except SystemExit as exit_:
            code = exit_.code
        return code, capsys.readouterr()

    def refused(*args):
        code, seen = start(*args)
        assert code == 1 and seen.err.count("\n") == 1, seen
        return seen.err

    def taken(*args):
        code, seen = start(*args)
        assert code == 0, seen
        return seen.out

    byte = 256 + len(SPECIAL_TOKENS)
    assert f"(vocabulary {byte})" in taken("--tokenizer", "byte")
    assert f"(vocabulary {byte})" in taken("--tokenizer", "byte", "--set", f"vocab_size={byte}")
    assert f"smaller than the tokenizer's {byte}" in refused("--tokenizer", "byte", "--set", f"vocab_size={byte - 1}")
    model = FrawdLLM.from_pretrained(trained).config
    one_more = tmp_path / "one_more.json"  # the corpus's characters and one it lacks
    train_tokenizer([corpus.read_text(encoding="utf-8") + "Q"], kind="char").save(one_more)
    assert Tokenizer.load(one_more).vocab_size == model.vocab_size + 1
    assert "use the model's tokenizer" in refused("--init-from", str(trained), "--tokenizer", str(one_more))
    longer = model.context_length + 1
    assert f"context_length {longer} exceeds" in refused("--init-from", str(trained), "--set", f"context_length={longer}")
    assert f"context {model.context_length}" in taken("--init-from", str(trained), "--set",
                                                      f"context_length={model.context_length}")
    taken("--init-from", str(trained), "--set", f"mlp_hidden={model.ffn_dim}")  # (the width it derives, written out)
    code, seen = start("--init-from", str(trained), "--vocab-size", "500")  # (the model's tokenizer: no BPE to size)
    assert code == 0 and "note: --vocab-size applies to a BPE tokenizer trained here, not to the --init-from " \
        "model's" in seen.err, seen
    assert not (tmp_path / "run").exists()


def test_a_validation_split_evaluates_from_one_window_and_its_target():
    """A window of T tokens needs T+1 (its targets shifted by one): a split of exactly T
    tokens cannot be evaluated (the run says so) and one of T+1 can."""
    from frawdllm.tokenizer import byte_tokenizer
    from frawdllm.train.pretrain import PreparedData, PretrainTask

    model = get_config("tiny", **TINY_MODEL, vocab_size=300)
    cfg = PretrainConfig(max_steps=1, batch_size=2)
    train = np.arange(200, dtype=np.uint16) % 256
    for extra, evaluable in ((0, False), (1, True)):
        data = PreparedData(train, train[:model.context_length + extra], byte_tokenizer(), {}, Path("."))
        assert PretrainTask(data, model, cfg).can_evaluate is evaluable, extra


def test_another_projects_tokenizer_gives_the_model_its_end_of_text_id(tmp_path):
    """The shards end each document with a foreign tokenizer's end-of-text token, so the
    model's eos (and bos, pad: one id for all three, as an imported GPT-2's) is that token,
    not FrawdLLM's id 3, an ordinary token there (generation never stopped). Ids set by
    hand stay."""
    from frawdllm.tokenizer import Tokenizer
    from frawdllm.train.pretrain import model_config_for
    from test_shards import _plain_bpe

    tok = Tokenizer.load(_plain_bpe(tmp_path, ["<s>", "<|endoftext|>"]))
    end = tok.document_end_id()
    assert end == tok.token_to_id("<|endoftext|>") == 1 and not tok.has_frawd_specials()
    model = model_config_for(PretrainConfig(max_steps=1), tok.vocab_size, tok)
    assert (model.eos_token_id, model.bos_token_id, model.pad_token_id) == (end, end, end)
    model = model_config_for(PretrainConfig(max_steps=1, model={"bos_token_id": 0}), tok.vocab_size, tok)
    assert (model.eos_token_id, model.bos_token_id, model.pad_token_id) == (end, 0, end)


def test_an_imported_transformers_gpt2_trains_further(corpus, char_tokenizer, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from frawdllm.export.hf import to_hf_config
    from frawdllm.tokenizer import Tokenizer

    assert Tokenizer.load(char_tokenizer).vocab_size < 101  # a tokenizer smaller than the model's vocabulary fits
    hf_config = to_hf_config(get_config("tiny", vocab_size=101, n_embd=32, n_layer=2, n_head=2, context_length=32))
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_bytes(char_tokenizer.read_bytes())
    main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")])
    main(["pretrain", "--init-from", str(tmp_path / "imported"), "--data", str(corpus), "--doc-split", "file",
          "--val-fraction", "0.1", "--max-steps", "2", "--batch-size", "4", "--dtype", "fp32", "--no-compile",
          "--device", "cpu", "--eval-interval", "0", "--log-interval", "1", "--sample-tokens", "0",
          "--peak-tflops", "1", "--no-progress", "--out", str(tmp_path / "run")])
    assert "tok/s (fp32, eager), MFU" in capsys.readouterr().out  # what ran, said even without progress
    first = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r][0]
    imported = FrawdLLM.from_pretrained(tmp_path / "imported")
    cfg = PretrainConfig(batch_size=4)  # the seed and batch size the run used
    assert first == pytest.approx(first_batch_loss(imported, tmp_path / "run", cfg, 32), rel=1e-5)
    assert FrawdLLM.from_pretrained(tmp_path / "run" / "model").config == imported.config


def test_pretrain_says_when_the_corpus_had_invalid_utf8(corpus, tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(corpus.read_bytes() + b"caf\xe9 \xff\n")  # Latin-1 bytes: replaced, as data prepare says
    run_pretraining(tiny_config(bad, tmp_path / "run", max_steps=1))
    assert "warning: replaced 2 invalid UTF-8 sequence(s) with U+FFFD in 1 file(s)" in capsys.readouterr().err


def test_max_time_none_clears_a_config_files_budget(corpus, tmp_path, capsys):
    """configs/shakespeare_char.yaml sets max_time: a run by steps alone clears it."""
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {corpus}\ntokenizer: char\nmax_time: 100s\n")
    code, err, _ = frawd(capsys, "pretrain", "--config", str(config), "--max-time", "none", "--out",
                         str(tmp_path / "run"), "--dry-run", "--no-progress")
    assert code == 1 and "give a budget" in err  # the config's budget is gone, and no other was given
    from cli_helpers import run_cli

    code, out, err = run_cli(capsys, "pretrain", "--config", config, "--max-time", "none", "--max-steps", "3",
                             "--out", tmp_path / "run", "--dry-run", "--no-progress")
    assert code == 0 and "budget:        max-steps 3\n" in out, (err, out)  # no max-time left


# ---- a --resume whose start fails leaves the run as it was ----------------------------------------

def _run_files(run):
    names = ["config.yaml", "tokenizer.json", *(f"data/{p.name}" for p in sorted((run / "data").iterdir()))]
    return {name: (run / name).read_bytes() for name in names if (run / name).is_file()}


def test_a_failed_resume_with_other_data_leaves_config_and_data_as_they_were(corpus, tmp_path):
    run = tmp_path / "run"
    run_pretraining(tiny_config(corpus, run, max_steps=2))
    before = _run_files(run)
    small = tmp_path / "small.txt"
    small.write_text("The king shall speak.\n", encoding="utf-8")  # fewer tokens than one window needs
    with pytest.raises(FrawdError, match="only .* tokens; a window of context_length 32"):
        run_pretraining(tiny_config(corpus, run, resume=True, data=str(small), max_steps=4))
    assert _run_files(run) == before  # config.yaml, tokenizer.json and data/ untouched
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # no backup left
    assert run_pretraining(tiny_config(corpus, run, resume=True, max_steps=3)).steps == 3  # a plain --resume


def test_a_resume_on_data_changed_since_the_checkpoint_says_so(corpus, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    shutil.copy(corpus, data)
    run = tmp_path / "run"
    run_pretraining(tiny_config(data, run, max_steps=2))
    run_pretraining(tiny_config(data, run, resume=True, max_steps=3))
    assert "changed since the checkpoint" not in capsys.readouterr().err  # the same data: nothing to say
    os.utime(data)  # touched: its shards are made again, the same
    run_pretraining(tiny_config(data, run, resume=True, max_steps=4))
    assert "changed since the checkpoint" not in capsys.readouterr().err
    with data.open("a", encoding="utf-8") as f:
        f.write("The queen answers the king.\n" * 200)  # edited in place: the shards are made again
    run_pretraining(tiny_config(data, run, resume=True, max_steps=5))
    err = capsys.readouterr().err
    assert f"warning: the training data ({data}) changed since the checkpoint" in err, err
    # Another --val-fraction moves the split: said as that, not as data edited in place.
    run_pretraining(tiny_config(data, run, resume=True, max_steps=6, val_fraction=0.3))
    err = capsys.readouterr().err
    assert "warning: the training split moved (val_fraction 0.1 -> 0.3) (" in err and "changed since" not in err, err
    # Another file, given on purpose: said as that, not as the new file edited since the checkpoint.
    other = tmp_path / "other.txt"
    shutil.copy(corpus, other)
    run_pretraining(tiny_config(other, run, resume=True, max_steps=7, val_fraction=0.3))
    err = capsys.readouterr().err
    assert f"warning: the run trains on other data now ({other}) (" in err and "changed since" not in err, err


def test_a_resume_on_other_data_keeps_the_runs_tokenizer(corpus, tmp_path, capsys):
    """--resume --data OTHER trained the tokenizer again on OTHER: a BPE of the same size went on
    silently in another vocabulary (the model's ids meant other text), a char one failed on the
    embedding's shape. The checkpoint's model reads the run's tokenizer: OTHER is tokenized with it."""
    import codecs

    from cli_helpers import run_cli

    other = tmp_path / "other.txt"
    other.write_text(codecs.encode(Path(corpus).read_text(encoding="utf-8"), "rot13"), encoding="utf-8")
    run = tmp_path / "run"
    run_pretraining(tiny_config(corpus, run, tokenizer="bpe", vocab_size=300, max_steps=2))
    before = (run / "tokenizer.json").read_bytes()
    code, out, _ = run_cli(capsys, "pretrain", "--out", run, "--resume", "--data", other, "--max-steps", "3",
                           "--dry-run")
    assert code == 0 and f"data:          {other} (the run's bpe tokenizer, " in out, out
    assert run_pretraining(tiny_config(other, run, tokenizer="bpe", vocab_size=300, max_steps=3,
                                       resume=True)).steps == 3
    assert (run / "tokenizer.json").read_bytes() == before == (run / "model" / "tokenizer.json").read_bytes()
    char = tmp_path / "char"
    run_pretraining(tiny_config(corpus, char, max_steps=2))
    assert run_pretraining(tiny_config(other, char, max_steps=3, resume=True)).steps == 3  # (was a shape error)


def test_a_run_started_with_relative_paths_resumes_and_reruns_from_anywhere(corpus, tmp_path, monkeypatch, capsys):
    """config.yaml kept --data as typed, so a --resume (or the rerun its header suggests)
    from another folder failed with "data source not found"; given again, the same file
    written another way was "a setting that differs" and retrained the tokenizer."""
    import yaml

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir(), elsewhere.mkdir()
    shutil.copy(corpus, start / "corpus.txt")
    monkeypatch.chdir(start)
    run = tmp_path / "run"
    run_pretraining(tiny_config("corpus.txt", run, max_steps=2))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"] == str(start / "corpus.txt")
    tokenizer_made = (run / "tokenizer.json").stat().st_mtime_ns
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert run_pretraining(tiny_config(saved["data"], run, resume=True, max_steps=3)).steps == 3
    assert "differ" not in capsys.readouterr().err
    assert (run / "tokenizer.json").stat().st_mtime_ns == tokenizer_made  # reused, not trained again
    from cli_helpers import run_cli

    code, out, err = run_cli(capsys, "pretrain", "--config", run / "config.yaml", "--out", tmp_path / "new",
                             "--max-steps", "1", "--dry-run", "--no-progress")
    assert code == 0 and f"data:          {start / 'corpus.txt'}" in out, err


def test_a_relative_out_is_saved_absolute_and_resumes_from_anywhere(corpus, tmp_path, monkeypatch, capsys):
    """config.yaml kept `out: runs/rel` and a `--config runs/rel/config.yaml` rerun header, so
    `--config /abs/runs/rel/config.yaml --resume` from another folder said "runs/rel: no run
    to resume"."""
    import yaml

    from cli_helpers import run_cli

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(start)
    code, out, err = run_cli(capsys, "pretrain", "--data", corpus, "--tokenizer", "char", "--max-steps", "2",
                             "--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2", "--set",
                             "context_length=32", "--sample-tokens", "0", "--out", "runs/rel", "--no-progress")
    assert code == 0 and "model in runs/rel/model" in out, err  # the user's own words in what is shown
    config = start / "runs" / "rel" / "config.yaml"
    assert config.read_text().splitlines()[0] == f"# rerun: frawd pretrain --config {config} --out NEW_DIR"
    assert yaml.safe_load(config.read_text())["out"] == str(start / "runs" / "rel")
    monkeypatch.chdir(elsewhere)
    code, out, err = run_cli(capsys, "pretrain", "--config", config, "--resume", "--max-steps", "3", "--no-progress")
    assert code == 0 and "max_steps: 3 steps" in out, err
    assert not (elsewhere / "runs").exists()


def test_config_yaml_keeps_non_ascii_paths_and_quotes_its_rerun_line(tmp_path):
    """A run folder with a space broke the rerun line once copied; non-ASCII paths were written
    as "donn\\xE9es" escapes."""
    import shlex

    import yaml

    from frawdllm.train.config import PretrainConfig, dump_yaml
    from frawdllm.train.rundir import rerun_line

    run = tmp_path / "run ä"
    line = rerun_line("pretrain", run)
    assert shlex.split(line[2:])[4] == str(run / "config.yaml")  # (# rerun: frawd pretrain --config PATH ...)
    text = dump_yaml(PretrainConfig(data=str(tmp_path / "données.txt"), out=str(run), max_steps=1), line)
    assert "données.txt" in text and "run ä" in text
    assert yaml.safe_load(text)["data"] == str(tmp_path / "données.txt")


def test_tokenizer_training_is_said_on_stderr(corpus, tmp_path, capsys):
    """Like every other note before the bar moves (it went to stdout)."""
    run_pretraining(tiny_config(corpus, tmp_path / "run", max_steps=1, progress=True))
    captured = capsys.readouterr()
    assert f"training a char tokenizer on {corpus} ...\n" in captured.err
    assert "tokenizer" not in captured.out, captured.out


def test_a_resume_that_changes_the_model_names_the_values_not_the_overrides(corpus, tmp_path):
    run = tmp_path / "run"
    run_pretraining(tiny_config(corpus, run, max_steps=2))
    with pytest.raises(FrawdError) as info:
        run_pretraining(tiny_config(corpus, run, resume=True, model={**TINY_MODEL, "n_layer": 3}, max_steps=3))
    assert "n_layer=3 (the run has 2)" in str(info.value) and "{" not in str(info.value)
    with pytest.raises(FrawdError) as info:  # (a char run has no vocab_size: "the run has None")
        run_pretraining(tiny_config(corpus, run, resume=True, vocab_size=100, max_steps=3))
    assert "these settings differ: vocab_size=100 (not set in the run);" in str(info.value)
    # the preset's own value, given as an override, changes nothing: not refused
    same = {**TINY_MODEL, "tie_embeddings": pretrain_module.model_config_for(
        tiny_config(corpus, run), 20).tie_embeddings}
    assert run_pretraining(tiny_config(corpus, run, resume=True, model=same, max_steps=3)).steps == 3


def test_a_resume_takes_a_config_yaml_without_a_later_setting_and_refuses_another_init_from(corpus, trained,
                                                                                             tmp_path):
    """A config.yaml an older FrawdLLM wrote (without a setting added since) resumes; the
    starting model of an --init-from run is fixed once trained from."""
    import yaml

    run = tmp_path / "run"
    run_pretraining(tiny_config(corpus, run, max_steps=2))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    del saved["grad_accum"]
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert run_pretraining(tiny_config(corpus, run, resume=True, max_steps=3)).steps == 3
    more = tmp_path / "more"
    run_pretraining(tiny_config(corpus, more, tokenizer=None, model={}, init_from=str(trained), max_steps=2))
    with pytest.raises(FrawdError, match=r"init_from="):
        run_pretraining(tiny_config(corpus, more, tokenizer=None, model={}, init_from=str(run / "model"),
                                    resume=True, max_steps=3))


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_the_training_memory_floor_is_below_what_backward_really_keeps(preset):
    """`training_floor_bytes` refuses runs: it must never exceed the real need. Autograd's
    saved tensors (unique storages) of a step plus 16 bytes a parameter are counted here."""
    import torch

    from frawdllm import FrawdLLM, get_config
    from frawdllm.memory import training_floor_bytes

    cfg = get_config(preset, n_layer=2, n_embd=64, n_head=4, vocab_size=300, context_length=32)
    model = FrawdLLM(cfg)
    storages = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, 300, (4, 32))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = model(x, x)[1]
    loss.backward()
    for p in model.parameters():  # (already in the 16 bytes a parameter)
        storages.pop(p.untyped_storage().data_ptr(), None)
    saved = sum(storages.values())
    floor = training_floor_bytes(cfg, 4, 32, 4)
    assert floor - 16 * cfg.num_parameters > 0
    assert floor <= 16 * cfg.num_parameters + saved


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_special_ids_set_by_hand_are_checked_against_the_tokenizer_to_be_trained(corpus, tmp_path, capsys, no_work,
                                                                                   tokenizer):
    """They were checked against a vocabulary of 7 (the special tokens alone) before the
    tokenizer was trained, and not at all against the tokenizer's own special ids."""
    from cli_helpers import run_cli

    common = ["pretrain", "--data", corpus, "--tokenizer", tokenizer, "--out", tmp_path / "run", "--max-steps", "1",
              "--dry-run", "--no-progress", "--set"]
    code, _, err = run_cli(capsys, *common, "eos_token_id=100")
    assert code == 1 and err.strip().splitlines() == [
        "frawd: error: eos_token_id 100 is not the tokenizer's <|eos|> id (3); FrawdLLM's tokenizers fix their "
        "special ids: leave eos_token_id unset"]
    code, out, err = run_cli(capsys, *common, "eos_token_id=3")
    assert code == 0 and "vocabulary" in out, err


def test_a_context_whose_position_tables_no_loader_builds_is_refused_before_training(corpus, tmp_path, capsys,
                                                                                      no_work):
    code, err, _ = frawd(capsys, "pretrain", "--data", str(corpus), "--tokenizer", "byte", "--out",
                         str(tmp_path / "run"), "--max-steps", "1", "--preset", "tiny-llama", "--set",
                         "context_length=1000000", "--batch-size", "1", "--dry-run")
    assert code == 1 and "context_length 1,000,000 needs position tables of" in err and \
        err.endswith(", so no command could load the trained model: give a shorter context_length\n"), err
    assert not (tmp_path / "run").exists()


def test_a_model_too_large_to_train_at_any_batch_size_is_not_told_to_lower_it(monkeypatch):
    """`--batch-size 1 ... lower --batch-size` where the weights and AdamW state alone did not fit."""
    import frawdllm.memory as memory

    cfg = get_config("tiny", n_layer=1)
    state = 16 * cfg.num_parameters
    monkeypatch.setattr(memory, "free_memory", lambda device: state - 1)
    with pytest.raises(FrawdError, match=rf"^the model's {cfg.num_parameters:,} parameters need 0\.\d GiB to train "
                                         r"\(weights, gradients and AdamW's two moments, in fp32\) before any "
                                         r"activation, more than the 0\.\d GiB available: a smaller model$"):
        memory.check_training_fits(cfg, 1, 8, "fp32", torch.device("cpu"))
    monkeypatch.setattr(memory, "free_memory", lambda device: state + 1)  # the batch's activations do not fit
    with pytest.raises(FrawdError, match=r"^--batch-size 64 \(rows of 256 tokens\) needs at least .* lower --batch-size"):
        memory.check_training_fits(cfg, 64, 256, "fp32", torch.device("cpu"))


def test_a_bpe_vocabulary_the_corpus_cannot_fill_is_said(tmp_path, capsys):
    """A 2,000-token BPE on a few KB: the dry run printed the asked size as the model's, the
    run trained ~900 tokens, and neither said so."""
    from cli_helpers import run_cli

    corpus = tmp_path / "small.txt"
    corpus.write_text("the cat sat on the mat and the dog ran to the log\n\n" * 40, encoding="utf-8")
    cfg = PretrainConfig(data=str(corpus), out=str(tmp_path / "run"), vocab_size=2000, max_steps=1, progress=False)
    code, out, err = run_cli(capsys, "pretrain", "--data", corpus, "--vocab-size", "2000", "--out", tmp_path / "run",
                             "--max-steps", "1", "--dry-run", "--no-progress")
    assert code == 0 and "(vocabulary 2,000 at most: BPE stops early on a small corpus)" in out, err
    (tmp_path / "run" / "data").mkdir(parents=True)
    tok = pretrain_module._source_tokenizer(cfg, tmp_path / "run")
    assert tok.vocab_size < 2000
    assert capsys.readouterr().err == (f"note: the corpus gave {tok.vocab_size:,} tokens, not the 2,000 asked for "
                                       "(BPE stops once every word of the corpus is one token; a larger corpus gives more)\n")


HOLD = """
import sys, time
from frawdllm.train.rundir import claim_run_dir
claim_run_dir(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_a_folder_in_use_is_refused_and_touches_nothing(corpus, tmp_path, capsys, no_work):
    # (a resume raced the ranks of a killed launcher for the folder: "state.pt: cannot read")
    import subprocess
    import sys

    from frawdllm.train.rundir import claim_run_dir, release_run_dir

    run = tmp_path / "busy"
    run.mkdir()
    (run / "config.yaml").write_text("# the other run's\n", encoding="utf-8")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        busy = f"frawd: error: {run} is in use by another run (process {holder.pid}): wait for it to end or stop " \
               "it, or give another --out\n"
        for flags in (("--resume",), ("--overwrite",), ()):  # (with neither, "stopped before its first checkpoint")
            code, err, _ = frawd(capsys, "pretrain", "--data", str(corpus), "--tokenizer", "char", "--max-steps", "2",
                                 "--out", str(run), *flags)
            assert (code, err) == (1, busy)
            assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]
            assert (run / "config.yaml").read_text(encoding="utf-8") == "# the other run's\n"
    finally:
        holder.kill()
        holder.wait()
    claim_run_dir(run)  # free once the other process ended (however it ended)
    claim_run_dir(run)  # (again from the same process: nothing)
    release_run_dir(run)


HOLD_THEN_LEAVE_A_CHILD = """
import os, sys, time
from frawdllm.train.rundir import claim_run_dir
claim_run_dir(sys.argv[1])
if os.fork() == 0:  # a child holding the lock on (as datatrove's manager process did after a kill -9)
    time.sleep(120)
    os._exit(0)
os._exit(0)
"""


def test_a_folder_held_by_a_child_of_a_run_that_ended_names_the_child(tmp_path):
    """The message named the process that took the lock, long gone, not the one to stop."""
    import signal
    import subprocess
    import sys

    from frawdllm.train.rundir import lock_holder

    run = tmp_path / "busy"
    run.mkdir()
    taker = subprocess.Popen([sys.executable, "-c", HOLD_THEN_LEAVE_A_CHILD, str(run)])
    assert taker.wait() == 0
    holder = lock_holder(run)
    try:
        assert holder is not None and holder != taker.pid
        assert b"claim_run_dir" in Path(f"/proc/{holder}/cmdline").read_bytes()  # the child left behind
    finally:
        if holder is not None and holder != taker.pid:
            os.kill(holder, signal.SIGKILL)


def test_a_run_folder_this_process_holds_is_not_called_in_use_by_another_run(tmp_path):
    """A Trainer run earlier in the same process keeps its folder's lock: the refusal of a new
    run there says what the folder holds, not "in use by another run (process <its own pid>)"."""
    from frawdllm.train.rundir import claim_run_dir, existing_run_message

    run = tmp_path / "mine"
    claim_run_dir(run)
    message = existing_run_message(run)
    assert "in use by another run" not in message and str(os.getpid()) not in message
    assert message.startswith(f"{run} holds a run that stopped before its first checkpoint")


def test_a_dry_run_refuses_shards_shorter_than_one_window_as_the_run_does(tmp_path, capsys):
    """`--dry-run` on prepared shards shorter than one window printed a plan; the run then
    refused them (their meta.json says how many tokens they hold)."""
    text = tmp_path / "small.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40, encoding="utf-8")
    main(["tokenizer", "train", "--data", str(text), "--kind", "char", "--out", str(tmp_path / "tok")])
    main(["data", "prepare", "--data", str(text), "--doc-split", "file", "--tokenizer",
          str(tmp_path / "tok" / "tokenizer.json"), "--out", str(tmp_path / "shards")])
    tokens = json.loads((tmp_path / "shards" / "meta.json").read_text())["train_tokens"]
    assert 1000 < tokens < 2048
    base = ["pretrain", "--data", str(tmp_path / "shards"), "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"),
            "--max-steps", "1", "--batch-size", "1", "--set", "context_length=2048", "--dtype", "fp32",
            "--compile", "false", "--no-progress", "--out", str(tmp_path / "run")]
    said = f"frawd: error: only {tokens} tokens; a window of context_length 2048 needs 2049: use more data or a " \
           "shorter context\n"
    for dry in (["--dry-run"], []):
        code, err, _ = frawd(capsys, *base, *dry)
        assert (code, err) == (1, said), dry
        assert not (tmp_path / "run").exists()
