"""cbuild's helper that is not about compiling C: the mark torch.compile reads
(tests/test_startup.py checks the import it saves)."""

import ctypes

import pytest
import torch

from frawdllm.cbuild import constant_under_compile


def test_the_mark_is_the_one_torchs_decorator_sets():
    def ours() -> int:
        return 1

    def theirs() -> int:
        return 1

    constant_under_compile(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(ours)


def _libc_abs() -> int:
    # a foreign call: dynamo cannot trace into it, so only a constant result compiles in one graph
    return ctypes.CDLL(None).abs(-3)


def test_torch_compile_takes_a_marked_function_as_a_constant():
    marked = constant_under_compile(lambda: _libc_abs())
    compiled = torch.compile(lambda x: x * marked(), fullgraph=True, backend="eager")
    assert compiled(torch.ones(2)).tolist() == [3.0, 3.0]

    unmarked = lambda: _libc_abs()  # noqa: E731
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(lambda x: x * unmarked(), fullgraph=True, backend="eager")(torch.ones(2))
