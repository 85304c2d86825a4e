"""Training throughput of the `tiny` preset: FrawdLLM through the shared loop vs Hugging Face.

Both models have the same dimensions (6 layers, width 256, 8 heads, vocabulary 8192),
train on random token batches (batch 8, sequence 256) with AdamW (weight decay 0.1) and
gradient clipping at 1.0, in the dtype `dtype: auto` picks on this machine (bf16 autocast
where the CPU computes bf16 natively, else fp32; `--dtypes fp32,bf16` for both; bf16 is
skipped where it would be emulated, ~100x slower, unless `--allow-emulated`):

    ours  `frawdllm.train.Trainer.train_step`, exactly what `frawd pretrain` runs
          (torch.compile on unless --no-compile, fused AdamW, fused LM-head loss,
          glibc malloc told to keep freed memory)
    hf    `transformers.GPT2LMHeadModel` (SDPA attention) in a plain PyTorch loop:
          autocast, backward, clip, `torch.optim.AdamW` with its defaults, eager, in a
          process of its own with the default allocator: HF as users run it

Each side runs in its own worker process (the allocator setting is per process); the
parent sequences them. The machine may be shared and noisy, so the variants take turns:
each of `--rounds` rounds starts fresh worker processes (the same code runs ~15% faster in
one process than in another here, every op alike, so one process per side would decide a
whole run; `--same-workers` keeps them) and times `--steps` steps of every variant. A round's
tokens/s is its median step; MFU (tokens/s x training FLOPs per token, 6N + attention as
`ModelConfig.flops_per_token` counts them, / the peak in the same dtype) and the ratios are
computed per round; the printed figures are medians over the rounds. The peak is the one
`frawd pretrain` and `frawd info` use (that of the dtype that really computes the matmuls,
measured once per machine and cached), so MFU means the same here as in training: a peak
measured in the run itself comes out too low on a loaded machine, and MFU above 1 with it.
An MFU above 1 (a wrong peak) is printed as n/a, with a note. The CPU's features and the
peaks are printed first. `--detail` adds HF with fused AdamW, HF with the same allocator
setting as ours, and HF under torch.compile.

    .venv/bin/python benchmarks/train_throughput.py            # prints key=value lines
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import warnings

from bench_common import ArgumentParser, cpu_features_line, non_negative_int, positive_int, require, run_main

BATCH, SEQ = 8, 256
DTYPE_CHOICES = ("auto", "fp32", "bf16")  # (HF's loop here autocasts to bf16 only)


def dtype_list(text: str) -> list[str]:
    """An argparse type: comma-separated dtypes out of DTYPE_CHOICES."""
    dtypes = [d.strip() for d in text.split(",")]
    unknown = [d for d in dtypes if d not in DTYPE_CHOICES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown dtype {unknown[0]!r}; use {', '.join(DTYPE_CHOICES)}")
    return dtypes


def random_batches(vocab_size: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    while True:
        ids = torch.randint(0, vocab_size, (BATCH, SEQ + 1), generator=generator)
        yield ids[:, :-1], ids[:, 1:]


def ours(cfg, dtype: str, compile: bool, workdir: str):
    import torch

    from frawdllm import FrawdLLM
    from frawdllm.train import Trainer, TrainTask
    from frawdllm.train.config import TrainConfig
    from frawdllm.train.pretrain import PretrainTask

    class RandomTokens(TrainTask):
        batches = random_batches(cfg.vocab_size)

        def next_batch(self):
            return next(self.batches)

        loss = PretrainTask.loss  # the pretraining loss, exactly

    train_cfg = TrainConfig(out=f"{workdir}/ours_{dtype}", device="cpu", dtype=dtype, compile=compile,
                            max_steps=10**9, lr=3e-4, warmup_steps=0, weight_decay=0.1, grad_clip=1.0,
                            eval_interval=0, log_interval=10**9, progress=False, peak_tflops=1.0)
    torch.manual_seed(0)
    return Trainer(FrawdLLM(cfg), RandomTokens(), train_cfg).train_step


def hf(cfg, dtype: str, compile: bool = False, fused: bool | None = None):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.context_length, n_embd=cfg.n_embd,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(hf_cfg).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), fused=fused)
    forward = torch.compile(model) if compile else model
    batches = random_batches(cfg.vocab_size)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step():
        x, _ = next(batches)
        with autocast:
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def worker(conn, specs: list[tuple[str, str, str, dict]], warmup: int, keep_memory: bool) -> None:
    """Build the variants `specs` (name, kind, dtype, options), warm them up, then time
    steps on request: ("run", name, n) -> list of seconds; ("stop",) ends. An exception is
    sent back instead, as ("error", "<type>: <message>"), and ends the worker."""
    try:
        serve(conn, specs, warmup, keep_memory)
    except Exception as error:
        conn.send(("error", f"{type(error).__name__}: {' '.join(str(error).split())}"))
        sys.exit(1)  # (quietly: the parent says what happened, in one line)


def serve(conn, specs: list[tuple[str, str, str, dict]], warmup: int, keep_memory: bool) -> None:
    warnings.filterwarnings("ignore")
    from frawdllm import get_config
    from frawdllm.train.device import keep_freed_memory

    if keep_memory:
        keep_freed_memory()
    cfg = get_config("tiny")
    with tempfile.TemporaryDirectory(prefix="frawd-throughput-", ignore_cleanup_errors=True) as workdir:
        steps, warm = {}, {}
        for name, kind, dtype, options in specs:
            steps[name] = (ours(cfg, dtype, workdir=workdir, **options) if kind == "ours"
                           else hf(cfg, dtype, **options))
            start = time.perf_counter()
            for _ in range(warmup):
                steps[name]()
            warm[name] = time.perf_counter() - start
        conn.send(warm)
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            _, name, n = message
            times = []
            for _ in range(n):
                start = time.perf_counter()
                steps[name]()
                times.append(time.perf_counter() - start)
            conn.send(times)


def receive(conn):
    """A worker's answer. Its failure (an error it sent back, or its death: the pipe closes)
    ends this script with one line and exit status 1, not a wait that never ends."""
    from frawdllm.errors import FrawdError

    try:
        answer = conn.recv()
    except EOFError:  # (the parent closed its copy of the worker's end: only the worker's death gets here)
        raise FrawdError("a worker process died without answering (killed? out of memory?)") from None
    if isinstance(answer, tuple) and answer[0] == "error":
        raise FrawdError(f"a worker process failed: {answer[1]}")
    return answer


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=8,
                        help="timed steps per variant per round [default: 8]")
    parser.add_argument("--rounds", type=positive_int, default=5, help="rounds of fresh workers [default: 5]")
    parser.add_argument("--warmup", type=non_negative_int, default=3,
                        help="untimed steps first (compilation happens here) [default: 3]")
    parser.add_argument("--no-compile", action="store_true", help="run our model eagerly")
    parser.add_argument("--dtypes", type=dtype_list, default="auto",
                        help="comma-separated, of auto, fp32, bf16; auto = what dtype: auto picks here "
                             "[default: auto]")
    parser.add_argument("--allow-emulated", action="store_true", help="also run bf16 where it is emulated")
    parser.add_argument("--same-workers", action="store_true",
                        help="keep one worker process per side for all rounds (default: fresh ones each round)")
    parser.add_argument("--detail", action="store_true",
                        help="also time HF with fused AdamW, with our allocator setting, and compiled (bf16)")
    args = parser.parse_args()
    require("transformers", "frawdllm[hf]")  # the reference
    import torch

    from frawdllm import get_config
    from frawdllm.errors import FrawdError
    from frawdllm.train.device import (PEAKS_FILE, cached_peak, choose_dtype, matmul_dtype, mfu, peak_flops,
                                       user_cache_dir)

    cpu = torch.device("cpu")
    cfg = get_config("tiny")
    auto = choose_dtype("auto", cpu)[0]
    dtypes = list(dict.fromkeys(auto if d == "auto" else d for d in args.dtypes))
    emulated = [d for d in dtypes if matmul_dtype(d, cpu) != d and not args.allow_emulated]
    if emulated == dtypes:  # nothing left to time: say so before any work
        raise FrawdError(f"{', '.join(emulated)} is emulated on this CPU, so nothing is left to run "
                         "(--allow-emulated runs it anyway; --dtypes fp32 times fp32)")
    print(cpu_features_line())
    print(f"auto_dtype={auto}")
    for d in emulated:
        print(f"skipped_{d}=emulated on this CPU (--allow-emulated runs it)")
        dtypes.remove(d)
    compile = not args.no_compile
    for key, value in (("threads", torch.get_num_threads()), ("torch", torch.__version__), ("batch", BATCH),
                       ("seq", SEQ), ("params", cfg.num_parameters), ("compile", compile)):
        print(f"{key}={value}")
    # The peak `frawd pretrain` divides by: cached per machine (measured once, here, before
    # the workers start, if this machine has none yet).
    peak_source = {d: "cached" if cached_peak(cpu, d) else "measured now" for d in dtypes}
    peaks = {d: peak_flops(cpu, d, say=lambda line: print(line, file=sys.stderr, flush=True)) for d in dtypes}
    for d in dtypes:
        print(f"peak_{d}_gflops={peaks[d] / 1e9:.1f}")
        print(f"peak_{d}_computed_in={matmul_dtype(d, cpu)}")
        print(f"peak_{d}_source={peak_source[d]}", flush=True)

    groups = {  # worker -> (variants, keep freed memory)
        "hf": ([(f"hf_{d}", "hf", d, {}) for d in dtypes], False),
        "ours": ([(f"ours_{d}", "ours", d, {"compile": compile}) for d in dtypes], True),
    }
    if args.detail and "bf16" not in dtypes:  # (as skipped_bf16 says why, where it was asked for)
        print("detail=skipped (--detail times bf16 variants, and bf16 is not run here)", flush=True)
    if args.detail and "bf16" in dtypes:
        groups["hf_extra"] = ([("hf_bf16_fused_adamw", "hf", "bf16", {"fused": True}),
                               ("hf_bf16_compiled", "hf", "bf16", {"compile": True})], False)
        groups["hf_keepmem"] = ([("hf_bf16_keep_freed_memory", "hf", "bf16", {})], True)
    ctx = mp.get_context("spawn")

    def start_workers(report: bool):
        workers, owner = [], {}
        for specs, keep in groups.values():
            parent, child = ctx.Pipe()
            process = ctx.Process(target=worker, args=(child, specs, args.warmup, keep), daemon=True)
            process.start()
            child.close()  # (the worker holds its end now: if it dies, recv() here ends with EOFError)
            for warm_name, seconds in receive(parent).items():  # warm-ups run one worker at a time
                if report:
                    print(f"warmup_s_{warm_name}={seconds:.1f}", flush=True)
            workers.append((process, parent))
            owner.update({name: parent for name, *_ in specs})
        return workers, owner

    def stop_workers(workers) -> None:
        for process, conn in workers:
            conn.send(("stop",))
            process.join(timeout=30)

    rounds = []
    workers, owner = start_workers(report=True)
    for i in range(args.rounds):
        if i and not args.same_workers:  # a process's speed varies from one process to the next: resample it
            stop_workers(workers)
            workers, owner = start_workers(report=False)
        tps = {}
        for name, conn in owner.items():
            conn.send(("run", name, args.steps))
            tps[name] = BATCH * SEQ / statistics.median(receive(conn))
        rounds.append(tps)
    stop_workers(workers)

    def median(f):
        return statistics.median(f(tps) for tps in rounds)

    flops_per_token = cfg.flops_per_token(SEQ)
    for name in owner:
        print(f"{name}_tokens_per_s={median(lambda t: t[name]):.0f}")
    for who in ("hf_", ""):
        for d in dtypes:
            value = mfu(median(lambda t: t[f"{who or 'ours_'}{d}"]), flops_per_token, peaks[d])
            if value is None:  # above 1: the peak cannot be right
                print(f"mfu_{who}{d}_note=achieved FLOP/s above peak_{d}_gflops: the peak is too low "
                      f"(remeasure it: delete its entry in {user_cache_dir() / PEAKS_FILE})")
            print(f"mfu_{who}{d}={'n/a' if value is None else f'{value:.3f}'}")
    for d in sorted(dtypes, key=lambda d: d == "bf16"):  # the headline, bf16, last
        print(f"ratio_vs_hf_{d}={median(lambda t: t[f'ours_{d}'] / t[f'hf_{d}']):.2f}")


if __name__ == "__main__":
    run_main(main)
