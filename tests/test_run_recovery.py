"""A run killed at a bad moment: whatever the kill left, `--resume` continues (or, before
the first complete checkpoint, starts over), temporary folders are tidied, and resumed
logs hold each step once."""

import os
import re
import signal
import subprocess
import sys

import pytest

from frawdllm.io import clean_partial
from frawdllm.train import run_pretraining
from frawdllm.train.checkpoint import list_checkpoints
from frawdllm.train.loop import Trainer
from frawdllm.train.rundir import SAMPLES_FILE, read_metrics, truncate_samples

from cli_helpers import run_cli
from conftest import ROOT
from test_train_loop import KILL_SCRIPT, corpus, tiny_config  # noqa: F401  (corpus is a fixture)


def kill_at_checkpoint(cfg, nth: int):
    script = KILL_SCRIPT.replace("{config}", repr(cfg.to_dict())).replace("len(saves) == 2", f"len(saves) == {nth}")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def sample_steps(run):
    return [int(s) for s in re.findall(r"^=== step (\d+) sample 0 ===$", (run / SAMPLES_FILE).read_text(), re.M)]


def test_kill_during_the_first_checkpoint_then_resume_starts_over(corpus, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    kill_at_checkpoint(tiny_config(corpus, run, max_steps=8, eval_interval=4), nth=1)
    assert list_checkpoints(run) == []  # nothing complete: the kill came during the first one
    assert any(p.name.startswith(".step_") for p in (run / "checkpoints").iterdir())
    result = run_pretraining(tiny_config(corpus, run, max_steps=8, eval_interval=4, resume=True))
    assert result.steps == 8
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 9))
    assert sample_steps(run) == [0, 4, 8]
    assert not [p.name for p in run.rglob(".*")]


def test_a_crash_before_the_first_checkpoint_is_named_and_resume_starts_over(corpus, tmp_path, monkeypatch,  # noqa: F811
                                                                            capsys):
    """fit() failing at step 1 leaves config.yaml and logs but no checkpoint: a plain rerun
    says so in one line, and --resume (its --dry-run too) starts over, never "resumes" nothing."""
    run = tmp_path / "run"

    def broken_step(self):
        raise RuntimeError("broken step")

    monkeypatch.setattr(Trainer, "train_step", broken_step)
    with pytest.raises(RuntimeError, match="broken step"):
        run_pretraining(tiny_config(corpus, run, max_steps=4, eval_interval=4, compile=False))
    monkeypatch.undo()
    assert (run / "config.yaml").is_file() and list_checkpoints(run) == []
    rerun = ("pretrain", "--config", run / "config.yaml", "--out", run, "--no-progress")
    code, _, err = run_cli(capsys, *rerun)
    assert code == 1 and err.count("\n") == 1, err
    assert "stopped before its first checkpoint; --resume or --overwrite starts it over" in err
    code, out, err = run_cli(capsys, *rerun, "--resume", "--dry-run")
    assert code == 0, err
    assert "no complete checkpoint to resume from: --resume starts the run over" in out and "(resume)" not in out
    result = run_pretraining(tiny_config(corpus, run, max_steps=4, eval_interval=4, compile=False, resume=True))
    assert "no complete checkpoint to resume from; starting the run over" in capsys.readouterr().err
    assert result.steps == 4 and [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]


def test_resume_never_deletes_a_run_whose_checkpoint_lost_a_file(corpus, tmp_path, capsys):  # noqa: F811
    """A finished run copied without its checkpoints' state.pt was taken for one killed
    before its first checkpoint: --resume deleted its checkpoints and its best model and
    trained a new one, exit 0."""
    run = tmp_path / "run"
    run_pretraining(tiny_config(corpus, run, max_steps=4, eval_interval=2, compile=False))
    for path in list_checkpoints(run):  # (steps 2 and 4: the refusal names the newest)
        (path[1] / "state.pt").unlink()
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    rerun = ("pretrain", "--config", run / "config.yaml", "--out", run, "--no-progress", "--resume")
    code, out, err = run_cli(capsys, *rerun, "--dry-run")
    assert code == 0 and "step_00000004 lacks state.pt; --resume refuses it" in out, out
    code, _, err = run_cli(capsys, *rerun)
    assert code == 1 and err.count("\n") == 1, err
    assert f"{run}: no complete checkpoint to resume from: {run / 'checkpoints' / 'step_00000004'} lacks state.pt; " \
           "the run is left as it is" in err
    # a plain rerun said "stopped before its first checkpoint; --resume or --overwrite starts it over"
    code, _, err = run_cli(capsys, *rerun[:-1])
    assert code == 1 and err == (f"frawd: error: {run} holds a run whose checkpoint is incomplete ("
                                 f"{run / 'checkpoints' / 'step_00000004'} lacks state.pt); restore the file and "
                                 "--resume, --overwrite starts over, or give another --out\n"), err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


