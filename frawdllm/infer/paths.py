"""Which forward runs each phase of generation on this machine: decided by a short measurement.

The native C forward (`native.py`) wins where PyTorch's per-operation overhead dominates
(batch-1 decode of a small model); PyTorch eager, whose matrix products are MKL/oneDNN
GEMMs, can win where there is arithmetic to share (long prefills, wide batches), by how
much depending on the CPU (AVX-512 or AVX2 only, core count) and the model. So the
engine times each candidate on the real model, once, for five phases:

    prefill   up to 64 prompt tokens in all          long     more (timed at 256)
    decode    one row, one new token                 batch    2-7 rows, one new token each
    wide      8 rows or more, one new token each

Candidates: PyTorch eager at torch's thread count, the native forward at that thread
count and at one thread. Each phase uses the fastest, so no phase is slower than PyTorch
eager (up to timing noise). Load changes while a program runs (another process takes a
core: a team of threads then waits for its member that has no core), so each phase's
thread count, native or PyTorch eager, keeps being re-decided as it runs (`ThreadChoice`). The choice is
cached in `~/.cache/frawdllm/native/engine_paths.json` (the newest `KEPT_ENTRIES`), keyed by the CPU, the
C build (-march), torch's kernel choice and thread count, the model's shape and the weight type; a
measurement of a model over 20M parameters says so on stderr (smaller ones take a
fraction of a second). A plan measured while other work kept the cores busy (other
processes used over a quarter of the cores while it was timed) is measured again the
next time the machine is quiet:
under load the native team waits for its member without a core, which can make PyTorch
look faster than it is, and that choice would otherwise stay for good.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..cbuild import cache_dir, cpu_signature, march, source_digest, update_json_cache, usable_cpus
from ..io import read_json_object
from ..model.gpt import eval_mode
from . import native as native_forward
from .cache import KVCache, RowKVCache
from .quantize import fp32_activations

PHASES = {"prefill": (1, 32), "long": (1, 256), "decode": (1, 1), "batch": (4, 1), "wide": (16, 1)}  # rows, tokens
FILL = 32  # cached tokens before a timed decode step
LOUD_PARAMS = 20_000_000  # models above this size say on stderr that they are being measured
# Entries engine_paths.json keeps, the last written (~150 bytes each): unbounded, it grew to 2,000
# (300 KB, read by each engine and rewritten at each measurement) with every model shape, weight
# type and thread count ever run; one dropped costs a measurement the next time it is needed
KEPT_ENTRIES = 256


@dataclass(frozen=True)
class Path:
    """How one phase runs: "native" (with `threads`), "torch" (eager) or "compiled"."""

    kind: str
    threads: int = 0

    def __str__(self) -> str:
        return {"torch": "PyTorch eager", "compiled": "torch.compile"}.get(self.kind, f"native ({self.threads} thr)")


class ThreadChoice:
    """The thread count of one phase (native, or PyTorch eager on the CPU), re-decided from
    the times of its own calls.

    `pick()` returns the count with the lower recent cost per token: the median of its
    last three times, so that one call slowed by something else (another thread of this
    process taking a core for a moment: the server's event loop) does not move a phase to
    the count that is slower the rest of the time (in the server, 32-row steps went to one
    thread after single slow calls: 0.6-0.75x the throughput). Now and then it tries the
    other count: every 8 calls while that one looks as fast, doubling up to every 64 while
    it loses, so a loaded machine pays little for the probes (one call in 64 at the slower
    count) and a machine that quiets down gets its threads back within ~70 calls (two
    winning probes, 8 calls apart; up to every 512 calls, a burst of server load left a
    lone client's decoding on one thread for its next ~500 tokens, at 2/3 of the speed).
    """

    RECENT = 3  # times kept per count
    MAX_INTERVAL = 64  # calls between probes of a count that keeps losing

    def __init__(self, first: int, threads: int) -> None:
        self.options = [first] + [n for n in {threads, 1} if n != first]
        self.times: dict[int, list[float]] = {}  # count -> its latest costs per token, newest last
        self._cost = dict.fromkeys(self.options, float("inf"))  # count -> median of its times (kept current)
        self.calls, self.interval = 0, 8

    def cost(self, threads: int) -> float:
        return self._cost[threads]

    def _best(self) -> int:
        return min(self.options, key=self._cost.__getitem__)

    def pick(self) -> int:
        untried = [n for n in self.options if n not in self.times]
        if untried and self.calls > 0:
            return untried[0]
        best = self._best()
        self.calls += 1
        if len(self.options) > 1 and self.calls % self.interval == 0:
            return next(n for n in self.options if n != best)
        return best

    def record(self, threads: int, seconds: float, tokens: int) -> None:
        per_token = seconds / max(tokens, 1)
        was_best = self._best()
        recent = self.times.setdefault(threads, [])
        recent.append(per_token)
        del recent[:-self.RECENT]
        self._cost[threads] = statistics.median(recent)
        if threads != was_best and len(self.times) == len(self.options):
            promising = per_token < self.cost(was_best)  # (this probe alone; the choice takes two)
            self.interval = 8 if promising else min(self.MAX_INTERVAL, 2 * self.interval)


def phase(rows: int, new_tokens: int) -> str:
    """The phase a forward of `rows` rows of `new_tokens` tokens belongs to."""
    if new_tokens > 1:
        return "prefill" if rows * new_tokens <= 64 else "long"
    return "decode" if rows == 1 else "batch" if rows < 8 else "wide"


def torch_logits(
    model: nn.Module, tokens: Int[Tensor, "B T"], positions: Int[Tensor, "B T"], cache: KVCache | RowKVCache
) -> Float[Tensor, "B V"]:
    """PyTorch eager, in eval mode: the last token's logits of each row (keys and values go into `cache`)."""
    with eval_mode(model):
        hidden = model.hidden_states(tokens, positions, cache)  # (B, T, D)
        return model.lm_head(hidden[:, -1]).float()


def _key(model: nn.Module, weights: str, threads: int) -> str:
    # (Not train.device.machine_key, on purpose: a plan is only valid for this C build (-march,
    # native.c's code, AMX on or off) and oneDNN/ATen caps as set, for this model; changing the
    # scheme would also throw away every plan users have measured.)
    isa = [os.environ.get(name, "") for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")]  # torch's kernels
    if os.environ.get("DNNL_MAX_CPU_ISA"):  # (appended only when set: the keys of users who set none stay)
        isa.append(os.environ["DNNL_MAX_CPU_ISA"])
    isa.append(native_forward.has_amx())  # (off: FRAWD_AMX=0, or Linux refused the tile registers)
    code = source_digest(native_forward.LIBRARY.source)  # a faster native.c is measured again
    text = json.dumps([cpu_signature(), march(), code, isa, torch.__version__, threads, weights,
                       asdict(model.config)],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _file():
    return cache_dir() / "engine_paths.json"


BUSY_SHARE = 0.25  # other processes using more than this share of the cores: the machine is busy


def _machine_cpu_seconds() -> float | None:
    """CPU seconds the cores this process may use have been busy since boot, or None.
    /proc/stat has a line per core ("cpu3 ...": all but idle and iowait is busy; steal, time
    the hypervisor gave to other guests, counts as busy); the cores are those of the process's
    affinity (`taskset -c 0`: only what runs on core 0 competes with it), or all of them."""
    try:
        mine = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    except (AttributeError, OSError):
        mine = {"cpu"}  # (the first line: all cores together)
    busy = 0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, *values = line.split()
                if name in mine:
                    fields = [int(v) for v in values]
                    if len(fields) < 5:
                        return None
                    busy += sum(fields[:8]) - fields[3] - fields[4]  # (guest time is in user)
                    mine.remove(name)
    except (OSError, ValueError):
        return None
    return None if mine else busy / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuWindow:
    """A window of time over which to ask how much of the cores other processes used."""

    machine: float | None = None
    own: float = 0.0
    wall: float = 0.0

    @classmethod
    def open(cls) -> "CpuWindow":
        times = os.times()
        return cls(_machine_cpu_seconds(), times.user + times.system, time.perf_counter())

    def others_share(self) -> float | None:
        """The share of the cores other processes used since `open` (None where unknown)."""
        now, times, wall = _machine_cpu_seconds(), os.times(), time.perf_counter() - self.wall
        if now is None or self.machine is None or wall <= 0:
            return None
        others = (now - self.machine) - (times.user + times.system - self.own)
        return max(0.0, others) / (wall * usable_cpus())


def machine_busy(window: CpuWindow | None = None, seconds: float = 0.05) -> bool:
    """Whether other work keeps the cores this process may use busy: other processes used more
    than a quarter of them during `window` (or, without one, during the next `seconds`).
    Where /proc/stat cannot be read: the 1-minute load average above half the cores. (The
    load average alone lags by a minute: a compile that had just started left it low while
    a plan was measured next to it.)"""
    if window is None:
        window = CpuWindow.open()
        time.sleep(seconds)
    share = window.others_share()
    if share is not None:
        return share > BUSY_SHARE
    try:
        return os.getloadavg()[0] > 0.5 * usable_cpus()
    except (AttributeError, OSError):
        return False


def remembered(what: str, model: nn.Module, weights: str, measure: Callable[[], Any]) -> Any:
    """`measure()`'s result (JSON data) for this CPU, C build, torch, thread count, model shape
    and weight type: from `engine_paths.json` when it holds one measured on a quiet machine,
    else measured now and kept there (with whether other processes were busy meanwhile)."""
    key = f"{what}:{_key(model, weights, torch.get_num_threads())}"
    entry = read_json_object(_file()).get(key)
    if isinstance(entry, dict) and "value" in entry and not (entry.get("busy") and not machine_busy()):
        return entry["value"]
    window = CpuWindow.open()
    value = measure()
    busy = machine_busy(window)  # other processes' CPU use while it was measured
    update_json_cache(_file(), key, {"value": value, "busy": busy}, keep=KEPT_ENTRIES)
    return value


def choose(model: nn.Module, decoder: Any, weights: str) -> dict[str, Path]:
    """The fastest path per phase for `model` (native candidates only when `decoder` is given)."""
    if decoder is None:
        return {name: Path("torch") for name in PHASES}
    threads = torch.get_num_threads()

    def measured() -> dict[str, list]:
        if sum(p.numel() for p in model.parameters()) > LOUD_PARAMS:  # (small models take a fraction of a second)
            print("measuring which forward is fastest on this CPU for this model (once)...", file=sys.stderr,
                  flush=True)
        with fp32_activations() if weights == "int8" else nullcontext():  # (as its PyTorch phases will run)
            return {name: [p.kind, p.threads] for name, p in measure(model, decoder, threads).items()}

    plan = remembered("plan", model, weights, measured)
    if not (isinstance(plan, dict) and set(plan) == set(PHASES)):  # (a file from elsewhere)
        plan = measured()
    return {name: Path(kind, int(n)) for name, (kind, n) in plan.items()}


@torch.inference_mode()
def measure(model: nn.Module, decoder: Any, threads: int, budget_s: float = 0.15) -> dict[str, Path]:
    """Time each candidate on each phase's shape (runs interleaved, medians) and keep the fastest."""
    cfg = model.config
    candidates = [Path("torch"), Path("native", threads)] + ([Path("native", 1)] if threads > 1 else [])
    gen = torch.Generator().manual_seed(0)
    plan = {}
    for name, (rows, new) in PHASES.items():
        new = min(new, cfg.context_length)
        fill = 0 if new > 1 else min(FILL, cfg.context_length - 1)
        cache = KVCache(cfg, rows, fill + new)
        tokens = torch.randint(cfg.vocab_size, (rows, new), generator=gen)
        positions = torch.arange(fill, fill + new).expand(rows, new).contiguous()
        if fill:
            cache.begin(fill)
            torch_logits(model, torch.randint(cfg.vocab_size, (rows, fill), generator=gen),
                         torch.arange(fill).expand(rows, fill), cache)

        def run(path: Path) -> float:
            cache.length = fill
            cache.begin(new)
            start = time.perf_counter()
            if path.kind == "native":
                decoder.forward(tokens, positions, cache, path.threads)
            else:
                torch_logits(model, tokens, positions, cache)
            return time.perf_counter() - start

        times: dict[Path, list[float]] = {p: [] for p in candidates}
        for p in candidates:
            run(p)  # warm-up
        started = time.perf_counter()
        while len(times[candidates[0]]) < 3 or (time.perf_counter() - started < budget_s
                                                and len(times[candidates[0]]) < 15):
            for p in candidates:
                times[p].append(run(p))
        plan[name] = min(candidates, key=lambda p: statistics.median(times[p]))
    return plan


__all__ = ["Path", "ThreadChoice", "PHASES", "phase", "choose", "measure", "torch_logits"]
