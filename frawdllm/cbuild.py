"""The package's C files: compiled on first use with the system compiler, loaded with ctypes.

Two parts of FrawdLLM are C (the inference forward, `infer/native.c`, and the CPU
training attention, `model/cpu_attention.c`); each says why in its header. Both are built
the same way: `cc -O3 -march=native -fopenmp` (about a second), into
`~/.cache/frawdllm/native/` (or `$FRAWD_CACHE_DIR/native`), under a name keyed by the
source (with the headers it includes), the flags, the compiler and the CPU, so later
processes load the built file at once. The compile goes to a temporary file that is then
renamed: a killed build never leaves half a library. Without a compiler, or with
`FRAWD_NATIVE=0`, a library is unavailable and its callers use PyTorch instead.

The library links `libgomp.so.1`; in a process that imported torch that is torch's own
OpenMP runtime (same soname), so C and PyTorch share one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import FrawdError

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


def cache_dir() -> Path:
    root = os.environ.get("FRAWD_CACHE_DIR") or Path.home() / ".cache" / "frawdllm"
    return Path(root) / "native"


def cpu_signature() -> str:
    try:  # -march=native code is only valid on the CPU it was built for
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sources(source: Path) -> list[Path]:
    """`source` and the files it includes with #include "..." (recursively)."""
    found, todo = [], [source]
    while todo:
        path = todo.pop()
        if path not in found:
            found.append(path)
            todo += [(path.parent / name).resolve() for name in re.findall(r'#include "([^"]+)"', path.read_text())]
    return found


def build(source: Path) -> Path:
    """Compile `source` into the cache (unless already there) and return the library's path."""
    compiler = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"no C compiler ({compiler}): {e}") from None
    texts = [path.read_text() for path in _sources(source)]
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (*texts, " ".join(CFLAGS), version, cpu_signature()))
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # compile aside, then rename: never half a file
    os.close(fd)
    try:
        result = subprocess.run([compiler, *CFLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed: {result.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


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
                    lib = ctypes.CDLL(str(build(self.source)))
                    self.declare(lib)
                    self._lib = lib
                except (RuntimeError, OSError) as e:
                    self._why_not = str(e)
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
