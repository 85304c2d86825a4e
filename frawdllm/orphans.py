"""Child processes that end with their parent, on Linux.

A process killed with SIGKILL cannot stop its children: they go on as orphans, holding
what they inherited (open files, a folder's lock). Linux offers one remedy,
`prctl(PR_SET_PDEATHSIG, sig)`: the kernel sends `sig` to a process when the thread that
created it dies. Elsewhere these are no-ops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator

PR_SET_PDEATHSIG = 1
_forking_parent: int | None = None  # this process's pid while `children_end_with_this_process` holds


def signal_when_parent_dies(sig: int) -> None:
    """Ask the kernel for `sig` when this process's parent dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _after_fork_in_child() -> None:
    global _forking_parent
    if _forking_parent is None:
        return
    parent, _forking_parent = _forking_parent, None  # (this child's own children are its business)
    signal_when_parent_dies(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def children_end_with_this_process() -> Iterator[None]:
    """Processes this one forks inside the block (with `os.fork`, as multiprocessing's fork
    start method does) get SIGTERM if this process dies, even by SIGKILL. For libraries
    whose helper processes would otherwise outlive it (datatrove's manager)."""
    global _forking_parent
    before, _forking_parent = _forking_parent, os.getpid()
    try:
        yield
    finally:
        _forking_parent = before
