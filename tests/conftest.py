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