@pytest.mark.parametrize("removed", ["folder", "each checkpoint", "each, a partial one left", "with model/"])
def test_resume_never_deletes_a_trained_run_whose_checkpoints_were_removed(corpus, tmp_path, capsys, removed):  # noqa: F811
    """A finished run whose checkpoints were deleted to save space, its best model kept: a
    plain rerun called it one that "stopped before its first checkpoint", and --resume
    deleted its best model and trained a new one, exit 0."""
    import shutil

    run = tmp_path / "run"
    run_pretraining(tiny_config(corpus, run, max_steps=8, eval_interval=4, compile=False))
    if removed == "folder":
        shutil.rmtree(run / "checkpoints")
    else:
        for _, path in list_checkpoints(run):
            shutil.rmtree(path)
    if removed == "each, a partial one left":  # (a stray of some earlier kill: steps went on after it)
        (run / "checkpoints" / ".step_00000004.abcdefgh.tmp").mkdir()
    if removed == "with model/":
        shutil.rmtree(run / "model")
    before = {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    published = "" if removed == "with model/" else f" and published {run / 'model'}"
    gone = f"evaluated up to step 8{published}, but its checkpoints are gone"
    rerun = ("pretrain", "--config", run / "config.yaml", "--out", run, "--no-progress")
    code, _, err = run_cli(capsys, *rerun)
    assert code == 1 and err == f"frawd: error: {run} holds a run that {gone}; --overwrite starts over, or give " \
                                 "another --out\n", err
    code, out, err = run_cli(capsys, *rerun, "--resume", "--dry-run")
    assert code == 0 and f"nothing to resume from: the run {gone}; --resume refuses it" in out, out
    code, _, err = run_cli(capsys, *rerun, "--resume")
    assert code == 1 and err.count("\n") == 1, err
    further = "" if removed == "with model/" else (f"{run / 'model'} can start a new run in another --out: pretrain "
                                                   "--init-from, sft and dpo --init; ")
    assert f"{run}: nothing to resume from: the run {gone}; the run is left as it is ({further}--overwrite starts over)" \
        in err
    assert {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("torn", ["state.pt", "model/model.safetensors"])
def test_a_torn_newest_checkpoint_names_the_one_before_it(corpus, tmp_path, capsys, torn):  # noqa: F811
    """The refusal named the torn file only, not the complete checkpoint --resume could use."""
    import shutil

    run = tmp_path / "run"
    run_pretraining(tiny_config(corpus, run, max_steps=8, eval_interval=4, compile=False))
    (earlier, _), (newest, _) = [(path, step) for step, path in list_checkpoints(run)]
    with open(newest / torn, "r+b") as f:
        f.truncate(1000)
    rerun = ("pretrain", "--config", run / "config.yaml", "--out", run, "--no-progress", "--resume", "--max-steps", "9")
    code, _, err = run_cli(capsys, *rerun)
    assert code == 1 and err.count("\n") == 1, err
    assert f"{newest / torn}" in err and err.endswith(
        f"; the checkpoint before it is {earlier}: move {newest} out of {run / 'checkpoints'} to resume from that one\n")
    shutil.move(newest, tmp_path / "aside")
    code, _, err = run_cli(capsys, *rerun)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 10))


