"""Where and in what precision training runs: device, autocast dtype, seeds, RNG state,
and what this machine can compute (its CPU features and matmul peaks).

Mixed precision keeps the weights and the optimizer in fp32 and runs the forward and
backward matmuls in bf16 or fp16 under `torch.autocast`. bf16 has fp32's range, so it
needs nothing else; fp16 overflows easily, so its loss is scaled (`GradScaler`).
`auto` picks a low-precision dtype only where the hardware computes it natively (GPUs
that support bf16; CPUs with AVX-512 BF16 or AMX, where the training loop times bf16
against fp32 in its first steps), else fp32: on an AVX2 CPU bf16 matmuls are emulated,
about 100x slower than fp32.

MFU (model FLOPs utilisation) = achieved training FLOP/s / peak FLOP/s. The peak is that
of the dtype that really computes the matmuls (fp32's where bf16 would be emulated),
measured once per machine, dtype and thread count with a large matmul and cached in
`~/.cache/frawdllm/peaks.json`. An MFU above 100% means the peak is wrong; it is never
shown (`n/a` instead), nor is one without a peak; a run that computed more than the cached
peak drops it (`forget_peak`), so the next run measures it again.

On Linux, glibc's malloc hands large freed blocks back to the kernel and asks for them
again at the next step; every page then comes back zeroed through a page fault (about
50 MB per step for the tiny preset, ~5% of CPU training time). `keep_freed_memory` tells
malloc to keep them, as jemalloc or tcmalloc would.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import os
import platform
import random
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ..cbuild import cache_dir as _native_cache_dir
from ..cbuild import cpuinfo_flags_line, cpuinfo_line, update_json_cache
from ..io import read_json_object
from ..seeds import torch_seed
from ..errors import ConfigError, counted

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


SUPPORTED_DEVICES = ("cpu", "cuda", "mps")


def pick_device(name: str = "auto") -> torch.device:
    """`name` as a device this machine has (auto: cuda > mps > cpu), else one line saying why.
    Other types torch parses (xpu, xla, meta...) are refused: nothing here runs on them."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in SUPPORTED_DEVICES:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda requested but no CUDA GPU is available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device mps requested but MPS is not available")
    return device


# CPU features that decide what is fast here (x86 flags; ARM's "asimd" is NEON).
SHOWN_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16",
                  "amx_tile", "asimd", "bf16", "sve")


def user_cache_dir() -> Path:
    """FrawdLLM's per-user cache: ~/.cache/frawdllm, $XDG_CACHE_HOME/frawdllm or $FRAWD_CACHE_DIR
    (cbuild.cache_dir says which, and where a process without a home keeps it)."""
    return _native_cache_dir().parent


def _cpuinfo_flags() -> frozenset[str]:
    line = cpuinfo_flags_line()
    if line is not None:
        return frozenset(line.split(":", 1)[1].split())
    if platform.machine().lower() in ("arm64", "aarch64"):  # macOS: every Apple CPU has NEON
        return frozenset({"asimd"})
    return frozenset()


ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # (the second: oneDNN's older name)
_BELOW_AVX512 = ("avx512", "amx")
# The flags each oneDNN ISA cap excludes (prefixes); ALL, DEFAULT and unknown values cap nothing
ONEDNN_CAPS = {
    **dict.fromkeys(("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"), _BELOW_AVX512),
    **dict.fromkeys(("AVX512_CORE", "AVX512_CORE_VNNI"), ("avx512_bf16", "avx512_fp16", "amx")),
    "AVX512_CORE_BF16": ("avx512_fp16", "amx"),
    **dict.fromkeys(("AVX512_CORE_FP16", "AVX10_1_512"), ("amx",)),
    **dict.fromkeys(("AVX512_CORE_AMX", "AVX10_1_512_AMX"), ("amx_fp16",)),
}


def onednn_isa_cap() -> str:
    """The instruction-set cap set for oneDNN, which computes PyTorch's bf16 matmuls ("" if none)."""
    return next((os.environ[name].strip().upper() for name in ONEDNN_ISA_VARIABLES if os.environ.get(name)), "")


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags, as PyTorch may use them. `ATEN_CPU_CAPABILITY=avx2` caps
    ATen's own kernels (elementwise, reductions): AVX-512 vector flags are hidden, not bf16
    matmuls, which oneDNN computes. A oneDNN cap (`ONEDNN_MAX_CPU_ISA` / `DNNL_MAX_CPU_ISA`)
    hides what it excludes (`ONEDNN_CAPS`): below AVX-512 (`AVX2`, ...) all of AVX-512 and
    AMX, `AVX512_CORE[_VNNI]` bf16, fp16 and AMX, `AVX512_CORE_BF16` fp16 and AMX, ..."""
    flags = _cpuinfo_flags()
    hidden: tuple[str, ...] = ()
    if aten_capped():
        hidden += ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512vbmi")
    hidden += ONEDNN_CAPS.get(onednn_isa_cap(), ())  # (a value oneDNN does not know caps nothing)
    return frozenset(f for f in flags if not f.startswith(hidden)) if hidden else flags


def aten_capped() -> bool:
    """`ATEN_CPU_CAPABILITY` keeps ATen's kernels from AVX-512. ATen reads it as written:
    `AVX2` (upper case) is ignored, with a warning, and so not a cap."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "") in ("avx2", "default")


