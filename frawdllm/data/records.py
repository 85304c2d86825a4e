"""Structured records (one JSON object per example) from the same sources as documents.

    *.jsonl[.gz]                 one JSON object a line
    *.parquet                    one row a record, every column, through pyarrow
    hf:NAME[:CONFIG][@SPLIT]     a Hugging Face dataset's rows (NAME may be a local directory)
    path/to/folder, a glob       every such file below it, sorted

Each record comes with where it was read ("file:line" or "file:row N"), so a caller can
report a bad one precisely. A line that is not valid JSON, not valid UTF-8, or holds a
lone surrogate (JSON's "\ud800", which is no text) is yielded as a `BadRecord`: the
caller decides whether that stops the run or is skipped and counted. Unlike a corpus's
text (sources.py replaces such bytes with U+FFFD), a record's text is learned as it is,
so nothing is replaced.

A folder or glob is read for its .jsonl, .jsonl.gz and .parquet files; other files there
(a README.md) are passed over and can be listed to the caller (`ignored`). A file named
on its own must be one of those.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import FrawdError
from .sources import BOM, _SURROGATE, open_hf_dataset, open_parquet, resolve_files, unreadable_rows

BOM_BYTES = BOM.encode()

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


@dataclass
class BadRecord:
    problem: str


def iter_records(spec: str, builtin: str = "stdlib", ignored: list[Path] | None = None,
                 ) -> Iterator[tuple[str, object]]:
    """(where, record) pairs of a record source, in a deterministic order; a record is a
    parsed JSON value or a `BadRecord`. The source is checked at once; `builtin` names the
    built-in corpus the caller also accepts (for the error message); the files of a folder
    or glob that are not record files are appended to `ignored`."""
    if spec.startswith("hf:"):
        return _hf_records(spec)
    files = resolve_files(spec, builtin)
    if Path(spec).is_file():
        if not _is_record_file(files[0]):
            raise FrawdError(f"{spec}: expected a .jsonl, .jsonl.gz or .parquet file of examples")
        return _file_records(files)
    records = [path for path in files if _is_record_file(path)]
    others = [path for path in files if not _is_record_file(path)]
    if not records:
        shown = ", ".join(p.name for p in others[:3]) + (", ..." if len(others) > 3 else "")
        raise FrawdError(f"{spec} holds no .jsonl, .jsonl.gz or .parquet file of examples (found: {shown})")
    if ignored is not None:
        ignored.extend(others)
    return _file_records(records)


def _is_record_file(path: Path) -> bool:
    return path.name.lower().endswith(RECORD_SUFFIXES)


def _file_records(files: list[Path]) -> Iterator[tuple[str, object]]:
    for path in files:
        if path.name.lower().endswith(".parquet"):
            yield from _parquet_records(path)
        else:
            yield from _jsonl_records(path)


def _jsonl_records(path: Path) -> Iterator[tuple[str, object]]:
    # read as bytes and decoded line by line, so a bad byte is pinned to its line
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    lineno = 0
    with opener(path, "rb") as f:
        try:
            for raw in f:
                for line in raw.splitlines() or [b""]:  # (\r, \n and \r\n end a line, as in text mode)
                    lineno += 1
                    if lineno == 1:  # a UTF-8 byte-order mark (Windows editors write one) is not JSON
                        line = line.removeprefix(BOM_BYTES)
                    if line.strip():
                        yield f"{path}:{lineno}", _parse(line)
        except (OSError, EOFError, zlib.error) as exc:  # a corrupt .gz
            raise FrawdError(f"{path}: cannot read ({exc})") from None


def _parse(line: bytes) -> object:
    """A line's JSON value, or the `BadRecord` saying why it has none."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadRecord(f"not valid UTF-8 (byte 0x{line[exc.start]:02x} at byte {exc.start + 1} of the line)")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadRecord(f"not valid JSON ({exc.msg})")
    if "\\u" in text and _ESCAPED_SURROGATE.search(text):  # (rare: only then is the record walked)
        surrogate = _lone_surrogate(record)
        if surrogate is not None:
            return BadRecord(f"holds a lone surrogate \\u{ord(surrogate):04x} (a JSON escape that is not text)")
    return record


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: object) -> str | None:
    """The first lone surrogate in a parsed JSON value's strings (keys too), or None."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return found.group() if found else None
    if isinstance(value, dict):
        return next((s for item in value.items() for s in map(_lone_surrogate, item) if s), None)
    if isinstance(value, list):
        return next((s for s in map(_lone_surrogate, value) if s), None)
    return None


def _parquet_records(path: Path) -> Iterator[tuple[str, object]]:
    parquet = open_parquet(path)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024):
        with unreadable_rows(str(path), row):
            records = batch.to_pylist()
        for record in records:
            row += 1
            yield f"{path}:row {row}", record


def _hf_records(spec: str) -> Iterator[tuple[str, object]]:
    dataset = open_hf_dataset(spec)
    return _hf_rows_of(dataset, spec)


def _hf_rows_of(dataset, spec: str) -> Iterator[tuple[str, object]]:
    rows, row = iter(dataset), 0
    while True:
        with unreadable_rows(spec, row):
            record = next(rows, None)
        if record is None:
            return
        row += 1
        yield f"{spec}:row {row}", record
