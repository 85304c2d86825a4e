"""torch.compile for training steps: compiling correctly, deciding whether it pays, and
falling back when it cannot run.

`compile_step(fn)` is `torch.compile(fn)` run with inductor's buffer reuse turned off.
torch 2.13's inductor miscompiles the backward of a compiled region that is called more
than once (`torch.compiler.nested_compile_region`, which the transformer blocks share so
that warm-up compiles one block instead of n_layer): with buffer reuse on, a saved
activation is overwritten and gradients come out thousands of times too large (~3300-4000x
measured) while the loss
is right. With it off, the gradients equal eager's (tests/test_compile.py pins this for
every block style) and the step is as fast. The blocks check the same switch, so a plain
`torch.compile(model)` inlines every layer instead and is correct too.

`compile: auto` compiles only where it pays within the run's budget (`AutoPlan`).
Compiling costs a warm-up w (seconds, once) and makes a step take c instead of e; in the
R seconds left, eager training does R / e steps and compiled (R - w) / c, which must be
20% more. e is timed on the run's first steps; w and c are measured by earlier runs on
this machine and model shape and cached in `~/.cache/frawdllm/compile.json` (before
any, guessed: w the slowest warm-up seen here or 60 s, c = e / 1.5; a record that measured
the warm-up but no step predicts c from the step's FLOPs). Kernels compiled once are reused
across runs (after a cold warm-up, the next is predicted at a quarter of it until measured):
inductor's FX-graph and autotune caches live in `~/.cache/frawdllm/inductor` (unless
TORCHINDUCTOR_CACHE_DIR says otherwise). A known failure (no C++ compiler; a compile
that failed here before) decides against compiling at once; a corrupt cache entry is
retried once with a fresh cache folder.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import device as device_module  # (its user_cache_dir is looked up at call time)
from .device import machine_key, read_cache, update_cache

COMPILE_FILE = "compile.json"
# before any measurement here: a cold CPU warm-up of the small presets took 20-80 s on
# the machines tried, and a compiled step was 1.3-2x faster
GUESS_WARMUP_S, GUESS_SPEEDUP = 60.0, 1.5
# A warm-up whose kernels inductor's cache already holds, as a fraction of the cold one that
# put them there, until a run measures it: tracing and AOT autograd still run, the C++
# compiles and autotuning do not (137.5 s cold, then 28.4 s, under AVX2 caps on an EPYC).
CACHED_WARMUP_FRACTION = 0.25
MARGIN = 1.2


def quiet_inductor() -> None:
    """Silence a deprecation warning inductor's own code raises while it tunes matmuls
    (torch 2.13: "TypedStorage is deprecated", from `select_algorithm.py`): nothing a
    user of this project can act on."""
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning,
                            module=r"torch\._inductor")


def compile_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` compiled with torch.compile; tracing and compiling happen with buffer reuse off."""
    import torch._inductor.config as inductor_config  # here: importing inductor costs seconds

    quiet_inductor()
    compiled = torch.compile(fn)

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        with inductor_config.patch(allow_buffer_reuse=False):
            return compiled(*args, **kwargs)

    return step


def use_persistent_cache() -> Path:
    """Keep inductor's compiled kernels in the per-user cache (unless TORCHINDUCTOR_CACHE_DIR
    is set), with its FX-graph and autotune caches on: a later run skips the warm-up."""
    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def use_fresh_cache() -> Path:
    """Point inductor at an empty cache folder (after a corrupt entry) and forget what dynamo
    and inductor compiled or loaded so far (inductor's in-memory code caches still named the
    damaged file, and the retry read it again). The per-user cache is emptied and filled
    again (else every later run met the damage and paid the retry); a folder the user chose
    with TORCHINDUCTOR_CACHE_DIR is left alone for a temporary one, removed at exit."""
    import torch._inductor.utils as inductor_utils

    damaged = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    ours = device_module.user_cache_dir() / "inductor"
    path = None
    if damaged.is_dir() and damaged.resolve() == ours.resolve():
        aside = ours.with_name(f"inductor.damaged-{os.getpid()}")
        try:
            ours.rename(aside)  # (atomic: a run starting meanwhile sees no half-deleted folder)
            shutil.rmtree(aside, ignore_errors=True)
            ours.mkdir()
            path = ours
        except OSError:
            pass
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="frawd-inductor-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    torch._dynamo.reset()
    inductor_utils.clear_caches()
    return path


def is_cache_corruption(exc: BaseException) -> bool:
    """A truncated or unreadable cached kernel (e.g. a run killed while writing it), or a C++
    build of a source in the cache folder that failed (inductor rebuilds a kernel whose .so
    it cannot load from the cached source: a damaged entry fails there): worth one retry
    in a fresh folder before compiling counts as failed on this machine."""
    text = f"{type(exc).__name__}: {exc}"
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return isinstance(exc, (ImportError, EOFError)) or any(
        s in text for s in ("file too short", "invalid ELF header", "cannot open shared object", "Unpickl")) or (
        "CppCompileError" in text and bool(cache) and cache in text)