def test_resume_trims_samples_and_tidies_stray_temporary_folders(corpus, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    kill_at_checkpoint(tiny_config(corpus, run, max_steps=12, eval_interval=4), nth=2)
    assert sample_steps(run) == [0, 4]  # samples follow their checkpoint: step 8's never completed
    with open(run / SAMPLES_FILE, "a") as f:  # what an older run (samples first) left: step 8 sampled
        f.write("=== step 8 sample 0 ===\nthe first time\n\n")
    (run / ".model.abcdefgh.tmp").mkdir()  # a best-model publication killed half-way
    (run / ".model.abcdefgh.tmp" / "model.safetensors").write_bytes(b"torn")
    (run / ".loss.png.0123abcd.tmp").write_bytes(b"torn")
    result = run_pretraining(tiny_config(corpus, run, max_steps=12, eval_interval=4, resume=True))
    assert result.steps == 12
    assert sample_steps(run) == [0, 4, 8, 12]  # step 8 once, from the resumed run
    # every step's line once: those before the kill were on disk (flushed), those after the checkpoint dropped
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 13))
    assert "differ" not in capsys.readouterr().err  # a larger budget is what --resume is for
    # other settings are taken, and said; how often to evaluate and what to keep are not the run's shape
    run_pretraining(tiny_config(corpus, run, max_steps=14, eval_interval=2, keep_last=3, lr=1e-3, resume=True))
    out = capsys.readouterr().err  # (notices go to stderr)
    notice = next(line for line in out.splitlines() if "settings that differ" in line)
    assert "resuming with settings that differ from its config.yaml: lr=0.001 (was " in notice
    assert "eval_interval" not in notice and "keep_last" not in notice, notice
    # but not the model or tokenizer the checkpoint was trained as: refused, the run left as it was
    from frawdllm.errors import FrawdError

    saved = (run / "config.yaml").read_text()
    for change in ({"model": {**tiny_config(corpus, run).model, "n_layer": 1}}, {"tokenizer": "byte"},
                   {"seed": 5}):  # (the seed was "taken" and said, yet the data order kept the run's)
        with pytest.raises(FrawdError, match="--resume continues the run's own model, tokenizer and data order"):
            run_pretraining(tiny_config(corpus, run, max_steps=16, eval_interval=4, resume=True, **change))
    assert (run / "config.yaml").read_text() == saved
    # the same model written another way (the MLP width it derives, given) is no change, and not said
    same = {**tiny_config(corpus, run).model, "mlp_hidden": 4 * 32}
    capsys.readouterr()
    assert run_pretraining(tiny_config(corpus, run, max_steps=16, eval_interval=4, lr=1e-3, resume=True,
                                       model=same)).steps == 16
    assert "differ" not in capsys.readouterr().err
    assert not [p.name for p in run.rglob(".*")]


def test_clean_partial_restores_a_folder_set_aside_and_removes_temporaries(tmp_path):
    (tmp_path / ".model.abcdefgh.old").mkdir()  # killed between the two renames of atomic_dir
    (tmp_path / ".model.abcdefgh.old" / "config.json").write_text("{}")
    (tmp_path / ".model.ijklmnop.tmp").mkdir()
    (tmp_path / ".metrics.jsonl.a1b2c3d4.tmp").write_text("x")
    (tmp_path / ".hidden_user_file").write_text("kept")  # not one of ours
    clean_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden_user_file", "model"]
    assert (tmp_path / "model" / "config.json").read_text() == "{}"


def test_truncate_samples_keeps_steps_up_to_the_checkpoint(tmp_path):
    text = "".join(f"=== step {s} sample 0 ===\ntext {s}\n\n" for s in (0, 4, 8))
    (tmp_path / SAMPLES_FILE).write_text(text)
    truncate_samples(tmp_path, 4)
    assert (tmp_path / SAMPLES_FILE).read_text() == text[: text.index("=== step 8")]


def test_the_summary_says_what_its_figures_cover(tmp_path):
    """After a resume the step, token and time counts are the whole run's, the speed this
    session's: each is labelled, so 30.7k tokens in 18 s beside 3.7k tok/s is not a puzzle."""
    from frawdllm.train.loop import TrainResult

    result = TrainResult(steps=30, tokens=30_700, elapsed_s=18.0, stop_reason="max_steps", last_loss=1.0,
                         val_loss=None, best_val_loss=None, best_step=None, tokens_per_s=3_700.0, mfu=0.1,
                         checkpoint=None, run_dir=tmp_path, flops_known=True, ran_as="bf16, eager")
    line = result.summary()
    assert "30 steps, 30.7k tokens in 18.0 s (the run so far)" in line
    assert "this session 3.7k tok/s (bf16, eager), MFU" in line


def test_without_a_writable_home_matplotlib_keeps_its_files_in_frawdllms_cache(tmp_path):
    """`docker run -u 12345` (no home): matplotlib warned at every run that it made a
    temporary cache folder (two lines, even under --no-progress)."""
    (tmp_path / "a_file").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME")}
    env.update(HOME=str(tmp_path / "a_file"), FRAWD_CACHE_DIR=str(tmp_path / "cache"))
    code = "import os; from frawdllm.train.rundir import load_pyplot; load_pyplot(); print(os.environ['MPLCONFIGDIR'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.strip() == str(tmp_path / "cache" / "matplotlib")
