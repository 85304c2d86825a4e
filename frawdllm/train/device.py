"""Where and in what precision training runs: device, autocast dtype, seeds, RNG state.

Mixed precision keeps the weights and the optimizer in fp32 and runs the forward and
backward matmuls in bf16 or fp16 under `torch.autocast`. bf16 has fp32's range, so it
needs nothing else; fp16 overflows easily, so its loss is scaled (`GradScaler`).
`auto` picks bf16 where the hardware computes it natively (recent GPUs; CPUs with
AVX-512 BF16 or AMX), else fp32.

MFU (model FLOPs utilisation) = achieved training FLOP/s / peak FLOP/s. The peak is
measured here with a large matmul in the training dtype, so it is the peak of this
machine, today.

On Linux, glibc's malloc hands large freed blocks back to the kernel and asks for them
again at the next step; every page then comes back zeroed through a page fault (about
50 MB per step for the tiny preset, ~5% of CPU training time). `keep_freed_memory` tells
malloc to keep them, as jemalloc or tcmalloc would.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import random
import sys
import time
from functools import lru_cache

import numpy as np
import torch

from ..errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda requested but no CUDA GPU is available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device mps requested but MPS is not available")
    return device


@lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> str:
    """The concrete dtype name for `auto`; checks that the device can run the one asked for."""
    if name == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        return "bf16" if device.type == "cpu" and cpu_has_bf16() else "fp32"
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return name


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict:
    """Every global RNG's state, as tensors and plain values (loadable with weights_only)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["key"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure_matmul_flops(device: torch.device, dtype: str, size: int | None = None,
                         min_seconds: float = 0.3) -> float:
    """Peak dense matmul FLOP/s: the best of repeated (size x size) @ (size x size) products."""
    size = size or (8192 if device.type == "cuda" else 2048)
    torch_dtype = DTYPES[dtype]
    a = torch.randn(size, size, device=device).to(torch_dtype)
    b = torch.randn(size, size, device=device).to(torch_dtype)
    flops = 2 * size**3
    torch.mm(a, b)  # warm-up: kernels, thread pools
    synchronize(device)
    best, spent = float("inf"), 0.0
    while spent < min_seconds or best == float("inf"):
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return flops / best


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Make glibc malloc reuse freed memory instead of returning it to the kernel (no-op
    elsewhere). Returns whether it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (e.g. musl)
    # Blocks up to 32 MB (glibc's maximum) come from the heap, and the heap is never trimmed.
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**30))
