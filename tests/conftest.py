"""Shared fixtures. jaxtyping shape checks are switched on for the whole package by
`--jaxtyping-packages=frawdllm,beartype.beartype` in pyproject's pytest options."""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("FRAWD_SHARED_DATA") or ROOT.parent / "shared" / "data")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def _session_inductor_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture(autouse=True)
def private_user_cache(tmp_path_factory, _session_inductor_dir, monkeypatch) -> Path:
    """Each test gets its own training cache (measured peaks, compile costs and failures),
    so a test's fake CPU or failing compile never reaches the user's ~/.cache/frawdllm;
    torch.compile's kernels go to one folder for the session."""
    import frawdllm.train.device as device

    folder = tmp_path_factory.mktemp("frawd-cache")
    monkeypatch.setattr(device, "user_cache_dir", lambda: folder)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(_session_inductor_dir))
    return folder
