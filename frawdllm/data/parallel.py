"""Parallel text for translation: two files, one sentence a line, line i of one the
translation of line i of the other (gzip-compressed files are read transparently, and
so is a pipe such as `<(head -100 test.de)`).

Bad input is named before any training: files of different line counts (misaligned),
undecodable bytes. Pairs with an empty side, and pairs longer than a token limit, are
skipped and counted, so the caller can say how many.
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import FrawdError
from .sources import BOM

GZIP_MAGIC = b"\x1f\x8b"


def decode_utf8(raw: bytes, where: str | Path, first_line: int = 1) -> str:
    """`raw` as text; bytes that are not UTF-8 are named by line: "WHERE: line N is not UTF-8
    text" (`first_line`: the number of the first line in `raw`)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + raw[: exc.start].count(b"\n")
        raise FrawdError(f"{where}: line {line} is not UTF-8 text") from None


def read_lines(path: str | Path) -> list[str]:
    """The lines of a text file (gzip or plain), without their line ends or a leading UTF-8
    byte-order mark. A pipe (`<(...)`, /dev/stdin) is read too: its bytes are read once."""
    path = Path(path)
    if path.is_dir():
        raise FrawdError(f"{path} is a folder; give a text file of one sentence a line")
    if not path.exists():
        where = "" if path.is_absolute() else f" (looked for in the current folder, {Path.cwd()})"  # (a config's path)
        if re.fullmatch(r"/(proc/\d+|dev)/fd/.*", path.as_posix()):  # a run's config.yaml keeps `<(zcat ...)`'s path
            where = " (the pipe of a command that has ended, as `<(...)` gives: give the file again)"
        raise FrawdError(f"file not found: {path}{where}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise FrawdError(f"{path}: cannot read it ({(exc.strerror or str(exc)).lower()})") from None
    if raw[:2] == GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise FrawdError(f"{path}: not a readable gzip file ({exc})") from None
    text = decode_utf8(raw, path).removeprefix(BOM)  # a BOM is not part of the first sentence
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final line end
    return [line.rstrip("\r") for line in lines]


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    """Source and target sentences, checked to be aligned (the same number of lines)."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise FrawdError(f"misaligned parallel files: {src_path} has {len(src):,} lines but {tgt_path} has "
                         f"{len(tgt):,}; line i of one must translate line i of the other")
    if not src:
        raise FrawdError(f"{src_path}: no sentences")
    return src, tgt


@dataclass
class EncodedPairs:
    pairs: list[tuple[list[int], list[int]]]  # (source ids, target ids)
    kept: list[int]  # the line index of each pair
    empty: int  # pairs skipped because a side was empty (or whitespace only)
    too_long: int  # pairs skipped because a side had more than max_tokens tokens

    def skipped_message(self, what: str, max_tokens: int) -> str | None:
        """"WHAT: skipped N with an empty side and M longer than L tokens of T pairs", or None."""
        reasons = self.skip_reasons(f"{max_tokens} tokens")
        if not reasons:
            return None
        return f"{what}: skipped {reasons} of {len(self.pairs) + self.empty + self.too_long:,} pairs"

    def skip_reasons(self, limit: str) -> str:
        """"N with an empty side and M longer than LIMIT" (the parts that apply; "" when none)."""
        parts = []
        if self.empty:
            parts.append(f"{self.empty:,} with an empty side")
        if self.too_long:
            parts.append(f"{self.too_long:,} longer than {limit}")
        return " and ".join(parts)


def sentences(lines: list[str]) -> list[str]:
    """Lines as the sentences a model reads and learns: without the whitespace around
    them, which are not part of a sentence (a trailing space became tokens the model had
    almost never seen, and "Two men are playing football. " translated differently)."""
    return [line.strip() for line in lines]


def encode_pairs(tokenizer, src: list[str], tgt: list[str], max_tokens: int | None) -> EncodedPairs:
    """Token ids of every usable pair, each side without the whitespace around it (as
    `frawd translate` reads a sentence); empty and over-long pairs skipped and counted."""
    src_ids, tgt_ids = tokenizer.encode_batch(sentences(src)), tokenizer.encode_batch(sentences(tgt))
    pairs, kept, empty, too_long = [], [], 0, 0
    for i, (s_text, t_text, s, t) in enumerate(zip(src, tgt, src_ids, tgt_ids)):
        if not s_text.strip() or not t_text.strip():
            empty += 1
        elif max_tokens is not None and (len(s) > max_tokens or len(t) > max_tokens):
            too_long += 1
        else:
            pairs.append((s, t))
            kept.append(i)
    return EncodedPairs(pairs, kept, empty, too_long)
