"""`frawd eval`: loss, perplexity and bits per byte of a model on held-out data."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import click

from .data import data_source_options


@click.command("eval")
@click.option("--model", "model_dir", required=True, metavar="DIR", help="A model directory (with tokenizer.json).")
@data_source_options
@click.option("--split", type=click.Choice(["val", "train"]), default="val", show_default=True,
              help="Which split of the data to evaluate on.")
@click.option("--val-fraction", type=float, default=0.005, show_default=True,
              help="Raw sources: share held out as the val split (use the value the model was trained with).")
@click.option("--batch-size", type=int, default=8, show_default=True, help="Windows per batch.")
@click.option("--context-length", type=int, default=None, help="Window length [default: the model's context].")
@click.option("--max-batches", type=int, default=None, help="Evaluate only the first N batches (N >= 1).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="Autocast precision.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, mps.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of key: value lines.")
def evaluate(model_dir: str, data: str, text_field: str, doc_split: str, split: str, val_fraction: float,
             batch_size: int, context_length: int | None, max_batches: int | None, dtype: str, device: str,
             as_json: bool) -> None:
    """Evaluate --model on a held-out split of --data: loss, perplexity, bits per byte.

    --data is a raw source (tokenized here with the model's tokenizer; its val split is
    chosen as in `frawd data prepare`, by --val-fraction and --doc-split) or a folder of
    prepared shards, whose own split is used (--val-fraction, --doc-split or --text-field
    given with one gets a note on stderr, and no effect). Every non-overlapping window of
    the split is scored. Bits per byte divide the loss by the shard's UTF-8 bytes per
    token, so they compare across tokenizers.

    \b
    Example:
      frawd eval --model runs/shakespeare/model --data ../shared/data/tinyshakespeare.txt \\
                 --doc-split file --val-fraction 0.1
    """
    from ..data import META_FILE, prepare_shards, read_split
    from ..data.shards import print_warnings, split_bytes_per_token
    from ..errors import FrawdError, counted
    from ..modeldir import TOKENIZER_FILE, load_config, load_model, model_file
    from ..tokenizer import Tokenizer
    from ..train.device import autocast, pick_device
    from ..train.evaluate import lm_loss, lm_metrics
    from ..train.pretrain import is_shard_dir

    for flag, value in (("--batch-size", batch_size), ("--max-batches", max_batches),
                        ("--context-length", context_length)):
        if value is not None and value < 1:
            raise FrawdError(f"{flag} must be a positive integer, got {value}")
    cfg = load_config(model_dir)
    context = context_length or cfg.context_length
    if context > cfg.context_length:
        raise FrawdError(f"--context-length must be in 1..{cfg.context_length}, got {context}")
    tok_path = model_file(model_dir, TOKENIZER_FILE, required=False)
    if tok_path is None:
        raise FrawdError(f"{model_dir} has no {TOKENIZER_FILE}; evaluation needs the model's tokenizer")
    tok = Tokenizer.load(tok_path).check_fits(cfg.vocab_size, model_dir)
    dev = pick_device(device)
    model = load_model(model_dir, device=dev, kind="decoder").eval()
    progress = sys.stderr.isatty()  # bars only where someone watches them, never in a log
    with tempfile.TemporaryDirectory(prefix="frawd-eval-") as tmp:
        if is_shard_dir(data):
            shard_dir = Path(data)
            meta = json.loads((shard_dir / META_FILE).read_text(encoding="utf-8"))
            if meta.get("tokenizer_hash") not in (None, tok.fingerprint):
                raise FrawdError(f"the shards in {data} were made with another tokenizer than {model_dir}'s")
            note = _raw_source_flags_note(data, meta)
            if note:
                click.echo(note, err=True)
        else:
            shard_dir = Path(tmp)
            meta = prepare_shards(data, tok, shard_dir, val_fraction=val_fraction, text_field=text_field,
                                  doc_split=doc_split, progress=progress)
            print_warnings(meta)
        tokens = read_split(shard_dir, split, meta)
        if len(tokens) <= context:
            larger = "larger" if split == "val" else "smaller"  # (the train split is what val leaves)
            fix = (f"prepare {data} again with a {larger} --val-fraction" if is_shard_dir(data)
                   else f"use more data, a {larger} --val-fraction")  # (a shard folder's split is fixed)
            raise FrawdError(f"the {split} split has {counted(len(tokens), 'token')}, too few for one window of "
                             f"{context} (it takes {context + 1}: each position predicts the next token); "
                             f"{fix} or a shorter --context-length")
        with autocast(dev, dtype):
            loss, count = lm_loss(model, tokens, batch_size, context, dev, max_batches, progress=progress)
    if not math.isfinite(loss):  # (nan is not a loss, and not JSON either)
        raise FrawdError(f"the loss is {loss} on this data: {_not_finite_cause(model, dtype)}")
    bytes_per_token = split_bytes_per_token(meta, split)
    metrics = {**lm_metrics(loss, bytes_per_token), "tokens": count, "bytes_per_token": bytes_per_token,
               "split": split}
    if as_json:
        click.echo(json.dumps(metrics))
    else:
        for key in ("loss", "ppl", "bpb", "tokens", "bytes_per_token", "split"):
            if metrics.get(key) is not None:
                value = metrics[key]
                click.echo(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}")


def _not_finite_cause(model, dtype: str) -> str:
    """Why a loss came out nan or inf: weights that hold such values, else the forward
    overflowing in its dtype."""
    from ..modeldir import first_non_finite

    bad = first_non_finite(model)
    if bad is not None:
        return f"the model's weights hold nan or inf values (the first: {bad})"
    return f"the forward overflowed in {dtype}" + ("; try --dtype fp32" if dtype != "fp32" else "")


def _raw_source_flags_note(data: str, meta: dict) -> str | None:
    from ..data.shards import raw_source_flags_note

    """A note naming the raw-source flags the user gave (none at their defaults) that a
    shard folder makes moot: its split was fixed when it was prepared."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = [flag for flag, name in (("--val-fraction", "val_fraction"), ("--doc-split", "doc_split"),
                                     ("--text-field", "text_field"))
             if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)]
    return raw_source_flags_note(given, data, meta)
