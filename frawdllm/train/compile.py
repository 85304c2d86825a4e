"""torch.compile for training steps.

`compile_step(fn)` is `torch.compile(fn)` run with inductor's buffer reuse turned off.
torch 2.13's inductor miscompiles the backward of a compiled region that is called more
than once (`torch.compiler.nested_compile_region`, which the transformer blocks share so
that warm-up compiles one block instead of n_layer): with buffer reuse on, a saved
activation is overwritten and gradients come out up to ~1000x too large while the loss
is right. With it off, the gradients equal eager's (tests/test_compile.py pins this for
every block style) and the step is as fast. The blocks check the same switch, so a plain
`torch.compile(model)` inlines every layer instead and is correct too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch._inductor.config as inductor_config


def compile_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` compiled with torch.compile; tracing and compiling happen with buffer reuse off."""
    compiled = torch.compile(fn)

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        with inductor_config.patch(allow_buffer_reuse=False):
            return compiled(*args, **kwargs)

    return step
