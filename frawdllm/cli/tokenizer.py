"""`frawd tokenizer train`: learn a tokenizer from a corpus and save tokenizer.json."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from .data import data_source_options

DEFAULT_BPE_VOCAB = 8192


@click.group()
def tokenizer() -> None:
    """Train tokenizers: byte-level BPE, char-level or raw bytes (one tokenizer.json)."""


@tokenizer.command()
@data_source_options
@click.option("--kind", type=click.Choice(["bpe", "char", "byte"]), default="bpe", show_default=True,
              help="bpe: byte-level BPE; char: one token per character of the corpus; byte: 256 bytes.")
@click.option("--vocab-size", type=int, default=None,
              help=f"BPE vocabulary size including the 7 special tokens, 263 to 1,048,576 [default: {DEFAULT_BPE_VOCAB}]. "
                   "A char tokenizer takes its size from the data; a byte one has 263 ids.")
@click.option("--out", required=True, type=click.Path(file_okay=True, dir_okay=True),
              help="Directory to write tokenizer.json into (or a path ending in .json).")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing tokenizer.json (shards prepared with it then no longer match it).")
def train(data: str, text_field: str, doc_split: str, kind: str, vocab_size: int | None, out: str,
          overwrite: bool) -> None:
    """Train a tokenizer on --data and write OUT/tokenizer.json.

    An existing OUT/tokenizer.json is refused unless --overwrite is given.

    \b
    Examples:
      frawd tokenizer train --data stdlib --vocab-size 8192 --out tok/stdlib
      frawd tokenizer train --data shakespeare.txt --kind char --out tok/shakespeare
    """
    from ..data.shards import refuse_out_in_source
    from ..data.sources import SourceStats, iter_documents
    from ..errors import FrawdError
    from ..tokenizer import TOKENIZER_FILE, check_bpe_vocab_size, short_bpe_note, train_tokenizer

    path, what = Path(out), "directory"
    if path.suffix == ".json" and not path.is_dir():
        what = "path"
    else:
        if path.exists() and not path.is_dir():
            raise FrawdError(f"{path} exists and is not a directory; give a directory or a path ending in .json")
        path = path / TOKENIZER_FILE
    above = next((folder for folder in path.parents if folder.exists()), None)
    if above is not None and not above.is_dir():  # (was the OS's "file exists: ABOVE")
        raise FrawdError(f"--out {out}: {above} is a file, not a folder")
    # the next run would read tokenizer.json as text
    refuse_out_in_source(data, path.parent, [path] if what == "path" else ())
    # Checked before training: shards prepared with the old tokenizer would no longer match it.
    if path.exists() and not overwrite:
        raise FrawdError(f"{path} exists; choose a new {what} (or --overwrite)")
    if vocab_size is not None and kind != "bpe":
        size_of = "takes its size from the data" if kind == "char" else "has 263 ids (256 bytes + 7 special tokens)"
        click.echo(f"note: --vocab-size applies to bpe only; a {kind} tokenizer {size_of}", err=True)
    size = DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size  # 0 is a size given (and refused), not none
    if kind == "bpe":
        check_bpe_vocab_size(size)  # before the corpus is read
    stats = SourceStats()
    documents = iter_documents(data, text_field=text_field, doc_split=doc_split, stats=stats)
    start = time.perf_counter()
    # Progress bars only where someone watches them; they go to stderr, never stdout.
    tok = train_tokenizer(documents, kind=kind, vocab_size=size, show_progress=sys.stderr.isatty())
    seconds = time.perf_counter() - start
    tok.save(path, replace=overwrite)  # (another process's tokenizer written there meanwhile: refused)
    if stats.warning():
        click.echo(f"warning: {stats.warning()}", err=True)
    note = short_bpe_note(tok, size) if kind == "bpe" else None
    if note:
        click.echo(note, err=True)
    click.echo(f"kind: {tok.kind}")
    click.echo(f"vocab_size: {tok.vocab_size} (7 special tokens at ids 0..6)")
    click.echo(f"documents: {stats.documents}" if kind != "byte" else "documents: none read (a byte tokenizer "
               "is the 256 bytes whatever the data)")
    click.echo(f"train_seconds: {seconds:.2f}")
    click.echo(f"wrote {path}")
