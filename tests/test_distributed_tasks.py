"""`frawd sft`, `frawd dpo` and `frawd translate train` on 2 processes (torchrun, gloo on the
CPU) against one process.

Each rank reads its part of every step's rows (`distributed.Share`): the parts of all
ranks are the one-process step's rows, and a loss that is a mean over a micro-batch's
tokens (SFT) is divided by the whole micro-batch's count on every rank, so 2 ranks with
batch 4 each give the losses of 1 process with batch 8 (to 1e-5, fp32). DPO runs under
FSDP with its frozen reference replicated on each rank; translation deals each token
batch's sentence pairs out to the ranks.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from frawdllm.align.examples import Example
from frawdllm.align.packing import PackedLoader
from frawdllm.train.distributed import Share

from align_helpers import model_dir, word_chats, word_prefs, write_jsonl

STEPS = 6
TOL = 1e-5


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist-align")
    model_dir(root)
    write_jsonl(root / "chats.jsonl", word_chats(80))
    write_jsonl(root / "prefs.jsonl", word_prefs(60))
    words = [("ein", "a"), ("mann", "man"), ("hund", "dog"), ("rot", "red"), ("auf", "on"), ("gras", "grass")]
    rng = random.Random(0)
    pairs = [[words[rng.randrange(len(words))] for _ in range(rng.randint(2, 7))] for _ in range(160)]
    for side, name in ((0, "train.de"), (1, "train.en")):
        (root / name).write_text("".join(" ".join(w[side] for w in p) + "\n" for p in pairs), encoding="utf-8")
    return root


def frawd(command: str, work: Path, out: Path, *extra: str) -> dict[int, tuple[float, int, dict]]:
    """Run `frawd COMMAND` on a tiny model for STEPS steps (under --nproc: a torchrun subprocess,
    else in this process); its (loss, tokens so far, the task's own metrics) by step."""
    common = ["--max-steps", str(STEPS), "--dtype", "fp32", "--compile", "false", "--device", "cpu",
              "--log-interval", "1", "--eval-interval", "3", "--eval-batches", "1", "--no-progress",
              "--dist-timeout", "30s", "--out", str(out)]
    if command == "translate":
        args = ["translate", "train", "--src", str(work / "train.de"), "--tgt", str(work / "train.en"),
                "--set", "n_embd=32", "--set", "n_head=2", "--set", "n_layer=1", "--set", "n_encoder_layer=1",
                "--set", "mlp_hidden=64", "--set", "dropout=0", "--vocab-size", "300", "--tokens-per-batch", "256",
                "--warmup-steps", "2", "--peak-tflops", "1", "--sample-tokens", "0"]
    else:
        data = work / ("chats.jsonl" if command == "sft" else "prefs.jsonl")
        args = [command, "--init", str(work / "base-llama"), "--data", str(data), "--batch-size", "8", "--lr", "3e-3",
                "--sample-tokens", "4", "--sample-count", "1", "--val-fraction", "0.1"]
    args += common + list(extra)
    if "--nproc" in args:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run([sys.executable, "-m", "frawdllm.cli", *args], capture_output=True, text=True,
                              timeout=200, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:  # the one-process reference: in this process (no fresh interpreter's `import torch` to pay)
        from frawdllm.cli import main

        try:
            main(args)
        except SystemExit as exc:
            assert exc.code in (0, None), f"frawd {command} exited {exc.code}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loop_keys = {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "elapsed_s"}
    return {r["step"]: (r["loss"], r["tokens"], {k: v for k, v in r.items() if k not in loop_keys})
            for r in records if "loss" in r}


def assert_same(got: dict[int, tuple[float, int, dict]], want: dict[int, tuple[float, int, dict]]) -> None:
    """The same losses and task metrics (to TOL: the ranks' mean) and the same token counts:
    each rank's tokens are summed (rank 0's count times N was 5-10% off where rows differ in length)."""
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step][0] == pytest.approx(want[step][0], rel=TOL, abs=TOL), f"step {step}: {got[step]} vs {want[step]}"
        assert got[step][1] == want[step][1], f"step {step}: tokens {got[step][1]} vs {want[step][1]}"
        assert got[step][2] == pytest.approx(want[step][2], rel=TOL, abs=TOL), f"step {step}: {got[step]} vs {want[step]}"


@pytest.mark.timeout(290)
def test_sft_on_two_ranks_gives_the_losses_of_one_process(work):
    one = frawd("sft", work, work / "sft-one")
    two = frawd("sft", work, work / "sft-two", "--nproc", "2")
    assert_same(two, one)
    assert len({loss for loss, _, _ in one.values()}) == STEPS  # it trains: not a constant
    assert (work / "sft-two" / "config.yaml").read_text().startswith("# rerun: frawd sft --nproc 2 --config ")


@pytest.mark.timeout(290)
def test_dpo_under_fsdp_on_two_ranks_gives_the_losses_of_one_process(work):
    one = frawd("dpo", work, work / "dpo-one")
    two = frawd("dpo", work, work / "dpo-two", "--nproc", "2", "--parallel", "fsdp")
    assert_same(two, one)
    assert (work / "dpo-two" / "model").is_dir()


@pytest.mark.timeout(400)
def test_translation_on_two_ranks_gives_the_losses_of_one_process(work):
    one = frawd("translate", work, work / "mt-one")
    two = frawd("translate", work, work / "mt-two", "--nproc", "2")  # each token batch's rows dealt out
    assert_same(two, one)
    assert (work / "mt-two" / "model" / "tokenizer.json").read_text() == \
        (work / "mt-one" / "model" / "tokenizer.json").read_text()
    # under FSDP too: the cross-attention keys/values are computed outside a block's forward
    # (once per source), so the block's weights must be gathered around that method as well
    sharded = frawd("translate", work, work / "mt-fsdp", "--nproc", "2", "--parallel", "fsdp")
    assert_same(sharded, one)


def _examples(lengths: list[int]) -> list[Example]:
    """Examples of the given lengths, each with a prompt of 2 tokens and the rest trained."""
    return [Example(ids=list(range(1, n + 1)), trained=[False, False] + [True] * (n - 2)) for n in lengths]


@pytest.mark.parametrize("world, grad_accum", [(2, 2), (2, 1), (4, 2)])
def test_the_ranks_parts_make_up_the_one_process_step(world, grad_accum):
    """Every rank's micro-batches, together, are the one-process step's rows, and each
    part's `normalizer` makes its summed loss a share of the step's mean over all its
    trained tokens (the step's count per one-process micro-batch, over the parts of one)."""
    examples = _examples([5, 9, 3, 12, 7, 4, 8, 6, 10, 3, 5, 11] * 3)
    one = PackedLoader(examples, 4, 16, seed=3, share=Share(4, grad_accum))
    parts = [PackedLoader(examples, 4, 16, seed=3, share=Share(4, grad_accum, r, world)) for r in range(world)]
    accum = parts[0].share.accum
    for _ in range(3):  # steps
        want = [one.next_batch() for _ in range(grad_accum)]
        got = [[loader.next_batch() for _ in range(accum)] for loader in parts]
        for name in ("tokens", "targets", "documents"):
            rows = torch.cat([got[r][m][name] for m in range(accum) for r in range(world)])
            assert torch.equal(rows, torch.cat([b[name] for b in want]))
        step = float(sum((b["targets"] != -100).sum() for b in want))
        assert [float(b["normalizer"]) for b in want] == [step / grad_accum] * grad_accum
        for m in range(accum):
            for r in range(world):
                assert float(got[r][m]["normalizer"]) == step / grad_accum / parts[r].share.scale
    assert [p.state_dict() for p in parts] == [one.state_dict()] * world
