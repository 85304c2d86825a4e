"""`frawd data prepare`: a corpus -> memory-mapped token shards (train.bin, val.bin, meta.json)."""

from __future__ import annotations

import click


def data_source_options(command):
    """--data, --text-field and --doc-split: how a corpus is read (shared with `tokenizer train`)."""
    command = click.option(
        "--doc-split", type=click.Choice(["blank", "line", "file"]), default="blank", show_default=True,
        help="How text files split into documents: at blank lines, one per line, or one per file.")(command)
    command = click.option("--text-field", default="text", show_default=True,
                           help="Field (JSONL) or column (Parquet, hf:) holding the text.")(command)
    command = click.option(
        "--data", required=True, metavar="SRC",
        help="stdlib (built in), a text file (.gz ok), a folder, a quoted glob, .jsonl[.gz], "
             ".parquet, or hf:NAME[:CONFIG][@SPLIT].")(command)
    return command


@click.group()
def data() -> None:
    """Prepare corpora into memory-mapped token shards."""


@data.command()
@data_source_options
@click.option("--tokenizer", "tokenizer_path", required=True, metavar="T",
              help="A tokenizer.json, or a directory holding one (e.g. a model directory).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--val-fraction", type=float, default=0.005, show_default=True,
              help="Share of documents held out for validation (chosen by a hash of their text).")
@click.option("--workers", type=int, default=None, help="Tokenizer threads [default: all cores].")
@click.option("--force", is_flag=True, help="Rebuild even if OUT holds shards of the same inputs.")
def prepare(data: str, text_field: str, doc_split: str, tokenizer_path: str, out: str,
            val_fraction: float, workers: int | None, force: bool) -> None:
    """Tokenize --data into OUT/train.bin, OUT/val.bin and OUT/meta.json.

    Documents are separated by <|eos|>; tokens are stored as uint16 when the vocabulary
    fits, else uint32. Running again with the same inputs reuses the shards.

    \b
    Example:
      frawd data prepare --data stdlib --tokenizer tok/stdlib/tokenizer.json --out data/stdlib
    """
    from ..data.shards import prepare_shards

    meta = prepare_shards(data, tokenizer_path, out, val_fraction=val_fraction, text_field=text_field,
                          doc_split=doc_split, workers=workers, force=force, progress=True)
    for warning in meta.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    if meta.get("reused"):
        click.echo(f"{out}: shards of these inputs already exist; reusing them (--force rebuilds)")
    for key in ("train_tokens", "val_tokens", "train_documents", "val_documents", "dtype",
                "bytes_per_token", "unk_tokens", "mb_per_s"):
        click.echo(f"{key}: {meta[key]}")
    if not meta.get("reused"):
        click.echo(f"wrote {out}/train.bin, {out}/val.bin, {out}/meta.json")
