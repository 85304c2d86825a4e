"""cbuild's helpers that are not about compiling C: the mark torch.compile reads, and the
import cost it saves."""

import ctypes
import subprocess
import sys

import pytest
import torch

from frawdllm.cbuild import constant_under_compile

from conftest import ROOT


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


def test_importing_the_package_does_not_import_the_compiler():
    # torch._dynamo takes ~2 s to import and ~0.5 s more to tear down at exit, in every
    # command; only a run that compiles should pay it
    code = ("import sys; import frawdllm.cli, frawdllm.train.loop, frawdllm.infer.engine, frawdllm.model; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
