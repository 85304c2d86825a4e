"""Helpers shared by the inference tests (engine, quantization, CLI)."""

import pytest
import torch

from frawdllm.infer.cache import HalfKVModel as HalfKV  # noqa: F401  (for the inference tests)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these tiny models gain nothing from more, and on a busy machine
    threads waiting on each other make every small op slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

