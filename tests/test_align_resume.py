"""`--resume` of sft and dpo when the --init model has changed since the run started: DPO's
reference and LoRA's frozen base are --init's weights, so such a resume is refused (it would
continue against another model); full SFT's checkpoint holds its weights, so it resumes."""

import hashlib
import json
import shutil

import pytest
import torch

from frawdllm.train import checkpoint as ckpt
from frawdllm.train.rundir import read_metrics

from align_helpers import byte_tokenizer, model_dir, tiny_model, word_chats, word_prefs, write_jsonl
from cli_helpers import run_cli

COMMON = ["--batch-size", "2", "--lr", "1e-3", "--dtype", "fp32", "--compile", "false", "--device", "cpu",
          "--log-interval", "1", "--eval-interval", "2", "--eval-batches", "1", "--sample-tokens", "0",
          "--no-progress", "--val-fraction", "0.2"]


def start(tmp_path, capsys, command, *extra):
    """A 2-step run of `command` from a copy of the tiny model (tmp_path/init): (init, run)."""
    init = tmp_path / "init"
    shutil.copytree(model_dir(tmp_path), init)
    records = word_prefs(10) if command == "dpo" else word_chats(10)
    data = write_jsonl(tmp_path / "data.jsonl", records)
    run = tmp_path / "run"
    code, _, err = run_cli(capsys, command, "--init", init, "--data", data, *COMMON, *extra, "--max-steps", "2",
                           "--out", run)
    assert code == 0, err
    return init, run


def retrain(init):
    """--init replaced by another model of the same shape (as `frawd sft --overwrite` would)."""
    tiny_model(seed=1).save_pretrained(init, tokenizer=byte_tokenizer())


def resume(capsys, command, run, steps=3):
    return run_cli(capsys, command, "--out", run, "--resume", "--max-steps", str(steps), "--no-progress")


def steps_logged(run):
    return [r["step"] for r in read_metrics(run) if "loss" in r]


@pytest.mark.parametrize("command, extra", [("dpo", []), ("dpo", ["--precompute-ref"]),
                                            ("sft", ["--lora-rank", "4"])],
                         ids=["dpo", "dpo-precompute-ref", "lora-sft"])
def test_a_resume_whose_init_weights_changed_is_refused_when_the_run_depends_on_them(tmp_path, capsys,
                                                                                     command, extra):
    init, run = start(tmp_path, capsys, command, *extra)
    original = (init / "model.safetensors").read_bytes()
    retrain(init)
    code, out, err = resume(capsys, command, run)
    assert code == 1 and err.count("\n") == 1, err
    assert f"--init {init}: its weights differ from those the run in {run} started from" in err
    assert "put the original model back" in err and "start a new run" in err
    assert ("reference model" if command == "dpo" else "frozen base weights of LoRA") in err
    assert steps_logged(run) == [1, 2]  # nothing trained, the run left as it was
    (init / "model.safetensors").write_bytes(original)  # the original back: it continues
    code, _, err = resume(capsys, command, run)
    assert code == 0, err
    assert steps_logged(run) == [1, 2, 3]


def test_a_full_sft_resume_does_not_need_the_init_weights(tmp_path, capsys):
    """Its checkpoint holds every weight: another model in --init changes nothing."""
    init, run = start(tmp_path, capsys, "sft")
    retrain(init)
    code, out, err = resume(capsys, "sft", run)
    assert code == 0, err
    assert "weights differ" not in out + err and "fingerprint" not in out + err
    assert steps_logged(run) == [1, 2, 3]


@pytest.mark.parametrize("command, extra", [("dpo", []), ("sft", ["--lora-rank", "4"])], ids=["dpo", "lora-sft"])
def test_an_unchanged_init_resumes_and_its_fingerprint_is_kept_in_the_checkpoints(tmp_path, capsys, command, extra):
    init, run = start(tmp_path, capsys, command, *extra)
    digest = hashlib.sha256((init / "model.safetensors").read_bytes()).hexdigest()
    assert ckpt.load_state(ckpt.latest_checkpoint(run))["task"]["init_weights"] == digest
    shutil.copytree(init, tmp_path / "copy")  # the same weights, written again
    shutil.rmtree(init)
    shutil.copytree(tmp_path / "copy", init)
    code, out, err = resume(capsys, command, run)
    assert code == 0, err
    assert "fingerprint" not in out + err
    assert steps_logged(run) == [1, 2, 3]
    assert ckpt.load_state(ckpt.latest_checkpoint(run))["task"]["init_weights"] == digest


def test_a_checkpoint_without_a_fingerprint_still_resumes_with_a_note(tmp_path, capsys):
    """Written before the fingerprint was recorded: nothing to check against, said in one line."""
    init, run = start(tmp_path, capsys, "dpo")
    for _, path in ckpt.list_checkpoints(run):
        state = ckpt.load_state(path)
        del state["task"]["init_weights"]
        torch.save(state, path / ckpt.STATE_FILE)
        listed = json.loads((path / ckpt.FILES_FILE).read_text())  # (that FrawdLLM listed names, no sizes)
        (path / ckpt.FILES_FILE).write_text(json.dumps(sorted(listed)))
    code, out, err = resume(capsys, "dpo", run)
    assert code == 0, err
    assert f"{run}: its checkpoint records no fingerprint of --init's weights" in err  # (a notice: stderr)
    assert steps_logged(run) == [1, 2, 3]
    assert "init_weights" in ckpt.load_state(ckpt.latest_checkpoint(run))["task"]  # recorded from here on


@pytest.mark.parametrize("alpha", [["--lora-alpha", "16"], []], ids=["alpha-given", "alpha-default"])
def test_a_resume_that_turns_lora_off_names_the_rank(tmp_path, capsys, alpha):
    """--resume --lora-rank 0 on a LoRA run blamed the run's config.yaml ("lora_alpha scales LoRA
    adapters: give --lora-rank R too"), or listed an alpha never typed ("lora_alpha=None (the run
    has 8)"): the rank, which the user changed, is what is named."""
    _, run = start(tmp_path, capsys, "sft", "--lora-rank", "4", *alpha)
    code, _, err = run_cli(capsys, "sft", "--out", run, "--resume", "--max-steps", "3", "--lora-rank", "0",
                           "--no-progress")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "--resume continues the run's own model" in err and "these settings differ: lora_rank=0 (the run has " \
        "4); drop them" in err, err


def test_a_resume_that_types_the_runs_own_lora_alpha_goes_on(tmp_path, capsys):
    """The alpha the run took by default (2 x rank), typed on --resume, is the run's own: no
    change to refuse (it is compared by value, not by whether it was typed)."""
    _, run = start(tmp_path, capsys, "sft", "--lora-rank", "4")
    code, _, err = run_cli(capsys, "sft", "--out", run, "--resume", "--max-steps", "3", "--lora-rank", "4",
                           "--lora-alpha", "8", "--no-progress")
    assert code == 0, err
    assert steps_logged(run) == [1, 2, 3]
