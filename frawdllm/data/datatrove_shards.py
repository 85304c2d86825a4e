"""`frawd data prepare --engine datatrove`: tokenization as a pipeline on HF datatrove.

datatrove runs a list of pipeline steps as `tasks` independent ranks, on this machine
(local executor: a process pool), on a Slurm cluster (a job array) or on a Ray cluster.
Two stages, each a datatrove executor, the second depending on the first:

    TokenizeFiles  rank r of N takes a contiguous block of the sorted source files
                   (files[r*F//N : (r+1)*F//N]) and tokenizes it with the same code as
                   `prepare_shards` into train-RRRRR.bin, val-RRRRR.bin and part-RRRRR.json
                   (its counts)
    MergeShards    one task: sums the parts into meta.json, which lists the shards of each
                   split in rank order (`train_shards`, `val_shards`); then removes the shard
                   files of earlier runs it does not list, and their logs

Order: the loaders read a split as its shards in rank order. Since the blocks are
contiguous and each document goes to train or val by a hash of its own text, that stream
is token for token the stream of single-process `prepare_shards` on the same inputs.
One difference: a corpus too small for a hashed val split (no document hashed to val, or
every one) is an error here, where single-process prepare splits its tokens head/tail.
Before launching, `check_source_start` reads the start of the source to catch that early.

A FrawdError in a task (bad input) reaches the user as one line, as with the single
engine: see `FrawdStep`. meta.json's `seconds` is the wall time from the call to the end
of the merge (for Slurm and Ray, queueing included).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from datatrove.pipeline.base import PipelineStep
from datatrove.utils.logging import logger

from ..errors import FrawdError
from ..io import write_json_atomic
from ..orphans import children_end_with_this_process
from ..tokenizer import Tokenizer
from .shard_format import open_shard_writer
from .shards import (LOGS_DIR, META_FILE, _inputs_hash, _is_val, _reusable, document_end, remove_stale_shards,
                     shard_meta, check_prepare_options, refuse_out_in_source, tokenize_documents, with_warnings,
                     writing_into)
from .sources import SourceStats, file_documents, source_files

EXECUTORS = ("local", "slurm", "ray")
PROBE_BYTES = 16 << 20  # text of the source's start read before launching (check_source_start)
# The datatrove module that logs a failed task's exception, traceback and all, before raising it again.
EXECUTOR_LOG = "datatrove.executor.base"


def logs_name(inputs_hash: str, workers: int) -> str:
    """The run's folder under OUT/.datatrove: the same inputs and workers resume there."""
    return f"{inputs_hash[:16]}-w{workers}"


