"""The training loop's progress: a tqdm bar on a terminal, whole lines elsewhere.

The bar shows the share of the first budget to run out (--max-steps, --max-tokens or
--max-time), the step, its loss, the task's own metrics, tokens/s, MFU and the time left.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import TYPE_CHECKING

from .device import format_mfu

if TYPE_CHECKING:
    from .loop import Trainer


def budget_value(value: int | float | None) -> str:
    return "none" if value is None else f"{value:g} s" if isinstance(value, float) else str(value)


def si(n: int | float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


LOG_LINE_INTERVAL_S = 30.0


def progress_bar(enabled: bool, progress: float):
    """A bar on a terminal; elsewhere (a log file, a pipe) `LogLines`, and on a terminal that
    says it has 0 columns (some `docker exec -t` and CI ptys), where tqdm draws nothing."""
    if not enabled:
        return None
    if not sys.stderr.isatty() or _columns(sys.stderr) == 0:
        return LogLines(progress, LOG_LINE_INTERVAL_S)
    from tqdm import tqdm

    bar = tqdm(total=1000, bar_format="training {percentage:3.0f}%|{bar}| {desc}", dynamic_ncols=True)
    bar.n = int(1000 * progress)
    return bar


def _columns(terminal) -> int:
    """The width the terminal `terminal` reports (0 where it reports none)."""
    try:
        return os.get_terminal_size(terminal.fileno()).columns
    except (OSError, ValueError):
        return 0


class LogLines:
    """What the bar shows, as one whole line on stderr at the first step and then every
    `interval` seconds: a bar redrawn with carriage returns would fill a log with partial
    lines (~10 a second). Takes the part of tqdm's interface that `bar_update` uses."""

    def __init__(self, progress: float, interval: float) -> None:
        self.n, self.desc, self.interval = int(1000 * progress), "", interval
        self._last = -math.inf

    def set_description_str(self, desc: str, refresh: bool = False) -> None:
        self.desc = desc

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            print(f"training {self.n / 10:3.0f}% | {self.desc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def bar_update(bar, trainer: Trainer, record: dict, now: float) -> None:
    """`now`: the loop's clock (`time.perf_counter()` there), from which the ETA counts."""
    if bar is None:
        return
    progress = trainer.progress()
    speed = trainer._speed(trainer._rate)
    postfix = [f"step {record['step']}", f"loss {record['loss']:.4f}"]
    postfix += [f"{key} {record[key]:.3g}" for key in trainer.task.bar_metrics if key in record]
    postfix.append(f"{si(speed['tokens_per_s'])} tok/s")
    if trainer.task.flops_per_token:
        postfix.append(f"MFU {format_mfu(speed.get('mfu'))}")
    postfix.append(f"ETA {clock(eta(trainer, now))}")
    bar.set_description_str(" | ".join(postfix), refresh=False)
    bar.update(int(1000 * progress) - bar.n)  # redraws at most every bar.mininterval


def eta(trainer: Trainer, now: float) -> float:
    """Seconds until the first budget runs out: a time budget's is what is left of it; a step
    or token budget's, what is left at the pace since this session's first bar update (the
    first step's pace would count the evaluation before it and one-time start-up: 20 minutes
    shown for a 2-minute run). inf (shown "?") where a step or token budget's pace is not
    known yet."""
    cfg = trainer.cfg
    if trainer._eta_from is None:
        trainer._eta_from = (now, trainer.step, trainer.tokens)
    since, step, tokens = trainer._eta_from
    left = [max(cfg.max_time_s - trainer.elapsed(), 0.0)] if cfg.max_time_s else []
    for budget, done, first in ((cfg.max_steps, trainer.step, step), (cfg.max_tokens, trainer.tokens, tokens)):
        if budget:
            left.append((now - since) / (done - first) * max(budget - done, 0) if done > first else math.inf)
    return min(left) if left else math.inf


def clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"
