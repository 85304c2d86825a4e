"""`frawd pretrain` and `frawd eval` from the outside: config files, flags, signals, errors,
and evaluation figures checked against a direct computation."""

import json
import math
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from frawdllm import FrawdLLM, get_config
from frawdllm.cli import cli
from frawdllm.data import prepare_shards, read_shard
from frawdllm.tokenizer import EOS_ID, train_tokenizer
from frawdllm.train.checkpoint import list_checkpoints
from frawdllm.train.rundir import read_metrics

from conftest import ROOT


@pytest.fixture
def corpus(shared_data, tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "head.txt"
    path.write_text((shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:100_000], encoding="utf-8")
    return path


def write_config(tmp_path, corpus, **extra):
    lines = [f"data: {corpus}", "tokenizer: char", "doc_split: file", "val_fraction: 0.1",
             "model:", "  n_layer: 1", "  n_head: 2", "  n_embd: 32", "  context_length: 32",
             "batch_size: 8", "lr: 3e-3", "warmup_steps: 2", "max_steps: 1000", "dtype: fp32", "device: cpu",
             "eval_interval: 5", "eval_batches: 2", "log_interval: 1", "sample_tokens: 4", "peak_tflops: 1.0",
             "progress: false"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    path = tmp_path / "config.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_pretrain_config_file_with_flag_overrides_and_eval_lines(corpus, tmp_path):
    config = write_config(tmp_path, corpus)
    out = tmp_path / "run"
    result = run_cli("pretrain", "--config", str(config), "--max-steps", "7", "--set", "n_embd=16", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "max_steps: 7 steps" in result.stdout  # the one-line summary
    records = read_metrics(out)
    assert [r["step"] for r in records if "val_loss" in r] == [0, 5, 7]
    assert max(r["step"] for r in records) == 7  # --max-steps beat the file's 1000
    model = FrawdLLM.from_pretrained(out / "model")
    assert model.config.n_embd == 16 and model.config.n_layer == 1  # --set merged into the file's model
    assert (out / "model" / "tokenizer.json").is_file()


def test_frawd_eval_figures_equal_a_direct_computation(corpus, tmp_path):
    text = corpus.read_text(encoding="utf-8")
    tok = train_tokenizer([text], kind="char")
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", n_layer=1, n_head=2, n_embd=32, context_length=16,
                                vocab_size=tok.vocab_size)).eval()
    model.save_pretrained(tmp_path / "model", tokenizer=tok)
    # blank-line documents, a hashed 20% of them held out
    result = run_cli("eval", "--model", str(tmp_path / "model"), "--data", str(corpus), "--val-fraction", "0.2",
                     "--batch-size", "5", "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)

    prepare_shards(str(corpus), tok, tmp_path / "shards", val_fraction=0.2)
    val = read_shard(tmp_path / "shards" / "val.bin").astype(np.int64)
    T = 16
    starts = range(0, (len(val) - 1) // T * T, T)
    windows = torch.tensor(np.stack([val[s:s + T + 1] for s in starts]))  # (N, T+1)
    with torch.no_grad():
        logits = torch.cat([model(w[None, :-1])[0] for w in windows]).double()  # (N, T, V)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, windows[:, 1:, None]).squeeze(-1)
    loss = float(-logp.mean())
    val_bytes = len(tok.decode(val[val != EOS_ID].tolist()).encode("utf-8"))
    bytes_per_token = val_bytes / len(val)  # <|eos|> separators count as tokens of no bytes
    assert figures["tokens"] == windows.shape[0] * T
    assert figures["loss"] == pytest.approx(loss, rel=1e-6)
    assert figures["ppl"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert figures["bpb"] == pytest.approx(loss / math.log(2) / bytes_per_token, rel=1e-5)


def test_frawd_eval_of_the_train_split_uses_trains_own_bytes_per_token(corpus, tmp_path):
    # (it took the whole corpus's figure: bits per byte 2.2% off on a small corpus)
    tok = train_tokenizer([corpus.read_text(encoding="utf-8")], kind="char")
    model = FrawdLLM(get_config("tiny", n_layer=1, n_head=2, n_embd=32, context_length=16, vocab_size=tok.vocab_size))
    model.save_pretrained(tmp_path / "model", tokenizer=tok)
    meta = prepare_shards(str(corpus), tok, tmp_path / "shards", val_fraction=0.5)
    train_figure = meta["train_text_bytes"] / meta["train_tokens"]
    assert abs(train_figure / meta["bytes_per_token"] - 1) > 1e-4  # (the two figures differ here)
    result = run_cli("eval", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "shards"), "--split",
                     "train", "--max-batches", "2", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["bytes_per_token"] == pytest.approx(train_figure, rel=1e-6)
    assert figures["bpb"] == pytest.approx(figures["loss"] / math.log(2) / train_figure, rel=1e-5)


def test_frawd_eval_accepts_a_prepared_shard_folder_and_prints_key_values(corpus, tmp_path):
    tok = train_tokenizer([corpus.read_text(encoding="utf-8")], kind="char")
    model = FrawdLLM(get_config("tiny", n_layer=1, n_head=2, n_embd=32, context_length=16, vocab_size=tok.vocab_size))
    model.save_pretrained(tmp_path / "model", tokenizer=tok)
    prepare_shards(str(corpus), tok, tmp_path / "shards", val_fraction=0.2)
    result = run_cli("eval", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "shards"),
                     "--max-batches", "2", "--batch-size", "4")
    assert result.exit_code == 0, result.output
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert {"loss", "ppl", "bpb", "tokens"} <= set(lines)
    assert int(lines["tokens"]) == 2 * 4 * 16


def test_frawd_eval_refuses_a_loss_that_is_not_a_number(corpus, tmp_path, capsys):
    """A model whose weights hold nan printed {"loss": NaN, ...} (not JSON) with exit 0."""
    tok = train_tokenizer([corpus.read_text(encoding="utf-8")], kind="char")
    model = FrawdLLM(get_config("tiny", n_layer=1, n_head=2, n_embd=32, context_length=16, vocab_size=tok.vocab_size))
    with torch.no_grad():
        model.blocks[0].mlp.up.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "model", tokenizer=tok)
    for extra in ([], ["--json"]):
        result = frawd_here(capsys, "eval", "--model", str(tmp_path / "model"), "--data", str(corpus),
                            "--max-batches", "1", *extra)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr.strip() == ("frawd: error: the loss is nan on this data: the model's weights hold nan "
                                         "or inf values (the first: blocks.0.mlp.up.weight)"), result.stderr


def test_frawd_eval_with_a_too_small_split_of_a_shard_folder_says_to_prepare_it_again(corpus, tmp_path, capsys):
    """The advice was "a larger --val-fraction", which a shard folder ignores (with a note)."""
    tok = train_tokenizer([corpus.read_text(encoding="utf-8")], kind="char")
    model = FrawdLLM(get_config("tiny", n_layer=1, n_head=2, n_embd=32, context_length=16, vocab_size=tok.vocab_size))
    model.save_pretrained(tmp_path / "model", tokenizer=tok)
    prepare_shards(str(corpus), tok, tmp_path / "shards", val_fraction=0.0)
    result = frawd_here(capsys, "eval", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "shards"))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "frawd: error: the val split has 0 tokens, too few for one window of 16 (it takes 17: each position "
        f"predicts the next token); prepare {tmp_path / 'shards'} again with a larger --val-fraction or a shorter "
        "--context-length"), result.stderr


