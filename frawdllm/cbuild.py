"""The package's C files: compiled on first use with the system compiler, loaded with ctypes.

The parts of FrawdLLM in C: the inference forward (`infer/native.c`) and, for training on
a CPU, the attention (`model/cpu_attention.c`), RMSNorm/RoPE/SwiGLU (`model/cpu_fused.c`)
and dropout's mask (`model/cpu_dropout.c`); each says why in its header. All are built
the same way: `cc -O3 -march=native -fopenmp` (seconds to half a minute, announced on
stderr), into `~/.cache/frawdllm/native/` (or `$FRAWD_CACHE_DIR/native`...: cache_dir),
under a name keyed by the source (with the headers it includes), the flags, the compiler
and the CPU, so later processes load the built file at once. The compile goes to a
temporary file that is then renamed: a killed build never leaves half a library. Where the
cache folder cannot be written, the library is built into a temporary folder of the
process (built again by the next process, but not slow PyTorch instead). Without a
compiler, with a build that fails (a full disk...), or with `FRAWD_NATIVE=0`, a library is
unavailable and its callers use PyTorch instead; a failure is said once on stderr.

`FRAWD_MARCH` replaces `native` in `-march=` (e.g. `haswell` to run the AVX2 code on a
newer CPU: how the AVX2 figures of docs/inference.md can be reproduced anywhere).

The library links `libgomp.so.1`; in a process that imported torch that is torch's own
OpenMP runtime (same soname), so C and PyTorch share one thread pool.

This module also owns the user cache folder (`cache_dir`), the small JSON files kept there
(`update_json_cache`; read with `io.read_json_object`: measured peaks, compile costs, the
engine's paths) and the reading of /proc/cpuinfo (`cpuinfo_line`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .errors import FrawdError
from .io import current_umask, read_json_object, write_json_atomic

CFLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


def _compiler_error(stderr: str) -> str:
    """The compiler's first error line (a bad -march= is said there, then a long list of
    the valid ones) and its last 200 characters (else its last 500), naming FRAWD_MARCH if set."""
    lines = stderr.strip().splitlines()
    first = next((line for line in lines if "error" in line), "")
    tail = stderr.strip()[-200 if first else -500:]
    told = f" (FRAWD_MARCH={os.environ['FRAWD_MARCH']})" if os.environ.get("FRAWD_MARCH") else ""
    return (first[:240] + " ... " + tail if first and first not in tail else tail) + told


def march() -> str:
    """The -march= the libraries are built for: this CPU, unless FRAWD_MARCH says otherwise
    (empty, as a script's unset `FRAWD_MARCH=$MARCH` gives, is the default)."""
    return os.environ.get("FRAWD_MARCH") or "native"


def cache_dir() -> Path:
    """Where the built libraries go: `$FRAWD_CACHE_DIR/native` (`~` expanded), else
    `$XDG_CACHE_HOME/frawdllm/native`, else `~/.cache/frawdllm/native`.

    A process without a home (no $HOME and no passwd entry for its user id: `docker run -u
    12345`, OpenShift's random user ids) gets `frawdllm-cache-UID` in the temporary folder
    instead: Path.home() raises there, and a cache that is lost when /tmp is cleaned only
    costs a rebuild."""
    given = os.environ.get("FRAWD_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if given:
        root = Path(os.path.expanduser(given))  # (FRAWD_CACHE_DIR='~/x': the shell left the `~` as it is)
    elif os.path.isabs(xdg):  # (the XDG spec: a relative path there is to be ignored)
        root = Path(xdg) / "frawdllm"
    else:
        try:
            root = Path.home() / ".cache" / "frawdllm"
        except RuntimeError:  # "Could not determine home directory"
            root = _homeless_cache()
    return root / "native"


def _homeless_cache() -> Path:
    """`frawdllm-cache-UID` in the temporary folder, made private to this user. That name can be
    taken by another user (anyone may create folders in /tmp), and the libraries in it are
    code this process runs: a folder that is not this user's alone is not used."""
    folder = Path(tempfile.gettempdir()) / f"frawdllm-cache-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
    except OSError:
        return folder  # (not there and cannot be made: nothing can be loaded from it)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022:
        return folder
    return process_folder()


_process_folder: Path | None = None


def process_folder() -> Path:
    """A temporary folder of this process alone (made on first use, removed at exit)."""
    global _process_folder
    if _process_folder is None:
        _process_folder = Path(tempfile.mkdtemp(prefix="frawdllm-"))
        atexit.register(shutil.rmtree, _process_folder, ignore_errors=True)
    return _process_folder


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (`taskset`, a container's cpuset), which
    can be fewer than the machine's os.cpu_count(). (A CPU quota, `docker --cpus`, is not seen.)"""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (macOS has no affinity to ask)
        return os.cpu_count() or 1


def update_json_cache(path: Path, key: str, value: Any, keep: int | None = None) -> None:
    """Set one entry of a JSON cache file (written atomically, as the newest entry); with
    `keep`, only the newest `keep` entries stay. A cache that cannot be written is skipped:
    it costs a measurement next time, nothing else."""
    data = read_json_object(path)
    data.pop(key, None)  # (then set again: the file's order is the order the entries were written in)
    data[key] = value
    if keep is not None:
        data = dict(list(data.items())[-keep:])
    try:
        write_json_atomic(path, data)
    except (OSError, FrawdError):  # (a full disk is a FrawdError: one line for the files a run must write)
        pass


def cpuinfo_line(*starts: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with one of `starts` (None: none, or no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return next((line for line in text.splitlines() if line.startswith(starts)), None)


def cpuinfo_flags_line() -> str | None:
    """The feature-flags line of /proc/cpuinfo ("flags: ..." on x86, "Features: ..." on ARM)."""
    return cpuinfo_line("flags", "Features")


def cpu_signature() -> str:
    # -march=native code is only valid on the CPU it was built for
    return cpuinfo_flags_line() or platform.processor() or platform.machine()


def _sources(source: Path) -> list[Path]:
    """`source` and the files it includes with #include "..." (recursively)."""
    found, todo = [], [source]
    while todo:
        path = todo.pop()
        if path not in found:
            found.append(path)
            todo += [(path.parent / name).resolve() for name in re.findall(r'#include "([^"]+)"', path.read_text())]
    return found


def source_digest(source: Path) -> str:
    """A hash of `source` and the headers it includes: changes when the C code does."""
    return hashlib.sha256(b"\0".join(path.read_bytes() for path in _sources(source))).hexdigest()


def build(source: Path, what: str = "") -> Path:
    """Compile `source` into the cache (unless already there) and return the library's path.

    A compile says so on stderr first ("compiling WHAT for this CPU (once)...")."""
    compiler = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"no C compiler ({compiler}): {e}") from None
    flags = [*CFLAGS, f"-march={march()}"]
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (source_digest(source), " ".join(flags), version, cpu_signature()))
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}_{key}.so"
    if _cached(target):
        return target
    # Processes that need the same library at once (the ranks of `--nproc N`) compile it
    # once: the others wait here, then find it built.
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
    with _held(target.with_suffix(".lock")):
        if _cached(target):
            return target
        return _compile(compiler, flags, source, target, what)


def _cached(target: Path) -> bool:
    """Whether `target` is a whole library; a damaged one is removed (and said)."""
    if not target.exists():
        return False
    damage = _damage(target)
    if damage is None:
        return True
    print(f"the cached {target} is damaged ({damage}); removing it", file=sys.stderr, flush=True)
    try:
        target.unlink()
    except OSError:  # (a read-only cache: built for this process by _compile)
        pass
    return False


@contextlib.contextmanager
def _held(lock: Path) -> Iterator[None]:
    """An exclusive lock on the file `lock` for the block (released when the process ends,
    however it ends); without one (a read-only cache, no fcntl) the block runs unlocked."""
    try:
        import fcntl

        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


def _compile(compiler: str, flags: list[str], source: Path, target: Path, what: str) -> Path:
    when = "once"
    try:  # the folder first: a compile announced must have somewhere to go
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # compile aside, then rename: never half a file
    except OSError as e:  # e.g. a read-only home: build for this process rather than not at all
        when = f"for this process only: cannot write {target.parent}: {e.strerror or e}"
        target = process_folder() / target.name
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    print(f"compiling {what or source.name} for this CPU ({when})...", file=sys.stderr, flush=True)
    try:
        result = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed: {_compiler_error(result.stderr)}")
        os.chmod(tmp, 0o777 & ~current_umask())  # (mkstemp's 0600, +x: unreadable to a shared cache's group)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _damage(library: Path) -> str | None:
    """Why a cached library cannot be loaded as it is, or None. A file cut short (a full disk,
    a copy that stopped) can keep a valid ELF header: loading maps segments past its end,
    and the first touch of one kills the process with SIGBUS, which no exception catches.
    So an ELF file must hold every segment and section table its header names. (Other
    formats, a Mach-O on macOS, are left to the loader.)"""
    if sys.platform == "darwin":
        return None
    try:
        size = library.stat().st_size
        with open(library, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF":
                return "not an ELF library"
            if head[4] != 2 or head[5] != 1:  # (64-bit, little-endian: what this package builds)
                return None
            phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
            if shoff + shnum * shentsize > size or phoff + phnum * phentsize > size:
                return f"cut short at {size:,} bytes"
            f.seek(phoff)
            table = f.read(phnum * phentsize)
    except OSError as e:
        return e.strerror or str(e)
    for i in range(phnum):  # each segment: p_offset at 0x08, p_filesz at 0x20
        (offset,), (filesz,) = (struct.unpack_from("<Q", table, i * phentsize + at) for at in (0x08, 0x20))
        if offset + filesz > size:
            return f"cut short at {size:,} bytes"
    return None


F = TypeVar("F", bound=Callable[..., object])


def constant_under_compile(fn: F) -> F:
    """Mark `fn` as `torch.compiler.assume_constant_result` does (torch.compile calls it once
    while tracing and keeps the result as a constant), without that function's cost:
    it imports all of dynamo, two seconds or more on a small CPU, for every command that
    imports the model. The mark is this attribute (tests/test_cbuild.py checks that
    torch's decorator sets the same)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


class CLibrary:
    """One C file of the package, built and loaded on first use (once per process).

    `declare(lib)` sets the argument and result types of its functions; `what` names it
    in errors ("the native forward is unavailable: no C compiler (cc)...").
    """

    def __init__(self, source: Path, what: str, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source, self.what, self.declare = source, what, declare
        self._lib: ctypes.CDLL | None = None
        self._why_not: str | None = None  # why it is unavailable, once we know

    def load(self) -> ctypes.CDLL:
        """The loaded library; raises FrawdError saying why if it cannot be built or loaded."""
        if self._lib is None and self._why_not is None:
            if os.environ.get("FRAWD_NATIVE", "1") == "0":
                self._why_not = "FRAWD_NATIVE=0"
            else:
                try:
                    lib = ctypes.CDLL(str(build(self.source, self.what)))
                    self.declare(lib)
                    self._lib = lib
                except (RuntimeError, OSError) as e:
                    self._why_not = str(e)
                    print(f"{self.what} is unavailable ({self._why_not}); using PyTorch instead",
                          file=sys.stderr, flush=True)
        if self._lib is None:
            raise FrawdError(f"{self.what} is unavailable: {self._why_not}")
        return self._lib

    def unavailable_reason(self) -> str | None:
        """None when the library loads (building it if needed), else why not."""
        try:
            self.load()
            return None
        except FrawdError:
            return self._why_not
