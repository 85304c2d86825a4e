"""Decode speed of the engine against Hugging Face transformers, measured in the same run.

Workload (issue 5): batch-1 greedy decode of 200 new tokens after a 32-token prompt, the
`tiny` preset with random weights, fp32 (`--preset small` or `base`: the same workload on
a GPT-2 style model whose weights no longer fit in the CPU's cache, where the roofline is
the memory's, not the cache's). The reference is `GPT2LMHeadModel.generate` with
the same dimensions (its own KV cache). Runs are interleaved (ours, theirs, ours, ...) so
that load from other processes hits both alike; each figure is a median.

Engines (each figure a median; warm-up seconds printed too):
  default      Engine(model, tokenizer): each phase on the forward measured fastest on
               this CPU (frawdllm/infer/paths.py), the native C forward reading fp16
               copies of the weights where it wins (int8_perplexity.py measures what fp16
               weights cost in perplexity); default_engine= says which ran where
  native_fp32  the native forward everywhere, reading fp32 weights: exact
  torch        PyTorch eager (native=False)
  int8         int8 weights (native where it wins)
  bf16         bf16 weights through PyTorch: only on CPUs that compute bf16 (elsewhere it
               is emulated, ~100x slower; --bf16 forces it)
  compiled, int8_compiled, bf16_compiled: under torch.compile, only with --compile (their
               warm-up alone can take minutes on some CPUs)
Also printed: batch-16 throughput, the first-token latency for a 256-token prompt (median
of 9 interleaved calls per engine, the thread-count probes of the engine included), the
CPU features, and the roofline: the read bandwidth of this machine on a buffer the size
of the weights one default decode step streams (`buf.sum()` with the same threads, the
lower quartile of 30; on 2 MB pages like the native decoder's weights, where Linux gives
them; measured just before and just after each default batch-1 run, so
that both figures come from the same phase of a shared machine, whose speed can swing
2x within minutes: the median of those, their range printed too), and
roofline_fraction_batch1 = weight bytes per token x tokens/s / that bandwidth. Then the
batch-1 figures again with a competing process spinning one core (`*_under_load`; run
last, after llama.cpp's). Where llama-cpp-python is installed (the optional `llamacpp`
extra), the same model exported with `frawd export --format gguf` in fp16 and fp32 is decoded by llama.cpp in
the same run (same prompt, 200 greedy tokens, same threads; llama-cpp-python's `eval`
per token and numpy's argmax of its logits): `llama_cpp_{f16,f32}_batch1_tok_s`, whether
its greedy tokens equal ours, our engine's tokens/s in the runs interleaved with llama.cpp's
(`ours_vs_llama_cpp_{f16,f32}_tok_s`) and `speedup_vs_llama_cpp_{f16,f32}`, the ratio of
those two (the default engine against f16, the exact native fp32 engine against f32); else
`llama_cpp=skipped`.
Both sides run with the same torch thread count (--threads; default torch's choice, as a
user gets it), printed as torch_threads. About 3-6 minutes on 2 cores.

    .venv/bin/python benchmarks/decode_speed.py [--repeats 3] [--threads N] [--compile] [--preset tiny]

The last line is the headline: speedup_vs_hf_batch1=<ours / transformers, default engine>.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import ArgumentParser, cpu_features_line, non_negative_int, positive_int, require, run_main
from frawdllm import FrawdLLM, get_config
from frawdllm.cbuild import march
from frawdllm.infer import Engine, SamplingParams
from frawdllm.infer.hugepages import huge_page_bytes
from frawdllm.infer.quantize import quantize_int8
from frawdllm.train.device import ONEDNN_CAPS, aten_capped, cpu_has_bf16, onednn_isa_cap

PROMPT_LEN, NEW_TOKENS, BATCH, LONG_PROMPT = 32, 200, 16, 256
FIRST_TOKEN_SAMPLES = 9  # per engine, interleaved; the figure is their median
LLAMA_CPP = {"f16": ("float16", "default"), "f32": ("float32", "native_fp32")}  # GGUF dtype, our engine to compare


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


class _LlamaCpp:
    """llama.cpp (through llama-cpp-python) on a GGUF export of `model`: batch-1 greedy decoding."""

    def __init__(self, model: FrawdLLM, dtype: str, folder: Path, threads: int) -> None:
        from llama_cpp import Llama

        from frawdllm.export.gguf import write_gguf

        path = folder / f"model-{dtype}.gguf"
        write_gguf(model, None, path, dtype)  # what `frawd export --format gguf --dtype ...` writes
        self.vocab = model.config.vocab_size
        self.llm = Llama(model_path=str(path), n_ctx=model.config.context_length, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def greedy(self, prompt: list[int], n_new: int) -> list[int]:
        import numpy as np

        llm, out = self.llm, []
        llm.reset()
        llm.eval(prompt)
        for _ in range(n_new):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(self.vocab,))  # the last token's
            out.append(int(logits.argmax()))
            llm.eval(out[-1:])
        return out

    def close(self) -> None:
        self.llm.close()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_bandwidth(n_bytes: int, repeats: int = 30) -> float:
    """Bytes/s that torch's threads read from an fp32 buffer of n_bytes (`sum`, the lower quartile
    of `repeats` timings), on 2 MB pages where the decoder's weights are (`hugepages`): the same
    kind of memory."""
    block = huge_page_bytes(max(n_bytes // 4, 1024) * 4)
    buf = block.view(torch.float32) if block is not None else torch.empty(max(n_bytes // 4, 1024))
    buf.fill_(1.0)
    buf.sum()
    times = sorted(timed(buf.sum) for _ in range(repeats))
    return buf.numel() * 4 / times[len(times) // 4]  # lower quartile: the machine's rate when not disturbed


def decode_weight_bytes(engine: Engine) -> int:
    """The weight bytes one batch-1 decode step of `engine` streams, on the path its plan gives
    that phase: the native forward's own copies (fp16 where it reads fp16), else PyTorch
    reading the model's linears as they are (fp32 here: twice fp16's bytes)."""
    if engine.plan()["decode"].kind == "native":
        return engine.native_decoder().weight_bytes
    return sum(m.weight.numel() * m.weight.element_size() for m in engine.model.modules()
               if isinstance(m, torch.nn.Linear))


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per figure [default: 3]")
    parser.add_argument("--threads", type=non_negative_int, default=0,
                        help="torch threads for both sides (0: torch's choice, the default a user gets)")
    parser.add_argument("--compile", action="store_true", help="add the torch.compile figures (slow warm-up)")
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 figures")
    parser.add_argument("--bf16", action="store_true", help="bf16 figures even where bf16 is emulated")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16-weight figures")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small", "base"),
                        help="the model (GPT-2 style, like the reference) [default: tiny]")
    args = parser.parse_args()
    require("transformers", "frawdllm[hf]")  # the reference
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = get_config(args.preset)
    model = FrawdLLM(cfg).eval()
    reference = hf_model(cfg)
    tokenizer = _IdTokenizer()
    engines = {
        "default": Engine(model, tokenizer),
        "native_fp32": Engine(model, tokenizer, native=True, weights="fp32"),
        "torch": Engine(model, tokenizer, native=False),
    }
    if args.compile:
        engines["compiled"] = Engine(model, tokenizer, compile=True)
    if not args.no_int8:
        int8_model = quantize_int8(copy.deepcopy(model))
        engines["int8"] = Engine(int8_model, tokenizer)
        if args.compile:
            engines["int8_compiled"] = Engine(int8_model, tokenizer, compile=True)
    bf16 = not args.no_bf16 and (args.bf16 or cpu_has_bf16())  # (oneDNN's ISA cap counted: device.cpu_features)
    if bf16:
        bf16_model = copy.deepcopy(model).to(torch.bfloat16)
        engines["bf16"] = Engine(bf16_model, tokenizer)
        if args.compile:
            engines["bf16_compiled"] = Engine(bf16_model, tokenizer, compile=True)
    default = engines["default"]
    print(f"preset={args.preset}")
    print(cpu_features_line())
    print(f"native_march={march()}")
    if not bf16 and not args.no_bf16:
        print("bf16=skipped (bf16 matmuls are emulated here: the CPU or a oneDNN cap; --bf16 to force)")

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
    default_mode = default.describe()
    if default.native:
        default_mode += f" [{default.native_decoder().stream_forms}]"  # as timed on its weights
    weight_bytes = decode_weight_bytes(default)

    times: dict[str, list[float]] = {}
    bandwidths = []  # measured beside each default batch-1 run: the same phase of a shared machine
    for _ in range(args.repeats):
        times.setdefault("hf_batch1", []).append(timed(theirs(prompt, NEW_TOKENS)))
        for name, engine in engines.items():
            if name == "default":
                bandwidths.append(read_bandwidth(weight_bytes))
            times.setdefault(f"{name}_batch1", []).append(timed(ours(engine, prompt, params)))
            if name == "default":
                bandwidths.append(read_bandwidth(weight_bytes))
    for _ in range(max(3, args.repeats // 2)):  # (at least 3: a median of 2 would be their mean)
        times.setdefault("hf_batch16", []).append(timed(theirs(batch, NEW_TOKENS)))
        for name, engine in engines.items():
            times.setdefault(f"{name}_batch16", []).append(timed(ours(engine, batch, params)))
    # A first token is cheap (~20-40 ms), and an engine's second long prompt tries the other
    # thread count once (paths.ThreadChoice): the median of two calls, one of them that probe,
    # would be their mean.
    for _ in range(FIRST_TOKEN_SAMPLES):
        times.setdefault("hf_first_token", []).append(timed(theirs(long_prompt, 1)))
        for name, engine in engines.items():
            times.setdefault(f"{name}_first_token", []).append(timed(ours(engine, long_prompt, first_token)))
    median = {key: statistics.median(values) for key, values in times.items()}
    bandwidth = statistics.median(bandwidths)

    llama_cpp: dict[str, float] = {}  # weight dtype -> tokens/s
    same_tokens: dict[str, bool] = {}
    if importlib.util.find_spec("llama_cpp") is not None:
        ids = prompt[0].tolist()
        with tempfile.TemporaryDirectory() as folder:
            for dtype, (gguf_dtype, ours_name) in LLAMA_CPP.items():
                peer = _LlamaCpp(model, gguf_dtype, Path(folder), torch.get_num_threads())
                try:
                    same_tokens[dtype] = peer.greedy(ids, NEW_TOKENS) == engines[ours_name].generate(
                        [ids], params)[0].tokens
                    peer_times, ours_times = [], []
                    for _ in range(args.repeats):  # interleaved with ours
                        peer_times.append(timed(lambda: peer.greedy(ids, NEW_TOKENS)))
                        ours_times.append(timed(ours(engines[ours_name], prompt, params)))
                finally:
                    peer.close()
                llama_cpp[dtype] = NEW_TOKENS / statistics.median(peer_times)
                median[f"{ours_name}_vs_llama_cpp_{dtype}"] = statistics.median(ours_times)

    # batch 1 again, with another process spinning a core for the duration. Last: the engine
    # moves decoding to one thread under load and takes a few hundred steps to try two again
    # (paths.ThreadChoice), which would have slowed the llama.cpp comparison's runs of ours.
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        for _ in range(max(3, args.repeats // 2)):
            for name in ("default", "torch"):
                times.setdefault(f"{name}_under_load", []).append(timed(ours(engines[name], prompt, params)))
    finally:
        spinner.kill()
        spinner.wait()
    for name in ("default", "torch"):
        median[f"{name}_under_load"] = statistics.median(times[f"{name}_under_load"])

    for name in ["hf", *engines]:
        print(f"{name}_batch1_tok_s={NEW_TOKENS / median[f'{name}_batch1']:.1f}")
    for name in ["hf", *engines]:
        print(f"{name}_batch16_tok_s={BATCH * NEW_TOKENS / median[f'{name}_batch16']:.1f}")
    for name in ["hf", *engines]:
        print(f"{name}_first_token_ms_prompt{LONG_PROMPT}={1000 * median[f'{name}_first_token']:.1f}")
    for name in ("default", "torch"):
        print(f"{name}_batch1_tok_s_under_load={NEW_TOKENS / median[f'{name}_under_load']:.1f}")
    default_tok_s = NEW_TOKENS / median["default_batch1"]
    print(f"weight_bytes_per_token={weight_bytes}")
    print(f"read_bandwidth_pages={'2M' if huge_page_bytes(weight_bytes) is not None else '4K'}")
    print(f"read_bandwidth_gb_s={bandwidth / 1e9:.1f}")
    print(f"read_bandwidth_gb_s_range={min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f}")
    print(f"roofline_fraction_batch1={weight_bytes * default_tok_s / bandwidth:.2f}")
    for name in engines:
        print(f"speedup_vs_hf_batch1_{name}={median['hf_batch1'] / median[f'{name}_batch1']:.2f}")
    if not llama_cpp:
        print("llama_cpp=skipped (llama-cpp-python is not installed; pip install 'frawdllm[llamacpp]' builds it)")
    capped = ["ATEN_CPU_CAPABILITY"] * aten_capped() + ["oneDNN's ISA cap"] * (onednn_isa_cap() in ONEDNN_CAPS)
    if llama_cpp and (capped or march() != "native"):  # (an emulated older CPU: not one for llama.cpp)
        told = capped + (["FRAWD_MARCH"] if march() != "native" else [])
        print(f"llama_cpp_note=llama.cpp runs its own build for this CPU; {', '.join(told)} apply to PyTorch and "
              "our C forward only")
    for dtype, (_, ours_name) in LLAMA_CPP.items():
        if dtype in llama_cpp:
            ours_tok_s = NEW_TOKENS / median[f"{ours_name}_vs_llama_cpp_{dtype}"]
            print(f"llama_cpp_{dtype}_batch1_tok_s={llama_cpp[dtype]:.1f}")
            print(f"llama_cpp_{dtype}_same_greedy_tokens={same_tokens[dtype]}")
            print(f"ours_vs_llama_cpp_{dtype}_tok_s={ours_tok_s:.1f}")  # our runs interleaved with its
            print(f"speedup_vs_llama_cpp_{dtype}={ours_tok_s / llama_cpp[dtype]:.2f}")
    print(f"default_engine={default_mode}")
    print(f"speedup_vs_hf_batch1={median['hf_batch1'] / median['default_batch1']:.2f}")


if __name__ == "__main__":
    run_main(main)
