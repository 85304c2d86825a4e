"""Training throughput of the `tiny` preset: FrawdLLM through the shared loop vs Hugging Face.

Both models have the same dimensions (6 layers, width 256, 8 heads, vocabulary 8192),
train on random token batches (batch 8, sequence 256) with AdamW (weight decay 0.1) and
gradient clipping at 1.0, in fp32 and in bf16 autocast:

    ours  `frawdllm.train.Trainer.train_step`, exactly what `frawd pretrain` runs
          (torch.compile on unless --no-compile, fused AdamW)
    hf    `transformers.GPT2LMHeadModel` (SDPA attention) in a plain PyTorch loop:
          autocast, backward, clip, `torch.optim.AdamW` with its defaults, eager

The machine may be shared and noisy, so the variants take turns: each of `--rounds`
rounds measures the dense matmul peak (per dtype) and then `--steps` steps of every
variant. A round's tokens/s is its median step; MFU (tokens/s x training FLOPs per token,
6N + attention as `ModelConfig.flops_per_token` counts them, / that round's peak in the
same dtype) and the ratios are computed per round; the printed figures are medians over
the rounds.

    .venv/bin/python benchmarks/train_throughput.py            # prints key=value lines
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.train import Trainer, TrainTask
from frawdllm.train.config import TrainConfig
from frawdllm.train.device import DTYPES, measure_matmul_flops
from frawdllm.train.pretrain import PretrainTask

BATCH, SEQ = 8, 256


class RandomTokens(TrainTask):
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self):
        ids = torch.randint(0, self.vocab_size, (BATCH, SEQ + 1), generator=self.generator)
        return ids[:, :-1], ids[:, 1:]

    loss = PretrainTask.loss  # the pretraining loss, exactly (fused LM head + cross-entropy)


def ours(cfg, dtype: str, compile: bool, workdir: str):
    train_cfg = TrainConfig(out=f"{workdir}/ours_{dtype}", device="cpu", dtype=dtype, compile=compile,
                            max_steps=10**9, lr=3e-4, warmup_steps=0, weight_decay=0.1, grad_clip=1.0,
                            eval_interval=0, log_interval=10**9, progress=False, peak_tflops=1.0)
    torch.manual_seed(0)
    trainer = Trainer(FrawdLLM(cfg), RandomTokens(cfg.vocab_size), train_cfg)
    return trainer.train_step


def hf(cfg, dtype: str, compile: bool = False, fused: bool | None = None):
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
    data = RandomTokens(cfg.vocab_size)
    autocast = torch.autocast("cpu", dtype=DTYPES[dtype], enabled=dtype != "fp32")

    def step():
        x, _ = data.next_batch()
        with autocast:
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--no-compile", action="store_true", help="run our model eagerly")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--detail", action="store_true",
                        help="also time HF with fused AdamW and HF under torch.compile (bf16)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cfg = get_config("tiny")
    dtypes = args.dtypes.split(",")
    compile = not args.no_compile
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} batch={BATCH} seq={SEQ} "
          f"params={cfg.num_parameters} compile={compile}", flush=True)

    workdir = tempfile.mkdtemp(prefix="frawd-throughput-")
    variants = {}
    for d in dtypes:
        variants[f"hf_{d}"] = hf(cfg, d)
        variants[f"ours_{d}"] = ours(cfg, d, compile, workdir)
    if args.detail and "bf16" in dtypes:
        variants["hf_bf16_fused_adamw"] = hf(cfg, "bf16", fused=True)
        variants["hf_bf16_compiled"] = hf(cfg, "bf16", compile=True)
    for name, step in variants.items():
        start = time.perf_counter()
        for _ in range(args.warmup):
            step()
        print(f"warmup_s_{name}={time.perf_counter() - start:.1f}", flush=True)

    # Each round measures the matmul peak and then every variant, so a change in the
    # machine's load hits a round's figures together; ratios and MFU are per round.
    rounds = []
    for _ in range(args.rounds):
        peaks = {d: measure_matmul_flops(torch.device("cpu"), d, min_seconds=0.5) for d in dtypes}
        tps = {}
        for name, step in variants.items():
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            tps[name] = BATCH * SEQ / statistics.median(times)
        rounds.append((peaks, tps))

    def median(f):
        return statistics.median(f(peaks, tps) for peaks, tps in rounds)

    flops_per_token = cfg.flops_per_token(SEQ)
    for d in dtypes:
        print(f"peak_{d}_gflops={median(lambda p, t: p[d]) / 1e9:.1f}")
    for name in variants:
        print(f"{name}_tokens_per_s={median(lambda p, t: t[name]):.0f}")
    for who in ("hf_", ""):
        for d in dtypes:
            mfu = median(lambda p, t: t[f"{who or 'ours_'}{d}"] * flops_per_token / p[d])
            print(f"mfu_{who}{d}={mfu:.3f}")
    for d in sorted(dtypes, key=lambda d: d == "bf16"):  # the headline, bf16, last
        print(f"ratio_vs_hf_{d}={median(lambda p, t: t[f'ours_{d}'] / t[f'hf_{d}']):.2f}")
    shutil.rmtree(workdir, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
