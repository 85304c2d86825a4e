"""`frawd data prepare`: a corpus -> memory-mapped token shards (train.bin, val.bin, meta.json)."""

from __future__ import annotations

import sys

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
        help="stdlib (built in), a text file (.gz ok), a folder, a quoted glob, .jsonl[.gz] (or JSON Lines named "
             ".ndjson or .json), .parquet, or hf:NAME[:CONFIG][@SPLIT].")(command)
    return command


@click.group()
def data() -> None:
    """Prepare corpora into memory-mapped token shards."""


@data.command()
@data_source_options
@click.option("--tokenizer", "tokenizer_path", required=True, metavar="T",
              help="A tokenizer.json, or a directory holding one (e.g. a model directory).")
@click.option("--out", required=True, help="Output directory.")  # (a file there is refused in one line)
@click.option("--val-fraction", type=float, default=0.005, show_default=True,
              help="Share of documents held out for validation (chosen by a hash of their text).")
@click.option("--workers", type=int, default=None,
              help="Tokenizer threads [default: all cores; at most 4 per core]; with --engine datatrove, the "
                   "number of datatrove tasks (each tokenizes a contiguous block of the sorted files) "
                   "[default: 2; at most 4 per core with the local executor].")
@click.option("--engine", type=click.Choice(["single", "datatrove"]), default="single", show_default=True,
              help="single: one process (threads). datatrove: a pipeline on HF datatrove (pip install "
                   "'frawdllm[datatrove]'), writing train-RRRRR.bin/val-RRRRR.bin per task; the "
                   "loaders read them in task order, the same tokens in the same order as single.")
@click.option("--executor", type=click.Choice(["local", "slurm", "ray"]), default="local", show_default=True,
              help="Where datatrove runs the tasks: this machine's cores, a Slurm job array (submits "
                   "and returns; meta.json appears when the merge job ends), or a Ray cluster (untested).")
@click.option("--slurm-partition", default=None, help="Slurm partition (--executor slurm).")
@click.option("--slurm-time", default="4:00:00", show_default=True, help="Slurm time limit per task.")
@click.option("--slurm-cpus", type=int, default=8, show_default=True, help="Slurm CPUs per task.")
@click.option("--force", is_flag=True, help="Rebuild even if OUT holds shards of the same inputs.")
@click.option("--overwrite", is_flag=True,
              help="Replace the shards OUT holds of another source (or of none it can name).")
def prepare(data: str, text_field: str, doc_split: str, tokenizer_path: str, out: str, val_fraction: float,
            workers: int | None, engine: str, executor: str, slurm_partition: str | None, slurm_time: str,
            slurm_cpus: int, force: bool, overwrite: bool) -> None:
    """Tokenize --data into OUT/train.bin, OUT/val.bin and OUT/meta.json.

    Documents are separated by <|eos|>; tokens are stored as uint16 when the vocabulary
    fits, else uint32. Running again with the same source reuses the shards (or rebuilds
    them when its files, the tokenizer or the options changed). An OUT holding the shards
    of another source is refused unless --overwrite is given.

    With --engine datatrove, task r of N tokenizes files[r*F//N:(r+1)*F//N] of the sorted
    file list into OUT/train-NNNNN.bin and OUT/val-NNNNN.bin, NNNNN = r (train-00000.bin, ...); meta.json
    lists them in task order.
    See docs/data.md.

    \b
    Example:
      frawd data prepare --data stdlib --tokenizer tok/stdlib/tokenizer.json --out data/stdlib
      frawd data prepare --data 'corpus/*.jsonl.gz' --tokenizer tok/tokenizer.json --out data/c \\
          --engine datatrove --workers 64 --executor slurm --slurm-partition cpu
    """
    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in ("executor", "slurm_partition", "slurm_time", "slurm_cpus")
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if engine != "datatrove" and given:
        raise click.UsageError(f"{', '.join(given)}: for --engine datatrove only")
    if not overwrite:
        from ..data import refuse_other_shards

        refuse_other_shards(out, data)  # never silently replace another corpus's shards
    if engine == "datatrove":
        try:
            from ..data.datatrove_shards import prepare_shards_datatrove
        except ImportError:
            raise click.UsageError("--engine datatrove needs datatrove: pip install 'frawdllm[datatrove]'") from None
        slurm = {"partition": slurm_partition, "time": slurm_time, "cpus_per_task": slurm_cpus}
        workers = 2 if workers is None else workers  # (0 is refused there, as by the single engine)
        meta = prepare_shards_datatrove(data, tokenizer_path, out, workers=workers, executor=executor,
                                        val_fraction=val_fraction, text_field=text_field, doc_split=doc_split,
                                        force=force, slurm=slurm)
        if meta is None:
            click.echo(f"submitted {workers} tokenize tasks and a merge task; {out}/meta.json appears "
                       f"when they finish (logs in {out}/.datatrove)")
            return
    else:
        from ..data.shards import prepare_shards

        # the bar only where someone watches it (stderr a terminal); a log gets the result lines alone
        meta = prepare_shards(data, tokenizer_path, out, val_fraction=val_fraction, text_field=text_field,
                              doc_split=doc_split, workers=workers, force=force, progress=sys.stderr.isatty(),
                              refuse_other=not overwrite)
    from ..data.shards import print_warnings

    print_warnings(meta)
    if meta.get("reused"):
        click.echo(f"{out}: shards of these inputs already exist; reusing them (--force rebuilds)", err=True)
    for key in ("train_tokens", "val_tokens", "train_documents", "val_documents", "dtype",
                "bytes_per_token", "unk_tokens", "mb_per_s"):
        click.echo(f"{key}: {meta[key]}")
    if not meta.get("reused"):
        from ..data.shards import split_files

        files = [f.name for split in ("train", "val") for f in split_files(out, split, meta)]
        click.echo(f"wrote {out}/{{{','.join(files)}}} and {out}/meta.json" if len(files) > 2
                   else f"wrote {out}/train.bin, {out}/val.bin, {out}/meta.json")
