"""What the benchmark scripts share: argument types that refuse nonsense at parse time, the
`cpu_features=` line, and one-line errors for bad input or a missing optional package.

    from bench_common import ArgumentParser, cpu_features_line, positive_int, require, run_main

(the scripts run as `python benchmarks/X.py`, so this folder is on sys.path.)
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line on stderr (no usage block), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


positive_int = _int_at_least(1)  # argparse types
non_negative_int = _int_at_least(0)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (nan passes every comparison, so it is named)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def duration(text: str) -> str:
    """An argparse type: a duration as `frawd` reads it ("90", "100s", "5m", "1h30m"),
    checked here and passed on as written."""
    from frawdllm.errors import FrawdError
    from frawdllm.train.config import parse_duration

    try:
        parse_duration(text)
    except FrawdError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


# The CPU features that decide what is fast here (the list `frawd info` shows), plus ARM's
# fp16 arithmetic (fphp), which the native decoder's fp16 weights use.
def cpu_features_line() -> str:
    """`cpu_features=a,b,c` (comma-separated; `none` when the CPU has none of them)."""
    from frawdllm.train.device import SHOWN_FEATURES, cpu_features

    found = [f for f in (*SHOWN_FEATURES, "fphp") if f in cpu_features()]
    return f"cpu_features={','.join(found) or 'none'}"


def require(module: str, install: str) -> None:
    """Stop with one line, `<script>: error: <module> is not installed; pip install '<install>'`
    (exit status 1), where an optional package the benchmark needs is missing: called up
    front, before any work, not after minutes of it."""
    if importlib.util.find_spec(module) is None:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {module} is not installed; pip install '{install}'")


def run_main(main) -> None:
    """Run a script's `main()`: bad input (the project's `FrawdError`, its `ConfigError`
    included, or an `OSError` such as a missing file) becomes one line on stderr,
    `<script>: error: ...`, and exit status 1, as `frawd` does. Anything else is a bug and
    keeps its traceback."""
    from frawdllm.cli import one_line_warnings
    from frawdllm.errors import FrawdError

    one_line_warnings()  # (a budget overrun is `warning: ...`, not Python's file:line: source form)
    try:
        main()
    except (FrawdError, OSError) as error:
        message = " ".join(str(error).split())  # one line
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {message}")