def test_frawd_eval_of_a_split_exactly_one_window_long_gives_the_same_advice(tmp_path, capsys):
    """A window of `context` inputs reads context + 1 tokens: a split of exactly `context`
    tokens is too small too, and gets the advice, not the loader's generic message."""
    text = "\n\n".join(f"document number {i} holds some words." for i in range(40))
    (tmp_path / "c.txt").write_text(text)
    tok = train_tokenizer([text], kind="char")
    model = FrawdLLM(get_config("tiny", n_layer=1, n_head=2, n_embd=32, context_length=256, vocab_size=tok.vocab_size))
    model.save_pretrained(tmp_path / "model", tokenizer=tok)
    n = prepare_shards(str(tmp_path / "c.txt"), tok, tmp_path / "shards", val_fraction=0.05)["val_tokens"]
    assert 16 < n < 256
    for context in (n, n - 1):
        result = frawd_here(capsys, "eval", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "shards"),
                            "--context-length", str(context))
        if context == n:
            assert result.returncode == 1 and result.stderr.strip() == (
                f"frawd: error: the val split has {n} tokens, too few for one window of {n} (it takes {n + 1}: each "
                f"position predicts the next token); prepare {tmp_path / 'shards'} again with a larger --val-fraction "
                "or a shorter --context-length"), result.stderr
        else:
            assert result.returncode == 0, result.stderr  # one window fits


