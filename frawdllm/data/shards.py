"""`prepare_shards`: a corpus -> train.bin, val.bin and meta.json, tokenized on all cores.

Three stages overlap, so the cores stay busy with tokenization:

    reader thread   documents from the source, grouped into batches of ~1 M characters;
                    each document goes to val or train by a hash of its text (so the
                    split is deterministic, and duplicates never straddle it); long
                    documents are cut into pieces at points where the tokenizer's
                    pre-tokenizer always has a boundary, so one huge file cannot keep
                    the other cores waiting
    encode threads  `encode_batch_fast` of the `tokenizers` library on a few batches at
                    once (Rust threads on all cores, GIL released)
    main thread     ids -> one numpy array per split (each document followed by <|eos|>),
                    appended to the shard files; progress bar in MB/s

The new shards are written under temporary names and renamed into place when complete,
meta.json last, so until then an old shard set in `out` stays usable (a run that fails or
is killed leaves it as it was); only then are the old set's other shard files removed
(`remove_stale_shards`: say the train-RRRRR.bin of a datatrove run). A second run with the
same inputs (source files by path, size and mtime; the tokenizer's content; the options)
finds the matching `inputs_hash` in meta.json and reuses the shards unless `force`.
`frawd data prepare` first calls `refuse_other_shards`: a folder holding the shards of
another source is refused unless --overwrite, so preparing a second corpus never silently
replaces the first (`prepare_shards` itself replaces them: pretrain's run folder caches the
data it was last given). A prepare that writes holds `out` (`writing_into`: a lock), so a
second one into it is refused instead of deleting the first's files. Documents end with
<|eos|>, or with the end-of-text token of a tokenizer without FrawdLLM's specials (an
imported GPT-2's <|endoftext|>); a tokenizer with neither is refused.

`read_split` reads a split back: train.bin, or the several shard files meta.json lists
(`--engine datatrove` writes one per worker, see datatrove_shards.py) as one stream.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import queue
import re
import shutil
import sys
import threading
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..cbuild import usable_cpus
from ..config import is_integer
from ..errors import FrawdError
from ..io import _fsync_wanted, atomic_path, clean_partial, new_folders, sync_path, undo_on_error, write_json_atomic
from ..tokenizer import FOREIGN_DOCUMENT_ENDS, TOKENIZER_FILE, Tokenizer, cut_at_word_starts
from .shard_format import (HEADER_BYTES, SNIFF_BYTES, VERSION, ShardStream, ShardWriter, TokenArray, is_shard_head,
                           read_header, read_shard, token_dtype)
from .sources import (BUILTIN_SOURCES, SourceStats, hf_local_path, is_glob, iter_documents, parse_hf_spec,
                      plain_text_head, source_files, source_spec)

TRAIN_FILE, VAL_FILE, META_FILE = "train.bin", "val.bin", "meta.json"
LOGS_DIR = ".datatrove"  # datatrove's logs and completion marks, inside the output folder
# The names a prepare gives its shards (either engine) and datatrove's log folders.
_SHARD_NAME = re.compile(r"(train|val)(-[0-9]{5,})?\.bin")
_LOGS_NAME = re.compile(r"[0-9a-f]{16}-w[0-9]+")
PIECE_CHARS = 16_384  # long documents are encoded in pieces of about this many characters
BATCH_CHARS = 1 << 20  # characters per encode_batch call
ENCODES_IN_FLIGHT = 3  # concurrent encode_batch calls: one's straggling pieces overlap the next's work


@dataclass
class _Batch:
    """Texts for one encode_batch call. A document longer than a batch spans several: each
    batch holds a part of it (some of its pieces), and only its last part ends it."""
    pieces: list[str] = field(default_factory=list)
    parts: list[tuple[int, bool, bool]] = field(default_factory=list)  # (pieces, is_val, ends the document)
    text_bytes: list[int] = field(default_factory=lambda: [0, 0])  # train, val
    chars: int = 0

    def documents(self, split: int) -> int:
        """The documents of `split` that end in this batch."""
        return sum(ends and is_val == bool(split) for _, is_val, ends in self.parts)


WORKERS_PER_CPU = 4  # a cap on local --workers: 3000 spent 18 s starting threads for a 136-byte file


def prepare_shards(data: str | Path, tokenizer: Tokenizer | str | Path, out: str | Path, *,
                   val_fraction: float = 0.005, text_field: str = "text", doc_split: str = "blank",
                   workers: int | None = None, force: bool = False, progress: bool = False,
                   refuse_other: bool = False) -> dict:
    """Tokenize the corpus `data` into `out/train.bin`, `out/val.bin` and `out/meta.json`.

    Returns the metadata (also written to meta.json): token counts, dtype, UTF-8 bytes of
    text per token, the tokenizer's hash and what was replaced or unknown. `refuse_other`:
    shards of another source in `out` are refused (`refuse_other_shards`), checked again
    once `out` is held (another prepare may have finished there since the caller's check).
    """
    data = source_spec(data)  # a Path, as the str meta.json records
    check_prepare_options(val_fraction, workers)
    if workers is not None:
        # The Rust thread pool reads this when it starts (the first parallel encode of the process).
        os.environ["RAYON_NUM_THREADS"] = str(workers)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.load(tokenizer)
    document_end(tok, tokenizer)
    out = Path(out)
    refuse_out_in_source(data, out)
    inputs_hash = _inputs_hash(data, tok, val_fraction, text_field, doc_split)
    if not force:
        reused = _reusable(out, inputs_hash)  # (read without the lock: every file there is replaced whole)
        if reused is not None:
            _tidy(out)
            return reused

    stats = SourceStats()
    documents = iter_documents(data, text_field=text_field, doc_split=doc_split, stats=stats)

    with writing_into(out):  # a failed first run leaves no empty folder
        if refuse_other:
            refuse_other_shards(out, str(data))
        start = time.perf_counter()
        bar = _progress_bar(progress, _source_bytes(data))
        try:
            # The new shards grow under temporary names; until they are complete the old
            # shards and their meta.json stay in place, usable.
            with atomic_path(out / TRAIN_FILE) as train_tmp, atomic_path(out / VAL_FILE) as val_tmp:
                with open(train_tmp, "wb") as train_f, open(val_tmp, "wb") as val_f:
                    writers = (ShardWriter(train_f, tok.vocab_size), ShardWriter(val_f, tok.vocab_size))
                    totals = tokenize_documents(documents, tok, writers, val_fraction, bar)
                    val_split = "documents"
                    if val_fraction > 0 and writers[0].n_tokens == 0:
                        _move_all(writers[1], writers[0], totals)  # every document hashed into val
                    if val_fraction > 0 and writers[1].n_tokens == 0:  # too few documents to hash
                        source = functools.partial(iter_documents, data, text_field=text_field, doc_split=doc_split)
                        _move_tail(writers[0], writers[1], val_fraction, totals, tok, source, data)
                        val_split = "tail"
                    for writer in writers:
                        writer.finish()
                if _fsync_wanted():  # flushed now, so the renames below follow at once
                    sync_path(train_tmp)
                    sync_path(val_tmp)
                # Leaving the block renames val, then train, into place. From here until the
                # new meta.json is written the folder has none: never old meta, new shards.
                (out / META_FILE).unlink(missing_ok=True)
            if bar is not None and bar.total:
                bar.update(max(0, bar.total - bar.n))  # blank lines and JSON syntax are not document text
        finally:
            if bar is not None:
                bar.close()
        totals.update(seconds=time.perf_counter() - start, replaced=stats.replaced, replaced_in=stats.replaced_in,
                      val_split=val_split, train_tokens=writers[0].n_tokens, val_tokens=writers[1].n_tokens)
        meta = shard_meta(data, tok, totals, val_fraction=val_fraction, text_field=text_field,
                          doc_split=doc_split, inputs_hash=inputs_hash)
        write_json_atomic(out / META_FILE, meta)
        remove_stale_shards(out, meta)
    return with_warnings(meta)


def check_prepare_options(val_fraction: Any, workers: Any, local: bool = True) -> None:
    """One line for a val_fraction outside [0, 1) or a worker count below 1 (None: the default),
    or, for workers on this machine (`local`), above WORKERS_PER_CPU per CPU."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise FrawdError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    if workers is not None and (not is_integer(workers) or workers < 1):
        raise FrawdError(f"workers must be an integer of at least 1, got {workers!r}")
    cpus = usable_cpus()  # (`taskset -c 0` leaves one of the machine's CPUs to this process)
    if local and workers is not None and workers > WORKERS_PER_CPU * cpus:
        raise FrawdError(f"workers must be at most {WORKERS_PER_CPU * cpus} here ({WORKERS_PER_CPU} per CPU, "
                         f"this process may use {cpus}), got {workers}: more only wait for a core")


def refuse_out_in_source(data: str, out: Path, written: Sequence[Path] = ()) -> None:
    """Shards (or a tokenizer) written into the source folder would be read back as part of
    the corpus by the next run (with everything a run writes beside them): one line, before
    anything is written. `written`: the files a glob must not find (default: what `data
    prepare` writes into `out`)."""
    if is_glob(data):
        what = f"{written[0]}" if written else f"folder {out}"
        written = written or [out / name for name in (TOKENIZER_FILE, TRAIN_FILE, VAL_FILE, META_FILE)]
        if any(_glob_matches(Path(os.path.abspath(data)).parts, Path(os.path.abspath(p)).parts) for p in written):
            raise FrawdError(f"the output {what} is where the glob {data!r} finds files: the next run would "
                             f"read what is written there as corpus text; write it elsewhere")
        return
    folder = hf_local_path(data) if data.startswith("hf:") else None if data == "stdlib" else Path(data)
    if folder is None or not folder.is_dir():  # (a Hub dataset, or a file: nothing is written into it)
        return
    source, dest = folder.resolve(), out.resolve()
    if dest == source or source in dest.parents:
        raise FrawdError(f"the output folder {out} is inside the source folder {data}: the next run would read "
                         f"what is written there as corpus text; write it outside {folder}")


def _glob_matches(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether `glob.glob(pattern, recursive=True)` would list the path of `parts` (a part of
    the pattern matches one name, `**` any number of folders)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_matches(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_matches(pattern[1:], parts[1:])


@contextmanager
def writing_into(out: Path) -> Iterator[None]:
    """Hold `out` while the block writes there, with the lock a training run takes on its
    folder (`claim_run_dir`): a second prepare into it fails at once, naming this process,
    instead of deleting the temporary files this one is writing. Once it is held, what
    killed runs left there is removed (`clean_partial`). If the block fails, the folders it
    created go too; a run refused here removes nothing (the folder is the other's)."""
    from ..train.rundir import claim_run_dir, release_run_dir  # (the data package is imported by train)

    created = new_folders(out)  # (looked at before claim_run_dir creates them)
    taken = claim_run_dir(out)  # (False: this process held it already, and goes on holding it)
    try:
        with undo_on_error(out, created):
            clean_partial(out)
            yield
    finally:
        if taken:
            release_run_dir(out)


def _tidy(out: Path) -> None:
    """Remove the temporary files of killed runs from a folder whose shards are reused, unless
    another process holds it (then they are its live ones; several ranks of a training run
    reuse the shards at once)."""
    try:
        with writing_into(out):
            pass
    except FrawdError:
        pass


def with_warnings(meta: dict) -> dict:
    """`meta` with its `warnings` (not written to meta.json): replaced bytes, unknown characters."""
    replaced = SourceStats(replaced=meta["replaced_utf8_sequences"], replaced_in=meta.get("replaced_in_files", []))
    meta["warnings"] = [w for w in (replaced.warning(), _unk_warning(meta), _empty_val_warning(meta)) if w]
    return meta


def document_end(tok: Tokenizer, source: Tokenizer | str | Path) -> int:
    """The id that ends each document in the shards (`Tokenizer.document_end_id`): <|eos|>,
    or an imported tokenizer's own end-of-text token. Refused in one line when it has none
    (id 3 would then be an ordinary token)."""
    end = tok.document_end_id()
    if end is None:
        where = "the tokenizer" if isinstance(source, Tokenizer) else f"tokenizer {source}"
        raise FrawdError(f"{where} has no token to end documents with: neither FrawdLLM's special tokens at "
                         f"ids 0..6 (missing: {', '.join(tok.missing_frawd_specials())}) nor an end-of-text "
                         f"token ({', '.join(FOREIGN_DOCUMENT_ENDS)}); use one made by `frawd tokenizer train`")
    return end


def tokenize_documents(documents: Iterable[str], tok: Tokenizer, writers: tuple[ShardWriter, ShardWriter],
                       val_fraction: float, bar=None) -> dict:
    """Tokenize `documents` in order into the train and val writers (each document, then
    <|eos|>; the split by a hash of its text). Returns the counts: documents and text bytes
    per split ([train, val]) and <|unk|> tokens."""
    totals = {"docs": [0, 0], "bytes": [0, 0], "unk": 0}
    end, unknown = document_end(tok, tok), tok.unknown_id()
    batches = _batches(documents, val_fraction, _piece_splitter(tok), BATCH_CHARS)
    for batch, encodings in _encode_ahead(_prefetch(batches, depth=ENCODES_IN_FLIGHT + 1), tok):
        for split, tokens in enumerate(_batch_tokens(batch, encodings, writers[0].dtype, end)):
            writers[split].write(tokens)
            if unknown is not None:
                totals["unk"] += int(np.count_nonzero(tokens == unknown))
        for split in (0, 1):
            totals["docs"][split] += batch.documents(split)
            totals["bytes"][split] += batch.text_bytes[split]
        if bar is not None:
            bar.update(sum(batch.text_bytes))
    return totals


def shard_meta(data: str, tok: Tokenizer, totals: dict, *, val_fraction: float, text_field: str,
               doc_split: str, inputs_hash: str, shards: dict | None = None) -> dict:
    """meta.json's content from the counts of `tokenize_documents` plus train_tokens,
    val_tokens, seconds, replaced and val_split. `shards` ({"train": [names], "val": [names]})
    lists the shard files of each split when there are several (see `split_files`)."""
    n_train, n_val, seconds = totals["train_tokens"], totals["val_tokens"], totals["seconds"]
    dtype = token_dtype(tok.vocab_size)
    meta = {
        "format_version": VERSION,
        "source": data,
        "resolved_source": resolved_source(data),
        "text_field": text_field,
        "doc_split": doc_split,
        "val_fraction": val_fraction,
        "val_split": totals["val_split"],
        "tokenizer_hash": tok.fingerprint,
        "tokenizer_kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "token_bytes": dtype.itemsize,
        "train_tokens": n_train,
        "val_tokens": n_val,
        "train_documents": totals["docs"][0],
        "val_documents": totals["docs"][1],
        "train_text_bytes": totals["bytes"][0],
        "val_text_bytes": totals["bytes"][1],
        "bytes_per_token": round(sum(totals["bytes"]) / max(1, n_train + n_val), 6),
        "val_bytes_per_token": round(totals["bytes"][1] / n_val, 6) if n_val else None,
        "unk_tokens": totals["unk"],
        "unk_token": None if tok.unknown_id() is None else tok.id_to_token(tok.unknown_id()),
        "replaced_utf8_sequences": totals["replaced"],
        "replaced_in_files": totals.get("replaced_in", []),
        "seconds": round(seconds, 3),
        "mb_per_s": round(sum(totals["bytes"]) / 1e6 / max(seconds, 1e-9), 3),
        "inputs_hash": inputs_hash,
    }
    if shards is not None:
        meta["train_shards"], meta["val_shards"] = list(shards["train"]), list(shards["val"])
    return meta


# ---- reading: one split, one or several shard files -------------------------------------------------

def split_files(shard_dir: str | Path, split: str, meta: dict | None = None) -> list[Path]:
    """The shard files of `split` ("train" or "val"), in stream order: those listed under
    `{split}_shards` in meta.json (a distributed prepare writes one per worker), else the
    single `{split}.bin`."""
    if split not in ("train", "val"):
        raise FrawdError(f"split must be train or val, got {split!r}")
    shard_dir = Path(shard_dir)
    if meta is None:
        meta = read_shard_meta(shard_dir)
    if meta is None:
        what = "is not a JSON object" if (shard_dir / META_FILE).is_file() else "is missing"
        raise FrawdError(f"{shard_dir}: not a folder of prepared shards ({META_FILE} {what}); "
                         "make them with frawd data prepare")
    names = meta.get(f"{split}_shards") or [f"{split}.bin"]
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise FrawdError(f"{shard_dir / META_FILE}: the shard lists are not lists of file names "
                         "(prepare the shards again with frawd data prepare)")
    outside = next((name for name in names if Path(name).name != name or name in ("", ".", "..")), None)
    if outside is not None:  # (a meta.json that names ../other/train.bin or /etc/passwd: read as tokens)
        raise FrawdError(f"{shard_dir / META_FILE}: the shard list names {outside!r}, not a file of the folder "
                         "(prepare the shards again with frawd data prepare)")
    return [shard_dir / name for name in names]


def read_shard_meta(shard_dir: str | Path) -> dict | None:
    """A folder's meta.json when it is one of prepared shards (a JSON object); None when the
    folder has none, or a file of that name that is not (unreadable, not JSON, not an
    object): a folder of text may hold a meta.json of its own. Beside train.bin or val.bin,
    though, a meta.json that cannot be read is prepared shards damaged, an error (their
    token ids must not pass for text)."""
    path = Path(shard_dir) / META_FILE
    meta, problem = _load_meta(path)
    if problem is None:
        return meta
    if path.is_file() and any((Path(shard_dir) / name).is_file() for name in (TRAIN_FILE, VAL_FILE)):
        raise FrawdError(f"{path} {problem}; prepare the shards again with frawd data prepare")
    return None


def _load_meta(path: Path) -> tuple[dict | None, str | None]:
    """(the JSON object in `path`, None); (None, None) when there is no such file; else
    (None, what is wrong with it: "is not valid JSON", ...)."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    except ValueError:
        return None, "is not valid JSON"
    if not isinstance(meta, dict):
        return None, "is not a JSON object"
    return meta, None


def holds_shards(folder: str | Path) -> bool:
    """Whether `folder` holds prepared shards: a meta.json that is a JSON object and at least one
    of the shard files it names (or train.bin, val.bin). A damaged meta.json beside train.bin
    or val.bin is an error (see `read_shard_meta`)."""
    folder = Path(folder)
    meta = read_shard_meta(folder)
    if meta is None:
        return False
    try:
        files = split_files(folder, "train", meta) + split_files(folder, "val", meta)
    except FrawdError:  # shard lists that are not lists of names
        files = [folder / TRAIN_FILE, folder / VAL_FILE]
    return any(f.is_file() for f in files)


def shard_files(shard_dir: str | Path, meta: dict) -> list[Path]:
    """Every shard file `meta` names (both splits), each checked to be there; else one line
    naming the missing ones."""
    shard_dir = Path(shard_dir)
    files = split_files(shard_dir, "train", meta) + split_files(shard_dir, "val", meta)
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FrawdError(f"{shard_dir} holds prepared shards but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing (prepare them again with frawd data prepare)")
    return files


def split_bytes_per_token(meta: dict, split: str) -> float | None:
    """UTF-8 bytes of text per token in one split (for bits per byte): the split's own
    figure, else the whole corpus's (a hand-made meta.json may lack the per-split counts)."""
    text_bytes, tokens = meta.get(f"{split}_text_bytes"), meta.get(f"{split}_tokens")
    if is_integer(text_bytes) and is_integer(tokens) and text_bytes > 0 and tokens > 0:
        return round(text_bytes / tokens, 6)
    figure = meta.get(f"{split}_bytes_per_token") or meta.get("bytes_per_token")
    return figure if isinstance(figure, (int, float)) and not isinstance(figure, bool) and figure > 0 else None


def read_split(shard_dir: str | Path, split: str, meta: dict | None = None) -> TokenArray:
    """The tokens of a split: one shard's memory map, or several read as one stream. Their ids
    are bounded by each header's vocabulary and meta.json's `vocab_size`, the smaller (see
    `read_shard`; the loaders check every batch against it)."""
    if meta is None:
        meta = read_shard_meta(shard_dir)
    files = split_files(shard_dir, split, meta)  # refuses a folder without meta.json
    vocab = meta.get("vocab_size")
    vocab = vocab if is_integer(vocab) and vocab >= 1 else None
    if len(files) == 1:
        return read_shard(files[0], vocab)
    return ShardStream([read_shard(f, vocab) for f in files])


def raw_source_flags_note(given: list[str], data: str, meta: dict) -> str | None:
    """A note naming the raw-source flags given (`--val-fraction`, ...) that the shard folder
    `data` makes moot: its split was fixed when it was prepared. None when none was given."""
    if not given:
        return None
    flags = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
    val_tokens = meta.get("val_tokens")
    count = f" ({val_tokens:,} tokens)" if isinstance(val_tokens, int) else ""  # hand-made meta.json may lack it
    return (f"note: {flags} appl{'ies' if len(given) == 1 else 'y'} to a raw source; {data} holds shards "
            f"with their own validation split{count}")


def print_warnings(meta: dict) -> None:
    """What the corpus needed (replaced bytes, unknown characters) as `warning:` lines on stderr."""
    for warning in meta.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)


def _unk_warning(meta: dict) -> str | None:
    if not meta["unk_tokens"]:
        return None
    what = "word" if meta["tokenizer_kind"] == "word" else "character"
    name = meta.get("unk_token") or "<|unk|>"  # (shards prepared before the name was recorded)
    return (f"{meta['unk_tokens']} {what}(s) are not in the {meta['tokenizer_kind']} tokenizer's "
            f"vocabulary and became {name}")


def _empty_val_warning(meta: dict) -> str | None:
    if meta.get("val_split") != "tail" or meta["val_tokens"] or not meta.get("val_fraction"):
        return None
    return (f"val_fraction {meta['val_fraction']} of the {meta['train_tokens']:,} tokens is less than one token: "
            "the val split is empty")


def remove_stale_shards(out: Path, meta: dict, keep_logs: str | None = None) -> None:
    """Delete what earlier prepares left in `out` beside the shard set `meta` lists: the shard
    files it does not list (known by their names and FrawdLLM's header) and datatrove's log
    folders other than `keep_logs` (their completion marks would skip tasks whose shards are
    gone). Nothing else is touched. Call only once the new meta.json is in place."""
    listed = {f.name for split in ("train", "val") for f in split_files(out, split, meta)}
    for path in out.iterdir():
        if path.name in listed or path.is_symlink() or not path.is_file():
            continue
        if _SHARD_NAME.fullmatch(path.name) and _is_shard_file(path):
            path.unlink(missing_ok=True)
    logs = out / LOGS_DIR
    if logs.is_dir() and not logs.is_symlink():
        for run in logs.iterdir():
            if run.name != keep_logs and _LOGS_NAME.fullmatch(run.name) and run.is_dir() and not run.is_symlink():
                shutil.rmtree(run)
        if not any(logs.iterdir()):
            logs.rmdir()


def _is_shard_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return is_shard_head(f.read(SNIFF_BYTES))
    except OSError:
        return False


# ---- reuse -------------------------------------------------------------------------------------

def _inputs_hash(data: str, tok: Tokenizer, val_fraction: float, text_field: str, doc_split: str) -> str:
    """Everything the shards depend on: the source files (path, size, mtime), the
    tokenizer's content and the options. An hf: dataset in a local folder is known by its
    files too; one on the Hub by its name only."""
    h = hashlib.sha256()  # (paths as resolved: `c.txt`, `./c.txt` and its absolute path are one source)
    h.update(json.dumps([VERSION, resolved_source(str(data)), tok.fingerprint, val_fraction, text_field,
                         doc_split]).encode())
    files = source_files(data)
    if files is None:  # hf:
        local = hf_local_path(data)
        files = [] if local is None else sorted(p for p in (local, *local.rglob("*")) if p.is_file())
    for path in files:
        st = path.stat()
        h.update(os.fsencode(path.resolve()) + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())  # (any file name)
    return h.hexdigest()


def resolved_source(spec: str) -> str:
    """The source the same from any working directory: a path or glob made absolute (links
    resolved for a path), and so the local folder of an hf: spec; built-in (`BUILTIN_SOURCES`)
    and Hub dataset names as given."""
    if spec in BUILTIN_SOURCES:
        return spec
    if spec.startswith("hf:"):
        local = hf_local_path(spec)
        if local is None:
            return spec
        name = parse_hf_spec(spec)[0]  # as written, then :CONFIG@SPLIT as given
        return f"hf:{_resolved(local, spec)}{spec[len('hf:') + len(name):]}"
    if is_glob(spec):
        return os.path.abspath(spec)
    return str(_resolved(Path(spec), spec))


def _resolved(path: Path, spec: str) -> Path:
    try:
        return path.resolve()
    except RuntimeError:  # (Python 3.11's symbolic-link loop; later versions raise OSError)
        raise FrawdError(f"data source {spec!r} is a loop of symbolic links") from None


def refuse_other_shards(out: str | Path, data: str) -> None:
    """One line when `out` holds shards that are not of the source `data`: those of another
    source (meta.json's `resolved_source`, or its `source` for shards made before it was
    recorded), or shard files without a meta.json saying what they were made from. Shards
    of the same source pass: they are reused, or rebuilt when its files, the tokenizer or
    the options changed."""
    out = Path(out)
    fix = "give another --out, or --overwrite to replace"
    meta_path = out / META_FILE
    if not meta_path.is_file():
        orphans = [name for name in (TRAIN_FILE, VAL_FILE) if (out / name).is_file()]
        if orphans:
            them = "them" if len(orphans) > 1 else "it"
            raise FrawdError(f"{out} holds {' and '.join(orphans)} but no {META_FILE} saying what "
                             f"{'they were' if len(orphans) > 1 else 'it was'} made from; {fix} {them}")
        return
    meta, problem = _load_meta(meta_path)
    if problem is not None:
        raise FrawdError(f"{meta_path} {problem}; {fix} it")
    held = None
    if isinstance(meta, dict):
        if isinstance(meta.get("resolved_source"), str):
            held = meta["resolved_source"]
        elif isinstance(meta.get("source"), str):
            held = resolved_source(meta["source"])
    if held is None:
        raise FrawdError(f"{out} holds a {META_FILE} that names no source it was prepared from; {fix} it")
    if held != resolved_source(data):
        raise FrawdError(f"{out} holds the shards of {held}, not of {data}; {fix} them")


def _reusable(out: Path, inputs_hash: str) -> dict | None:
    meta, _ = _load_meta(out / META_FILE)
    if meta is None or meta.get("inputs_hash") != inputs_hash:  # (none, or damaged: prepared again)
        return None
    try:
        for split in ("train", "val"):
            if sum(read_header(f)["n_tokens"] for f in split_files(out, split, meta)) != meta[f"{split}_tokens"]:
                return None
    except (OSError, ValueError, KeyError, TypeError, FrawdError):
        return None
    meta["reused"] = True
    return meta


# ---- reading and batching ------------------------------------------------------------------------

def _is_val(text_bytes: bytes, val_fraction: float) -> bool:
    return zlib.crc32(text_bytes) < val_fraction * 2**32


def _piece_splitter(tok: Tokenizer):
    """A function cutting a long document into pieces that encode to the same ids.

    For char and byte tokenizers any cut is safe. For byte-level BPE with the GPT-2
    regex, a space, tab or newline right after a non-space character always starts a new
    pre-token (no pattern spans a non-space and a following whitespace character, and none
    looks behind), so cuts there are safe. Other tokenizers are never cut.
    """
    if tok.kind in ("char", "byte"):
        return lambda text: [text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]
    setup = json.loads(tok.backend.to_str())
    pre, normalizer = setup.get("pre_tokenizer") or {}, setup.get("normalizer")
    if not (pre.get("type") == "ByteLevel" and pre.get("use_regex") and not pre.get("add_prefix_space")
            and normalizer is None and setup["model"].get("type") == "BPE"):
        return lambda text: [text]
    return lambda text: cut_at_word_starts(text, PIECE_CHARS)


def _batches(documents: Iterable[str], val_fraction: float, splitter, batch_chars: int) -> Iterator[_Batch]:
    """Documents gathered into batches of about `batch_chars` characters; a longer document
    is cut into pieces spread over several batches, so that memory stays bounded by the
    batch (the tokenizer's encodings take ~200 bytes per character of text)."""
    batch = _Batch()
    for doc in documents:
        raw = doc.encode("utf-8")
        n_bytes, is_val = len(raw), _is_val(raw, val_fraction)
        del raw
        pieces = splitter(doc) if len(doc) > PIECE_CHARS else [doc]
        taken, counted = 0, 0  # this document's pieces in the batch; its bytes in earlier batches
        for i, piece in enumerate(pieces):
            batch.pieces.append(piece)
            batch.chars += len(piece)
            taken += 1
            if batch.chars >= batch_chars and i < len(pieces) - 1:  # the document goes on in the next batch
                part_bytes = sum(len(p.encode("utf-8")) for p in pieces[i + 1 - taken:i + 1])
                batch.parts.append((taken, is_val, False))
                batch.text_bytes[is_val] += part_bytes
                counted += part_bytes
                yield batch
                batch, taken = _Batch(), 0
        batch.parts.append((taken, is_val, True))
        batch.text_bytes[is_val] += n_bytes - counted
        if batch.chars >= batch_chars:
            yield batch
            batch = _Batch()
    if batch.pieces:
        yield batch


def _prefetch(items: Iterator, depth: int = 2) -> Iterator:
    """Run an iterator in a background thread, `depth` items ahead; errors re-raise here."""
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        buffer.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            buffer.put((done, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            buffer.put((done, exc))

    thread = threading.Thread(target=produce, name="frawd-reader", daemon=True)
    thread.start()
    try:
        while True:
            item, error = buffer.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()


def _encode_ahead(batches: Iterator[_Batch], tok: Tokenizer) -> Iterator[tuple[_Batch, list]]:
    """Encode several batches at once on the Rust thread pool while the caller writes
    earlier ones; results come back in order."""
    encode = tok._plain.encode_batch_fast
    with ThreadPoolExecutor(max_workers=ENCODES_IN_FLIGHT, thread_name_prefix="frawd-encode") as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.submit(encode, batch.pieces, add_special_tokens=False)))
            if len(pending) >= ENCODES_IN_FLIGHT:
                done_batch, future = pending.popleft()
                yield done_batch, future.result()
        while pending:
            done_batch, future = pending.popleft()
            yield done_batch, future.result()


def _batch_tokens(batch: _Batch, encodings: list, dtype: np.dtype, end: int) -> tuple[np.ndarray, np.ndarray]:
    """The train and val tokens of a batch: each document's ids, then `end` (<|eos|>) where
    the document ends in this batch."""
    flat: tuple[list[int], list[int]] = ([], [])
    k = 0
    for n_pieces, is_val, ends in batch.parts:
        ids = flat[is_val]
        for encoding in encodings[k:k + n_pieces]:
            ids += encoding.ids
        if ends:
            ids.append(end)
        k += n_pieces
    return np.array(flat[0], dtype=dtype), np.array(flat[1], dtype=dtype)


MOVE_TOKENS = 1 << 24  # tokens `_move_all` copies at a time


def _move_all(val: ShardWriter, train: ShardWriter, totals: dict) -> None:
    """Every document hashed into val (a single document does with probability val_fraction):
    all of val becomes train, and `_move_tail` then gives val the tail, so that a corpus of
    one document is split head/tail whichever way its hash falls."""
    val.file.flush()
    for start in range(0, val.n_tokens, MOVE_TOKENS):
        train.write(np.fromfile(val.file.name, dtype=val.dtype, count=min(MOVE_TOKENS, val.n_tokens - start),
                                offset=HEADER_BYTES + start * val.dtype.itemsize))
    val.file.truncate(HEADER_BYTES)
    val.file.seek(0, os.SEEK_END)
    val.n_tokens = 0
    for key in ("docs", "bytes"):  # [train, val]
        totals[key] = [sum(totals[key]), 0]


def _move_tail(train: ShardWriter, val: ShardWriter, val_fraction: float, totals: dict, tok: Tokenizer,
               source: Callable[[], Iterable[str]], data: str) -> None:
    """Too few documents for a hashed split: the last `val_fraction` of train tokens become val.
    The text bytes and documents moved are counted from those tokens (a document is on the
    side of the cut where it ends), so val's bytes per token are its own. A fraction of less
    than one token moves nothing (val stays empty, and a warning says so); one that would
    leave train empty is refused. `source()` reads the documents again (see `_head_text_bytes`)."""
    n = train.n_tokens
    n_val = round(n * val_fraction)
    if n_val >= n:
        raise FrawdError(f"val_fraction {val_fraction} of the {n:,} tokens of {data} leaves none to train on; "
                         "use a smaller one")
    if n_val == 0:
        return
    train.file.flush()
    keep = n - n_val
    tail = np.fromfile(train.file.name, dtype=train.dtype, count=n_val,
                       offset=HEADER_BYTES + keep * train.dtype.itemsize)
    val.write(tail)
    train.file.truncate(HEADER_BYTES + keep * train.dtype.itemsize)
    train.file.seek(0, os.SEEK_END)
    train.n_tokens = keep
    unk = tok.unknown_id()
    if tok._byte_level or (tok.kind == "char" and not (unk is not None and np.any(tail == unk))):
        moved = _text_bytes(tail, tok)  # (each token's bytes are exactly its text's)
    else:  # <|unk|> hides its character; a SentencePiece "▁the" or a word-level "the" its space
        moved = totals["bytes"][0] - _head_text_bytes(source(), keep, tok)
    totals["bytes"][0] -= moved
    totals["bytes"][1] += moved
    ends = int(np.count_nonzero(tail == tok.document_end_id()))
    totals["docs"][0] -= ends
    totals["docs"][1] += ends


def _head_text_bytes(documents: Iterable[str], keep: int, tok: Tokenizer) -> int:
    """UTF-8 bytes of the source text of the first `keep` tokens, read from the documents
    (all on the train side; each is its tokens, then its end). `_move_tail` needs it where a
    token's own bytes are not its text's: an <|unk|> (which character of 1 to 4 bytes it
    stood for, the tokens no longer say), a SentencePiece-style "▁the" (decoded alone, its
    space is gone), a word-level token (no spaces at all). A char tokenizer's tokens are
    its characters; any other's are found by encoding each document again, whole, as
    `prepare_shards` did (`_piece_splitter` cuts only char, byte and byte-level BPE
    documents), and a document cut by the split counts its text up to the end of its last
    train token (the tokenizer's offsets: a space between two words goes with the next)."""
    done = head = 0  # tokens and bytes of the documents before this one
    for doc in documents:
        encoding = None if tok.kind == "char" else tok._plain.encode(doc, add_special_tokens=False)
        n = len(doc) if encoding is None else len(encoding.ids)
        if done + n + 1 > keep:
            cut = keep - done  # this document's tokens on the train side (all but its end, at most)
            chars = cut if encoding is None else len(doc) if cut == n else encoding.offsets[cut - 1][1] if cut else 0
            return head + len(doc[:chars].encode())
        done, head = done + n + 1, head + len(doc.encode())
    return head


def _text_bytes(ids: np.ndarray, tok: Tokenizer) -> int:
    """UTF-8 bytes of document text that `ids` stand for: each token's own bytes, none for a
    special token (a document's end), one for <|unk|> (the character it replaced is gone;
    `_move_tail` counts those from the source)."""
    unique, counts = np.unique(ids, return_counts=True)
    unk, specials = tok.unknown_id(), tok.special_ids
    return sum(int(count) * (1 if i == unk else 0 if i in specials else len(tok.token_bytes(int(i))))
               for i, count in zip(unique, counts))


# ---- progress --------------------------------------------------------------------------------------

def _source_bytes(data: str) -> int | None:
    """Total size of a plain UTF-8 text source (the progress bar's 100%: the bar counts
    document text), else None: compressed files (by suffix or first bytes), UTF-16 or UTF-32
    text (twice or four times its UTF-8), and JSON or Parquet, whose documents are a part of
    their bytes."""
    files = source_files(data)
    if files is None or any(p.name.lower().endswith((".gz", ".bz2", ".xz", ".parquet", ".jsonl", ".ndjson", ".json"))
                            or not _plain_utf8(p) for p in files):
        return None
    return sum(p.stat().st_size for p in files)


def _plain_utf8(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return plain_text_head(f.read(8))
    except OSError:
        return False  # (reading it says what is wrong)


def _progress_bar(enabled: bool, total: int | None):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="tokenizing",
                dynamic_ncols=True)
