"""Wall-clock assertions on a shared machine.

A time budget test measures the code only while the code has the CPU: when other work (or the
hypervisor) takes the core away for a moment, the wall clock runs on and the run overshoots
for reasons outside the code. `on_a_free_core` runs a timed job again when its process (and
its children) got less than 90% of a core over the run, and the test then asserts on a run
that had the core; a run that overshoots with the core is a failure like any other.
"""

import os
import time
from typing import Any, Callable

FREE_SHARE = 0.9  # an uncontended one-thread run measures 0.97-0.99 here


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def on_a_free_core(run: Callable[[], Any], tries: int = 3) -> tuple[Any, float]:
    """(`run()`'s result, its wall seconds) from the first of `tries` runs whose process had at
    least FREE_SHARE of a core throughout; the last run's if none had."""
    for attempt in range(tries):
        cpu, start = _cpu_seconds(), time.perf_counter()
        result = run()
        wall = time.perf_counter() - start
        share = (_cpu_seconds() - cpu) / wall
        if share >= FREE_SHARE:
            break
        print(f"run {attempt + 1}: the process had {share:.0%} of a core (the machine was busy): again")
    return result, wall
