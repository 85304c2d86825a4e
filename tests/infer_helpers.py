"""Helpers shared by the inference tests (engine, quantization, CLI)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these tiny models gain nothing from more, and on a busy machine
    threads waiting on each other make every small op slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
