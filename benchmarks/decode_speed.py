"""Decode speed of the engine against Hugging Face transformers, measured in the same run.

Workload (issue 5): batch-1 greedy decode of 200 new tokens after a 32-token prompt, the
`tiny` preset with random weights, fp32. The reference is `GPT2LMHeadModel.generate` with
the same dimensions (its own KV cache). Runs are interleaved (ours, theirs, ours, ...) so
that load from other processes hits both alike; each figure is a median.

Engines (each figure a median; warm-up seconds printed too):
  default      Engine(model, tokenizer): on CPU the native C forward reading fp16 copies
               of the weights (frawdllm/infer/native.c; int8_perplexity.py measures what
               fp16 weights cost in perplexity)
  native_fp32  the native forward reading the fp32 weights: exact
  torch        PyTorch eager (native=False)
  compiled     PyTorch under torch.compile (--no-compile skips it and the two below)
  int8, int8_compiled, bf16, bf16_compiled: int8 / bf16 weights through PyTorch
Also printed: batch-16 throughput and the first-token latency for a 256-token prompt.
Both sides run with the same torch thread count (--threads; default torch's choice, as a
user gets it), printed as torch_threads.

    .venv/bin/python benchmarks/decode_speed.py [--repeats 5] [--threads N] [--no-compile]

The last line is the headline: speedup_vs_hf_batch1=<ours / transformers, default engine>.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.infer import Engine, SamplingParams
from frawdllm.infer.quantize import quantize_int8

PROMPT_LEN, NEW_TOKENS, BATCH, LONG_PROMPT = 32, 200, 16, 256


class _IdTokenizer:
    """The engine only needs decode for text; ids stand for themselves here."""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def hf_model(cfg):
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.context_length, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
    )
    return GPT2LMHeadModel(hf_cfg).eval()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for both sides (0: torch's choice, the default a user gets)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile figures")
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 figures")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16-weight figures")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = get_config("tiny")
    model = FrawdLLM(cfg).eval()
    reference = hf_model(cfg)
    tokenizer = _IdTokenizer()
    engines = {
        "default": Engine(model, tokenizer),
        "native_fp32": Engine(model, tokenizer, native=True, weights="fp32"),
        "torch": Engine(model, tokenizer, native=False),
    }
    if not args.no_compile:
        engines["compiled"] = Engine(model, tokenizer, compile=True)
    if not args.no_int8:
        int8_model = quantize_int8(copy.deepcopy(model))
        engines["int8"] = Engine(int8_model, tokenizer)
        if not args.no_compile:
            engines["int8_compiled"] = Engine(int8_model, tokenizer, compile=True)
    if not args.no_bf16:
        bf16_model = copy.deepcopy(model).to(torch.bfloat16)
        engines["bf16"] = Engine(bf16_model, tokenizer)
        if not args.no_compile:
            engines["bf16_compiled"] = Engine(bf16_model, tokenizer, compile=True)
    default = engines["default"]
    default_mode = (f"native_{default.weights}" if default.native else
                    "torch_compiled" if default.compile else "torch_eager")

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(7, cfg.vocab_size, (1, PROMPT_LEN), generator=gen)
    batch = torch.randint(7, cfg.vocab_size, (BATCH, PROMPT_LEN), generator=gen)
    long_prompt = torch.randint(7, cfg.vocab_size, (1, LONG_PROMPT), generator=gen)
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    first_token = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)

    def ours(engine, prompts, p):
        return lambda: engine.generate([row.tolist() for row in prompts], p)

    def theirs(prompts, n_new):
        def run():
            with torch.inference_mode():
                reference.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n_new,
                                   min_new_tokens=n_new, do_sample=False, pad_token_id=cfg.pad_token_id)
        return run

    print(f"torch_threads={torch.get_num_threads()}")
    for name, engine in engines.items():  # warm-up; for compiled engines this is the compile
        seconds = timed(lambda: [ours(engine, x, params)() for x in (prompt, batch, long_prompt)])
        print(f"warmup_s_{name}={seconds:.1f}")
    timed(theirs(prompt, 8))

    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        times.setdefault("hf_batch1", []).append(timed(theirs(prompt, NEW_TOKENS)))
        for name, engine in engines.items():
            times.setdefault(f"{name}_batch1", []).append(timed(ours(engine, prompt, params)))
    for _ in range(max(2, args.repeats // 2)):
        times.setdefault("hf_batch16", []).append(timed(theirs(batch, NEW_TOKENS)))
        times.setdefault("hf_first_token", []).append(timed(theirs(long_prompt, 1)))
        for name, engine in engines.items():
            times.setdefault(f"{name}_batch16", []).append(timed(ours(engine, batch, params)))
            times.setdefault(f"{name}_first_token", []).append(timed(ours(engine, long_prompt, first_token)))
    median = {key: statistics.median(values) for key, values in times.items()}

    for name in ["hf", *engines]:
        print(f"{name}_batch1_tok_s={NEW_TOKENS / median[f'{name}_batch1']:.1f}")
    for name in ["hf", *engines]:
        print(f"{name}_batch16_tok_s={BATCH * NEW_TOKENS / median[f'{name}_batch16']:.1f}")
    for name in ["hf", *engines]:
        print(f"{name}_first_token_ms_prompt{LONG_PROMPT}={1000 * median[f'{name}_first_token']:.1f}")
    for name in engines:
        print(f"speedup_vs_hf_batch1_{name}={median['hf_batch1'] / median[f'{name}_batch1']:.2f}")
    print(f"default_engine={default_mode}")
    print(f"speedup_vs_hf_batch1={median['hf_batch1'] / median['default_batch1']:.2f}")


if __name__ == "__main__":
    main()
