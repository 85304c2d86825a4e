"""Structured records (one JSON object per example) from the same sources as documents.

    *.jsonl[.gz]                 one JSON object a line
    *.parquet                    one row a record, every column, through pyarrow
    hf:NAME[:CONFIG][@SPLIT]     a Hugging Face dataset's rows (NAME may be a local directory)
    path/to/folder, a glob       every such file below it, sorted

Each record comes with where it was read ("file:line" or "file:row N"), so a caller can
report a bad one precisely. A line that is not valid JSON is yielded as a `BadRecord`:
the caller decides whether that stops the run or is skipped and counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import FrawdError
from .sources import _open_text, open_hf_dataset, open_parquet, resolve_files

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


@dataclass
class BadRecord:
    problem: str


def iter_records(spec: str, builtin: str = "stdlib") -> Iterator[tuple[str, object]]:
    """(where, record) pairs of a record source, in a deterministic order; a record is a
    parsed JSON value or a `BadRecord`. The source is checked at once; `builtin` names the
    built-in corpus the caller also accepts (for the error message)."""
    if spec.startswith("hf:"):
        return _hf_records(spec)
    files = resolve_files(spec, builtin)
    for path in files:
        if not path.name.lower().endswith(RECORD_SUFFIXES):
            raise FrawdError(f"{path}: expected a .jsonl, .jsonl.gz or .parquet file of examples")
    return _file_records(files)


def _file_records(files: list[Path]) -> Iterator[tuple[str, object]]:
    for path in files:
        if path.name.lower().endswith(".parquet"):
            yield from _parquet_records(path)
        else:
            yield from _jsonl_records(path)


def _jsonl_records(path: Path) -> Iterator[tuple[str, object]]:
    with _open_text(path) as f:
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield where, BadRecord(f"not valid JSON ({exc.msg})")
        except (OSError, EOFError) as exc:  # a corrupt .gz
            raise FrawdError(f"{path}: cannot read ({exc})") from None


def _parquet_records(path: Path) -> Iterator[tuple[str, object]]:
    parquet = open_parquet(path)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", record


def _hf_records(spec: str) -> Iterator[tuple[str, object]]:
    dataset = open_hf_dataset(spec)
    return ((f"{spec}:row {i + 1}", record) for i, record in enumerate(dataset))
