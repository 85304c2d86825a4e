"""Atomic file writes: nothing is ever left half-written.

Every file FrawdLLM writes goes to a temporary name in the same folder first and is
renamed into place (`os.replace` is atomic on POSIX), so a crash or a kill leaves
either the old file or the new one, never a torn one. A folder of files (an export) is
built the same way: in a temporary folder beside the target, renamed at the end.

The temporary names are private (mode 0600/0700) while being written; what is renamed
into place gets the permissions a plain `open()` or `mkdir()` would give (0666/0777 less
the umask). A write that fails removes its temporary file and any folder it created,
and a full disk (or quota, or file size limit) is reported as one line naming the file.

Durable, not only atomic: a rename is atomic for the running system, but after a power
loss or a kernel crash the new name can point at a file whose data never reached the
disk (an empty or torn checkpoint). So before the rename the new file's data (for a
folder: every file and folder in it) is flushed with `os.fsync`, and after it the
folder holding the new name, as SQLite and git do. A disk that fills up while the data
is written back shows up here too (the delayed write fails at the fsync) and is
reported like any full disk. `FRAWD_FSYNC=0` skips the flushes (a scratch disk, a slow
network filesystem): still atomic, no longer durable.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import FrawdError


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (threads may be writing)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish_mode(path: Path, directory: bool) -> None:
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


def _fsync_wanted() -> bool:
    return os.environ.get("FRAWD_FSYNC", "1") != "0"


def sync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to the disk. Folders that cannot be
    opened for it (Windows) are skipped: there a rename is as durable as it gets."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0))
    except (PermissionError, IsADirectoryError):
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # (a full disk found here is named by the file, for the message)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    finally:
        os.close(fd)


def _sync_tree(root: Path) -> None:
    """fsync every file and folder below `root`, then `root` (children before parents)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink():
                sync_path(path)
        sync_path(Path(folder))


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    device = path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == device:
        path = path.parent
    return path


_FULL_TEXTS = {"No space left on device": errno.ENOSPC, "os error 28": errno.ENOSPC,
               "Disk quota exceeded": errno.EDQUOT, "os error 122": errno.EDQUOT,
               "File too large": errno.EFBIG, "os error 27": errno.EFBIG}


def _full_errno(exc: BaseException | None) -> int | None:
    """ENOSPC, EDQUOT or EFBIG if `exc` (or an exception it was raised from) says the disk,
    a quota or the file size limit is full; libraries such as safetensors wrap the OSError
    in their own type, or keep only its text."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return exc.errno
        text = str(exc)
        for marker, code in _FULL_TEXTS.items():
            if marker in text:
                return code
        exc = exc.__cause__ or exc.__context__
    return None


def is_disk_full(exc: BaseException) -> bool:
    """True if `exc` says the disk, a quota or the file size limit is full."""
    return _full_errno(exc) is not None


def _nearly_full(folder: Path) -> bool:
    """Less than 1 MiB left where `folder` is: what a write that failed there ran into
    (some writers report a short write without the errno)."""
    try:
        vfs = os.statvfs(folder)
    except OSError:
        return False
    return vfs.f_bavail * vfs.f_frsize < 2**20


def _failed_file(exc: BaseException, path: Path) -> Path:
    """The file a write that found the disk full was writing: `path`, or the file beside it
    that its OSError names (our temporary name read as the name it stands for). With two
    files written at once (train.bin and val.bin) this names the one the disk filled up on.
    The OSError may be one that `exc` was raised from or during (closing a file flushes it
    again, and fails again naming no file)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = exc.filename if isinstance(exc, OSError) and _full_errno(exc) is not None else None
        if isinstance(name, str) and os.path.abspath(Path(name).parent) == os.path.abspath(path.parent):
            match = _PARTIAL.fullmatch(Path(name).name)
            return path.parent / (match["name"] if match else Path(name).name)  # (spelled as the caller did)
        exc = exc.__cause__ or exc.__context__
    return path


