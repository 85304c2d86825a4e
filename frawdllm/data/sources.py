"""Corpus sources: every kind of input becomes a stream of documents (strings).

    stdlib                       the .py files of this interpreter's standard library
                                 (tests excluded, sorted by path; one document per file)
    path/to/file.txt[.gz|.bz2|.xz]  a text file; documents split by `doc_split`:
                                 "blank" (a blank line, default), "line", or "file"
    path/to/folder               every non-hidden file below it, sorted by path; a folder
                                 of prepared shards (meta.json) is refused, not read as text,
                                 and so is one holding such a folder, at any depth
    'data/*.txt', 'data/**/*.gz' a glob (quote it in the shell), sorted; a path that exists
                                 is that path, even if its name holds [ ] * ?
    *.jsonl, *.ndjson[.gz|...]   one JSON object a line; its `text_field` is the document
    *.json[.gz|.bz2|.xz]         the same when its first line is such an object (Hugging Face
                                 data files are JSON Lines named .json), else read as text
    *.parquet                    the `text_field` column, through pyarrow
    hf:NAME[:CONFIG][@SPLIT]     a Hugging Face dataset through `datasets` (split: train);
                                 NAME may be a local dataset directory

Invalid UTF-8 never stops a run: each bad byte sequence becomes U+FFFD and is counted
in a `SourceStats`, to be reported at the end. A missing path, an empty corpus or a JSON
line without the field is a `FrawdError` naming the file and line. So is a token shard
(a file starting with the shard magic, FRAWDTOK): its ids must never pass for text. Files
named *.bin are checked when the source is resolved, any other when it is read.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import functools
import gzip
import io
import json
import lzma
import os
import re
import socket
import sysconfig
import threading
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator
from urllib.parse import urlparse

from ..errors import FrawdError
from ..train.config import DOC_SPLITS

BOM = "\ufeff"  # the UTF-8 byte-order mark some editors (Windows') write first

# Names of the built-in corpora, which no file of that name can shadow: `stdlib` here, and
# the alignment data of frawdllm.align.stdlib_corpus.CORPORA
BUILTIN_SOURCES = ("stdlib", "stdlib-instruct", "stdlib-prefs")
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
_SEPARATORS = {"blank": re.compile(r"\n(?:[^\S\n]*\n)+"), "line": re.compile(r"\n")}
_CHUNK_CHARS = 1 << 22
_SURROGATE = re.compile("[\ud800-\udfff]")
_ERRORS = "frawd-count-replace"
_counter = threading.local()
# Compressed files read as they are, known by their suffix or their first bytes
_DECOMPRESSORS = {".gz": (b"\x1f\x8b", gzip.open), ".bz2": (b"BZh", bz2.open), ".xz": (b"\xfd7zXZ\x00", lzma.open)}
# Compressed files that are not (their first bytes), and the command that unpacks them
_NOT_READ = {b"\x28\xb5\x2f\xfd": ("zstd", "zstd -d"), b"PK\x03\x04": ("zip", "unzip"),
             b"7z\xbc\xaf\x27\x1c": ("7z", "7z x"), b"\x04\x22\x4d\x18": ("lz4", "lz4 -d")}
# Byte-order marks of text that is not UTF-8 (UTF-32's first: it starts like UTF-16's)
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)  # what a corrupt compressed file raises
_PACKED = ("", ".gz", ".bz2", ".xz")
_JSONL_SUFFIXES = tuple(base + packed for base in (".jsonl", ".ndjson") for packed in _PACKED)
_JSON_SUFFIXES = tuple(".json" + packed for packed in _PACKED)
_HEAD_BYTES = 512  # enough for a tar header's "ustar" (at byte 257)


def _count_and_replace(exc: UnicodeError) -> tuple[str, int]:
    _counter.replaced = getattr(_counter, "replaced", 0) + 1
    return "\ufffd", exc.end


codecs.register_error(_ERRORS, _count_and_replace)


def _replaced_so_far() -> int:
    return getattr(_counter, "replaced", 0)


@dataclass
class SourceStats:
    """What a pass over a source saw; `replaced` counts invalid UTF-8 sequences."""

    documents: int = 0
    files: int = 0
    replaced: int = 0
    replaced_in: list[str] = field(default_factory=list)

    def note_replaced(self, n: int, where: str) -> None:
        if n:
            self.replaced += n
            if where not in self.replaced_in:
                self.replaced_in.append(where)

    def warning(self) -> str | None:
        """One line for the user about replaced bytes, or None when the text was clean."""
        if not self.replaced:
            return None
        shown = ", ".join(self.replaced_in[:3]) + (", ..." if len(self.replaced_in) > 3 else "")
        return (f"replaced {self.replaced} invalid UTF-8 sequence(s) with U+FFFD "
                f"in {len(self.replaced_in)} file(s): {shown}")


def source_spec(spec: str | os.PathLike) -> str:
    """A source as the string the readers take: a `pathlib.Path` is a file, folder or glob."""
    spec = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
    if not isinstance(spec, str):
        raise FrawdError(f"a data source is a string (stdlib, hf:NAME, a file, a folder or a glob) or a path, "
                         f"got {spec!r}")
    if not spec.strip():  # (not the current folder: an unset variable in a script gave it)
        raise FrawdError("the data source is empty: give stdlib, hf:NAME, a file, a folder or a glob")
    return spec


def iter_documents(spec: str | os.PathLike, text_field: str = "text", doc_split: str = "blank",
                   stats: SourceStats | None = None) -> Iterator[str]:
    """Documents of a source, in a deterministic order. The source is checked at once;
    an empty corpus raises when the stream ends without a document."""
    spec = source_spec(spec)
    if doc_split not in DOC_SPLITS:
        raise FrawdError(f"doc_split must be one of {', '.join(DOC_SPLITS)}, got {doc_split!r}")
    stats = stats if stats is not None else SourceStats()
    if spec.startswith("hf:"):
        documents = _hf_documents(spec, text_field, stats)
    else:
        files = source_files(spec)
        split = "file" if spec == "stdlib" else doc_split
        documents = file_documents(files, text_field, split, stats)
    return _counted(documents, spec, stats)


def _counted(documents: Iterator[str], spec: str, stats: SourceStats) -> Iterator[str]:
    for doc in documents:
        stats.documents += 1
        yield doc
    if stats.documents == 0:
        raise FrawdError(f"data source {spec!r} holds no documents (no non-empty text)")


# ---- resolving a spec to files -----------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP_DIRS]  # prune: never walk into tests or site-packages
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def stdlib_files() -> list[Path]:
    """The standard library's .py files without its tests, sorted by relative path."""
    return list(_stdlib_files())