def rank_files(files: list, rank: int, world_size: int) -> list:
    """Rank `rank`'s contiguous block of `files` (empty when there are more ranks than files)."""
    n = len(files)
    return files[rank * n // world_size:(rank + 1) * n // world_size]


def _names(rank: int) -> dict[str, str]:
    return {"train": f"train-{rank:05d}.bin", "val": f"val-{rank:05d}.bin", "part": f"part-{rank:05d}.json"}


def _doc_split(data: str, doc_split: str) -> str:
    return "file" if data == "stdlib" else doc_split  # (the built-in corpus is one document per file)


def _no_documents(data: str) -> FrawdError:
    return FrawdError(f"data source {data!r} holds no documents (no non-empty text)")


def _no_val_document(data: str, val_fraction: float) -> FrawdError:
    return FrawdError(f"no document of {data!r} hashed into the val split (too few documents for "
                      f"--val-fraction {val_fraction}); use a larger --val-fraction or the single-process "
                      "prepare, which then holds out the tail of train")


def _no_train_document(data: str, val_fraction: float) -> FrawdError:
    return FrawdError(f"every document of {data!r} hashed into the val split (too few documents for "
                      f"--val-fraction {val_fraction}); use a smaller --val-fraction or the single-process "
                      "prepare, which then trains on the head of val")


def check_source_start(data: str, text_field: str, doc_split: str, val_fraction: float) -> None:
    """Before any task runs: read the source from its start until it has met a document of
    each split (any document, with no val split). A source that ends first, within
    PROBE_BYTES of text, would fail the merge's checks after every task ran, so it fails them
    now. A longer one is left to the merge: reading it all here would be the tasks' work."""
    documents = file_documents(source_files(data), text_field, _doc_split(data, doc_split), SourceStats())
    count, read, sides = 0, 0, set()  # sides met: True for val
    for doc in documents:
        raw = doc.encode("utf-8")
        sides.add(val_fraction > 0 and _is_val(raw, val_fraction))
        if val_fraction == 0 or len(sides) == 2:
            return
        count, read = count + 1, read + len(raw)
        if read >= PROBE_BYTES:
            return
    if count == 0:
        raise _no_documents(data)
    raise _no_train_document(data, val_fraction) if True in sides else _no_val_document(data, val_fraction)


class FrawdStep(PipelineStep):
    """A pipeline step whose FrawdError (bad input) reaches the user as one line.

    datatrove's executor logs a task's exception with its full traceback, to the terminal
    and the task's log, before raising it again; the CLI then prints its one line. For a
    FrawdError that log is switched off as it passes (the log file gets a line of our own).
    The next step, or the end of a local run, switches it on again. An OSError (a source file
    unreadable, or gone since it was listed) is bad input too, said as the single-process
    prepare says it. Other exceptions are bugs and keep their traceback."""

    def __call__(self, data=None, rank: int = 0, world_size: int = 1):
        from ..cli import describe_os_error

        logger.enable(EXECUTOR_LOG)
        try:
            try:
                return self.run(data, rank, world_size)
            except OSError as exc:
                raise FrawdError(describe_os_error(exc)) from None
        except FrawdError as exc:
            logger.debug(f"stopped by bad input: {exc}")  # (a task prints INFO and up; its log file has all)
            logger.disable(EXECUTOR_LOG)
            raise


class TokenizeFiles(FrawdStep):
    """Tokenize this rank's block of the source files into its own train and val shards.
    `files`: the source's files as listed once when the prepare started (each task listing
    them again, maybe hours later under Slurm, shifted the blocks when a file came or went:
    files tokenized twice or never)."""

    name = "frawd tokenize"
    type = "FrawdLLM"

    def __init__(self, data: str, tokenizer: str, out: str, *, files: list[str], val_fraction: float,
                 text_field: str, doc_split: str, threads: int | None = None):
        super().__init__()
        self.data, self.tokenizer, self.out, self.threads = data, tokenizer, out, threads
        self.files = files
        self.val_fraction, self.text_field, self.doc_split = val_fraction, text_field, doc_split

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        if self.threads is not None:  # read when the Rust thread pool starts (this process's first encode)
            os.environ.setdefault("RAYON_NUM_THREADS", str(self.threads))
        tok = Tokenizer.load(self.tokenizer)
        out, names = Path(self.out), _names(rank)
        files = [Path(f) for f in rank_files(self.files, rank, world_size)]
        split = _doc_split(self.data, self.doc_split)
        stats = SourceStats()
        with open_shard_writer(out / names["train"], tok.vocab_size) as train, \
                open_shard_writer(out / names["val"], tok.vocab_size) as val:
            documents = file_documents(files, self.text_field, split, stats)
            totals = tokenize_documents(documents, tok, (train, val), self.val_fraction)
        totals.update(train_tokens=train.n_tokens, val_tokens=val.n_tokens, replaced=stats.replaced,
                      replaced_in=stats.replaced_in, files=len(files))
        self.stat_update("documents", value=sum(totals["docs"]))
        write_json_atomic(out / names["part"], totals)
        return iter(())  # nothing flows on to a next step


class MergeShards(FrawdStep):
    """Sum the ranks' counts into meta.json, listing the shards in rank order."""

    name = "frawd merge"
    type = "FrawdLLM"

    def __init__(self, data: str, tokenizer: str, out: str, *, parts: int, val_fraction: float,
                 text_field: str, doc_split: str, inputs_hash: str, started: float):
        super().__init__()
        self.data, self.tokenizer, self.out, self.parts = data, tokenizer, out, parts
        self.options = {"val_fraction": val_fraction, "text_field": text_field, "doc_split": doc_split,
                        "inputs_hash": inputs_hash, "started": started}

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        merge_parts(self.data, Tokenizer.load(self.tokenizer), Path(self.out), self.parts, **self.options)
        return iter(())


def merge_parts(data: str, tok: Tokenizer, out: Path, parts: int, *, val_fraction: float, text_field: str,
                doc_split: str, inputs_hash: str, started: float) -> dict:
    """Write meta.json from the part-RRRRR.json of ranks 0..parts-1; returns it. `started`:
    the time.time() at which the prepare began (its `seconds` run from there to now)."""
    totals = {"docs": [0, 0], "bytes": [0, 0], "unk": 0, "train_tokens": 0, "val_tokens": 0, "replaced": 0}
    totals["replaced_in"] = []  # files in which bytes were replaced
    for rank in range(parts):
        path = out / _names(rank)["part"]
        if not path.is_file():
            raise FrawdError(f"{path} is missing: rank {rank} of the tokenize step did not finish")
        part = json.loads(path.read_text(encoding="utf-8"))
        for key in ("docs", "bytes"):
            totals[key] = [a + b for a, b in zip(totals[key], part[key])]
        for key in ("unk", "train_tokens", "val_tokens", "replaced"):
            totals[key] += part[key]
        totals["replaced_in"] += part["replaced_in"]
    if sum(totals["docs"]) == 0:  # (check_source_start catches these early for a small source)
        raise _no_documents(data)
    if val_fraction > 0 and totals["val_tokens"] == 0:
        raise _no_val_document(data, val_fraction)
    if totals["train_tokens"] == 0:
        raise _no_train_document(data, val_fraction)
    totals["val_split"] = "documents"
    # Wall time, as the single engine's: with Slurm or Ray, time spent queueing counts too.
    totals["seconds"] = max(0.0, time.time() - started)  # (time.time: the merge may run on another machine)
    shards = {split: [_names(rank)[split] for rank in range(parts)] for split in ("train", "val")}
    meta = shard_meta(data, tok, totals, val_fraction=val_fraction, text_field=text_field, doc_split=doc_split,
                      inputs_hash=inputs_hash, shards=shards)
    meta["engine"] = {"name": "datatrove", "workers": parts}
    write_json_atomic(out / META_FILE, meta)
    for rank in range(parts):
        (out / _names(rank)["part"]).unlink(missing_ok=True)
    remove_stale_shards(out, meta, keep_logs=logs_name(inputs_hash, parts))
    return with_warnings(meta)


def prepare_shards_datatrove(data: str, tokenizer: str | Path, out: str | Path, *, workers: int,
                             executor: str = "local", val_fraction: float = 0.005, text_field: str = "text",
                             doc_split: str = "blank", force: bool = False, slurm: dict | None = None) -> dict | None:
    """Tokenize `data` with `workers` datatrove tasks into OUT/{train,val}-RRRRR.bin + meta.json.

    `local` runs here and returns the metadata; `slurm` submits two dependent job arrays
    (options in `slurm`: partition, time, cpus_per_task, ...) and returns None at once;
    meta.json appears when the merge job ends. A rerun with the same inputs reuses finished
    shards (meta.json) or, after a failure, skips the ranks datatrove marked complete.
    """
    started = time.time()
    if executor not in EXECUTORS:
        raise FrawdError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    check_prepare_options(val_fraction, workers, local=executor == "local")
    if data.startswith("hf:"):
        raise FrawdError("--engine datatrove splits a list of files among workers; hf: datasets have none "
                         "(download them to files, or use the single-process prepare)")
    refuse_out_in_source(data, Path(out))
    tokenizer = str(Path(tokenizer).resolve())
    tok = Tokenizer.load(tokenizer)
    document_end(tok, tokenizer)
    out = Path(out).resolve()
    inputs_hash = _inputs_hash(data, tok, val_fraction, text_field, doc_split)
    if not force:
        reused = _reusable(out, inputs_hash)
        if reused is not None:
            return reused
    check_source_start(data, text_field, doc_split, val_fraction)  # a source too small fails now, not at the merge
    logs = out / LOGS_DIR / logs_name(inputs_hash, workers)
    with writing_into(out):  # (a second prepare into OUT is refused while this one runs or submits)
        # The tasks rewrite the shard files in place, so the old meta.json must go first.
        (out / META_FILE).unlink(missing_ok=True)
        if force:
            shutil.rmtree(logs, ignore_errors=True)
        options = {"val_fraction": val_fraction, "text_field": text_field, "doc_split": doc_split}
        listed = [str(path) for path in source_files(data)]
        tokenize = [TokenizeFiles(data, tokenizer, str(out), files=listed, **options)]
        merge = [MergeShards(data, tokenizer, str(out), parts=workers, inputs_hash=inputs_hash, started=started,
                             **options)]
        if executor == "local":
            from datatrove.executor import LocalPipelineExecutor

            tokenize[0].threads = max(1, (os.cpu_count() or 1) // workers)  # the workers share this machine
            first = LocalPipelineExecutor(tokenize, tasks=workers, workers=workers, logging_dir=str(logs / "tokenize"))
            second = LocalPipelineExecutor(merge, tasks=1, logging_dir=str(logs / "merge"), depends=first)
            try:
                with children_end_with_this_process():  # (datatrove's manager, forked, held OUT's lock as an orphan)
                    second.run()
            finally:
                logger.enable(EXECUTOR_LOG)  # (a FrawdStep that failed here, in this process, switched it off)
            if not (out / META_FILE).is_file():
                raise FrawdError(f"the datatrove pipeline wrote no {META_FILE}; see its logs in {logs}")
            return with_warnings(json.loads((out / META_FILE).read_text(encoding="utf-8")))
        if executor == "slurm":
            from datatrove.executor import SlurmPipelineExecutor

            opts = {"time": "4:00:00", "partition": None, **(slurm or {})}
            if not opts["partition"]:
                raise FrawdError("--executor slurm needs --slurm-partition")
            first = SlurmPipelineExecutor(tokenize, tasks=workers, logging_dir=str(logs / "tokenize"),
                                          job_name="frawd-tokenize", **opts)
            second = SlurmPipelineExecutor(merge, tasks=1, logging_dir=str(logs / "merge"), depends=first,
                                           job_name="frawd-merge", **opts)
            second.run()  # submits both arrays (sbatch) and returns
            return None
        try:
            from datatrove.executor.ray import RayPipelineExecutor
            import ray  # noqa: F401
        except ImportError:
            raise FrawdError("--executor ray needs Ray: pip install 'ray[default]'") from None
        first = RayPipelineExecutor(tokenize, tasks=workers, logging_dir=str(logs / "tokenize"))
        second = RayPipelineExecutor(merge, tasks=1, logging_dir=str(logs / "merge"), depends=first)
        second.run()
        return with_warnings(json.loads((out / META_FILE).read_text(encoding="utf-8"))) \
            if (out / META_FILE).is_file() else None
