"""Shared fixtures. jaxtyping shape checks are switched on for the whole package by
`--jaxtyping-packages=frawdllm,beartype.beartype` in pyproject's pytest options
(`shape_checks_for_first_steps` below: a long training run checks its first steps only)."""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("FRAWD_SHARED_DATA") or ROOT.parent / "shared" / "data")

# `make test` runs the tests in one pytest-xdist worker per CPU: each worker gets its share of
# the cores (OpenMP threads that wait on a core another worker holds slow every op down).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


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
