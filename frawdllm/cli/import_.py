"""`frawd import`: a local transformers checkpoint or a GGUF file as a FrawdLLM model directory."""

from __future__ import annotations

import click

from .export import require


@click.command(name="import")
@click.option("--from-hf", "hf_dir", metavar="DIR",
              help="Local transformers GPT-2 or Llama checkpoint (config.json + safetensors).")
@click.option("--from-gguf", "gguf_file", metavar="FILE",
              help="GGUF file of llama.cpp's llama or gpt2 architecture (any tensor type the gguf package "
                   "dequantizes: F32, F16, BF16, Q8_0, Q4_K, ...).")
@click.option("--out", required=True, metavar="DIR", help="New FrawdLLM model directory to create.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out, only once the import is complete.")
def import_(hf_dir: str | None, gguf_file: str | None, out: str, overwrite: bool) -> None:
    """Import a Hugging Face transformers checkpoint (GPT2LMHeadModel or LlamaForCausalLM)
    or a GGUF file (llama.cpp's llama or gpt2): give one of --from-hf and --from-gguf.

    The result is an ordinary FrawdLLM model directory (config.json, model.safetensors,
    and tokenizer.json when the source has one): `frawd generate`, `frawd eval` and
    `frawd export` take it, and `frawd pretrain --init-from OUT` trains it further.
    Pickle weights (*.bin) are refused: FrawdLLM never unpickles. A GGUF file's tensors
    are stored as float32 (quantized ones dequantized); its tokenizer is kept where it is
    GPT-2-style byte-level BPE, as `frawd export --format gguf` writes it.

    \b
    Examples:
      frawd import --from-hf exports/tiny-hf --out models/tiny
      frawd import --from-gguf exports/tiny.gguf --out models/tiny-from-gguf
    """
    if (hf_dir is None) == (gguf_file is None):
        raise click.UsageError("give one of --from-hf DIR and --from-gguf FILE")
    from pathlib import Path

    from ..io import clean_partial

    clean_partial(Path(out).parent, only=Path(out).name)  # what an import killed before left beside --out
    if gguf_file is not None:
        require("gguf")
        from ..export.gguf_import import import_gguf

        model, source = import_gguf(gguf_file, out, overwrite=overwrite), gguf_file
    else:
        require("transformers")
        from ..export.hf_dir import import_hf

        model, source = import_hf(hf_dir, out, overwrite=overwrite), hf_dir
    cfg = model.config
    click.echo(
        f"imported {source} to {out}: {cfg.num_parameters:,} parameters, {cfg.n_layer} layers, "
        f"n_embd {cfg.n_embd}, vocab {cfg.vocab_size}"
    )