def shown_features(features: frozenset[str] | None = None) -> str:
    """The features that matter here, as one line ("avx2 fma f16c avx512f ...")."""
    features = cpu_features() if features is None else features
    return " ".join(f for f in SHOWN_FEATURES if f in features) or "none of " + " ".join(SHOWN_FEATURES)


def cpu_has_bf16(features: frozenset[str] | None = None) -> bool:
    """Native bf16 matmuls: x86 AVX-512 BF16 or AMX (ARM's bf16 extension counts too)."""
    features = cpu_features() if features is None else features
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & features)


def _cpu_has_fp16(features: frozenset[str]) -> bool:
    return bool({"avx512_fp16", "amx_fp16"} & features)


def choose_dtype(name: str, device: torch.device, features: frozenset[str] | None = None) -> tuple[str, str]:
    """(dtype, why): `auto` resolved for this device, or the one asked for (checked)."""
    if name != "auto":
        if name not in DTYPES:
            raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
        return name, "asked for"
    if device.type == "cuda":
        # (not counting emulation: torch's default says yes on a T4 or V100, which only emulate it)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", "auto: this GPU computes bf16"
        return "fp32", "auto: this GPU does not compute bf16"
    if device.type == "cpu":
        if cpu_has_bf16(features):
            return "bf16", "auto: this CPU computes bf16 natively (AVX-512 BF16 / AMX)"
        return "fp32", "auto: no native bf16 on this CPU (no AVX-512 BF16 or AMX), bf16 would be emulated"
    return "fp32", f"auto: fp32 on {device.type}"