def source_files(spec: str | os.PathLike) -> list[Path] | None:
    """The files a spec reads, in reading order; None for hf: datasets."""
    spec = source_spec(spec)
    if spec.startswith("hf:"):
        return None
    return stdlib_files() if spec == "stdlib" else resolve_files(spec)


def is_glob(spec: str) -> bool:
    """Whether a spec is a glob: it holds a wildcard and names no existing path (a file named
    `data[1].txt` is that file, never a pattern that could match `data1.txt`)."""
    return any(ch in spec for ch in "*?[") and not os.path.lexists(spec)


def resolve_files(spec: str, builtin: str = "stdlib") -> list[Path]:
    """A file, a folder (all non-hidden files below it) or a glob, as a sorted list of files.
    `builtin` names the built-in corpus the caller also accepts, for the error message."""
    if is_glob(spec):
        files = _glob_files(spec)
        if not files:
            raise FrawdError(f"no files match {spec!r}")
        refuse_shard_files(p for p in files if p.name.lower().endswith(".bin"))
        return _without_binaries(files, f"files matching {spec!r}")
    path = Path(spec)
    if path.is_file():
        refuse_shard_files([path])
        return [path]
    if path.is_dir():
        refuse_shard_dir(path)
        files = _walk_files(path)
        if not files:
            if any(p.is_file() for p in path.rglob("*")):
                _refuse_unfinished_shards(path)
                raise FrawdError(f"folder {path} holds only hidden files (names starting with '.'), which are skipped")
            raise FrawdError(f"folder {path} holds no files")
        _refuse_shard_subdirs(path, files)
        refuse_shard_files(p for p in files if p.name.lower().endswith(".bin"))
        return _without_binaries(files, f"folder {path}")
    raise FrawdError(f"data source not found: {spec!r} (expected {builtin}, hf:NAME, a file, a folder or a glob)")


