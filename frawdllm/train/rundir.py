"""The run directory: everything a training run leaves behind.

    OUT/config.yaml      the merged config: `frawd pretrain --config OUT/config.yaml` reruns it
    OUT/metrics.jsonl    one JSON object a line: train lines (step, tokens, loss, lr,
                         grad_norm, tokens_per_s, mfu) and eval lines (val_loss, ...)
    OUT/loss.png         train and validation loss curves, redrawn at each evaluation
    OUT/samples.txt      text sampled from the model at each evaluation
    OUT/checkpoints/     the last few checkpoints and the best (see checkpoint.py)
    OUT/model/           the best model so far by validation loss: a model directory

TensorBoard and Weights & Biases receive the same metrics when switched on (W&B runs
offline unless WANDB_MODE says otherwise, so it needs no network or account).

Every training command (pretrain, sft, dpo, ...) starts its run the same way:
`check_run_dir` before any work, then inside `undo_failed_start` the `prepare_run_dir`
and the job's own preparation, so a start that fails leaves nothing in the way of the next.
A `Trainer` used directly, with no job around it, applies the same rules (`settle_run_dir`)
to what the loop itself writes: an earlier run is resumed, overwritten or refused, never mixed.
A run holds OUT (`claim_run_dir`: a lock on the folder) from its start to the end of `fit`,
so a second command on the same OUT is refused instead of racing it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import secrets
import shutil
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # (Windows: runs are not locked)
    fcntl = None

from ..errors import FrawdError
from ..io import atomic_path, is_inside, partial_write, write_text_atomic
from .checkpoint import CHECKPOINTS_DIR, damaged_checkpoint, latest_checkpoint, list_checkpoints

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
SAMPLES_FILE = "samples.txt"
BEST_MODEL_DIR = "model"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, PLOT_FILE, SAMPLES_FILE)
RUN_DIRS = (CHECKPOINTS_DIR, BEST_MODEL_DIR, "tensorboard", "wandb")
# what the training loop writes: a job's start writes config.yaml before the loop begins
LOOP_OUTPUTS = (METRICS_FILE, PLOT_FILE, SAMPLES_FILE, *RUN_DIRS)


# ---- starting a run --------------------------------------------------------------------------

_claims: dict[Path, int] = {}  # run folders this process holds: their open descriptors


def claim_run_dir(run_dir: Path) -> bool:
    """Create `run_dir` if need be and hold it for this process (an exclusive `flock` on the
    folder, which the kernel lets go when the process ends, however it ends); again from the
    same process, nothing. Another process's run there: one line, nothing touched. True if
    this call took the hold (then its caller is the one to release it)."""
    run_dir = Path(run_dir)
    _refuse_file(run_dir)
    make_run_dir(run_dir)
    key = run_dir.resolve()
    if key in _claims or fcntl is None:
        return False
    fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = lock_holder(key)
        raise FrawdError(f"{run_dir} is in use by another run{f' (process {holder})' if holder else ''}: wait for "
                         "it to end or stop it, or give another --out") from None
    _claims[key] = fd
    return True


def release_run_dir(run_dir: Path) -> None:
    """Let go of a folder `claim_run_dir` holds (nothing if this process does not hold it)."""
    fd = _claims.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def lock_holder(folder: Path) -> int | None:
    """The process holding a flock on `folder`, from /proc/locks (Linux), else None. The lock
    names the process that took it; a child it forked holds it too, after that process is
    gone (a helper process of some library that outlived a `kill -9`; datatrove's manager
    did, before `orphans.children_end_with_this_process`): then the process that still has
    the folder open."""
    try:
        inode = folder.stat().st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and fields[-3].rsplit(":", 1)[-1] == str(inode):
                taker = int(fields[-4])
                return taker if Path(f"/proc/{taker}").exists() else _opener(folder) or taker
    except (OSError, ValueError, IndexError):
        pass
    return None


def _opener(folder: Path) -> int | None:
    """A process of this user with `folder` open (as `fuser` finds it), else None."""
    target = str(folder)
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                return int(fd_dir.parent.name)
        except OSError:  # (another user's process, or one that just ended)
            continue
    return None


def check_run_dir(cfg: Any) -> None:
    """OUT (`cfg.out`) suits the run: a new run needs one without a run (or `cfg.overwrite`),
    `cfg.resume` a previous run."""
    run_dir = Path(cfg.out)
    _refuse_file(run_dir)
    if cfg.resume and not has_run(run_dir):
        raise FrawdError(f"{run_dir}: no run to resume")
    if has_run(run_dir) and not cfg.resume and not cfg.overwrite:
        raise FrawdError(existing_run_message(run_dir))
    if has_run(run_dir) and not cfg.resume:  # --overwrite: would it delete the model the run starts from?
        for flag, start in (("--init-from", getattr(cfg, "init_from", None)), ("--init", getattr(cfg, "init", None))):
            if start and any(is_inside(start, run_dir / name) for name in RUN_DIRS):
                raise FrawdError(f"{flag} {start} lies inside --out {run_dir}, whose run --overwrite deletes; "
                                 "copy the model elsewhere first, or give another --out")
    found = list_checkpoints(run_dir) if cfg.resume else []
    if found:
        _refuse_fixed_changes(cfg, run_dir)
    if found and cfg.max_steps and found[-1][0] >= cfg.max_steps:  # (tokens and time: Trainer.fit)
        raise FrawdError(budget_spent(run_dir, f"{found[-1][0]} steps of --max-steps {cfg.max_steps}"))


def rerun_line(command: str, run_dir: Path, world_size: int = 1) -> str:
    """config.yaml's first line: the command that runs the run again (on as many ranks)."""
    ranks = f" --nproc {world_size}" if world_size > 1 else ""
    return f"# rerun: frawd {command}{ranks} --config {shlex.quote(str(run_dir / CONFIG_FILE))} --out NEW_DIR\n"