def matmul_dtype(dtype: str, device: torch.device, features: frozenset[str] | None = None) -> str:
    """The dtype that actually computes the matmuls: fp32 where bf16/fp16 would be emulated."""
    if device.type != "cpu" or dtype == "fp32":
        return dtype
    features = cpu_features() if features is None else features
    native = cpu_has_bf16(features) if dtype == "bf16" else _cpu_has_fp16(features)
    return dtype if native else "fp32"


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(torch_seed(seed))  # (numpy's legacy seed and torch's CPU generator keep 32 bits)
    torch.manual_seed(torch_seed(seed))  # also seeds every CUDA device


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
    """Peak dense matmul FLOP/s: the best of repeated (size x size) @ (size x size) products.
    Its random inputs come from a generator of its own: the global RNG streams (dropout,
    data order) are left untouched."""
    size = size or (8192 if device.type == "cuda" else 2048)
    torch_dtype = DTYPES[dtype]
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(torch_dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(torch_dtype)
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


PEAKS_FILE = "peaks.json"


def machine_key(device: torch.device) -> str:
    """What a measured peak or compile cost belongs to: the processor, its features, the
    thread count and the torch version (readable: compile.py splits it at "|"; why the
    engine's paths have a key of their own: `infer.paths._key`)."""
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        line = cpuinfo_line("model name")
        model = line.split(":", 1)[1].strip() if line else platform.processor() or platform.machine()
        what = f"{model} [{hashlib.sha256(' '.join(sorted(cpu_features())).encode()).hexdigest()[:8]}]"
    return f"{device.type}:{what}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def read_cache(name: str) -> dict:
    """A JSON file of the user cache as a dict ({} if missing or unreadable)."""
    return read_json_object(user_cache_dir() / name)


def update_cache(name: str, key: str, value) -> None:
    """Set one entry of a JSON file of the user cache (a cache that cannot be written is skipped)."""
    update_json_cache(user_cache_dir() / name, key, value)


def cached_peak(device: torch.device, dtype: str) -> float | None:
    """The cached peak FLOP/s of the dtype computing `dtype`'s matmuls here, if measured."""
    value = read_cache(PEAKS_FILE).get(f"{machine_key(device)}|{matmul_dtype(dtype, device)}")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def peak_flops(device: torch.device, dtype: str, say=None) -> float:
    """Peak matmul FLOP/s for training in `dtype` here: cached, or measured once (`say`
    gets a one-line message first) with the dtype that really computes the matmuls."""
    peak = cached_peak(device, dtype)
    if peak is not None:
        return peak
    computed = matmul_dtype(dtype, device)
    if say is not None:
        say(f"measuring this {'GPU' if device.type == 'cuda' else device.type.upper()}'s {computed} "
            "matmul peak (once)...")
    peak = measure_matmul_flops(device, computed)
    update_cache(PEAKS_FILE, f"{machine_key(device)}|{computed}", peak)
    return peak


def forget_peak(device: torch.device, dtype: str) -> None:
    """Drop the cached peak of `dtype`'s matmuls here (0: not measured), so the next run
    measures it again: a run computed more than it (it was measured while other work held
    the cores, and every MFU would be n/a until the cache was deleted)."""
    update_cache(PEAKS_FILE, f"{machine_key(device)}|{matmul_dtype(dtype, device)}", 0)


def mfu(tokens_per_s: float, flops_per_token: int | float | None, peak: float | None) -> float | None:
    """Achieved / peak FLOP/s, or None without a peak or when above 1 (a wrong peak)."""
    if not flops_per_token or not peak or tokens_per_s < 0:
        return None
    value = tokens_per_s * flops_per_token / peak
    return value if value <= 1.0 else None


def format_mfu(value: float | None) -> str:
    return "n/a" if value is None or value > 1.0 else f"{100 * value:.1f}%"


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


def process_started_at() -> float:
    """When this command started, on the `time.perf_counter()` clock (Linux; elsewhere: now):
    this process's start, or for a rank torchrun started first (not a restart), torchrun's
    (its parent; with --nproc, the launching command itself), so --max-time counts the
    launch too."""
    first_rank = "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and \
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
    try:
        fields_ = Path(f"/proc/{os.getppid() if first_rank else 'self'}/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields_[19]) / os.sysconf("SC_CLK_TCK")  # seconds after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter()
    return time.perf_counter() - max(0.0, age)


def hardware_report(device_name: str = "auto", dtype: str = "auto", compile_setting: str = "auto",
                    say=None, peak_tflops: float | None = None) -> list[str]:
    """What `frawd info` and `frawd pretrain --dry-run` say about this machine: the device,
    its CPU features, the dtype and compile decisions and why, the matmul peaks (measured
    once, cached), and the one MFU divides by where `peak_tflops` (--peak-tflops) replaces them."""
    from . import compile as compiling

    device = pick_device(device_name)
    chosen, why = choose_dtype(dtype, device)
    lines = [f"device:        {device}" + (f" ({counted(torch.get_num_threads(), 'thread')})" if device.type == "cpu" else
                                           f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")]
    lines.append(f"cpu features:  {shown_features()}")
    blocker = compiling.known_failure(device) if compile_setting != "false" else None
    if dtype == "auto" and device.type == "cpu" and cpu_has_bf16() and compile_setting != "true":
        why += "; the first steps time bf16 and fp32 and keep the faster" + (
            "" if compile_setting == "false" or blocker is not None else " (compiled or not)")
    if device.type == "cpu" and matmul_dtype(chosen, device) != chosen:  # (as training warns)
        why += f"; emulated on this CPU (no native {chosen} matmuls): far slower than fp32"
    lines.append(f"dtype:         {chosen} ({why})")
    if compile_setting == "false":
        decision = "off (compile: false)"
    elif blocker is not None and (compile_setting == "auto" or "before" not in blocker):
        decision = f"off: {blocker}"
    elif compile_setting == "true":
        decision = "on (compile: true)"
    else:
        decision = ("auto: decided after timing the first steps, by whether the warm-up pays back in the "
                    f"budget left (warm-up and speedup measured by earlier runs here, else predicted; "
                    f"kernels cached in {compiling.inductor_cache_dir()})")
    lines.append(f"compile:       {decision}")
    for d in dict.fromkeys([matmul_dtype(chosen, device), "fp32", *(["bf16"] if cpu_has_bf16() or
                                                                   device.type == "cuda" else [])]):
        cached = cached_peak(device, d)
        peak = cached if cached is not None else peak_flops(device, d, say=say)
        kept = "cached" if cached else "measured now" if cached_peak(device, d) else \
            "measured now, not kept: the cache cannot be written"
        lines.append(f"peak {d}:     {peak / 1e9:,.1f} GFLOP/s ({kept}; {user_cache_dir() / PEAKS_FILE})")
    if device.type == "cpu" and not cpu_has_bf16():
        lines.append("peak bf16:     none native (emulated bf16 matmuls; MFU of bf16 training uses fp32's peak)")
    if peak_tflops is not None:
        lines.append(f"peak for MFU:  {peak_tflops * 1e3:,.1f} GFLOP/s (--peak-tflops, in place of the measured peaks)")
    return lines
