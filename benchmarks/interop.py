"""Interop parity: our logits against transformers and llama.cpp, measured in the same run.

For the `tiny` (GPT-2 style) and `tiny-llama` (Llama style, GQA) presets, plus MQA and
untied variants, with random weights (biases and norm gains perturbed too), a model is
saved with a byte-level BPE tokenizer trained on tiny shakespeare, exported (the code
`frawd export` runs), and loaded back the way a user would:

- transformers: `AutoModelForCausalLM.from_pretrained(out)`, fp32; reported: the largest
  absolute logit difference on 4 x context_length tokens of real text, and the forward
  time of ours / theirs (median of interleaved runs);
- llama.cpp (when `llama-cpp-python` is importable): the GGUF export run with
  `logits_all=True` and a float32 KV cache; reported: the largest logit difference over
  one context of text and whether llama.cpp tokenizes 20,000 characters to our ids.

    .venv/bin/python benchmarks/interop.py [--repeats 5] [--threads 2]

The last line is the headline: max_abs_diff_hf=<worst difference over the variants>.
(llama.cpp's GPT-2 differs by ~1e-3 because ggml's CPU GELU reads a float16 table.)
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_common import ArgumentParser, cpu_features_line, positive_int, require, run_main
from frawdllm import FrawdLLM, get_config
from frawdllm.export.gguf import export_gguf
from frawdllm.export.hf_dir import export_hf
from frawdllm.tokenizer import train_tokenizer

SHAKESPEARE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
VARIANTS = {
    "gpt2_tied": ("tiny", {}),
    "gpt2_untied": ("tiny", {"tie_embeddings": False}),
    "llama_gqa": ("tiny-llama", {}),
    "llama_mqa_untied": ("tiny-llama", {"n_kv_head": 1, "tie_embeddings": False}),
}


def perturbed(model: FrawdLLM, seed: int) -> FrawdLLM:
    """GPT-2 init, then noise on everything so biases and norm gains matter too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def llama_cpp_check(gguf_path: Path, model: FrawdLLM, tokenizer, text: str, threads: int) -> tuple[float, bool]:
    from llama_cpp import Llama

    n_ctx = model.config.context_length
    llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, logits_all=True, n_threads=threads, verbose=False,
                type_k=0, type_v=0)  # float32 KV cache (llama.cpp's default is float16)
    try:
        ids = tokenizer.encode(text)[:n_ctx]
        llm.eval(ids)
        theirs = torch.from_numpy(llm.scores[: len(ids)].copy())
        same_tokens = llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(text)
    finally:
        llm.close()
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0]
    return (ours - theirs).abs().max().item(), same_tokens


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="interleaved forward timings per variant; the figures are medians [default: 5]")
    parser.add_argument("--threads", type=positive_int, default=2,
                        help="torch threads, and llama.cpp's, for both sides [default: 2]")
    args = parser.parse_args()
    require("transformers", "frawdllm[hf]")  # the reference
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # ("Loading weights: 100%" bars between the figures)
    text = SHAKESPEARE.read_text(encoding="utf-8")
    tokenizer = train_tokenizer([text[i:i + 4000] for i in range(0, len(text), 4000)], "bpe", 8192)
    corpus_ids = tokenizer.encode(text[:200_000])
    have_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    print(cpu_features_line())
    print(f"torch_threads={torch.get_num_threads()}")
    print(f"transformers_version={transformers.__version__}")
    print(f"llama_cpp={'available' if have_llama_cpp else 'unavailable'}")
    worst = 0.0
    worst_cpp: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (name, (preset, overrides)) in enumerate(VARIANTS.items()):
            model = perturbed(FrawdLLM(get_config(preset, **overrides)), seed)
            cfg = model.config
            ours_dir, hf_dir = Path(tmp) / f"{name}-ours", Path(tmp) / f"{name}-hf"
            model.save_pretrained(ours_dir, tokenizer=tokenizer)
            export_hf(ours_dir, hf_dir)  # what `frawd export --format hf` runs
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
            T = cfg.context_length
            ids = torch.tensor(corpus_ids[: 4 * T]).view(4, T)
            with torch.no_grad():
                diff = (model(ids)[0] - hf_model(ids).logits).abs().max().item()
                ours_s, theirs_s = [], []
                for _ in range(args.repeats):  # interleaved, so load from others hits both alike
                    ours_s.append(median_seconds(lambda: model(ids), 1))
                    theirs_s.append(median_seconds(lambda: hf_model(ids), 1))
            worst = max(worst, diff)
            print(f"{name}_params={cfg.num_parameters}")
            print(f"{name}_max_abs_diff_hf={diff:.3e}")
            print(f"{name}_forward_ms_ours={1000 * statistics.median(ours_s):.1f}")
            print(f"{name}_forward_ms_hf={1000 * statistics.median(theirs_s):.1f}")
            print(f"{name}_forward_time_ratio_ours_vs_hf={statistics.median(ours_s) / statistics.median(theirs_s):.3f}")
            if have_llama_cpp:
                gguf_path = Path(tmp) / f"{name}.gguf"
                export_gguf(ours_dir, gguf_path)
                cpp_diff, same_tokens = llama_cpp_check(gguf_path, model, tokenizer, text[:20_000], args.threads)
                print(f"{name}_max_abs_diff_llama_cpp={cpp_diff:.3e}")
                print(f"{name}_llama_cpp_tokenizes_like_ours={same_tokens}")
                family = name.split("_")[0]
                worst_cpp[family] = max(worst_cpp.get(family, 0.0), cpp_diff)
    for family, diff in worst_cpp.items():
        print(f"max_abs_diff_llama_cpp_{family}={diff:.3e}")
    print(f"max_abs_diff_hf={worst:.3e}")


if __name__ == "__main__":
    run_main(main)
