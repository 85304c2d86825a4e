"""`frawd export`: a FrawdLLM model directory as a transformers directory or a GGUF file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from ..errors import FrawdError

FORMATS = ("hf", "gguf")
DTYPES = ("float32", "float16", "bfloat16")  # export.hf_dir.DTYPES' names (that module imports torch)
SHORT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # the other commands' spelling


def require(module: str) -> None:
    """One clear line instead of an ImportError when an optional dependency is missing."""
    if importlib.util.find_spec(module) is None:
        raise FrawdError(f"this needs the '{module}' package: pip install 'frawdllm[hf]'")


@click.command()
@click.option("--model", "model_dir", required=True, metavar="DIR", help="FrawdLLM model directory to export.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="hf: a transformers model directory; gguf: a llama.cpp file.  [default: gguf for an "
                   "--out ending in .gguf, else hf]")
@click.option("--out", required=True, metavar="PATH",
              help="New directory to create (gguf: model.gguf inside it), or a path ending in .gguf.")
@click.option("--dtype", type=click.Choice((*DTYPES, *SHORT)), default="float32", show_default=True,
              help="Precision of the weights (GGUF keeps norms and biases in float32); fp32, fp16 and bf16, as "
                   "the other commands spell them, mean the same.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing --out, only once the new export is complete.")
def export(model_dir: str, fmt: str | None, out: str, dtype: str, overwrite: bool) -> None:
    """Export a model to Hugging Face transformers or GGUF (llama.cpp).

    GPT-2 style configs (learned positions, LayerNorm, GELU) become GPT2LMHeadModel /
    llama.cpp "gpt2"; Llama style configs (RoPE, RMSNorm, SwiGLU, GQA) become
    LlamaForCausalLM / llama.cpp "llama". Other configs are refused with the nearest
    exportable one. An encoder-decoder translation model (post-LN, sinusoidal positions,
    tied embeddings: the aiayn presets, not configs/multi30k.yaml's pre-LN) becomes
    MarianMTModel (hf only); options that do not map are named. The hf export loads with
    stock transformers, no trust_remote_code:

    \b
      AutoModelForCausalLM.from_pretrained(OUT)    # a language model
      AutoModelForSeq2SeqLM.from_pretrained(OUT)   # a translation model (MarianMTModel)
      AutoTokenizer.from_pretrained(OUT)           # a language model's has our chat template

    Nothing is written at --out unless the whole export succeeds.
    """
    dtype = SHORT.get(dtype, dtype)
    if fmt is None:
        fmt = "gguf" if out.lower().endswith(".gguf") else "hf"
    if fmt == "hf" and out.lower().endswith(".gguf"):
        raise click.UsageError(f"--out {out} names a GGUF file, but --format hf writes a directory; "
                               "for a GGUF file give --format gguf")
    from ..io import clean_partial

    clean_partial(Path(out).parent, only=Path(out).name)  # what an export killed before left beside --out
    if fmt == "hf":
        require("transformers")
        from ..export.hf_dir import export_hf

        arch = export_hf(model_dir, out, dtype=dtype, overwrite=overwrite)
        click.echo(f"exported {model_dir} as {arch} ({dtype}) to {out}")
        auto = "AutoModelForSeq2SeqLM" if arch == "MarianMTModel" else "AutoModelForCausalLM"
        click.echo(f"load it with: {auto}.from_pretrained({str(out)!r})")
        return
    require("gguf")
    from ..export.gguf import export_gguf

    path = export_gguf(model_dir, out, dtype=dtype, overwrite=overwrite, progress=True)
    click.echo(f"exported {model_dir} as GGUF ({dtype}) to {path}")
