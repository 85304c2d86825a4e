"""cbuild's helpers that are not about compiling C: the mark torch.compile reads
(tests/test_startup.py checks the import it saves), and the user cache's JSON files."""

import ctypes

import pytest
import torch

from frawdllm.cbuild import constant_under_compile, update_json_cache
from frawdllm.io import read_json_object as read_json_cache


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


def test_a_missing_corrupt_or_non_object_json_cache_reads_as_empty(tmp_path):
    path = tmp_path / "cache.json"
    assert read_json_cache(path) == {}
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        path.write_bytes(content)
        assert read_json_cache(path) == {}
    update_json_cache(path, "key", 1.0)  # (a corrupt file is replaced)
    assert read_json_cache(path) == {"key": 1.0}


def test_a_bounded_json_cache_keeps_the_entries_written_last(tmp_path):
    path = tmp_path / "cache.json"
    for key in "abcd":
        update_json_cache(path, key, key.upper(), keep=3)
    assert list(read_json_cache(path)) == ["b", "c", "d"]
    update_json_cache(path, "b", "B2", keep=3)  # written again: the newest now
    update_json_cache(path, "e", "E", keep=3)
    assert read_json_cache(path) == {"d": "D", "b": "B2", "e": "E"}
    assert list(read_json_cache(path)) == ["d", "b", "e"]
    update_json_cache(path, "f", "F")  # (no bound: nothing dropped)
    assert list(read_json_cache(path)) == ["d", "b", "e", "f"]


def test_a_json_cache_that_cannot_be_written_is_skipped(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    update_json_cache(blocker / "cache.json", "key", 1.0)  # (its folder is a file: no error)
    assert read_json_cache(blocker / "cache.json") == {}
