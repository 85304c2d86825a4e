"""The token shard file: a 64-byte header, then the tokens as one flat little-endian array.

    offset  size  field
    0       8     magic b"FRAWDTOK"
    8       4     format version (1)
    12      4     bytes per token: 2 (uint16, vocab <= 65,536) or 4 (uint32)
    16      8     number of tokens
    24      8     vocabulary size of the tokenizer that wrote it
    32      32    zero padding (keeps the tokens 64-byte aligned)

`read_shard` memory-maps the tokens, so a shard of any size opens instantly and pages
in only what a batch touches. The ids themselves are checked as they are read: the loaders
bound each batch by the shard's vocabulary (`id_limit`, `bad_id_error`), one `max` per
batch, so a damaged shard is one line naming the file and the position of the bad id
(a full scan when a shard opens would read every byte of it first).
"""

from __future__ import annotations

import errno
import struct
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from ..config import is_integer
from ..errors import FrawdError
from ..io import atomic_path

MAGIC = b"FRAWDTOK"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQ")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
SNIFF_BYTES = 16  # what tells a shard from a text that starts with the magic's letters


def is_shard_head(head: bytes) -> bool:
    """Whether a file's first bytes are a token shard's: the magic, then its version's NULs."""
    return head[:len(MAGIC)] == MAGIC and b"\0" in head[len(MAGIC):SNIFF_BYTES]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65,536), else uint32."""
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


def _pack_header(n_tokens: int, dtype: np.dtype, vocab_size: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, dtype.itemsize, n_tokens, vocab_size).ljust(HEADER_BYTES, b"\0")


def read_header(path: str | Path) -> dict:
    """Validate a shard's header against its file size; return its fields."""
    path = Path(path)
    if path.is_dir():  # ("not found" said of a folder that exists)
        raise FrawdError(f"{path} is a folder, not a shard file (a prepared folder holds train.bin and val.bin)")
    if not path.is_file():
        raise FrawdError(f"shard not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise FrawdError(f"{path}: not a FrawdLLM token shard (bad magic); run `frawd data prepare`")
    _, version, itemsize, n_tokens, vocab_size = _HEADER.unpack(raw[:_HEADER.size])
    if version != VERSION:
        raise FrawdError(f"{path}: shard format version {version}, this FrawdLLM reads version {VERSION}")
    if itemsize not in _DTYPES:
        raise FrawdError(f"{path}: corrupt header ({itemsize} bytes per token; expected 2 or 4)")
    expected = HEADER_BYTES + n_tokens * itemsize
    if size != expected:
        raise FrawdError(f"{path}: truncated or corrupt ({size} bytes; the header promises {expected})")
    return {"version": version, "dtype": _DTYPES[itemsize], "n_tokens": n_tokens, "vocab_size": vocab_size}


def read_shard(path: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """The tokens of a shard as a read-only memory-mapped 1-D array (uint16 or uint32).

    The array knows its file (`shard_path`) and the ids it may hold (`id_limit`: the header's
    vocabulary size, or `vocab_size` when smaller, say meta.json's), which the loaders check
    each batch against (`bad_id_error`)."""
    header = read_header(path)
    if header["n_tokens"] == 0:
        return np.zeros(0, dtype=header["dtype"])  # mmap cannot map zero bytes
    try:
        tokens = np.memmap(path, dtype=header["dtype"], mode="r", offset=HEADER_BYTES, shape=(header["n_tokens"],))
    except OSError as exc:  # (ENOMEM: past vm.max_map_count, ~65,000 maps a process, e.g. a split of 100k shards)
        why = exc.strerror or str(exc)
        if exc.errno == errno.ENOMEM:
            why += ("; a process may map only so many files at once (vm.max_map_count): prepare the data into "
                    "fewer, larger shards")
        raise FrawdError(f"{path}: cannot map the shard ({why})") from None
    tokens.shard_path = Path(path)
    tokens.id_limit = min(header["vocab_size"], vocab_size) if vocab_size else header["vocab_size"]
    return tokens


class ShardWriter:
    """Append token arrays to an open shard file; the header is patched on close."""

    def __init__(self, file: BinaryIO, vocab_size: int):
        if not is_integer(vocab_size) or not 1 <= vocab_size <= 2**32:
            raise FrawdError(f"vocab_size must be an integer in [1, 2**32], got {vocab_size!r}")
        self.file = file
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(self.vocab_size)
        self.n_tokens = 0
        file.write(b"\0" * HEADER_BYTES)  # placeholder until the count is known

    def write(self, tokens: np.ndarray) -> None:
        """Append `tokens`: a 1-D integer array of ids in [0, vocab_size) (never wrapped into the dtype)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or (tokens.dtype.kind not in "iu" and tokens.size):
            raise FrawdError(f"token ids must be a 1-D integer array, got a {tokens.ndim}-D {tokens.dtype} array")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            position = int(np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))[0])
            raise FrawdError(f"token id {tokens[position]} at position {self.n_tokens + position} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        with self._named_errors():
            self.file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self.n_tokens += len(tokens)

    def finish(self) -> None:
        with self._named_errors():
            self.file.flush()
            self.file.seek(0)
            self.file.write(_pack_header(self.n_tokens, self.dtype, self.vocab_size))
            self.file.flush()

    @contextmanager
    def _named_errors(self) -> Iterator[None]:
        """A failed write (a full disk) names this shard's file: Python's does not, and with
        train and val open at once the message then named the wrong one."""
        try:
            yield
        except OSError as exc:
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, exc.strerror, getattr(self.file, "name", None)) from exc


@contextmanager
def open_shard_writer(path: str | Path, vocab_size: int) -> Iterator[ShardWriter]:
    """Write a shard atomically: it appears at `path` only when the block completes."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        writer = ShardWriter(f, vocab_size)
        yield writer
        writer.finish()


def write_shard(path: str | Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Write a whole array as one shard (atomically): a 1-D integer array of ids in [0, vocab_size)."""
    try:
        with open_shard_writer(path, vocab_size) as writer:
            writer.write(tokens)
    except FrawdError as error:
        raise FrawdError(f"{path}: {error}") from None


class ShardStream:
    """Several shards read as one 1-D token array, without copying them.

    Supports what the loaders and evaluation do with a shard's memmap: `len`, an integer,
    a slice or an integer index array (any shape), and `np.asarray` (which does copy).
    """

    def __init__(self, parts: list[np.ndarray]):
        if not parts:
            raise FrawdError("a shard stream needs at least one shard")
        if len({p.dtype for p in parts}) != 1:
            raise FrawdError(f"shards of one split must share a dtype, got {sorted({p.dtype.name for p in parts})}")
        self.dtype = parts[0].dtype
        self.parts = [p for p in parts if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])  # part i starts at offsets[i]
        self.shape = (int(self.offsets[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        index = np.asarray(index)
        if index.dtype.kind not in "iu":
            raise TypeError(f"shard streams take integer indices, got {index.dtype}")
        index = np.where(index < 0, index + len(self), index)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"index out of range for a stream of {len(self)} tokens")
        which = np.searchsorted(self.offsets, index, side="right") - 1  # the part holding each index
        out = np.empty(index.shape, dtype=self.dtype)
        for part in np.unique(which):
            mask = which == part
            out[mask] = self.parts[part][index[mask] - self.offsets[part]]
        return out[()] if out.ndim == 0 else out

    def locate(self, position: int) -> tuple[np.ndarray, int]:
        """The part holding stream position `position`, and the position within it."""
        part = int(np.searchsorted(self.offsets, position, side="right")) - 1
        return self.parts[part], position - int(self.offsets[part])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=self.dtype)
        return whole if dtype is None else whole.astype(dtype)


TokenArray = np.ndarray | ShardStream  # what the loaders read: one shard's memmap, or several as one


def id_limit(tokens: TokenArray, vocab_size: int | None = None) -> int | None:
    """One more than the largest id `tokens` may hold: the smallest of its shards' `id_limit`
    (see `read_shard`) and `vocab_size` (a model's, say); None when nothing bounds them."""
    parts = tokens.parts if isinstance(tokens, ShardStream) else [tokens]
    limits = [limit for limit in [getattr(part, "id_limit", None) for part in parts] + [vocab_size]
              if limit is not None]
    return min(limits) if limits else None


def bad_id_error(tokens: TokenArray, ids: np.ndarray, index: np.ndarray, limit: int,
                 model_bound: bool = False) -> FrawdError:
    """The error for `ids = tokens[index]` holding an id outside [0, `limit`): the first such
    id, its shard file and its position there (token and byte), or its position in a plain
    array. `model_bound`: the limit is the caller's (a model's vocabulary), below the shards'."""
    bad = (ids >= limit) | (ids < 0)
    positions = index[bad]
    first = int(np.argmin(positions))
    value, position = int(ids[bad][first]), int(positions[first])
    part = tokens
    if isinstance(tokens, ShardStream):
        part, position = tokens.locate(position)
    path = getattr(part, "shard_path", None)
    if path is None:
        return FrawdError(f"token id {value} at position {position} is outside the vocabulary [0, {limit})")
    where = f"{path}: token id {value} at position {position} (byte {HEADER_BYTES + position * part.dtype.itemsize})"
    if model_bound:
        return FrawdError(f"{where} is outside the model's vocabulary [0, {limit}); the shards were made with "
                          "another tokenizer")
    return FrawdError(f"{where} is outside the vocabulary [0, {limit}); the shard is damaged: prepare it again "
                      "with frawd data prepare")