def _write_error(exc: BaseException, path: Path) -> FrawdError | None:
    """The one-line error for a write into `path` that failed for lack of room (disk,
    quota, file size limit), or None if it failed for another reason. An error already
    worded (a FrawdError, by an inner write) passes through unchanged."""
    if isinstance(exc, FrawdError) or not isinstance(exc, Exception):
        return None
    path = _failed_file(exc, path)
    if is_disk_full(exc):
        return disk_full_error(path, exc)
    # (torch.save's writer reports a short write as a RuntimeError without the errno:
    # "[enforce fail at inline_container.cc:672] . unexpected pos 42048 vs 41940", or
    # "file write failed")
    torch_writer = isinstance(exc, RuntimeError) and any(
        text in str(exc) for text in ("PytorchStreamWriter", "unexpected pos", "file write failed"))
    if (isinstance(exc, OSError) or torch_writer) and _nearly_full(path.parent):
        return disk_full_error(path)
    if torch_writer:  # (also an I/O error, a stale NFS handle: its text is kept)
        said = " ".join(str(exc).split())[:200]
        return FrawdError(f"could not write {path}: the write stopped short with space left on "
                          f"{_mount_point(path)} (a disk quota or the file size limit, `ulimit -f`?): {said}")
    return None


def disk_full_error(path: str | os.PathLike, exc: BaseException | None = None) -> FrawdError:
    """"no space left on MOUNT while writing PATH", or the quota or file size limit that
    `exc` names."""
    code = _full_errno(exc)
    if code == errno.EDQUOT:
        return FrawdError(f"disk quota exceeded on {_mount_point(Path(path))} while writing {path}")
    if code == errno.EFBIG:
        return FrawdError(f"file size limit reached while writing {path} (`ulimit -f`, or the "
                          "filesystem's largest file)")
    return FrawdError(f"no space left on {_mount_point(Path(path))} while writing {path}")


def _refuse_dangling_link(path: str | os.PathLike) -> None:
    """Refuse to write at or below a symbolic link whose target does not exist: it cannot
    be written through, and replacing it would delete what the user made."""
    for link in (Path(path), *Path(path).parents):
        if link.is_symlink() and not link.exists():
            raise FrawdError(f"{link} is a symbolic link to {os.readlink(link)}, which does not exist: "
                             "remove the link or choose another path")


def _missing_parents(path: Path) -> list[Path]:
    """The folders above `path` that do not exist yet, outermost first."""
    missing = []
    for parent in path.parents:
        if os.path.lexists(parent):  # (a link counts: it is there, even if its target is not)
            break
        missing.append(parent)
    return missing[::-1]


def new_folders(path: str | os.PathLike) -> list[Path]:
    """`path` and the folders above it that do not exist yet, outermost first; a link to
    nowhere in the way is one line (nothing can be made through it)."""
    path = Path(path)
    _refuse_dangling_link(path)
    return _missing_parents(path) + ([] if os.path.lexists(path) else [path])


@contextmanager
def undo_on_error(path: str | os.PathLike, created: list[Path] | None = None) -> Iterator[None]:
    """If the block fails, remove `path` and the folders above it that did not exist
    before the block (a failed write leaves no empty folders behind); a full disk becomes
    one clear FrawdError. `created`: those folders, when the caller made them just before
    the block (`new_folders` looked first)."""
    path = Path(path)
    _refuse_dangling_link(path)
    created = new_folders(path) if created is None else created
    try:
        yield
    except BaseException as exc:
        for folder in reversed(created):
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder, ignore_errors=True)
            elif folder.exists() or folder.is_symlink():
                folder.unlink(missing_ok=True)
        if isinstance(exc, Exception) and not isinstance(exc, FrawdError) and is_disk_full(exc):
            raise disk_full_error(_failed_file(exc, path), exc) from None
        raise


@contextmanager
def _disk_full_as_one_line(path: Path) -> Iterator[None]:
    """A write into `path`'s folder that failed for lack of room becomes one line."""
    try:
        yield
    except Exception as exc:
        error = _write_error(exc, path)
        if error is None:
            raise
        try:
            raise error from None
        finally:
            # a local naming the raised error is a cycle through its traceback, which kept
            # the failed writer's open file on the full disk until a garbage collection
            del error