def save_run_config(cfg: Any, command: str, world_size: int, about: str, is_main: bool) -> None:
    """OUT/config.yaml (rank 0 writes it): the run's merged config, paths absolute, without
    this start's resume/overwrite, under a header of the command that reruns it, the versions and
    `about` (the model and data in a few words)."""
    if not is_main:
        return
    import torch

    from .. import __version__
    from .config import dump_yaml

    run_dir = Path(cfg.out)
    # OUT absolute too, in the config and in the header: `--config OUT/config.yaml --resume`
    # from another folder finds the run
    out = os.path.abspath(run_dir)
    header = rerun_line(command, Path(out), world_size) + \
        f"# frawdllm {__version__}, torch {torch.__version__}; {about}\n"
    streams = [name for name in PATH_FIELDS if _is_stream(getattr(cfg, name, None))]
    if streams:  # (`<(zcat ...)`: its /dev/fd path means nothing once this command ends)
        flags = ", ".join("--" + name.replace("_", "-") for name in streams)
        header += f"# {flags} {'was a pipe' if len(streams) == 1 else 'were pipes'} (read once): give " \
                  f"{'it' if len(streams) == 1 else 'them'} again to rerun or --resume\n"
    saved = type(cfg).from_dict({**absolute_paths(cfg.to_dict()), "out": out, "resume": False, "overwrite": False})
    write_text_atomic(run_dir / CONFIG_FILE, dump_yaml(saved, header))


# Settings that name files or folders: config.yaml keeps them absolute (and `out`:
# save_run_config), so that a --resume or a rerun from another working directory finds them.
PATH_FIELDS = ("data", "init_from", "init", "tokenizer", "src", "tgt", "valid_src", "valid_tgt")


