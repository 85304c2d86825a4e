"""Checkpoints: a model directory plus the training state, written so a kill never hurts.

    OUT/checkpoints/step_00001000/
        model/      a model directory (config.json, model.safetensors, tokenizer.json):
                    usable by every command as it is
        state.pt    optimizer moments, schedule, step/token/time counters, RNG states,
                    data loader position: tensors and plain values only, read back with
                    `torch.load(weights_only=True)` (never unpickled code)
        files.json  the files written (a task's own `save_model` may write others than
                    a model directory's), each with its size and CRC-32, checked at --resume

A checkpoint is built in a hidden temporary folder and renamed into place when complete
(`io.atomic_dir`), so a kill at any moment leaves the earlier checkpoints intact and at
worst a stray temporary folder, which is ignored and cleaned up at the next start (as
are the best model's and every other temporary file in OUT). Only
folders named step_N holding every file files.json lists count as checkpoints (a folder
from before files.json: state.pt, model/config.json and model/model.safetensors).
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ..errors import FrawdError, first_line
from ..io import atomic_dir, clean_partial
from ..modeldir import CONFIG_FILE, WEIGHTS_FILE, readable

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "state.pt"
MODEL_SUBDIR = "model"
FILES_FILE = "files.json"
_NAME = re.compile(r"step_(\d+)")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:08d}"


def save_checkpoint(run_dir: Path, step: int, save_model: Callable[[Path], object], state: dict) -> Path:
    """Write checkpoint `step` atomically: `save_model(dir)` writes the model directory."""
    path = checkpoint_path(run_dir, step)
    with atomic_dir(path, overwrite=True) as tmp:
        save_model(tmp / MODEL_SUBDIR)
        torch.save(state, tmp / STATE_FILE)
        list_files(tmp)
    return path


def list_files(folder: Path) -> None:
    """Write files.json: the files of a checkpoint being built in `folder`, the last step
    before it is renamed into place (what `_missing_files` checks against), each with its
    size and CRC-32 (what `check_unchanged` checks against)."""
    written = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    written = [name for name in written if name != FILES_FILE]  # (listed again: not itself)
    files = {name: {"bytes": (folder / name).stat().st_size, "crc32": _crc32(folder / name)} for name in written}
    (folder / FILES_FILE).write_text(json.dumps(files, indent=1), encoding="utf-8")


def _crc32(file: Path) -> str:
    """The file's CRC-32 (zlib's: ~2.5 GB/s, a small share of a checkpoint's save; it finds
    damage, not tampering), as 8 hex digits."""
    crc = 0
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 23), b""):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _listed(path: Path) -> dict | list | None:
    """files.json of the checkpoint folder `path`: a mapping name -> {"bytes", "crc32"}, a
    list of names (a checkpoint of an earlier FrawdLLM), or None where it is missing or damaged."""
    try:
        listed = json.loads((path / FILES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(listed, (dict, list)) and STATE_FILE in listed and all(_inside(name) for name in listed):
        return listed
    return None


def _inside(name: object) -> bool:
    """`name` is a path inside the checkpoint folder (not /dev/zero, not ../../x)."""
    if not isinstance(name, str):
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


def check_unchanged(path: Path) -> None:
    """Refuse a checkpoint whose files changed since it was written (a damaged disk or copy:
    weights that differ in a few bytes load, and trained to NaN), by the size and CRC-32
    files.json records (a checkpoint without them passes)."""
    listed = _listed(path)
    if not isinstance(listed, dict):
        return
    for name, recorded in listed.items():
        if not isinstance(recorded, dict):
            continue
        file = path / name
        size, crc, now = recorded.get("bytes"), recorded.get("crc32"), file.stat().st_size
        if isinstance(size, int) and now != size:
            changed = f"{now:,} bytes, not the {size:,} written"
        elif isinstance(crc, str) and _crc32(file) != crc:
            changed = "its CRC-32 differs from the one recorded when it was written"
        else:
            continue
        raise FrawdError(f"{file}: changed since the checkpoint was written ({changed}: a damaged disk or copy)")


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = _NAME.fullmatch(path.name)
            if match and not _missing_files(path):
                found.append((int(match.group(1)), path))
    return sorted(found)


def _missing_files(path: Path) -> list[str]:
    """What a checkpoint folder lacks of a complete checkpoint's files: those files.json lists
    (without it, or where it is damaged: a model directory's two and state.pt)."""
    listed = _listed(path)
    if listed is None:
        listed = [STATE_FILE, f"{MODEL_SUBDIR}/{WEIGHTS_FILE}", f"{MODEL_SUBDIR}/{CONFIG_FILE}"]
    return [name for name in listed if not (path / name).is_file()]


def damaged_checkpoint(run_dir: Path) -> str | None:
    """What is missing from the newest checkpoint folder that is not complete ("step_N lacks
    state.pt"), None when there is none. Checkpoints are written whole and renamed into
    place, so such a folder was damaged afterwards (copied without its large state.pt)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    named = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.fullmatch(p.name))) \
        if root.is_dir() else []
    for _, path in reversed(named):
        missing = _missing_files(path)
        if missing:
            return f"{path} lacks {' and '.join(missing)}"
    return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def remove_partial(run_dir: Path) -> None:
    """Tidy what killed writes left in the run directory and its checkpoints folder:
    temporary checkpoint folders, the best model's temporary folder, half-written files."""
    clean_partial(run_dir)
    clean_partial(Path(run_dir) / CHECKPOINTS_DIR)


def prune(run_dir: Path, keep_last: int, keep_steps: set[int]) -> None:
    """Keep the newest `keep_last` checkpoints and those of `keep_steps` (the best)."""
    found = list_checkpoints(run_dir)
    for step, path in found[:-keep_last] if keep_last else found:
        if step not in keep_steps:
            if path.is_symlink():  # (a checkpoint linked in from elsewhere: the link goes, not what it names)
                path.unlink()
            else:
                shutil.rmtree(path)


def load_state(path: Path) -> dict:
    file = Path(path) / STATE_FILE
    try:
        with warnings.catch_warnings():  # (a foreign pickle's protocol is warned about before it is refused)
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # refused by the weights-only reader (torch's own message suggests turning it off)
        raise FrawdError(f"{file}: cannot read the training state: it holds objects other than tensors and plain "
                         "values, which are not loaded (a damaged or tampered file)") from None
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, IndexError) as exc:
        detail = "not a file torch.save wrote" if isinstance(exc, (KeyError, IndexError)) else \
            first_line(exc, type(exc).__name__)  # (an EOFError has no text)
        raise FrawdError(f"{file}: cannot read the training state ({detail})") from None
    if not isinstance(state, dict):
        raise FrawdError(f"{file}: not a training state (a {type(state).__name__}, not a dict)")
    return state


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Load a model directory's weights into `model` in place (its config must match)."""
    file = Path(model_dir) / WEIGHTS_FILE
    try:
        state = load_file(str(readable(file)))
    except (SafetensorError, OSError) as exc:
        raise FrawdError(f"{file}: not a readable safetensors file ({exc})") from None
    expected = model.state_dict()
    # A tied head is stored once (as the embedding); it comes back through the shared tensor.
    tied = {name for name, t in expected.items()
            if any(t.data_ptr() == u.data_ptr() and other != name for other, u in expected.items())}
    missing = set(expected) - set(state) - tied
    unexpected = set(state) - set(expected)
    bad_shape = [k for k in set(state) & set(expected) if state[k].shape != expected[k].shape]
    if missing or unexpected or bad_shape:
        raise FrawdError(f"{file}: weights do not fit this model (missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}, wrong shape {sorted(bad_shape)[:3]})")
    model.load_state_dict(state, strict=False)