def test_frawd_eval_notes_raw_source_flags_given_with_a_shard_folder(corpus, tmp_path):
    """A shard folder keeps the split it was prepared with; a --val-fraction given anyway
    gets a one-line note on stderr, not silence, and one left at its default gets nothing."""
    tok = train_tokenizer([corpus.read_text(encoding="utf-8")], kind="char")
    model = FrawdLLM(get_config("tiny", n_layer=1, n_head=2, n_embd=32, context_length=16, vocab_size=tok.vocab_size))
    model.save_pretrained(tmp_path / "model", tokenizer=tok)
    meta = prepare_shards(str(corpus), tok, tmp_path / "shards", val_fraction=0.2)
    args = ["eval", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "shards"), "--max-batches", "1",
            "--device", "cpu", "--json"]
    plain = run_cli(*args)
    assert plain.exit_code == 0 and plain.stderr == ""
    for value in ("0.5", "0.005"):  # the default's value, given explicitly, still notes
        given = run_cli(*args, "--val-fraction", value)
        assert given.exit_code == 0, given.output
        assert given.stderr == (f"note: --val-fraction applies to a raw source; {tmp_path / 'shards'} holds shards "
                                f"with their own validation split ({meta['val_tokens']:,} tokens)\n")
        assert json.loads(given.stdout) == json.loads(plain.stdout)  # the shards' split, as before
    both = run_cli(*args, "--val-fraction", "0.5", "--doc-split", "file")
    assert both.stderr.startswith("note: --val-fraction and --doc-split apply to a raw source; ")


def test_pretrain_notes_raw_source_settings_a_shard_folder_makes_moot(corpus, tmp_path):
    """pretrain took --val-fraction/--doc-split/--text-field with a shard folder silently (and
    wrote them into config.yaml as if they applied); eval said so in a note."""
    from frawdllm.train.config import PretrainConfig
    from frawdllm.train.pretrain import shard_source_note

    tok = train_tokenizer([corpus.read_text(encoding="utf-8")], kind="char")
    meta = prepare_shards(str(corpus), tok, tmp_path / "shards", val_fraction=0.2)
    shards = str(tmp_path / "shards")
    assert shard_source_note(PretrainConfig(data=shards, max_steps=1)) is None
    assert shard_source_note(PretrainConfig(data=str(corpus), val_fraction=0.3, max_steps=1)) is None  # (raw: applies)
    note = shard_source_note(PretrainConfig(data=shards, val_fraction=0.3, doc_split="line", text_field="foo",
                                            max_steps=1))
    assert note == (f"note: --val-fraction, --doc-split and --text-field apply to a raw source; {shards} holds "
                    f"shards with their own validation split ({meta['val_tokens']:,} tokens)")


FRAWD = [sys.executable, "-c", "from frawdllm.cli import main; main()"]


def frawd_here(capsys, *args):
    """`frawd ARGS` run in this process (no fresh interpreter's `import torch` to pay)."""
    from cli_helpers import run_cli as run_main

    code, out, err = run_main(capsys, *args)
    return subprocess.CompletedProcess(list(args), code, out, err)