def _is_stream(value: Any) -> bool:
    """A path that names a pipe or a device (a FIFO, `/dev/fd/63` of `<(...)`), not a file or folder."""
    if not isinstance(value, str) or not value:
        return False
    try:
        mode = os.stat(value).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each path in PATH_FIELDS as `resolved_source` writes a data source
    (absolute; built-in corpora and `hf:` names as given); tokenizer kinds (`bpe`, ...) are no paths."""
    from ..data.shards import resolved_source
    from ..tokenizer import KINDS

    return {key: resolved_source(value) if key in PATH_FIELDS and isinstance(value, str)
            and not (key == "tokenizer" and value in KINDS) else value for key, value in values.items()}


def budget_spent(run_dir: Path, done: str) -> str:
    """The message for a --resume with nothing left to do (`done`: what was used of what)."""
    return f"{run_dir}: the budget is already spent ({done}); give --resume a larger budget to continue"


def has_run(run_dir: Path, names: tuple[str, ...] = RUN_FILES + RUN_DIRS) -> bool:
    return any((Path(run_dir) / name).exists() for name in names)


def checkpoints_gone(run_dir: Path) -> str | None:
    """What a run without any checkpoint had done, where it had done more than a run killed
    before its first one: an evaluation after step 0 comes with a checkpoint, so they were
    deleted since (to save space, say). Its model/ is then the only copy of what it learned,
    and starting over would delete it. None otherwise; also for a run killed while writing
    its first checkpoint (a partial one is there, and no step was logged after the
    evaluation it follows)."""
    if latest_checkpoint(run_dir) is not None or damaged_checkpoint(run_dir) is not None:
        return None
    records = [r for r in read_metrics(run_dir) if isinstance(r.get("step"), int)]
    evaluated = [r["step"] for r in records if r["step"] > 0 and any(key.startswith("val_") for key in r)]
    if not evaluated:
        return None
    went_on = any("loss" in r and r["step"] > min(evaluated) for r in records)  # (past a complete checkpoint)
    folder = run_dir / CHECKPOINTS_DIR
    writing = folder.is_dir() and any(partial_write(entry.name) for entry in folder.iterdir())
    if writing and not went_on:
        return None
    last = max(evaluated)
    published = (run_dir / BEST_MODEL_DIR).is_dir()
    return (f"evaluated up to step {last}" + (f" and published {run_dir / BEST_MODEL_DIR}" if published else "")
            + ", but its checkpoints are gone")


def existing_run_message(run_dir: Path) -> str:
    """Why a new run may not start in `run_dir`, which holds one, and what to do instead (a
    run still going there is not told apart by its files: it "stopped before its first
    checkpoint" while it made it)."""
    if (holder := lock_holder(run_dir)) not in (None, os.getpid()):  # (this process's own hold: its earlier run)
        return (f"{run_dir} is in use by another run (process {holder}): wait for it to end or stop it, or give "
                "another --out")
    if latest_checkpoint(run_dir) is not None:
        return f"{run_dir} already holds a run; --resume continues it, --overwrite starts over, or give another --out"
    if (damage := damaged_checkpoint(run_dir)) is not None:  # (--resume refuses it: not "starts it over")
        return (f"{run_dir} holds a run whose checkpoint is incomplete ({damage}); restore the file and --resume, "
                "--overwrite starts over, or give another --out")
    if (gone := checkpoints_gone(run_dir)) is not None:
        return f"{run_dir} holds a run that {gone}; --overwrite starts over, or give another --out"
    return (f"{run_dir} holds a run that stopped before its first checkpoint; --resume or --overwrite starts "
            "it over, or give another --out")


def _refuse_file(run_dir: Path) -> None:
    """One line when OUT, or the nearest folder above it that exists, is a file."""
    if run_dir.exists() and not run_dir.is_dir():
        raise FrawdError(f"--out {run_dir} is a file, not a folder")
    above = next((folder for folder in run_dir.parents if folder.exists()), None)
    if above is not None and not above.is_dir():  # (the OS says "not a directory: OUT")
        raise FrawdError(f"--out {run_dir}: {above} is a file, not a folder")


def make_run_dir(run_dir: Path) -> None:
    """Create OUT and the folders above it; one line, with the OS's reason, where it cannot
    be created (a read-only disk, /proc), instead of an OSError naming OUT as if it were missing."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = (error.strerror or str(error) or type(error).__name__).lower()
        raise FrawdError(f"--out {run_dir}: cannot create the folder there ({reason})") from None


def settle_run_dir(run_dir: Path, resume: bool, overwrite: bool,
                   names: tuple[str, ...] = RUN_FILES + RUN_DIRS) -> bool:
    """Make `run_dir` ready for a run, by the rules every way of starting one follows (`frawd
    pretrain`, `Trainer` used directly), so two runs never mix; returns whether the run resumes.

    An earlier run there (any of `names`) is continued with `resume`, deleted with `overwrite`,
    and otherwise refused; a `resume` of a run killed before its first complete checkpoint has
    nothing to continue, so it starts over."""
    _refuse_file(run_dir)
    if not has_run(run_dir, names):
        return resume
    if resume and latest_checkpoint(run_dir) is not None:
        return True
    if resume and not overwrite and (damage := damaged_checkpoint(run_dir)) is not None:
        # a run with checkpoints, one of them damaged: never deleted for a start over
        raise FrawdError(f"{run_dir}: no complete checkpoint to resume from: {damage}; the run is left as it "
                         "is (restore the file, or --overwrite starts the run over)")
    if resume and not overwrite and (gone := checkpoints_gone(run_dir)) is not None:
        # a trained run whose checkpoints were deleted: starting over would delete its model too
        further = (f"{run_dir / BEST_MODEL_DIR} can start a new run in another --out: pretrain --init-from, sft "
                   "and dpo --init; " if (run_dir / BEST_MODEL_DIR).is_dir() else "")
        raise FrawdError(f"{run_dir}: nothing to resume from: the run {gone}; the run is left as it is "
                         f"({further}--overwrite starts over)")
    if resume:
        print(f"{run_dir}: no complete checkpoint to resume from; starting the run over", file=sys.stderr, flush=True)
    elif not overwrite:
        raise FrawdError(existing_run_message(run_dir))
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return False


def prepare_run_dir(cfg: Any) -> Path:
    """OUT, checked (`check_run_dir`), emptied of an earlier run with --overwrite, created. A
    --resume of a run killed before its first complete checkpoint starts it over (`cfg` is
    changed to say so)."""
    check_run_dir(cfg)
    run_dir = Path(cfg.out)
    resumes = settle_run_dir(run_dir, cfg.resume, cfg.overwrite)
    if cfg.resume and not resumes:  # started over: from here on a new run
        cfg.resume, cfg.overwrite = False, True
    if cfg.resume:
        _note_changed_settings(cfg, run_dir)
    make_run_dir(run_dir)
    return run_dir


# Settings a resumed run is expected to change (a larger budget) or that do not shape it.
RESUME_FREE = {"resume", "overwrite", "max_steps", "max_tokens", "max_time", "progress", "out", "dist_timeout",
               "eval_interval", "log_interval", "keep_last", "device", "parallel", "wandb", "wandb_project",
               "tensorboard", "peak_tflops"}
# Settings the checkpoint's weights (or the run's tokenizer and shards) are made for: fixed once trained.
# And the seed: the data order of the epoch a run stopped in is drawn from it (SFT, DPO and
# translation redraw it on resume, so another seed repeats and skips examples mid-epoch).
RESUME_FIXED = {"preset", "model", "vocab_size", "tokenizer", "init_from", "init", "lora_rank", "lora_alpha",
                "seed"}


def _changed_settings(cfg: Any, run_dir: Path) -> dict[str, tuple[Any, Any]]:
    """{setting: (value saved in the run's config.yaml, value now)} for what a --resume changes."""
    from .config import load_config_file

    try:
        saved = load_config_file(run_dir / CONFIG_FILE)
    except FrawdError:
        return {}
    typed_now, typed_saved = absolute_paths(cfg.to_dict()), absolute_paths(saved)
    now, saved = cfg.effective(cfg.to_dict()), cfg.effective(saved)  # (defaults that depend on others, resolved)
    # (paths compared as resolved: written another way then, or given from elsewhere now, the same file)
    resolved_now, resolved_saved = absolute_paths(now), absolute_paths(saved)
    # A change as typed and as used: the default typed is none, nor is a default that moved with
    # another setting (lora_alpha unset, with --lora-rank 0: "lora_alpha=None (the run has 8)").
    return {key: (saved[key], now[key]) for key in now
            if key in saved and key not in RESUME_FREE and resolved_now[key] != resolved_saved[key]
            and typed_now.get(key) != typed_saved.get(key)}


def _refuse_fixed_changes(cfg: Any, run_dir: Path) -> None:
    """A --resume that changes what the checkpoint was trained as (the model, its tokenizer)
    cannot load it: refused before anything is written, so the run stays resumable."""
    fixed = {k: v for k, v in _changed_settings(cfg, run_dir).items() if k in RESUME_FIXED}
    refuse_fixed(cfg, run_dir, _each_change(cfg, fixed))


def refuse_fixed(cfg: Any, run_dir: Path, changes: list[tuple[str, Any, Any]]) -> None:
    """One line for a --resume whose `changes` ((setting, value then, value now)) are to what
    the run was trained as; `cfg` a config, or its class, for the advice."""
    if changes:
        listed = ", ".join(f"{key}={new!r} ({'not set in the run' if old is None else f'the run has {old!r}'})"
                           for key, old, new in changes)
        raise FrawdError(f"{run_dir}: --resume continues the run's own model, tokenizer and data order; "
                         f"these settings differ: {listed}; drop them, or {_new_run_advice(cfg, run_dir)}")


def _each_change(cfg: Any, settings: dict[str, tuple[Any, Any]]) -> list[tuple[str, Any, Any]]:
    """(setting, value then, value now) for each of `settings`; the model's overrides of the
    preset compared as the values they give (another way to write the same model is no change)."""
    changes = []
    for key, (old, new) in settings.items():
        if key == "model":
            preset_now = getattr(cfg, "preset", None)
            preset_then = settings["preset"][0] if "preset" in settings else preset_now
            values = _model_values(preset_then, old, preset_now, new)
            if values is not None:
                changes += [(name, then, now) for name, (then, now) in values.items()]
                continue
        changes.append((key, old, new))
    return changes


def _model_values(preset_then: Any, then: Any, preset_now: Any, now: Any) -> dict[str, tuple[Any, Any]] | None:
    """{field: (the run's value, the value now)} for the model fields whose effective values
    (the preset with its overrides) differ; None where they cannot be worked out."""
    from ..config import config_class, get_config, typed_overrides

    def effective(preset: Any, overrides: Any) -> dict[str, Any]:
        return get_config(preset, **typed_overrides(config_class(preset), overrides)).settings()

    if not (isinstance(then, dict) and isinstance(now, dict) and isinstance(preset_then, str)
            and isinstance(preset_now, str)):
        return None
    try:
        old, new = effective(preset_then, then), effective(preset_now, now)
    except Exception:  # an override the run's own code would refuse: shown as given
        return None
    return {name: (old.get(name), new[name]) for name in new if old.get(name) != new[name]}


def _new_run_advice(cfg: Any, run_dir: Path) -> str:
    """How this command starts a new run, from the run's model where it can (pretrain:
    --init-from, sft and dpo: --init; translate train has neither)."""
    for flag, field in (("--init-from", "init_from"), ("--init", "init")):
        if hasattr(cfg, field):
            return f"start a new run ({flag} {run_dir / BEST_MODEL_DIR} trains its model further)"
    return "start a new run (another --out, or --overwrite to replace this one)"


def _note_changed_settings(cfg: Any, run_dir: Path) -> None:
    """Say which settings of a resumed run differ from those it was started with (its
    config.yaml): flags override the saved config, so other data or another learning rate
    take effect from here on, which should not go unnoticed."""
    changed = [f"{key}={new!r} (was {old!r})" for key, old, new in _each_change(cfg, _changed_settings(cfg, run_dir))]
    if changed:
        print(f"{run_dir}: resuming with settings that differ from its {CONFIG_FILE}: {', '.join(changed)}",
              file=sys.stderr, flush=True)


START_BACKUP_DIR = ".start-backup"  # what a --resume's or --overwrite's start may replace, until it has succeeded


@contextmanager
def undo_failed_start(cfg: Any, enabled: bool = True, keep: tuple[str, ...] = ()) -> Iterator[Path]:
    """Wraps a run's start: if it raises, the folders it created are removed, else the
    config.yaml it wrote (reusable data such as a tokenizer and shards stays). `enabled`
    False (ranks other than 0, which write nothing) leaves everything in place.

    A --resume's or --overwrite's start leaves an earlier run as it was: its outputs and the
    names in `keep` (e.g. the run's own data/ and tokenizer.json, which other --data
    replaces) are put back, so a plain --resume still continues it (an --overwrite whose data
    was then refused deleted the run it was to replace)."""
    run_dir = Path(cfg.out)
    created = None  # the outermost folder this start creates
    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            break
        created = folder
    if enabled:  # (refused: another run's folder, left as it is)
        claim_run_dir(run_dir)
    # What the start may replace: a resume's config.yaml and `keep`; everything when the start
    # deletes the run (--overwrite, or a resume with no checkpoint, which starts over).
    deletes = cfg.overwrite or latest_checkpoint(run_dir) is None
    names = (*RUN_FILES, *RUN_DIRS, *keep) if deletes else (CONFIG_FILE, *keep)
    backup = _back_up(run_dir, names) if enabled and (cfg.resume or cfg.overwrite) and created is None \
        and run_dir.is_dir() else None
    try:
        yield run_dir
    except BaseException:
        if not enabled:
            raise
        release_run_dir(run_dir)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif backup is not None:
            _restore(run_dir, backup, names)
        elif not cfg.resume and not (run_dir / CHECKPOINTS_DIR).exists():
            (run_dir / CONFIG_FILE).unlink(missing_ok=True)
        raise
    finally:
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where it can (the files are replaced by renames, never rewritten in place), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _back_up(run_dir: Path, names: tuple[str, ...]) -> Path:
    """`names` of `run_dir` as they are now, in a backup folder inside it."""
    backup = run_dir / START_BACKUP_DIR
    shutil.rmtree(backup, ignore_errors=True)  # one left by a killed start
    backup.mkdir()
    for name in names:
        path = run_dir / name
        if path.is_dir():
            shutil.copytree(path, backup / name, copy_function=_link_or_copy, symlinks=True)
        elif path.is_file():
            _link_or_copy(str(path), str(backup / name))
    return backup


def _restore(run_dir: Path, backup: Path, names: tuple[str, ...]) -> None:
    """Put `names` back as `_back_up` saved them (a name that was not there is removed)."""
    for name in names:
        path, saved = run_dir / name, backup / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        if saved.exists():
            os.replace(saved, path)


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


WANDB_ID_FILE = "wandb/frawd-run-id"


def _wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of this run directory, made on its first start and kept, so that each
    --resume continues the same W&B run (without one, every session was a new run)."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8").strip()
    run_id = secrets.token_hex(4)  # (W&B ids: lowercase letters and digits)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, run_id + "\n")
    return run_id


class MetricsLog:
    """Appends metric lines to metrics.jsonl and forwards them to the optional loggers."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "frawdllm", config: dict | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.file = open(self.path, "a", encoding="utf-8")
        self.tb = self.wb = self._tensorboard = None
        self._purge_step: int | None = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise FrawdError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            # (made at the first line: a resume first says where it goes on, see `rewind`)
            self._tensorboard = lambda purge_step: SummaryWriter(str(Path(run_dir) / "tensorboard"),
                                                                 purge_step=purge_step)
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                raise FrawdError("--wandb needs the wandb package: pip install wandb") from None
            os.environ.setdefault("WANDB_MODE", "offline")
            self.wb = wandb_lib.init(project=wandb_project, dir=str(run_dir), config=config,
                                     name=Path(run_dir).name, id=_wandb_run_id(Path(run_dir)), resume="allow")

    def rewind(self, step: int) -> None:
        """A resume from the checkpoint of `step`: the steps after it are computed again, and
        TensorBoard hides what it was told of them before (the session a kill -9 ended
        logged them; metrics.jsonl drops them itself, `truncate_metrics`)."""
        self._purge_step = step + 1

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        if self.tb is None and self._tensorboard is not None:
            self.tb = self._tensorboard(self._purge_step)
        step = record.get("step", 0)
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, step)
        if self.wb is not None:
            self.wb.log(numbers, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a kill
    return records


def truncate_metrics(run_dir: Path, after_step: int) -> None:
    """Drop lines logged after `after_step`: a resumed run logs those steps again."""
    kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= after_step]
    write_text_atomic(Path(run_dir) / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))


def _home_config_writable() -> bool:
    """Whether matplotlib's default config folder (~/.config/matplotlib) is, or can be made,
    writable."""
    try:
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    except (RuntimeError, KeyError):  # no home at all
        return False
    folder = base / "matplotlib"
    if folder.is_dir():
        return os.access(folder, os.W_OK)
    existing = next((p for p in folder.parents if p.exists()), None)
    return existing is not None and existing.is_dir() and os.access(existing, os.W_OK)


def load_pyplot():
    """matplotlib's pyplot on the file-only Agg backend, imported on first use (it takes
    about a second: the loop imports it before training, inside --max-time when the
    budget started with the process, as under `frawd pretrain`). Without a writable home
    (`docker run -u 12345`, a read-only home) its config and font cache go to FrawdLLM's
    cache folder, rather than a temporary one with a warning at every run."""
    if "MPLCONFIGDIR" not in os.environ and "matplotlib" not in sys.modules and not _home_config_writable():
        from ..cbuild import cache_dir

        folder = cache_dir().parent / "matplotlib"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            os.environ["MPLCONFIGDIR"] = str(folder)
        except OSError:
            pass  # (matplotlib's own fallback, and its warning)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


LOOP_KEYS = frozenset({"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "elapsed_s"})


def task_metric_names(records: list[dict[str, Any]]) -> list[str]:
    """The named metrics a task logged beside its training loss (e.g. `rewards/margins`)."""
    names: dict[str, None] = {}
    for r in records:
        if "loss" in r:
            names.update((k, None) for k, v in r.items()
                         if k not in LOOP_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool))
    return list(names)


def metric_panels(names: list[str]) -> list[tuple[str, list[str]]]:
    """The task metrics grouped by their prefix (`rewards/margins` -> `rewards`), one panel a
    group: log-probabilities (tens of nats) and rewards (about 1) share no useful scale."""
    panels: dict[str, list[str]] = {}
    for name in names:
        prefix, sep, _ = name.partition("/")
        panels.setdefault(prefix if sep else "task metrics", []).append(name)
    return list(panels.items())


def plot_losses(run_dir: Path, unit: str = "nats/token") -> None:
    """Draw loss.png from metrics.jsonl: the training loss (in `unit`) and the validation
    points; below them, if the task logs named metrics, one panel per group of them
    (their `val_` values as points)."""
    plt = load_pyplot()

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    panels = metric_panels(task_metric_names(records))
    fig, axes = plt.subplots(1 + len(panels), 1, figsize=(7, 4 + 3 * len(panels)), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({unit})")
    ax.set_title(Path(run_dir).resolve().name)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    for row, (title, names) in enumerate(panels, start=1):
        ax = axes[row][0]
        for i, name in enumerate(names):
            color = f"C{i % 10}"
            points = [(r["step"], r[name]) for r in records if r.get(name) is not None and "loss" in r]
            if points:
                ax.plot(*zip(*points), label=name, linewidth=1, color=color)
            points = [(r["step"], r[f"val_{name}"]) for r in records if r.get(f"val_{name}") is not None]
            if points:
                ax.plot(*zip(*points), "o", color=color, markersize=4)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{title} (points: validation)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    with atomic_path(Path(run_dir) / PLOT_FILE) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


_SAMPLE_HEADER = re.compile(r"=== step (\d+) sample \d+ ===\n")


def truncate_samples(run_dir: Path, after_step: int) -> None:
    """Drop samples written after `after_step`: a resumed run writes those again."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    cut = next((m.start() for m in _SAMPLE_HEADER.finditer(text) if int(m.group(1)) > after_step), None)
    if cut is not None:
        write_text_atomic(path, text[:cut])


def append_samples(run_dir: Path, step: int, samples: list[str]) -> None:
    with open(Path(run_dir) / SAMPLES_FILE, "a", encoding="utf-8") as f:
        for i, text in enumerate(samples):
            f.write(f"=== step {step} sample {i} ===\n{text}\n\n")
