"""What `frawdllm.cli.main` does around every command: a reader of stdout that leaves
(`| head`), a hangup (SIGHUP: the terminal closed, ssh dropped), running out of memory and
a terminal whose encoding cannot show the output."""

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.cli import info as info_command
from frawdllm.tokenizer import byte_tokenizer
from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
FRAWD = [sys.executable, "-c", "from frawdllm.cli import main; main()"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = byte_tokenizer()
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("model")
    FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=4, context_length=64)) \
        .save_pretrained(directory, tokenizer=tok)
    return directory


@pytest.mark.parametrize("args", [["info", "--preset", "tiny"], ["generate"], ["generate", "--stream"],
                                  ["generate", "--json"]], ids=" ".join)
def test_a_reader_that_leaves_ends_the_command_quietly_as_sigpipe_does(model_dir, args):
    """`frawd info | true` exited 1 without a word: click took the BrokenPipeError, and piped
    output is buffered, so the error came at the flush at exit ("Exception ignored"). Now
    the status is 141, as a program killed by SIGPIPE gives (`yes | head -1`)."""
    if args[0] == "generate":
        args = [*args, "--model", str(model_dir), "--prompt", "Hello", "--max-new-tokens", "20"]
    proc = subprocess.Popen([*FRAWD, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader leaves before a line is written
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert err == ""


@pytest.mark.parametrize("args, closed", [(["info", "--preset", "tiny"], ">&-"), (["generate"], ">&-"),
                                          (["chat"], "<&-")], ids=lambda v: v if isinstance(v, str) else v[0])
def test_a_closed_stdout_or_stdin_is_no_traceback(model_dir, args, closed):
    """`frawd info >&-` ended in AttributeError tracebacks (Python's sys.stdout is None for a
    closed descriptor), after an export or a tokenizer had been written; `chat <&-` too."""
    if args[0] != "info":
        args = [*args, "--model", str(model_dir), *(["--prompt", "Hello", "--max-new-tokens", "5"]
                                                    if args[0] == "generate" else [])]
    proc = subprocess.run(["sh", "-c", f'"$@" {closed}', "sh", *FRAWD, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, stdin=None if closed == "<&-" else subprocess.DEVNULL)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


# `frawd data prepare` whose first write of a shard waits 3 s: the test's signal comes then.
SLOW_PREPARE = """
import sys, time
from frawdllm.cli import main
from frawdllm.data.shard_format import ShardWriter
write = ShardWriter.write
def slow_write(self, tokens):
    write(self, tokens)
    if not hasattr(ShardWriter, "waited"):
        ShardWriter.waited = True
        time.sleep(3)
ShardWriter.write = slow_write
main()
"""


def start_slow_prepare(tmp_path, **popen):
    # SIGHUP as a terminal's session has it, even where the suite runs under nohup (which
    # the command, rightly, keeps ignoring: the hangup tests then saw exit 0)
    popen.setdefault("preexec_fn", lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i}: {'word ' * 20}\n\n" for i in range(200)))
    byte_tokenizer().save(tmp_path / "tok.json")
    out = tmp_path / "shards"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE, "data", "prepare", "--data", str(corpus),
                             "--tokenizer", str(tmp_path / "tok.json"), "--out", str(out)], cwd=ROOT, **popen)
    return proc, out


def wait_for_temporary_files(proc, out, drain=None):
    """Until the shards' temporary files exist (the child is in its slow write)."""
    deadline = time.monotonic() + 60
    while not (out.is_dir() and any(p.name.startswith(".train.bin.") for p in out.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, "no temporary shard appeared"
        if drain is not None:
            drain()
        time.sleep(0.05)
    time.sleep(0.3)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_hangup_ends_a_command_as_sigterm_does_leaving_nothing(tmp_path, stop):
    """SIGHUP (the terminal closed, ssh dropped) killed the command where it stood: `data
    prepare` left its 8 MB `.train.bin.*.tmp` files, an export its `.X.tmp/` folder."""
    proc, out = start_slow_prepare(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_temporary_files(proc, out)
    proc.send_signal(stop)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.split() == ["aborted"], err
    assert not out.exists()  # a first run: not even its folder


def test_a_hangup_ignored_by_nohup_stays_ignored(tmp_path):
    """`nohup frawd ...` ignores SIGHUP so that the command survives the terminal closing."""
    proc, out = start_slow_prepare(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    wait_for_temporary_files(proc, out)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_a_hangup_of_the_terminal_itself_still_tidies_up(tmp_path):
    """When the terminal is gone a write to it fails (EIO): the "aborted" line, a progress
    bar, a trainer's log before its checkpoint. What is printed after the hangup goes to
    /dev/null instead, and the command ends as at SIGTERM."""
    terminal, child_end = pty.openpty()
    proc, out = start_slow_prepare(tmp_path, stdin=subprocess.DEVNULL, stdout=child_end, stderr=child_end,
                                   start_new_session=True)
    os.close(child_end)

    def drain():  # read the progress bar, so the terminal's buffer never fills
        while select.select([terminal], [], [], 0)[0]:
            os.read(terminal, 4096)

    try:
        wait_for_temporary_files(proc, out, drain)
    finally:
        os.close(terminal)  # the terminal goes: writes to it fail from now on
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=60) == 130
    assert not out.exists()


@pytest.mark.parametrize("error, said", [
    (MemoryError(), "out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 8000000000 bytes. Error code 12 (Cannot allocate memory)"),
     "out of memory: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8000000000 bytes. "
     "Error code 12 (Cannot allocate memory)"),
    (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 64 bytes.\nmore"),
     "out of memory: DefaultCPUAllocator: not enough memory: you tried to allocate 64 bytes."),
], ids=["MemoryError", "can't allocate", "not enough"])
def test_out_of_memory_is_one_line_with_a_hint(capsys, monkeypatch, error, said):
    """`ulimit -v 600000; frawd pretrain ...` ended in a MemoryError or torch allocator traceback."""
    def allocate(**options):
        raise error

    monkeypatch.setattr(info_command.info, "callback", allocate)
    code, _, err = run_cli(capsys, "info", "--preset", "tiny")
    assert code == 1
    assert err == f"frawd: error: {said}; try a smaller --batch-size or model, or a machine with more memory\n"


def test_any_other_runtime_error_keeps_its_traceback(capsys, monkeypatch):
    def broken(**options):
        raise RuntimeError("a bug")

    monkeypatch.setattr(info_command.info, "callback", broken)
    with pytest.raises(RuntimeError, match="^a bug$"):
        run_cli(capsys, "info", "--preset", "tiny")


def test_output_the_terminal_cannot_encode_is_escaped_not_a_crash(tmp_path):
    """PYTHONIOENCODING=latin-1 (or a C locale): printing a path with 日本 in it crashed with
    a UnicodeEncodeError traceback, after the file was written."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a small corpus\n\nof two documents\n")
    proc = subprocess.run([*FRAWD, "tokenizer", "train", "--data", str(corpus), "--kind", "char",
                           "--out", str(tmp_path / "日本" / "tok")], cwd=ROOT, capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONIOENCODING": "latin-1"})
    assert proc.returncode == 0, proc.stderr.decode("latin-1")
    assert f"wrote {tmp_path}/\\u65e5\\u672c/tok/tokenizer.json" in proc.stdout.decode("latin-1")
    assert (tmp_path / "日本" / "tok" / "tokenizer.json").is_file()


@pytest.mark.parametrize("value", ["", "0", "-1", "abc", "2x"])
def test_an_empty_or_invalid_thread_count_variable_is_no_openmp_warning(value):
    """OMP_NUM_THREADS set empty (an unset shell variable) or to no count: OpenMP printed its own
    "libgomp: Invalid value" line into the output when torch loaded, and went on with its default.
    Empty now means unset; anything else that is no count is refused in one line."""
    proc = subprocess.run([*FRAWD, "info", "--preset", "tiny"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": value})
    assert "libgomp" not in proc.stderr + proc.stdout
    if value:
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr == (f"frawd: error: OMP_NUM_THREADS={value!r} is not a thread count: give a number "
                               "from 1 (or a list such as 2,1), or unset it\n")
    else:
        assert proc.returncode == 0, proc.stderr
        assert "parameters" in proc.stdout


@pytest.mark.parametrize("value", ["1", " 2 ", "2,1"])
def test_a_thread_count_openmp_reads_is_kept(value):
    proc = subprocess.run([*FRAWD, "info", "--preset", "tiny"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": value})
    assert proc.returncode == 0 and "libgomp" not in proc.stderr, proc.stderr