def test_a_signal_stops_with_a_checkpoint_when_stderr_has_no_reader(corpus, tmp_path):
    """`frawd pretrain ... 2>&1 | less`, and less has quit: the signal's acknowledgement
    cannot be written, and the stop still comes with a checkpoint (then the exit status of a
    command whose reader left, 141, as `| head` gives). (Any line written to stderr may find
    the reader gone first: test_train_loop's test of a reader that leaves.)"""
    config = write_config(tmp_path, corpus, max_time="5m", eval_interval=0)
    out = tmp_path / "run"
    proc = subprocess.Popen([*FRAWD, "pretrain", "--config", str(config), "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 90
    while time.time() < deadline and len(read_metrics(out)) < 3:
        time.sleep(0.2)
    proc.stderr.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 141
    (step, _), = list_checkpoints(out)
    assert step == max(r["step"] for r in read_metrics(out))


def test_sigterm_saves_a_checkpoint_exits_cleanly_and_resume_continues(corpus, tmp_path, capsys):
    config = write_config(tmp_path, corpus, max_time="5m", eval_interval=0)
    out = tmp_path / "run"
    proc = subprocess.Popen([*FRAWD, "pretrain", "--config", str(config),
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while time.time() < deadline and len(read_metrics(out)) < 5:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "interrupted" in stderr and "--resume" in stderr
    # said when the signal came (a compile's warm-up can make that minutes before the checkpoint)
    assert "\nSIGTERM: stopping after this step, with a checkpoint (another stops at once, without one)\n" in stderr
    assert stderr.index("SIGTERM: stopping") < stderr.index("interrupted: checkpoint")
    (step, path), = list_checkpoints(out)
    assert step == max(r["step"] for r in read_metrics(out))
    resumed = frawd_here(capsys, "pretrain", "--out", str(out), "--resume", "--max-steps", str(step + 3))
    assert resumed.returncode == 0, resumed.stderr
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == list(range(1, step + 4))  # continued where it stopped, nothing twice


def test_user_errors_are_one_line(corpus, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_sise: 4\n")
    proc = frawd_here(capsys, "pretrain", "--config", str(bad), "--out", str(tmp_path / "x"))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "batch_sise" in proc.stderr
    proc = frawd_here(capsys, "pretrain", "--out", str(tmp_path / "nothing"), "--resume")
    assert proc.returncode == 1 and "no run to resume" in proc.stderr and proc.stderr.count("\n") == 1
    proc = frawd_here(capsys, "eval", "--model", str(tmp_path / "missing"), "--data", str(corpus))
    assert proc.returncode == 1 and "not found" in proc.stderr and proc.stderr.count("\n") == 1


def test_pretrain_help_lists_every_config_field():
    from dataclasses import fields

    from frawdllm.train.config import PretrainConfig

    result = run_cli("pretrain", "--help")
    assert result.exit_code == 0
    for f in fields(PretrainConfig):
        if f.name != "model":
            assert "--" + f.name.replace("_", "-") in result.output
    assert "--config" in result.output and "--set" in result.output


def test_the_projects_warnings_are_one_line_under_the_cli(capsys, tmp_path):
    """A NaN step's warning read as a crash (Python's `file:line: UserWarning:` and a source
    line); under `frawd` the project's warnings are one `warning: ...` line."""
    import warnings

    from cli_helpers import run_cli

    run_cli(capsys, "info", "--preset", "tiny")  # (any command: main() installs the format)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("step 4: loss nan; update skipped (1 in a row)", UserWarning,
                               filename=str(ROOT / "frawdllm" / "train" / "loop.py"), lineno=534)
    assert capsys.readouterr().err == "warning: step 4: loss nan; update skipped (1 in a row)\n"


def test_a_shard_folder_with_a_corrupt_meta_json_is_an_error_not_text(corpus, tmp_path):
    from frawdllm.data.shards import read_shard_meta
    from frawdllm.errors import FrawdError
    from frawdllm.train.pretrain import is_shard_dir

    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("train.bin", "val.bin"):
        (shards / name).write_bytes(bytes(range(256)) * 4)
    (shards / "meta.json").write_text("{oops\n")
    with pytest.raises(FrawdError, match=r"meta.json is not valid JSON; prepare the shards again"):
        is_shard_dir(shards)
    model = tmp_path / "model"
    tok = train_tokenizer([corpus.read_text(encoding="utf-8")], kind="char")
    FrawdLLM(get_config("tiny", n_layer=1, n_head=2, n_embd=32, context_length=16,
                        vocab_size=tok.vocab_size)).save_pretrained(model, tokenizer=tok)
    with pytest.raises(FrawdError, match="meta.json is not valid JSON"):  # not scored as text
        run_cli("eval", "--model", str(model), "--data", str(shards), "--device", "cpu")
    with pytest.raises(FrawdError, match="meta.json is not valid JSON"):
        run_cli("data", "prepare", "--data", str(shards), "--tokenizer", str(model / "tokenizer.json"),
                "--out", str(tmp_path / "out"))
    text = tmp_path / "text"  # a text folder may hold a meta.json of its own
    text.mkdir()
    (text / "meta.json").write_text("{oops\n")
    (text / "a.txt").write_text("hello\n")
    assert read_shard_meta(text) is None and not is_shard_dir(text)


def test_pretrain_counts_the_tokens_of_shards_whose_meta_json_lacks_them(corpus, tmp_path):
    """A hand-made meta.json without train_tokens/val_tokens ended pretrain in a TypeError
    (formatting None): the counts are the shards' own."""
    import json

    tok = train_tokenizer([corpus.read_text(encoding="utf-8")], kind="char")
    meta = prepare_shards(str(corpus), tok, tmp_path / "shards", val_fraction=0.2)
    tok.save(tmp_path / "tok.json")
    pruned = {k: v for k, v in meta.items() if k not in ("train_tokens", "val_tokens")}
    (tmp_path / "shards" / "meta.json").write_text(json.dumps(pruned))
    config = write_config(tmp_path, corpus)
    result = run_cli("pretrain", "--config", str(config), "--data", str(tmp_path / "shards"), "--tokenizer",
                     str(tmp_path / "tok.json"), "--max-steps", "1", "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    header = (tmp_path / "run" / "config.yaml").read_text().splitlines()[1]  # (the run's model and data)
    assert header.endswith(f"data: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens"), header


def test_a_command_called_from_a_running_program_gets_its_whole_max_time(corpus, tmp_path, capsys, monkeypatch):
    """main(ARGS) in a program that started long before (a notebook, this test session)
    counted the program's age as the command's start-up: `--max-time 5m` ended after one step
    with "start-up 477.8 s". The command counts from main()'s call; as the process, from the
    process's start (its `import torch` included)."""
    from frawdllm.train import device

    monkeypatch.setattr(device, "process_started_at", lambda: time.perf_counter() - 3600.0)  # an hour-old program
    config = write_config(tmp_path, corpus, max_time="5m", max_steps=6, eval_interval=0)
    done = frawd_here(capsys, "pretrain", "--config", str(config), "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == list(range(1, 7)), done.stderr