def failure_reason(exc: BaseException, limit: int = 200) -> str:
    """`exc` in one line: its type and the first line of its message, with the next line too
    when the first only introduces it (inductor's "backend='inductor' raised:" puts the cause
    on the second line); at most `limit` characters of message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines or [""])[0]
    return f"{type(exc).__name__}: {text[:limit]}"


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on a CPU, if there is one."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


@dataclass
class CompileCost:
    warmup_s: float
    speedup: float | None  # compiled vs eager step, measured in one run
    source: str  # "measured here" or "guessed"
    step_s: float | None = None  # a compiled step's time, measured


def shape_key(device: torch.device, dtype: str, model: torch.nn.Module, batch_shape: tuple[int, ...]) -> str:
    """What a compile's cost depends on: machine, dtype, the model's parameter shapes, batch shape."""
    shapes = ",".join("x".join(map(str, p.shape)) for p in model.parameters())
    digest = hashlib.sha256(f"{shapes}|{batch_shape}".encode()).hexdigest()[:12]
    return f"{machine_key(device)}|{dtype}|{digest}"


def known_failure(device: torch.device) -> str | None:
    """Why compiling cannot work here, known before trying (None: it may)."""
    if device.type == "cpu" and cxx_compiler() is None:
        return "no C++ compiler (g++/clang++) for inductor"
    if device.type == "mps":
        return "inductor does not compile training steps for mps reliably"
    failed = read_cache(COMPILE_FILE).get(f"{machine_key(device)}|failed")
    if isinstance(failed, str):
        return f"it failed here before ({failed}); --compile true tries again"
    return None


def remember_failure(device: torch.device, reason: str) -> None:
    update_cache(COMPILE_FILE, f"{machine_key(device)}|failed", reason[:200])


def forget_failure(device: torch.device) -> None:
    data = read_cache(COMPILE_FILE)
    if f"{machine_key(device)}|failed" in data:
        update_cache(COMPILE_FILE, f"{machine_key(device)}|failed", None)


def _cache_dir_key(key: str) -> str:
    return f"{key}|{os.environ.get('TORCHINDUCTOR_CACHE_DIR', '')}"


def compile_cost(key: str) -> CompileCost:
    """Warm-up and speedup measured by earlier runs for `key` (the warm-up of a run whose
    inductor cache still holds the kernels, if this cache folder did: measured by a run
    that found them there, else CACHED_WARMUP_FRACTION of the cold one that compiled them),
    else a guess (the warm-up: the slowest measured here for any model, or GUESS_WARMUP_S)."""
    records = read_cache(COMPILE_FILE)
    record, warm = records.get(key), records.get(_cache_dir_key(key))
    if not isinstance(record, dict):
        machine = records.get(_machine_key(key))  # the slowest cold warm-up of any model here
        return CompileCost(float(machine) if isinstance(machine, (int, float)) else GUESS_WARMUP_S,
                           GUESS_SPEEDUP, "guessed")
    warmup, source = record.get("warmup_s", GUESS_WARMUP_S), "measured here"
    if Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")).is_dir():
        if isinstance(warm, (int, float)):  # measured with the kernels cached
            warmup = warm
        elif isinstance(warm, dict) and isinstance(warm.get("cold_s"), (int, float)):  # they were compiled
            warmup = warm["cold_s"] * CACHED_WARMUP_FRACTION
            source = f"a quarter of the cold {warm['cold_s']:.0f} s measured here: its kernels are cached"
    speedup, step_s = record.get("speedup"), record.get("step_s")
    return CompileCost(float(warmup), float(speedup) if speedup else None, source,
                       float(step_s) if step_s else None)


def record_cost(key: str, warmup_s: float, speedup: float | None, step_s: float | None = None) -> None:
    """Remember a compiled run's warm-up (the cold one: the largest seen), its step time
    and its speedup over eager (when the run timed both)."""
    record = read_cache(COMPILE_FILE).get(key)
    record = dict(record) if isinstance(record, dict) else {}
    record["warmup_s"] = round(max(warmup_s, record.get("warmup_s", 0.0)), 2)
    if speedup is not None:
        record["speedup"] = round(speedup, 3)
    if step_s is not None:
        record["step_s"] = round(step_s, 5)
    cached_before = read_cache(COMPILE_FILE).get(_cache_dir_key(key)) is not None
    update_cache(COMPILE_FILE, key, record)
    # a first compile into this cache folder was cold: the next one finds its kernels there
    update_cache(COMPILE_FILE, _cache_dir_key(key), round(warmup_s, 2) if cached_before else
                 {"cold_s": round(warmup_s, 2)})
    machine = read_cache(COMPILE_FILE).get(_machine_key(key))
    update_cache(COMPILE_FILE, _machine_key(key), round(max(warmup_s, machine if isinstance(machine, (int, float)) else 0.0), 2))


def _machine_key(key: str) -> str:
    """The machine part of a cost key (machine|threads|torch), for what is known of any model."""
    return "|".join(key.split("|")[:3]) + "|any-model-warmup_s"


def predicted_step_s(step_flops: float | None, peak: float | None, eager_step_s: float) -> float:
    """A compiled step's time before any was measured: the matmuls at 75% of the peak
    (what compiled small models reach here), no slower than eager, at most 4x faster."""
    if not step_flops or not peak:
        return eager_step_s / GUESS_SPEEDUP
    return min(eager_step_s, max(eager_step_s / 4, step_flops / (0.75 * peak)))


class AutoPlan:
    """`dtype: auto` and `compile: auto` decided by measurement.

    The loop runs its first steps eagerly, `timed` (+1 warm-up) in each candidate dtype
    (those the hardware computes natively), then `decide` compares, for the time left,
    how many steps each option gets done: eager R / e, compiled (R - w) / c, with the
    eager step e timed, and the compiled step c and warm-up w measured by earlier runs
    (`compile_cost`), else guessed (c = e / GUESS_SPEEDUP) or predicted from the step's
    FLOPs (`predicted_step_s`). Compiling must win by `MARGIN`.
    """

    timed = 2

    def __init__(self, dtypes: list[str], compile_setting: str, keys: dict[str, str]) -> None:
        self.dtypes, self.compile_setting, self.keys = dtypes, compile_setting, keys
        # set by the loop once known: a step's FLOPs (after the timing steps) and each dtype's peak
        self.step_flops: float | None = None
        self.peaks: dict[str, float | None] = {}
        self.times: dict[str, list[float]] = {d: [] for d in dtypes}
        self._seen: dict[str, int] = {d: 0 for d in dtypes}

    def next_dtype(self) -> str | None:
        """The dtype of the next timing step, None once every candidate is timed."""
        for d in self.dtypes:
            if len(self.times[d]) < self.timed:
                return d
        return None

    def record(self, dtype: str, seconds: float) -> None:
        self._seen[dtype] += 1
        if self._seen[dtype] > 1:  # a dtype's first step warms up (kernels, a C build)
            self.times[dtype].append(seconds)

    def eager_step_s(self, dtype: str) -> float:
        return sorted(self.times[dtype])[len(self.times[dtype]) // 2]

    def decide(self, remaining_s: float, steps_left: int | float | None = None) -> tuple[str, bool, str]:
        """(dtype, compile, why) for the `remaining_s` seconds of training left; `steps_left`
        when a step or token budget bounds them (then named: a time would be a guess of it)."""
        options = []  # (steps done in remaining_s, dtype, compiled, description)
        for d in self.dtypes:
            e = self.eager_step_s(d)
            options.append((remaining_s / e, d, False, f"{d} eager {1e3 * e:.0f} ms/step"))
            if self.compile_setting == "auto":
                cost = compile_cost(self.keys[d])
                if cost.speedup:
                    c = e / cost.speedup
                elif cost.step_s:
                    c = min(e, cost.step_s)
                else:
                    c = predicted_step_s(self.step_flops, self.peaks.get(d), e)
                    cost.source += "; the step predicted from its FLOPs"
                steps = max(0.0, remaining_s - cost.warmup_s) / c / MARGIN
                options.append((steps, d, True, f"{d} compiled ~{1e3 * c:.0f} ms/step after a "
                                                f"~{cost.warmup_s:.0f} s warm-up ({cost.source})"))
        steps, dtype, compiled, what = max(options, key=lambda o: o[0])
        others = "; ".join(o[3] for o in options if o[1:3] != (dtype, compiled))
        left = f"~{remaining_s:.0f} s" if remaining_s >= 10 else f"~{remaining_s:.1f} s" if remaining_s >= 0.1 else "<0.1 s"
        if steps_left is None:
            why = f"{what}: the most steps in the {left} left"
        elif steps_left < 1:
            why = f"{what}: no steps left after the timing steps"
        else:
            steps = round(steps_left)
            why = f"{what}: the fastest for the {steps:,} step{'s' * (steps != 1)} left ({left} eager)"
        why += f" (vs {others})" if others else ""
        return dtype, compiled, why


def inductor_cache_dir() -> Path:
    """Where compiled kernels are kept: TORCHINDUCTOR_CACHE_DIR if the user set it, else
    the per-user cache (torch writes its own default, a folder in /tmp, into the variable)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != os.path.abspath(default_cache_dir()):
        return Path(given)
    return device_module.user_cache_dir() / "inductor"
