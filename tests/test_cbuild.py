"""cbuild's helpers that are not about compiling C: the mark torch.compile reads
(tests/test_startup.py checks the import it saves), and the user cache's JSON files."""

import ctypes
import os
import stat
import subprocess
import sys
from pathlib import Path

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


def test_a_build_is_a_working_library_named_by_everything_that_makes_it(tmp_path, monkeypatch):
    """The cache key holds the C source and the headers it includes, the flags (-march), the
    compiler's version and the CPU: a change in any of them builds anew (a stale library
    loaded instead, built for another CPU or from other code, could be wrong or crash). The
    compile goes to a temporary file renamed over the target: the library is whole."""
    from frawdllm import cbuild

    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FRAWD_MARCH", raising=False)
    (tmp_path / "k.h").write_text("#define K 3\n")
    source = tmp_path / "lib.c"
    source.write_text('#include "k.h"\nint frawd_k(void) { return K; }\n')
    first = cbuild.build(source)
    assert first.stat().st_size > 0 and ctypes.CDLL(str(first)).frawd_k() == 3
    assert cbuild.build(source) == first  # (cached)
    names = {first.name}
    (tmp_path / "k.h").write_text("#define K 4\n")  # a header changed
    header = cbuild.build(source)
    assert ctypes.CDLL(str(header)).frawd_k() == 4
    names.add(header.name)
    monkeypatch.setenv("FRAWD_MARCH", "x86-64" if cbuild.cpu_signature() != "aarch64" else "armv8-a")
    names.add(cbuild.build(source).name)
    monkeypatch.delenv("FRAWD_MARCH")
    monkeypatch.setattr(cbuild, "cpu_signature", lambda: "another cpu")
    names.add(cbuild.build(source).name)
    monkeypatch.undo()
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path / "cache"))
    wrapper = tmp_path / "cc"  # another compiler version
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "cc 99.0" && exit 0\nexec {os.environ.get("CC", "cc")} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(wrapper))
    names.add(cbuild.build(source).name)
    assert len(names) == 5, names


def test_processes_that_need_the_same_library_at_once_compile_it_once(tmp_path):
    """The ranks of `--nproc 2` each compiled the same kernels (25-30 s each on a 2-core AVX2
    machine, both printing "compiling ... (once)"); one compiles now, the other waits for it.
    (The compiler here sleeps 2 s first, so that the two builds overlap.)"""
    source = tmp_path / "lib.c"
    source.write_text("int frawd_k(void) { return 5; }\n")
    slow = tmp_path / "cc"
    slow.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {os.environ.get("CC", "cc")} --version\n'
                    f'sleep 2\nexec {os.environ.get("CC", "cc")} "$@"\n')
    slow.chmod(slow.stat().st_mode | stat.S_IEXEC)
    load = ("import ctypes, sys; from pathlib import Path; from frawdllm import cbuild; "
            "p = cbuild.build(Path(sys.argv[1])); print(ctypes.CDLL(str(p)).frawd_k())")
    env = {**os.environ, "FRAWD_CACHE_DIR": str(tmp_path / "cache"), "CC": str(slow)}
    procs = [subprocess.Popen([sys.executable, "-c", load, str(source)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert [out for out, _ in results] == ["5\n", "5\n"]
    assert sum(err.count("compiling lib.c for this CPU (once)...") for _, err in results) == 1, results


@pytest.mark.skipif(sys.platform == "darwin", reason="ELF libraries only")
def test_a_damaged_cached_library_is_built_again_and_the_build_follows_the_umask(tmp_path):
    """A library cut short (a full disk, a copy that stopped) kept its ELF header: loading
    it mapped segments past its end and the process died of SIGBUS, every run; a file that
    was not a library at all left every later run on PyTorch. And a build was 0711 (mkstemp's
    0600 plus gcc's x bits) whatever the umask, so a group sharing the cache could not load it.
    (In child processes: the unfixed load kills its process.)"""
    source = tmp_path / "lib.c"
    source.write_text("int frawd_k(void) { return 3; }\n")
    load = ("import ctypes, sys; from pathlib import Path; from frawdllm import cbuild; "
            "p = cbuild.build(Path(sys.argv[1])); print(p); print(ctypes.CDLL(str(p)).frawd_k())")
    env = {**os.environ, "FRAWD_CACHE_DIR": str(tmp_path / "cache")}

    def run():
        done = subprocess.run([sys.executable, "-c", load, str(source)], capture_output=True, text=True, env=env,
                              preexec_fn=lambda: os.umask(0o002), timeout=120)
        assert done.returncode == 0, (done.returncode, done.stderr)
        path, value = done.stdout.split()
        return Path(path), value, done.stderr

    library, value, _ = run()
    assert value == "3" and stat.S_IMODE(library.stat().st_mode) == 0o775
    size = library.stat().st_size
    for damage, says in ((lambda: os.truncate(library, 1000), "cut short at 1,000 bytes"),
                         (lambda: library.write_bytes(b"not a library"), "not an ELF library")):
        damage()
        again, value, err = run()
        assert again == library and value == "3" and library.stat().st_size == size
        assert f"the cached {library} is damaged ({says}); removing it" in err, err