def _temporary_in(make: Any, path: Path) -> str:
    """`make(prefix=.., suffix=".tmp", dir=..)` (tempfile.mkstemp or mkdtemp) beside `path`. If
    it fails (an unwritable folder), the OSError names `path`, the name the caller asked for,
    not the private temporary name; errno and type are kept."""
    try:
        made = make(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    if isinstance(made, tuple):  # mkstemp: (fd, name)
        os.close(made[0])
        return made[1]
    return made


@contextmanager
def atomic_path(path: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` if the block succeeds.
    `replace` False: a `path` that appeared meanwhile (another process writing it, checked
    for before the work began) is refused, not replaced: one of the two outputs was lost."""
    path = Path(path)
    _refuse_dangling_link(path)
    if path.is_symlink():  # written through, as open() writes through a link (a rename would replace the link)
        path = path.resolve()
    with undo_on_error(path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = Path(_temporary_in(tempfile.mkstemp, path))
        try:
            with _disk_full_as_one_line(path):
                yield tmp_path
                if _fsync_wanted():
                    sync_path(tmp_path)
            _publish_mode(tmp_path, directory=False)
            if replace:
                os.replace(tmp_path, path)
            else:
                _publish_new(tmp_path, path)
            if _fsync_wanted():
                sync_path(path.parent)
        finally:
            if tmp_path.exists():
                tmp_path.unlink()


def _publish_new(tmp_path: Path, path: Path) -> None:
    """Give `tmp_path` the name `path` only if nothing has it: a hard link fails on an
    existing name, where a rename would replace it (where links are not supported, a check
    then a rename)."""
    try:
        os.link(tmp_path, path)
    except FileExistsError:
        raise FrawdError(f"{path} exists (written meanwhile by another process); choose a new path "
                         "(or --overwrite)") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(path):
            raise FrawdError(f"{path} exists (written meanwhile by another process); choose a new path "
                             "(or --overwrite)") from None
        os.replace(tmp_path, path)
    # (the caller's cleanup unlinks tmp_path, the second name of the published file)


def is_inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """True when `path` is `folder` or lies below it (links resolved)."""
    try:
        Path(path).resolve().relative_to(Path(folder).resolve())
        return True
    except ValueError:
        return False


@contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False,
               keep: tuple[str | os.PathLike, ...] = ()) -> Iterator[Path]:
    """Yield an empty temporary folder; it becomes `path` only if the block succeeds. An
    existing non-empty `path` is refused unless `overwrite`, and is then replaced only after
    the new folder is complete; never when that would delete one of `keep` (the input being
    converted) or the current folder. An existing empty folder (one the user made, maybe
    private, group-shared or a mount point) is kept and filled: the temporary folder is made
    inside it and its entries moved up at the end."""
    path = Path(path)
    _refuse_dangling_link(path)
    if path.is_symlink():  # written through, as open() writes through a link (the swap renamed the link itself)
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise FrawdError(f"{path} exists and is not a directory")
    if path.is_dir() and _holds_output(path) and not overwrite:
        raise FrawdError(f"{path} exists and is not empty; choose a new directory (or --overwrite)")
    if path.is_dir():
        for source in keep:
            if is_inside(source, path):
                what = "is the input" if is_inside(path, source) else f"holds {source}, the input"
                raise FrawdError(f"{path} {what}: replacing it would delete it; choose another output folder")
        if is_inside(Path.cwd(), path):
            raise FrawdError(f"{path} is the current folder or holds it; choose another output folder")
    in_place = path.is_dir() and not _holds_output(path)
    with undo_on_error(path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
        if in_place:
            clean_partial(path)  # (what a killed write into it left)
        tmp = Path(_temporary_in(tempfile.mkdtemp, path / path.name if in_place else path))
        try:
            with _disk_full_as_one_line(path), _named_as(tmp, path):
                yield tmp
                if _fsync_wanted():
                    _sync_tree(tmp)
            for inner in tmp.rglob("*"):  # a library's own temp-and-rename leaves 0600 files
                if not inner.is_symlink():
                    _publish_mode(inner, directory=inner.is_dir())
            if in_place:
                _move_entries(tmp, path, overwrite)
            else:
                _swap_in(tmp, path, overwrite)
            if _fsync_wanted():
                sync_path(path if in_place else path.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)


def _holds_output(folder: Path) -> bool:
    """`folder` holds something besides what killed writes left (temporary names)."""
    return any(_PARTIAL.fullmatch(entry.name) is None for entry in folder.iterdir())


@contextmanager
def _named_as(tmp: Path, path: Path) -> Iterator[None]:
    """An error worded by an inner write names the file as it will be called (`OUT/model/
    model.safetensors`), not inside the temporary folder (`OUT/.model.6w70wn7u.tmp/...`)."""
    try:
        yield
    except FrawdError as exc:
        if str(tmp) not in str(exc):
            raise
        raise FrawdError(str(exc).replace(str(tmp), str(path))) from None


def _move_entries(tmp: Path, path: Path, overwrite: bool) -> None:
    """Fill the existing folder `path` with `tmp`'s entries (then remove `tmp`, inside it):
    the folder keeps its owner, mode and filesystem. Another writer that filled it meanwhile
    wins: refused, unless `overwrite`."""
    if _holds_output(path) and not overwrite:
        raise _written_meanwhile(path)
    for entry in sorted(tmp.iterdir()):
        target = path / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)  # (--overwrite: a folder is not replaced by a rename)
        os.replace(entry, target)
    tmp.rmdir()


def _swap_in(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename `tmp` onto `path`: a folder that does not exist, or with `overwrite` one whose
    old copy is set aside and removed once the swap stands (its owner and mode are kept)."""
    if not (overwrite and path.exists()):
        _publish_mode(tmp, directory=True)
        try:
            os.replace(tmp, path)  # (onto a folder another writer filled meanwhile: refused by the OS)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise _written_meanwhile(path) from None
        return
    _copy_owner_and_mode(path, tmp)
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    if _exchange(tmp, path):  # in one step: `path` is never missing (a reader of RUN/model found no folder)
        os.replace(tmp, old)  # (a directory onto an empty directory: allowed)
    else:  # in two: set the old copy aside, then rename the new one in
        try:
            os.replace(path, old)
        except OSError as exc:
            old.rmdir()
            if exc.errno != errno.EBUSY:
                raise
            raise FrawdError(f"{path} is a mount point: --overwrite cannot replace it; empty it first, or choose "
                             "another folder") from None
        os.replace(tmp, path)
    remove_tree_or_warn(old, f"replaced {path}, but its old copy")  # (the swap stands whatever happens here)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux's renameat2 with RENAME_EXCHANGE); False
    where the system or file system cannot (or `b` is a mount point): the caller renames twice."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # (glibc 2.28+, musl 1.1.24+)
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _written_meanwhile(path: Path) -> FrawdError:
    return FrawdError(f"{path} exists and is not empty (written meanwhile by another process); choose a new "
                      "directory (or --overwrite)")


def _copy_owner_and_mode(source: Path, target: Path) -> None:
    """`target` gets `source`'s permission bits (setgid included) and, where allowed, its
    owner and group."""
    info = source.stat()
    try:
        os.chown(target, info.st_uid, info.st_gid)
    except OSError:
        pass  # (not ours to give away: the new folder stays the writer's)
    os.chmod(target, stat.S_IMODE(info.st_mode))


def remove_tree_or_warn(folder: Path, what: str) -> bool:
    """Delete `folder`; True once it is gone. If part of it cannot be deleted (a read-only
    folder), a warning says "`what` is left at FOLDER" and names the first file that resisted,
    by its full path."""
    failed: list[tuple[str, BaseException]] = []

    def note(_function: Any, name: str, error: Any) -> None:
        failed.append((name, error[1] if isinstance(error, tuple) else error))

    shutil.rmtree(folder, **{"onexc" if sys.version_info >= (3, 12) else "onerror": note})
    if not failed:
        return True
    name, error = failed[0]
    reason = (getattr(error, "strerror", None) or str(error)).lower()
    warnings.warn(f"{what} is left at {folder} ({reason}: {name}); delete it by hand")
    return False


def write_text_atomic(path: str | os.PathLike, text: str, replace: bool = True) -> None:
    with atomic_path(path, replace=replace) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON file's top-level object ({} when it is missing, unreadable, not JSON or not an object)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# The temporary names above: .NAME.<8 random characters>.tmp (or .old for a replaced folder).
_PARTIAL = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.(?P<kind>tmp|old)")


def partial_write(name: str) -> tuple[str, str] | None:
    """(the name written, "tmp" or "old") of a temporary name above, else None."""
    match = _PARTIAL.fullmatch(name)
    return (match["name"], match["kind"]) if match else None


def clean_partial(folder: str | os.PathLike, only: str | None = None) -> None:
    """Tidy what writes killed in `folder` left: a folder set aside for replacement whose
    replacement never arrived is put back; other temporary files and folders are removed.
    `only`: just those of the entry of that name (a folder shared with other writers)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir()):
        match = _PARTIAL.fullmatch(path.name)
        if match is None or (only is not None and match["name"] != only):
            continue
        target = folder / match["name"]
        if match["kind"] == "old" and not target.exists():
            os.replace(path, target)
        elif path.is_dir() and not path.is_symlink():
            remove_tree_or_warn(path, f"the old copy of {target}, set aside when it was replaced,"
                                if match["kind"] == "old" else f"an unfinished write of {target}")
        else:
            path.unlink(missing_ok=True)
