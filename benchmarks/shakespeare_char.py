"""Character-level tiny shakespeare in a fixed wall-clock budget (default 100 s).

The classic setup: the whole text, one token per character, the last 10% held out for
validation. The recipe is `configs/shakespeare_char.yaml` (dtype and compile auto); this
script runs it with `--max-time` (the budget covers the whole job: tokenizing the 1 MB
of text, the dtype/compile timing steps, torch.compile's warm-up if auto compiles,
evaluations and checkpoints), then scores the best model on the whole validation split in
fp32. It prints the CPU's features, what auto chose and why, and the peak used for MFU.

torch.compile keeps compiled kernels in a disk cache; by default this script points it
at a fresh temporary folder, removed at the end, so the warm-up is paid in full as on a
first run (`--warm-cache` reuses the usual cache). The run directory is temporary too
(removed at the end) unless `--out` names one.

Reference (issue 4, same machine class): nanoGPT's CPU recipe reaches 1.886 in ~104 s,
retuned 1.768 in 100 s.

    .venv/bin/python benchmarks/shakespeare_char.py        # ends with val_loss=<number>
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ArgumentParser, cpu_features_line, duration, run_main

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "shakespeare_char.yaml"),
                        help="the recipe [default: configs/shakespeare_char.yaml]")
    parser.add_argument("--max-time", type=duration, default="100s",
                        help="wall-clock budget of the whole job, e.g. 100s, 5m [default: 100s]")
    parser.add_argument("--out", default=None, help="run directory, kept (default: a temporary one, removed)")
    parser.add_argument("--warm-cache", action="store_true", help="reuse torch.compile's kernel cache")
    parser.add_argument("--progress", action="store_true", help="show the training progress")
    parser.add_argument("--data", default=None, help="the tinyshakespeare.txt to use (default: the recipe's)")
    parser.add_argument("--dtype", default=None, choices=("auto", "fp32", "bf16", "fp16"),
                        help="override the recipe's dtype (auto)")
    parser.add_argument("--compile", default=None, choices=("auto", "true", "false"),
                        help="override the recipe's compile (auto)")
    args = parser.parse_args()
    for name in ("config", "out", "data"):  # given relative to where the script is run (`run` moves to the repo)
        if getattr(args, name) is not None:
            setattr(args, name, os.path.abspath(os.path.expanduser(getattr(args, name))))
    temporary = []  # folders this script makes: removed at the end, also on failure
    try:
        if not args.warm_cache:
            temporary.append(tempfile.mkdtemp(prefix="frawd-inductor-"))
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = temporary[-1]
        if args.out is None:
            temporary.append(tempfile.mkdtemp(prefix="frawd-shakespeare-"))
        run(args, args.out or temporary[-1])
    finally:
        for folder in temporary:
            shutil.rmtree(folder, ignore_errors=True)


def run(args, out: str) -> None:
    os.chdir(ROOT)  # the recipe's data path is relative to the repository root (the options' are absolute)

    import torch

    from frawdllm import FrawdLLM
    from frawdllm.data import VAL_FILE, read_shard
    from frawdllm.train import PretrainConfig, Trainer, build_config, run_pretraining
    from frawdllm.train.device import process_started_at
    from frawdllm.train.evaluate import lm_loss
    from frawdllm.train.pretrain import DATA_DIR

    cfg = build_config(PretrainConfig, args.config, {"max_time": args.max_time, "out": out, "overwrite": True,
                                                      "progress": args.progress, "data": args.data,
                                                      "dtype": args.dtype, "compile": args.compile})
    start = process_started_at()
    seen = {}
    result = run_pretraining(cfg, callbacks=[lambda trainer, record: seen.update(trainer=trainer)],
                             started_at=start)
    wall = time.perf_counter() - start
    trainer: Trainer = seen["trainer"]
    load = os.getloadavg()[0]

    model = FrawdLLM.from_pretrained(Path(out) / "model").eval()
    val = read_shard(Path(out) / DATA_DIR / VAL_FILE)
    loss, n_tokens = lm_loss(model, val, 64, model.config.context_length, torch.device("cpu"))

    for key, value in (("recipe", Path(args.config).name), ("dtype", cfg.dtype), ("compile", cfg.compile),
                       ("params", model.config.num_parameters), ("context", model.config.context_length),
                       ("batch", cfg.batch_size)):
        print(f"{key}={value}")
    print(cpu_features_line())
    print(f"dtype_used={trainer.dtype} ({trainer.dtype_why})")
    print(f"compile_used={trainer.compiled} ({trainer.compile_why})")
    peak = trainer.peak_flops
    print(f"peak_used_gflops={peak / 1e9:.1f}" if peak else "peak_used_gflops=n/a")
    print(f"mfu={result.mfu:.3f}" if result.mfu is not None else "mfu=n/a")
    print(f"budget_s={cfg.max_time_s:.0f}")
    # (no train_s: the run's own clock, result.elapsed_s, counts from the process start too)
    print(f"wall_s={wall:.1f}")  # from the process start: data preparation included
    print(f"load_average={load:.2f}")
    print(f"steps={result.steps}")
    print(f"tokens={result.tokens}")
    print(f"tokens_per_s={result.tokens_per_s:.0f}")
    print(f"best_step={result.best_step}")
    print(f"val_tokens={n_tokens}")
    print(f"val_loss={loss:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    run_main(main)