_BINARY_PROBE = 8000  # bytes read for a NUL, as git tells binary files from text


def _without_binaries(files: list[Path], where: str) -> list[Path]:
    """`files` less those that are not text (a NUL byte in their first 8,000 bytes, as git
    tells them: an executable, a .pyc, an image found in a folder or by a glob), with a
    warning naming them: read as text, they were thousands of tokens of U+FFFD and control
    bytes in the training data. A file named alone is read as given; Parquet and JSON (Lines)
    files by their suffix; UTF-16 and UTF-32 text (with a byte-order mark) are text."""
    kept, skipped = [], []
    for path in files:
        (skipped if _is_binary(path) else kept).append(path)
    if skipped:
        shown = ", ".join(str(p) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        if not kept:
            raise FrawdError(f"{where}: no text files, only binary ones (a NUL byte near the start): {shown}")
        message = f"skipped {len(skipped)} binary file(s) in {where} (a NUL byte near the start, not text): {shown}"
        if message not in _SAID:  # (a command lists its source more than once: said once)
            _SAID.add(message)
            warnings.warn(message, stacklevel=3)
    return kept


_SAID: set[str] = set()


def _is_binary(path: Path) -> bool:
    if path.name.lower().endswith((".parquet", *_JSONL_SUFFIXES, *_JSON_SUFFIXES)):  # (their readers check them)
        return False
    try:
        opener, head = _binary_opener(path)
        if opener is open:
            with open(path, "rb") as f:
                head = f.read(_BINARY_PROBE)
    except (FrawdError, OSError):  # (reading it says what is wrong)
        return False
    from .shard_format import is_shard_head

    if is_shard_head(head):  # a token shard: refused where it is read, saying where it goes
        return False
    return not any(head.startswith(bom) for bom, _ in _BOMS) and b"\0" in head


def _glob_files(spec: str) -> list[Path]:
    """The files a glob matches, sorted, as the folder form reads them: a link to a folder is
    not followed (glob.glob's `**` followed one, reading `data/latest -> data/2024-06` twice,
    and a link to a folder above looped: the same file 41 times, or a walk that never ended),
    names starting with '.' are skipped unless the pattern spells one, and a folder that
    cannot be read is an error, not silently left out."""
    parts = Path(spec).parts
    first = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
    # (`a**b`: glob.glob's `*`; pathlib takes `**` only as a whole component)
    rest = [part if part == "**" else re.sub(r"\*\*+", "*", part) for part in parts[first:]]
    root, pattern = Path(*parts[:first]) if first else Path("."), Path(*rest)
    if pattern.parts[-1] == "**":  # (glob.glob's `DIR/**` lists every file below; pathlib's, folders only)
        pattern = pattern / "*"
    hidden_asked = any(part.startswith(".") for part in pattern.parts)
    if "**" in pattern.parts and root.is_dir():  # (a pattern that walks the tree below root)
        _walk_files(root)  # (the walk refuses a folder it cannot list; pathlib's glob skips it)
    files = []
    for path in root.glob(str(pattern)):  # (pathlib's `**` does not follow links to folders)
        inside = path.relative_to(root).parts
        folders = [root.joinpath(*inside[:i]) for i in range(1, len(inside))]
        if path.is_file() and not any(folder.is_symlink() for folder in folders) \
                and (hidden_asked or not any(part.startswith(".") for part in inside)):
            files.append(path)
    return sorted(files)


def _walk_files(root: Path) -> list[Path]:
    """The non-hidden files below `root`, sorted (links to folders and hidden folders not
    followed; a link to a file is a file); a folder that cannot be listed is one line naming
    it: its files would be left out without a word."""
    def refuse(error: OSError) -> None:
        reason = (error.strerror or str(error)).lower()
        raise FrawdError(f"cannot read folder {error.filename} ({reason}): its files would be left out")

    files = []
    for folder, folders, names in os.walk(root, onerror=refuse):
        folders[:] = [name for name in folders if not name.startswith(".")]
        files += [Path(folder, name) for name in names if not name.startswith(".") and Path(folder, name).is_file()]
    return sorted(files)


def refuse_shard_dir(path: Path) -> None:
    """A folder of prepared shards (its meta.json a JSON object) holds token ids, never text
    to read: one line saying where it goes instead, or which of its shard files is missing
    (the other split's bytes must not pass for text)."""
    from .shards import read_shard_meta, shard_files

    meta = read_shard_meta(path)
    if meta is not None:
        shard_files(path, meta)  # all there, else the error names the missing ones
        raise FrawdError(f"{path} holds prepared shards (meta.json), not text; give it to "
                         f"frawd pretrain --data {path} or frawd eval --data {path}")


def _refuse_unfinished_shards(path: Path) -> None:
    """A folder holding only a `frawd data prepare`'s temporary shard files (.train.bin.*.tmp):
    one line saying that a prepare is writing it, or was stopped before it finished."""
    from ..io import partial_write
    from ..train.rundir import lock_holder

    if not any((w := partial_write(p.name)) and w[1] == "tmp" and w[0].endswith(".bin") for p in path.iterdir()):
        return
    holder = lock_holder(path.resolve())
    if holder:
        raise FrawdError(f"{path} is being prepared by `frawd data prepare` (process {holder}); wait for it to end")
    raise FrawdError(f"{path} holds an unfinished `frawd data prepare` (temporary shard files, no meta.json): "
                     f"run frawd data prepare --out {path} again")


def _refuse_shard_subdirs(root: Path, files: list[Path]) -> None:
    """A folder of prepared shards below `root` (a meta.json beside the shard files it names)
    holds token ids, not text: one line naming it."""
    from .shards import META_FILE, holds_shards

    for folder in sorted({p.parent for p in files if p.name == META_FILE and p.parent != root}):
        if holds_shards(folder):
            raise FrawdError(f"{folder} holds prepared shards (meta.json), not text: move it out of {root} "
                             f"(or name the text files with a glob); shards go to frawd pretrain --data or "
                             f"frawd eval --data")


def _shard_file_error(path: Path) -> FrawdError:
    from .shards import META_FILE

    if not (path.parent / META_FILE).exists():
        return FrawdError(f"{path} is a FrawdLLM token shard (binary token ids), not text, and {path.parent} has no "
                          f"{META_FILE}: a folder of prepared shards needs its {META_FILE} (prepare it again); a text "
                          "source must leave shards out")
    return FrawdError(f"{path} is a FrawdLLM token shard (binary token ids), not text; leave it out of the data "
                      "source (a folder of prepared shards goes whole to frawd pretrain --data or frawd eval --data)")


def refuse_shard_files(paths: Iterable[Path]) -> None:
    """One line for the first of `paths` that is a token shard (a text file that starts with
    the magic's letters is text, as it is where its text is read)."""
    from .shard_format import SNIFF_BYTES, is_shard_head

    for path in paths:
        try:
            with open(path, "rb") as f:
                head = f.read(SNIFF_BYTES)
        except OSError:
            continue  # reading it later says what is wrong
        if is_shard_head(head):
            raise _shard_file_error(path)


def _refuse_shard_text(head: str, path: Path) -> None:
    """The first text read from a file: a token shard decodes to the magic, then its version's NULs."""
    if head.startswith("FRAWDTOK") and "\0" in head[8:16]:
        raise _shard_file_error(path)


def file_documents(files: list[Path], text_field: str, doc_split: str, stats: SourceStats) -> Iterator[str]:
    """The documents of `files`, file after file (no check that there is any)."""
    for path in files:
        stats.files += 1
        name = path.name.lower()
        if name.endswith(_JSONL_SUFFIXES) or (name.endswith(_JSON_SUFFIXES) and _opens_a_record(path, text_field)):
            yield from _jsonl_documents(path, text_field, stats)
        elif name.endswith(".parquet"):
            yield from _parquet_documents(path, text_field)
        else:
            yield from _text_documents(path, doc_split, stats)


def _open_text(path: Path, newline: str = "") -> io.TextIOBase:
    """Open as UTF-8 text, unpacking gzip, bzip2 and xz files (by suffix or first bytes) and
    refusing in one line other compressed files and tar archives; text opening with a UTF-16
    or UTF-32 byte-order mark (compressed or not) is decoded as such. Bad bytes become U+FFFD
    and are counted. newline="" keeps the text exactly as stored; "\n" also makes readline()
    end lines at "\n" alone (JSON Lines: a lone "\r" is whitespace inside a record, not a
    line end)."""
    opener, head = _binary_opener(path)
    encoding = next((codec for bom, codec in _BOMS if head.startswith(bom)), "utf-8")
    if opener is open:
        return open(path, encoding=encoding, errors=_ERRORS, newline=newline)
    return opener(path, "rt", encoding=encoding, errors=_ERRORS, newline=newline)


def _binary_opener(path: Path) -> tuple[Callable, bytes]:
    """How to open a file's bytes (a decompressor or `open`), and the first bytes of what
    it gives; a file of a kind that is not read here is one line saying how to unpack it."""
    with open(path, "rb") as f:
        head = f.read(_HEAD_BYTES)
    opener = next((opener for suffix, (magic, opener) in _DECOMPRESSORS.items()
                   if path.name.lower().endswith(suffix) or head.startswith(magic)), open)
    if opener is not open:
        try:
            with opener(path, "rb") as f:
                head = f.read(_HEAD_BYTES)  # (what the decompressed stream starts with)
        except _READ_ERRORS as exc:  # a corrupt compressed file
            raise FrawdError(f"{path}: cannot read ({exc})") from None
    for magic, (kind, command) in _NOT_READ.items():
        if head.startswith(magic):
            raise FrawdError(f"{path} is compressed with {kind}, which is not read here (gzip, bzip2 and xz are): "
                             f"decompress it first ({command} {path})")
    if head[257:262] == b"ustar":  # (POSIX and GNU tar headers; its members' bytes would pass for text)
        raise FrawdError(f"{path} is a tar archive, which is not read here: unpack it (tar xf {path}) and give "
                         "the folder")
    return opener, head


def plain_text_head(head: bytes) -> bool:
    """Whether a file starting with `head` is read as it is, UTF-8 (not compressed, not UTF-16/32)."""
    return not any(head.startswith(magic) for magic, _ in _DECOMPRESSORS.values()) \
        and not any(head.startswith(bom) for bom, _ in _BOMS)


def _opens_a_record(path: Path, text_field: str) -> bool:
    """Whether a .json file is JSON Lines: its first non-blank line a JSON object with the
    text field (a pretty-printed or other JSON document, e.g. a config in a folder of code,
    is text)."""
    with _open_text(path, newline="\n") as f:
        try:
            for line in f:
                if line.strip():
                    record = json.loads(line.removeprefix(BOM))
                    return isinstance(record, dict) and text_field in record
        except (ValueError, *_READ_ERRORS):  # (not JSON: text; a corrupt file is said when it is read)
            return False
    return False


def _read(f: io.TextIOBase, size: int, path: Path, stats: SourceStats) -> str:
    before = _replaced_so_far()
    try:
        text = f.read(size)
    except _READ_ERRORS as exc:  # a corrupt compressed file
        raise FrawdError(f"{path}: cannot read ({exc})") from None
    stats.note_replaced(_replaced_so_far() - before, str(path))
    return text


# ---- text files ------------------------------------------------------------------------------

def _text_documents(path: Path, doc_split: str, stats: SourceStats) -> Iterator[str]:
    with _open_text(path) as f:
        if doc_split == "file":
            text = _read(f, -1, path, stats).removeprefix(BOM)  # (a byte-order mark is not text)
            _refuse_shard_text(text, path)
            if text.strip():
                yield text
            return
        head = [_read(f, _CHUNK_CHARS, path, stats).removeprefix(BOM)]
        _refuse_shard_text(head[0], path)
        yield from _split_stream(lambda: head.pop() if head else _read(f, _CHUNK_CHARS, path, stats),
                                 _SEPARATORS[doc_split])


def _split_stream(read_chunk, separator: re.Pattern) -> Iterator[str]:
    """Split a stream read in chunks on `separator`; a separator followed by nothing but
    whitespace up to the end of the buffer may continue in the next chunk, so it waits
    for more text."""
    carry = ""
    while True:
        chunk = read_chunk()
        buffer = carry + chunk
        start = 0
        text_end = len(buffer.rstrip())  # (once per chunk: per separator it made reading quadratic)
        for match in separator.finditer(buffer):
            if chunk and match.end() >= text_end:
                break
            yield from _nonblank(buffer[start:match.start()])
            start = match.end()
        carry = buffer[start:]
        if not chunk:
            yield from _nonblank(carry)
            return


def _nonblank(doc: str) -> Iterator[str]:
    doc = doc.strip("\r\n")
    if doc.strip():
        yield doc


# ---- records: JSONL, Parquet, Hugging Face datasets ------------------------------------------------

def _clean(text: str, where: str, stats: SourceStats) -> str:
    """JSON can spell lone surrogates (\\ud800) that are not text; replace and count them."""
    if text.isascii():
        return text
    cleaned, n = _SURROGATE.subn("\ufffd", text)
    stats.note_replaced(n, where)
    return cleaned


def _kind(value: object) -> str:
    """A value's type as the file spells it (JSON's and Parquet's null, not Python's NoneType)."""
    return "null" if value is None else type(value).__name__


def _record_text(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise FrawdError(f"{where}: expected a JSON object with a {text_field!r} field")
    if text_field not in record:
        fields = ", ".join(map(repr, list(record)[:8])) or "none"
        raise FrawdError(f"{where}: no field {text_field!r} (fields: {fields}); choose one with --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise FrawdError(f"{where}: field {text_field!r} is {_kind(text)}, expected a string")
    return text


def _jsonl_documents(path: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    with _open_text(path, newline="\n") as f:
        lineno = 0
        while True:
            before = _replaced_so_far()
            try:
                line = f.readline()
            except _READ_ERRORS as exc:
                raise FrawdError(f"{path}: cannot read ({exc})") from None
            stats.note_replaced(_replaced_so_far() - before, str(path))
            if not line:
                return
            lineno += 1
            if lineno == 1:
                line = line.removeprefix(BOM)  # (a UTF-8 byte-order mark is not JSON)
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FrawdError(f"{where}: not valid JSON ({exc.msg})") from None
            text = _clean(_record_text(record, text_field, where), str(path), stats)
            if text.strip():
                yield text


def open_parquet(path: Path):
    """A `pyarrow.parquet.ParquetFile`, or one line saying why not."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise FrawdError("reading Parquet needs pyarrow: pip install 'frawdllm[hf]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise FrawdError(f"{path}: not a readable Parquet file ({exc})") from None


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    parquet = open_parquet(path)
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise FrawdError(f"{path}: no column {text_field!r} (columns: {', '.join(columns)}); "
                         f"choose one with --text-field")
    row = 0
    for batch in parquet.iter_batches(batch_size=4096, columns=[text_field]):
        with unreadable_rows(str(path), row):
            texts = batch.column(0).to_pylist()
        for text in texts:
            row += 1
            if not isinstance(text, str):
                raise FrawdError(f"{path}: row {row}: column {text_field!r} is "
                                 f"{_kind(text)}, expected a string")
            if text.strip():
                yield text


@contextlib.contextmanager
def unreadable_rows(where: str, rows_read: int):
    """Turn a reader's failure on the data itself (pyarrow's JSON parser refusing a lone
    surrogate, a string column holding invalid UTF-8) into one line saying how far it got;
    readers parse rows in blocks, so the bad row is at or after the one named."""
    try:
        yield
    except (UnicodeError, ValueError) as exc:  # pyarrow.ArrowInvalid is a ValueError
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FrawdError(f"{where}: cannot read row {rows_read + 1} or a later one ({problem})") from None


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """'hf:NAME[:CONFIG][@SPLIT]' -> (name, config or None, split; default 'train')."""
    rest, split = spec[len("hf:"):], "train"
    if "@" in rest:
        rest, split = rest.rsplit("@", 1)
    name, _, config = rest.partition(":")
    if not name or not split:
        raise FrawdError(f"bad dataset spec {spec!r}; expected hf:NAME[:CONFIG][@SPLIT]")
    return name, config or None, split


def hf_local_path(spec: str) -> Path | None:
    """The local folder (or file) an 'hf:' spec names, None for a Hub dataset name."""
    try:
        name = Path(parse_hf_spec(spec)[0])
    except FrawdError:  # (a bad spec is said when the source is read)
        return None
    return name if name.exists() else None


def open_hf_dataset(spec: str):
    """The `datasets` dataset an 'hf:' spec names: a local `save_to_disk` folder, or one
    streamed by `load_dataset` (one split either way)."""
    name, config, split = parse_hf_spec(spec)
    local = Path(name)
    saved = local.is_dir() and any((local / f).is_file() for f in ("dataset_info.json", "dataset_dict.json"))
    unreachable = None if local.exists() else _hub_unreachable()  # (a local folder needs no Hub)
    if unreachable:  # only the local cache then (read when `datasets` is imported), at once
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError:
        raise FrawdError("hf: sources need the datasets library: pip install 'frawdllm[hf]'") from None
    try:
        if saved:  # a directory written by Dataset.save_to_disk
            dataset = datasets.load_from_disk(str(local))
            if isinstance(dataset, datasets.DatasetDict):
                if split not in dataset:
                    raise FrawdError(f"{spec}: no split {split!r} (splits: {', '.join(dataset)})")
                dataset = dataset[split]
            elif "@" in spec[len("hf:"):] and (dataset.split is None or split != str(dataset.split)):
                its = "" if dataset.split is None else f" (the {dataset.split} split)"
                raise FrawdError(f"{spec}: {name} holds one saved dataset{its}, not a dictionary of splits, so "
                                 f"@{split} cannot apply; leave it out")
        else:
            dataset = datasets.load_dataset(name, config, split=split, streaming=True)
    except FrawdError:
        raise
    except Exception as exc:  # datasets raises many kinds (not found, offline, bad split)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        offline = f"; {unreachable} cannot be reached (no network?), so only the local cache was tried" \
            if unreachable else ""
        raise FrawdError(f"{spec}: cannot load dataset ({message}){offline}") from None
    return dataset


def _hub_unreachable() -> str | None:
    """The Hub's host name when it does not resolve (no network), else None. Without this
    `datasets` retries for ~30 s, logging each retry, before it gives up. Behind a proxy
    (which resolves names itself), or with HF_HUB_OFFLINE set, nothing is checked."""
    if os.environ.get("HF_HUB_OFFLINE") or any(os.environ.get(v) for v in (
            "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return host
    return None


def _hf_documents(spec: str, text_field: str, stats: SourceStats) -> Iterator[str]:
    dataset = open_hf_dataset(spec)
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise FrawdError(f"{spec}: no column {text_field!r} (columns: {', '.join(columns)}); "
                         f"choose one with --text-field")
    return _hf_rows(dataset, spec, text_field, stats)


def _hf_rows(dataset, spec: str, text_field: str, stats: SourceStats) -> Iterator[str]:
    row = 0
    batches = iter(dataset.iter(batch_size=1024))
    while True:
        with unreadable_rows(spec, row):
            batch = next(batches, None)
        if batch is None:
            return
        if text_field not in batch:
            raise FrawdError(f"{spec}: no column {text_field!r} (columns: {', '.join(batch)})")
        for text in batch[text_field]:
            row += 1
            if not isinstance(text, str):
                raise FrawdError(f"{spec}: row {row}: column {text_field!r} is "
                                 f"{_kind(text)}, expected a string")
            text = _clean(text, spec, stats)
            if text.strip():
                yield text
