"""Shared fixtures. jaxtyping shape checks are switched on for the whole package by
`--jaxtyping-packages=frawdllm,beartype.beartype` in pyproject's pytest options
(`shape_checks_for_first_steps` below: a long training run checks its first steps only)."""

import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("FRAWD_SHARED_DATA") or ROOT.parent / "shared" / "data")

# `make test` runs the tests in one pytest-xdist worker per CPU: each worker gets its share of
# the cores (OpenMP threads that wait on a core another worker holds slow every op down).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))
LOCKS = "FRAWD_TEST_LOCKS"  # the folder of `worker_turn`'s locks, made for one `pytest -n` run


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ[LOCKS] = tempfile.mkdtemp(prefix="frawd-tests-")  # (the workers start after this)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and os.environ.get(LOCKS):
        shutil.rmtree(os.environ.pop(LOCKS), ignore_errors=True)


@contextmanager
def worker_turn(alone: bool):
    """Under pytest-xdist: a test marked `alone` (it times a run against the wall clock) runs
    while no other worker runs a test; the others share the machine. Two file locks: every
    test passes the gate and then holds the lock shared; an `alone` test holds the gate while
    it waits for the lock alone, so the other workers cannot keep taking it meanwhile."""
    folder = os.environ.get(LOCKS)
    if not folder or WORKERS < 2:
        yield
        return
    with open(Path(folder) / "gate", "a") as gate, open(Path(folder) / "lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # (closing the file lets the lock go)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test's whole run, its module's and session's fixtures set up or torn down with it,
    takes its turn (`worker_turn`)."""
    with worker_turn(alone=item.get_closest_marker("alone") is not None):
        yield


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA


SHAPE_CHECKED_STEPS = 5


@pytest.fixture
def shape_checks_for_first_steps(monkeypatch):
    """Shape checks in the first SHAPE_CHECKED_STEPS training steps (`Trainer.train_step`)
    of each run in the test, none in the later ones, back on once a run's `fit` returns. The
    later steps of a long run make the same calls (on other batches), and the checks cost
    more than the arithmetic of a tiny model: the two seq2seq learning runs (1,800 steps)
    took 85 s with them and 47 s without."""
    import jaxtyping

    from frawdllm.train.loop import Trainer

    was = jaxtyping.config.jaxtyping_disable
    train_step, fit = Trainer.train_step, Trainer.fit
    steps = [0]

    def counted_step(self):
        steps[0] += 1
        if steps[0] > SHAPE_CHECKED_STEPS:
            jaxtyping.config.update("jaxtyping_disable", True)
        return train_step(self)

    def checked_fit(self):
        steps[0] = 0
        try:
            return fit(self)
        finally:
            jaxtyping.config.update("jaxtyping_disable", was)

    monkeypatch.setattr(Trainer, "train_step", counted_step)
    monkeypatch.setattr(Trainer, "fit", checked_fit)
    yield steps
    jaxtyping.config.update("jaxtyping_disable", was)


@pytest.fixture(autouse=True)
def private_user_cache(tmp_path_factory, monkeypatch) -> Path:
    """Each test gets its own training cache (measured peaks, compile costs and failures),
    so a test's fake CPU or failing compile never reaches the user's ~/.cache/frawdllm;
    TORCHINDUCTOR_CACHE_DIR is put back after each test (training points it at that cache)."""
    import frawdllm.train.device as device
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = tmp_path_factory.mktemp("frawd-cache")
    monkeypatch.setattr(device, "user_cache_dir", lambda: folder)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    return folder
