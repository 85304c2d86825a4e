"""What lower-precision weights cost in held-out perplexity (and gain in decode speed).

Trains a model on tiny shakespeare with `frawd pretrain` (a short budget) unless --model
names one, then scores its validation split (the last 10% of the text, never trained on)
with fp32 weights, fp16-rounded linear weights (what the engine's default native decoding
reads), the same with keys and values rounded to fp16 as they are cached (fp16_kv: the
engine's default KV cache where every phase runs natively), bf16 weights and int8
weights (as the native forward computes them: int8 x scale in fp32; int8_torch:
PyTorch's int8 kernel, bf16 activations), and times greedy decoding
of each (fp32: native forward with weights="fp32"; fp16: the engine's default).
Recipes: `char` (configs/shakespeare_char.yaml: 4 layers, width 128, characters) and
`tiny-bpe` (the `tiny` preset: 6 layers, width 256, an 8192-token BPE vocabulary).

    .venv/bin/python benchmarks/int8_perplexity.py [--recipe char|tiny-bpe] [--max-steps 600] [--run DIR]
    .venv/bin/python benchmarks/int8_perplexity.py --model DIR --data-dir DIR

The last line is the headline: int8_ppl_change_pct=<(ppl_int8 / ppl_fp32 - 1) * 100>;
fp16_ppl_change_pct is the same figure for the default native decoding.
"""

from __future__ import annotations

import argparse
import copy
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import ArgumentParser, cpu_features_line, positive_int, run_main
from frawdllm.data import VAL_FILE, read_shard
from frawdllm.errors import FrawdError
from frawdllm.infer import Engine, SamplingParams
from frawdllm.infer.cache import HalfKVModel
from frawdllm.infer.native import dequantized_copy, fp16_rounded_copy
from frawdllm.infer.quantize import int8_weight_bytes, quantize_int8
from frawdllm.modeldir import load_model
from frawdllm.tokenizer import Tokenizer
from frawdllm.train.evaluate import lm_loss

ROOT = Path(__file__).resolve().parent.parent


RECIPES = {
    "char": ["--config", str(ROOT / "configs" / "shakespeare_char.yaml")],
    "tiny-bpe": ["--preset", "tiny", "--data", str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"),
                 "--tokenizer", "bpe", "--doc-split", "file", "--val-fraction", "0.1", "--lr", "1e-3",
                 "--warmup-steps", "50", "--dtype", "fp32"],
}


def train(out: Path, recipe: str, max_steps: int) -> None:
    frawd = str(Path(sys.executable).parent / "frawd")
    done = subprocess.run([frawd, "pretrain", *RECIPES[recipe], "--max-steps", str(max_steps), "--max-time", "60m",
                           "--eval-interval", "0", "--sample-tokens", "0", "--no-progress", "--out", str(out)],
                          cwd=ROOT, stdout=sys.stderr)  # (its summary line: not one of our figures)
    if done.returncode != 0:  # it said why on stderr
        sys.exit(done.returncode)


def decode_tok_s(model, tokenizer, n: int = 200, **engine_options) -> float:
    """Median greedy decode speed; past the (short) context the engine slides."""
    engine = Engine(model, tokenizer, overflow="slide", **engine_options)
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    engine.generate("ROMEO:", params.replace(max_new_tokens=8))
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        tokens = engine.generate("ROMEO:", params)[0].tokens
        rates.append(len(tokens) / (time.perf_counter() - start))
    return sorted(rates)[1]


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="A model directory (default: train one).")
    parser.add_argument("--run", default=None, help="Train into (or reuse the model of) this run directory.")
    parser.add_argument("--data-dir", default=None, help="The prepared shards to score on (val.bin); default: the "
                                                          "run's data/ (the model's run's, with --model).")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="char", help="What to train.")
    parser.add_argument("--max-steps", type=positive_int, default=600, help="Training steps when training here.")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="Rows per batch when scoring.")
    parser.add_argument("--threads", type=positive_int, default=1, help="Torch threads for scoring and decoding.")
    args = parser.parse_args()
    if args.model is not None and not Path(args.model).is_dir():
        raise FrawdError(f"model folder not found: {args.model}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise FrawdError(f"{args.model} is not a model directory (no config.json)")
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise FrawdError(f"--data-dir folder not found: {args.data_dir}")
    torch.set_num_threads(args.threads)
    where = args.model
    with tempfile.TemporaryDirectory(prefix="frawd-int8-") as tmp:
        if args.model is None:
            run = Path(args.run).resolve() if args.run else Path(tmp) / "run"  # (training runs in the repo)
            if (run / "model").is_dir():
                where = f"reused from {run / 'model'}"
            else:
                train(run, args.recipe, args.max_steps)
                where = f"trained here ({args.recipe}, {args.max_steps} steps)"
            model_dir, data_dir = run / "model", Path(args.data_dir) if args.data_dir else run / "data"
        else:
            model_dir = Path(args.model)
            data_dir = Path(args.data_dir) if args.data_dir else model_dir.parent / "data"
        tokens = read_shard(data_dir / VAL_FILE)
        tokenizer = Tokenizer.load(model_dir)
        fp32 = load_model(model_dir).eval()
        context = fp32.config.context_length
        int8 = quantize_int8(copy.deepcopy(fp32))
        fp16 = fp16_rounded_copy(fp32)
        variants = {"fp32": fp32, "fp16": fp16, "fp16_kv": HalfKVModel(fp16),
                    "bf16": copy.deepcopy(fp32).to(torch.bfloat16), "int8": dequantized_copy(int8), "int8_torch": int8}
        # What decodes each: the native forward computes the fp16-rounded and the
        # dequantized models exactly; int8_torch is PyTorch's int8 kernel (bf16 activations).
        # (fp16_kv is scored only: the "fp16" engine decodes with an fp16 KV cache where every
        # phase runs natively, Engine.kv_dtype)
        decoding = {"fp32": (fp32, dict(weights="fp32")), "fp16": (fp32, dict(weights="fp16")),
                    "int8": (int8, {}), "int8_torch": (int8, dict(native=False))}
        ppl, speed = {}, {}
        for name, model in variants.items():
            loss, count = lm_loss(model, tokens, args.batch_size, context, torch.device("cpu"))
            ppl[name] = math.exp(loss)
            if name != "fp16_kv":
                decode_model, options = decoding.get(name, (model, {}))
                speed[name] = decode_tok_s(decode_model, tokenizer, **options)
    stored, full = int8_weight_bytes(int8)
    print(cpu_features_line())
    for key, value in (("model", where), ("val_tokens", count), ("context", context),
                       ("params", fp32.num_parameters()), ("linear_weight_bytes_fp32", full),
                       ("linear_weight_bytes_int8", stored)):
        print(f"{key}={value}")
    for name in variants:
        print(f"ppl_{name}={ppl[name]:.4f}")
    for name in speed:
        print(f"decode_tok_s_{name}={speed[name]:.1f}")
    print(f"fp16_ppl_change_pct={(ppl['fp16'] / ppl['fp32'] - 1) * 100:.3f}")
    print(f"fp16_kv_ppl_change_pct={(ppl['fp16_kv'] / ppl['fp32'] - 1) * 100:.3f}")
    print(f"bf16_ppl_change_pct={(ppl['bf16'] / ppl['fp32'] - 1) * 100:.3f}")
    print(f"int8_ppl_change_pct={(ppl['int8'] / ppl['fp32'] - 1) * 100:.3f}")


if __name__ == "__main__":
    run_main(main)
