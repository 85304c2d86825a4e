"""GPU decode: the engine against Hugging Face transformers at batch 1 and 64 (not run by CI).

The `base` preset with random weights in bf16 on cuda, greedy decode of 200 new tokens
after a 32-token prompt; the reference is `GPT2LMHeadModel.generate` with the same
dimensions and dtype. Runs alternate (ours, theirs) and each figure is the median of 3.

    python benchmarks/cuda_decode.py [--preset base]

(--preset: tiny, small or base, the GPT-2 style presets: the reference is a GPT-2, which
has their architecture, not that of a Llama-style or RoPE preset.)

Prints decode_tokens_per_s_{ours,hf}_batch{1,64} and, last, speedup_vs_hf_batch64.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ArgumentParser, require, run_main  # noqa: E402
from decode_speed import _IdTokenizer, hf_model  # noqa: E402

from frawdllm import FrawdLLM, get_config  # noqa: E402
from frawdllm.infer import Engine, SamplingParams  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 32, 200


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base", choices=("tiny", "small", "base"),
                        help="the model, random weights (GPT-2 style, like the reference) [default: base]")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(1, f"{parser.prog}: error: this benchmark needs a CUDA GPU (torch.cuda.is_available() is False)\n")
    require("transformers", "frawdllm[hf]")  # the reference
    cfg = get_config(args.preset)
    device, dtype = torch.device("cuda"), torch.bfloat16
    model = FrawdLLM(cfg).to(device, dtype).eval()
    reference = hf_model(cfg).to(device, dtype)
    engine = Engine(model, _IdTokenizer())
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    print(f"device={torch.cuda.get_device_name()}")
    print(f"preset={args.preset}")
    print("dtype=bf16")
    for batch in (1, 64):
        prompts = torch.randint(7, cfg.vocab_size, (batch, PROMPT_LEN), generator=gen)
        on_device = prompts.to(device)

        def ours():
            engine.generate([row.tolist() for row in prompts], params)

        def theirs():
            with torch.inference_mode():
                reference.generate(on_device, attention_mask=torch.ones_like(on_device), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=cfg.pad_token_id)

        ours(), theirs()  # warm-up
        times = {"ours": [], "hf": []}
        for _ in range(3):
            for name, fn in (("ours", ours), ("hf", theirs)):
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
        rates = {name: batch * NEW_TOKENS / statistics.median(t) for name, t in times.items()}
        for name, rate in rates.items():
            print(f"decode_tokens_per_s_{name}_batch{batch}={rate:.0f}")
        print(f"speedup_vs_hf_batch{batch}={rates['ours'] / rates['hf']:.2f}")  # (batch 64's, the headline, last)


if __name__ == "__main__":
    run_main(main)
