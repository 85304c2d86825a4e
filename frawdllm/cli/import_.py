"""`frawd import`: a local transformers checkpoint as a FrawdLLM model directory."""

from __future__ import annotations

import click

from .export import require


@click.command(name="import")
@click.option("--from-hf", "hf_dir", required=True, metavar="DIR",
              help="Local transformers GPT-2 or Llama checkpoint (config.json + safetensors).")
@click.option("--out", required=True, metavar="DIR", help="New FrawdLLM model directory to create.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out, only once the import is complete.")
def import_(hf_dir: str, out: str, overwrite: bool) -> None:
    """Import a Hugging Face transformers checkpoint (GPT2LMHeadModel or LlamaForCausalLM).

    The result is an ordinary FrawdLLM model directory (config.json, model.safetensors,
    and tokenizer.json when the checkpoint has one): `frawd generate`, `frawd eval` and
    `frawd export` take it, and `frawd pretrain --init-from OUT` trains it further.
    Pickle weights (*.bin) are refused: FrawdLLM never unpickles.
    """
    require("transformers")
    from pathlib import Path

    from ..export.hf_dir import import_hf
    from ..io import clean_partial

    clean_partial(Path(out).parent, only=Path(out).name)  # what an import killed before left beside --out
    model = import_hf(hf_dir, out, overwrite=overwrite)
    cfg = model.config
    click.echo(
        f"imported {hf_dir} to {out}: {cfg.num_parameters:,} parameters, {cfg.n_layer} layers, "
        f"n_embd {cfg.n_embd}, vocab {cfg.vocab_size}"
    )
