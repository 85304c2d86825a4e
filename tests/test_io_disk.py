"""Writing files: the permissions a plain open() gives, data flushed to the disk before
the rename that publishes it (and the folder after), and a full disk reported in one
line with nothing half-written and no empty folders left behind; a folder that refuses
the write is reported under the name asked for, not the temporary one.

The full disk is a 1 MiB tmpfs where this machine lets the test mount one (root on
Linux); elsewhere those tests are skipped with the reason.
"""

import errno
import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from frawdllm import FrawdError, FrawdLLM, get_config
import frawdllm.io as io_module
from frawdllm.io import _mount_point, atomic_dir, atomic_path, sync_path, undo_on_error, write_text_atomic
from frawdllm.tokenizer import byte_tokenizer
from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
FRAWD = [sys.executable, "-c", "from frawdllm.cli import main; main()"]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_and_folders_get_the_umask_permissions(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "new" / "a.txt", "x")
        with atomic_dir(tmp_path / "exported") as tmp:
            (tmp / "f").write_text("y")
            (tmp / "sub").mkdir(mode=0o700)
            fd, private = tempfile.mkstemp(dir=tmp / "sub")  # 0600, as a library's own atomic write makes
            os.close(fd)
            os.replace(private, tmp / "sub" / "g")
        with open(tmp_path / "plain.txt", "w") as f:  # the reference: what open() gives
            f.write("z")
        (tmp_path / "plain_dir").mkdir()
    finally:
        os.umask(old)
    assert mode(tmp_path / "new" / "a.txt") == mode(tmp_path / "plain.txt") == 0o666 & ~umask
    assert mode(tmp_path / "exported") == mode(tmp_path / "plain_dir") == 0o777 & ~umask
    assert mode(tmp_path / "exported" / "f") == mode(tmp_path / "exported" / "sub" / "g") == 0o666 & ~umask
    assert mode(tmp_path / "exported" / "sub") == 0o777 & ~umask
    assert mode(tmp_path / "new") == 0o777 & ~umask


def test_model_directory_files_are_readable_by_others_under_umask_022(tmp_path):
    old = os.umask(0o022)
    try:
        FrawdLLM(get_config("tiny", vocab_size=300, n_layer=1, n_embd=32, n_head=4, context_length=16)) \
            .save_pretrained(tmp_path / "m", tokenizer=byte_tokenizer())
    finally:
        os.umask(old)
    assert {p.name: mode(p) for p in (tmp_path / "m").iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644, "tokenizer.json": 0o644}
    assert mode(tmp_path / "m") == 0o755


def test_hf_exports_are_readable_by_others_under_umask_022(tmp_path):
    pytest.importorskip("transformers")
    from frawdllm import Seq2SeqTransformer
    from frawdllm.export.hf_dir import export_hf

    FrawdLLM(get_config("tiny", vocab_size=300, n_layer=1, n_embd=32, n_head=4, context_length=16)) \
        .save_pretrained(tmp_path / "lm", tokenizer=byte_tokenizer())
    Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=300, n_embd=32, n_head=2, n_layer=1, n_encoder_layer=1)) \
        .save_pretrained(tmp_path / "mt", tokenizer=byte_tokenizer())
    old = os.umask(0o022)
    try:
        export_hf(tmp_path / "lm", tmp_path / "gpt2")  # safetensors' own writer makes its file 0600
        export_hf(tmp_path / "mt", tmp_path / "marian")
    finally:
        os.umask(old)
    for out in ("gpt2", "marian"):
        files = {p.name: mode(p) for p in (tmp_path / out).iterdir()}
        assert "model.safetensors" in files and set(files.values()) == {0o644}, files


def test_a_failed_write_leaves_no_temporary_file_and_no_new_folder(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "a" / "b" / "file") as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("writer", ["file", "folder"])
def test_an_unwritable_folder_names_the_path_asked_for_not_the_temporary_name(tmp_path, monkeypatch, writer):
    import tempfile

    def refused(prefix, suffix, dir):  # what mkstemp/mkdtemp raise in a folder without write permission
        raise PermissionError(errno.EACCES, "Permission denied", f"{dir}/{prefix}x1y2z3w4{suffix}")

    monkeypatch.setattr(tempfile, "mkstemp" if writer == "file" else "mkdtemp", refused)
    target = tmp_path / "h.txt"
    with pytest.raises(PermissionError) as info:
        with (atomic_path(target) if writer == "file" else atomic_dir(target)):
            pass
    assert info.value.filename == str(target) and info.value.errno == errno.EACCES
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def disk_events(monkeypatch):
    """What reaches the disk, in order: ("fsync", path) for each os.fsync (the path its
    descriptor names) and ("replace", source, target) for each os.replace."""
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    def recorded_replace(source, target):
        events.append(("replace", Path(source), Path(target)))
        replace(source, target)

    monkeypatch.delenv("FRAWD_FSYNC", raising=False)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return events


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names file descriptors through /proc")
def test_a_file_reaches_the_disk_before_its_rename_and_the_folder_after(tmp_path, disk_events):
    write_text_atomic(tmp_path / "a.txt", "data")
    (_, synced), (_, source, target), (_, folder) = disk_events
    assert synced == source and source.parent == tmp_path and source.name.startswith(".a.txt.")
    assert target == tmp_path / "a.txt" and folder == tmp_path
    assert (tmp_path / "a.txt").read_text() == "data"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names file descriptors through /proc")
def test_every_file_of_a_folder_reaches_the_disk_before_the_folder_is_renamed(tmp_path, disk_events):
    with atomic_dir(tmp_path / "export") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "a").write_text("1")
        (tmp / "sub" / "b").write_text("2")
    renamed = next(i for i, e in enumerate(disk_events) if e[0] == "replace" and e[2] == tmp_path / "export")
    before = {e[1] for e in disk_events[:renamed] if e[0] == "fsync"}
    assert before == {tmp / "a", tmp / "sub" / "b", tmp / "sub", tmp}
    assert ("fsync", tmp_path) in disk_events[renamed + 1:]


def test_a_model_directory_is_flushed_whole(tmp_path, disk_events):
    FrawdLLM(get_config("tiny", n_layer=1, n_embd=64, n_head=2, vocab_size=300)).save_pretrained(
        tmp_path / "m", tokenizer=byte_tokenizer())
    published = {}  # final path -> index of the rename that published it (or its folder)
    for i, event in enumerate(disk_events):
        if event[0] == "replace":
            published[event[2]] = i
            assert ("fsync", event[1]) in disk_events[:i]  # the data before the name
    files = sorted((tmp_path / "m").iterdir())
    assert files and all(f in published or f.parent in published for f in files)
    last = max(published.values())
    assert ("fsync", tmp_path / "m") in disk_events[last:] or ("fsync", tmp_path) in disk_events[last:]


def test_frawd_fsync_0_renames_without_flushing(tmp_path, disk_events, monkeypatch):
    monkeypatch.setenv("FRAWD_FSYNC", "0")
    write_text_atomic(tmp_path / "a.txt", "data")
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "f").write_text("x")
    assert [e[0] for e in disk_events] == ["replace", "replace"]
    monkeypatch.setenv("FRAWD_FSYNC", "yes")  # (only 0 skips the flushes)
    write_text_atomic(tmp_path / "b.txt", "data")
    assert [e[0] for e in disk_events[2:]].count("fsync") >= 1


def test_a_json_file_that_is_not_an_object_reads_as_empty(tmp_path):
    from frawdllm.io import read_json_object

    for text, expected in (("[1]", {}), ('"x"', {}), ("3", {}), ("{bad", {}), ('{"a": 1}', {"a": 1})):
        (tmp_path / "f.json").write_text(text)
        assert read_json_object(tmp_path / "f.json") == expected, text
    assert read_json_object(tmp_path / "missing.json") == {}


def test_a_disk_that_fills_while_flushing_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    """Delayed allocation: write() succeeded into memory and the disk filled up before the
    data was written back. The failure surfaces at the fsync, before anything is renamed."""
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.delenv("FRAWD_FSYNC", raising=False)
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(FrawdError, match=r"^no space left on .* while writing .*file$"):
        write_text_atomic(tmp_path / "a" / "file", "data")
    with pytest.raises(FrawdError, match=r"^no space left on .* while writing .*/b$"):
        with atomic_dir(tmp_path / "b") as tmp:
            (tmp / "f").write_text("x")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, or a skip where this machine does not allow mounting one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """A model directory whose weights (about 4 MiB) do not fit on the small disk."""
    d = tmp_path_factory.mktemp("big") / "model"
    torch.manual_seed(0)
    FrawdLLM(get_config("tiny", vocab_size=4096, n_layer=1, n_embd=128, n_head=4, context_length=32)) \
        .save_pretrained(d, tokenizer=byte_tokenizer())
    return d


def check_full_disk(proc, disk):
    err = proc.stderr.strip()
    assert proc.returncode == 1, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"frawd: error: no space left on {disk} while writing "), err
    assert sorted(p.relative_to(disk) for p in disk.rglob("*")) == []  # nothing half-written, no folders


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_export_to_a_full_disk_is_one_line_and_leaves_nothing(small_disk, big_model, fmt):
    pytest.importorskip("gguf") if fmt == "gguf" else None
    out = small_disk / "sub" / ("m.gguf" if fmt == "gguf" else "hf")
    proc = subprocess.run([*FRAWD, "export", "--model", str(big_model), "--format", fmt, "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    # the gguf package's own "Writing" progress bar shares stderr (issue 14); the error is one line
    proc.stderr = "\n".join(line for line in re.split("[\r\n]", re.sub(r"Writing:[^\r\n]*?\]", "", proc.stderr))
                            if line)
    check_full_disk(proc, small_disk)


def test_save_pretrained_to_a_full_disk_leaves_no_folder(small_disk, big_model):
    script = ("import sys; from frawdllm import FrawdLLM; from frawdllm.errors import FrawdError\n"
              "m = FrawdLLM.from_pretrained(sys.argv[1])\n"
              "try:\n    m.save_pretrained(sys.argv[2])\nexcept FrawdError as e:\n"
              "    print('frawd: error:', e, file=sys.stderr); sys.exit(1)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(big_model), str(small_disk / "a" / "m")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    check_full_disk(proc, small_disk)


def test_data_prepare_and_tokenizer_train_on_a_full_disk(small_disk, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i}: {'word ' * 40}\n\n" for i in range(20000)))  # ~4 MB
    byte_tokenizer().save(tmp_path / "tok.json")  # (`--tokenizer` wants a file: "byte" is "tokenizer not found")
    proc = subprocess.run([*FRAWD, "data", "prepare", "--data", str(corpus), "--tokenizer",
                           str(tmp_path / "tok.json"), "--out", str(small_disk / "data")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    # the progress bar of the work done before the disk filled shares stderr; the error is one line
    proc.stderr = "\n".join(line for line in re.split("[\r\n]", proc.stderr) if not line.startswith("tokenizing"))
    check_full_disk(proc, small_disk)
    # fill the disk so even a small tokenizer.json cannot be written
    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    proc = subprocess.run([*FRAWD, "tokenizer", "train", "--data", str(corpus), "--kind", "char",
                           "--out", str(small_disk / "tok")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    (small_disk / "filler").unlink()
    check_full_disk(proc, small_disk)


def test_torch_save_on_a_full_disk_is_one_error(small_disk):
    """A checkpoint's state.pt: torch.save reports a short write as a RuntimeError ("[enforce
    fail at inline_container.cc] unexpected pos"), which went out as a traceback."""
    with pytest.raises(FrawdError, match=rf"^no space left on {small_disk} while writing {small_disk / 'state.pt'}$"):
        with atomic_path(small_disk / "state.pt") as tmp:
            torch.save({"moments": torch.zeros(2**19)}, tmp)  # 2 MiB on a 1 MiB disk
    assert list(small_disk.iterdir()) == []


_UNDER_FILE_SIZE_LIMIT = """
import resource, signal, sys, torch
from safetensors.torch import save_file
from frawdllm import FrawdError
from frawdllm.io import atomic_path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
try:
    with atomic_path(sys.argv[1]) as tmp:
        tensors = {"moments": torch.zeros(2**19)}  # 2 MiB
        save_file(tensors, tmp) if sys.argv[1].endswith(".safetensors") else torch.save(tensors, tmp)
except FrawdError as exc:
    print(exc)
"""


@pytest.mark.parametrize("name", ["state.pt", "model.safetensors"])
def test_a_file_size_limit_is_named_not_a_full_disk(tmp_path, name):
    """EFBIG (`ulimit -f`) on a disk with room: safetensors keeps the errno's text and says
    so; torch.save's short write has no errno and was a traceback."""
    proc = subprocess.run([sys.executable, "-c", _UNDER_FILE_SIZE_LIMIT, str(tmp_path / name)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    if name.endswith(".safetensors"):
        assert proc.stdout.strip() == (f"file size limit reached while writing {tmp_path / name} "
                                       "(`ulimit -f`, or the filesystem's largest file)")
    else:
        assert re.fullmatch(rf"could not write {re.escape(str(tmp_path / name))}: the write stopped short "
                            r"with space left on /\S* \(a disk quota or the file size limit, `ulimit -f`\?\): "
                            r"\[enforce fail at inline_container.cc:\d+\] \. unexpected pos \d+ vs \d+",
                            proc.stdout.strip()), proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_export_cleans_what_an_export_killed_before_left_beside_its_out(tmp_path, big_model):
    stale = tmp_path / ".hf.a1b2c3d4.tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_text("half")
    other = tmp_path / ".other.a1b2c3d4.tmp"  # another writer's: not ours to remove
    other.mkdir()
    proc = subprocess.run([*FRAWD, "export", "--model", str(big_model), "--format", "hf", "--out", str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.a1b2c3d4.tmp", "hf"]


# Root deletes read-only files regardless of their mode: without these capabilities it cannot.
AS_OWNER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


def test_a_replaced_folder_that_cannot_be_deleted_leaves_the_new_one_and_a_warning_naming_it(tmp_path):
    """--overwrite onto a read-only old output: the new one is in place and a warning names
    the old copy left over and the file that resisted, by full path (it was an error naming
    only "tokenizer.json", with the new one already in place); the clean-up of a later write
    names it again (it ignored it)."""
    if os.geteuid() == 0 and subprocess.run([*AS_OWNER, "true"], capture_output=True).returncode != 0:
        pytest.skip("setpriv cannot drop root's file-permission override here")
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("old")
    out.chmod(0o555)
    script = f"""
import warnings
from pathlib import Path
from frawdllm.io import atomic_dir, clean_partial
warnings.simplefilter("always")
out = Path({str(out)!r})
with atomic_dir(out, overwrite=True) as tmp:
    (tmp / "new.txt").write_text("new")
clean_partial(out.parent, only="out")
"""
    proc = subprocess.run([*(AS_OWNER if os.geteuid() == 0 else []), sys.executable, "-c", script],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    for p in left:
        p.chmod(0o755)  # (for pytest's clean-up)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(out) == ["new.txt"] and len(left) == 1
    warned = [line for line in proc.stderr.splitlines() if "UserWarning" in line]
    assert len(warned) == 2, proc.stderr
    assert all(f"is left at {left[0]} (permission denied: {left[0] / 'tokenizer.json'})" in w for w in warned)
    assert "replaced" in warned[0] and "old copy" in warned[1]


def test_a_symbolic_link_to_nowhere_is_refused_and_kept(tmp_path):
    """A dangling link counted as a folder our write had created (`exists()` is False for
    it), so the failed write deleted the user's link; an export said "not a directory:
    .lnk.x1y2z3w4.tmp -> lnk", a name of ours the user never gave."""
    link = tmp_path / "lnk"
    link.symlink_to("nowhere")
    said = (f"^{re.escape(str(link))} is a symbolic link to nowhere, which does not exist: "
            "remove the link or choose another path$")
    for writer in (atomic_path(link), atomic_path(link / "sub" / "f"), atomic_dir(link), atomic_dir(link / "sub"),
                   undo_on_error(link), undo_on_error(link / "sub")):
        with pytest.raises(FrawdError, match=said):
            with writer:
                pass
    assert os.listdir(tmp_path) == ["lnk"] and os.readlink(link) == "nowhere"


@pytest.mark.parametrize("command", ["tokenizer", "data", "export", "export-below"])
def test_out_a_symbolic_link_to_nowhere_is_one_line_and_the_link_stays(tmp_path, capsys, command):
    tok = byte_tokenizer()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("first document\n\nsecond document\n")
    tok.save(tmp_path / "tok.json")
    if command.startswith("export"):
        FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=4, context_length=16)) \
            .save_pretrained(tmp_path / "model", tokenizer=tok)
    before = sorted(os.listdir(tmp_path))
    link = tmp_path / "lnk"
    link.symlink_to("nowhere")
    out = link / "sub" if command == "export-below" else link
    args = {"tokenizer": ["tokenizer", "train", "--data", corpus, "--kind", "char", "--out", out],
            "data": ["data", "prepare", "--data", corpus, "--tokenizer", tmp_path / "tok.json", "--out", out],
            "export": ["export", "--model", tmp_path / "model", "--format", "hf", "--out", out]}
    code, _, err = run_cli(capsys, *args[command.split("-")[0]])
    assert code == 1 and err == (f"frawd: error: {link} is a symbolic link to nowhere, which does not exist: "
                                 "remove the link or choose another path\n")
    assert os.readlink(link) == "nowhere" and sorted(os.listdir(tmp_path)) == sorted([*before, "lnk"])


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names file descriptors through /proc")
@pytest.mark.parametrize("failing", ["train.bin", "val.bin"])
@pytest.mark.parametrize("how", ["write", "fsync"])
def test_a_full_disk_names_the_file_being_written_not_another_one_open(tmp_path, monkeypatch, failing, how):
    """`data prepare` writes train.bin and val.bin at once (two atomic_path blocks, one inside
    the other). The disk filled while writing train.bin, and the message named val.bin (674
    bytes), the inner block, which worded the error first with its own name."""
    files = {}  # name -> its temporary file
    fsync = os.fsync

    def full_fsync(fd):  # the data of `failing` does not fit
        if Path(os.readlink(f"/proc/self/fd/{fd}")) == files[failing]:
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.delenv("FRAWD_FSYNC", raising=False)
    monkeypatch.setattr(os, "fsync", full_fsync)
    with pytest.raises(FrawdError) as info:
        with atomic_path(tmp_path / "train.bin") as files["train.bin"], \
                atomic_path(tmp_path / "val.bin") as files["val.bin"]:
            files["val.bin"].write_bytes(b"small")
            if how == "write":
                try:  # the write, its OSError naming the (temporary) file it was writing
                    raise OSError(errno.ENOSPC, "No space left on device", str(files[failing]))
                except OSError:  # closing that file flushes it again, and fails naming no file
                    raise OSError(errno.ENOSPC, "No space left on device")
            sync_path(files["train.bin"])  # the delayed write-back fails here, as shards.py flushes them
            sync_path(files["val.bin"])
    assert str(info.value) == f"no space left on {_mount_point(tmp_path)} while writing {tmp_path / failing}"
    assert list(tmp_path.iterdir()) == []


def test_an_empty_folder_the_user_made_is_filled_in_place_keeping_its_mode(tmp_path):
    """An export into a private (700) or group-shared (2770) empty folder replaced it with a
    new 755 one; into a mount point (a container's volume) the rename failed with EBUSY and
    left a `.old` folder at each try. The folder itself is kept now (same inode) and filled."""
    out = tmp_path / "private"
    out.mkdir()
    out.chmod(0o2700)
    inode = out.stat().st_ino
    with atomic_dir(out) as tmp:
        assert tmp.parent == out  # (made inside it: same filesystem as the folder, mount point or not)
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a").write_text("a")
    assert out.stat().st_ino == inode and stat.S_IMODE(out.stat().st_mode) == 0o2700
    assert sorted(os.listdir(out)) == ["config.json", "sub"] and (out / "sub" / "a").read_text() == "a"
    assert sorted(os.listdir(tmp_path)) == ["private"]
    # what a killed write into it left is tidied, and does not count as holding an output
    other = tmp_path / "other"
    other.mkdir()
    (other / ".other.abcd1234.tmp").mkdir()
    with atomic_dir(other) as tmp:
        (tmp / "f").write_text("x")
    assert os.listdir(other) == ["f"]


def test_overwrite_keeps_the_replaced_folders_mode_and_a_mount_point_is_one_line(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    out.chmod(0o700)
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert os.listdir(out) == ["new.txt"] and stat.S_IMODE(out.stat().st_mode) == 0o700
    real_replace = os.replace

    def busy(source, target):  # what renaming a mount point gives
        if Path(source) == out:
            raise OSError(errno.EBUSY, "Device or resource busy", str(source))
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", busy)
    monkeypatch.setattr(io_module, "_exchange", lambda a, b: False)  # (as renameat2 refuses a mount point)
    with pytest.raises(FrawdError, match=rf"^{re.escape(str(out))} is a mount point: --overwrite cannot replace "
                                         r"it; empty it first, or choose another folder$"):
        with atomic_dir(out, overwrite=True) as tmp:
            (tmp / "newer.txt").write_text("newer")
    assert os.listdir(out) == ["new.txt"] and sorted(os.listdir(tmp_path)) == ["out"]  # (no .old left)


def test_overwrite_swaps_the_folder_in_one_step_so_it_is_never_missing(tmp_path, monkeypatch):
    """--overwrite set the old folder aside, then renamed the new one in: between the two,
    a reader (a server loading RUN/model while training published a better model) found no
    folder. Linux swaps them in one step (renameat2's RENAME_EXCHANGE)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("an atomic swap of two folders is Linux's renameat2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real_replace, seen = os.replace, []

    def watched(source, target):
        real_replace(source, target)
        seen.append(out.is_dir())

    monkeypatch.setattr(os, "replace", watched)
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert os.listdir(out) == ["new.txt"] and sorted(os.listdir(tmp_path)) == ["out"]
    assert all(seen), seen


@pytest.mark.parametrize("existing", [False, True])
def test_a_writer_that_finishes_second_does_not_replace_the_first_ones_output(tmp_path, existing):
    """Two exports to one new --out: both said "exported", the second had silently replaced the
    first (only --overwrite may); the checks ran at the start, the swap at the end regardless."""
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    with pytest.raises(FrawdError, match=rf"^{re.escape(str(out))} exists and is not empty \(written meanwhile by "
                                         r"another process\); choose a new directory \(or --overwrite\)$"):
        with atomic_dir(out) as first:
            (first / "who").write_text("first")
            with atomic_dir(out) as second:
                (second / "who").write_text("second")
    assert (out / "who").read_text() == "second" and sorted(os.listdir(tmp_path)) == ["out"]
    assert os.listdir(out) == ["who"]


@pytest.mark.parametrize("links", [True, False])
def test_a_file_writer_that_finishes_second_without_overwrite_is_refused(tmp_path, monkeypatch, links):
    """Two `tokenizer train` (or GGUF exports) to one new --out: both said "wrote", and the
    second file silently replaced the first. Without --overwrite (replace=False) the second
    is refused; with it, it replaces. (Where hard links are not supported: checked, then renamed.)"""
    if not links:
        def no_links(src, dst):
            raise OSError(errno.EPERM, "links not supported")
        monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "tokenizer.json"
    with pytest.raises(FrawdError, match=rf"^{re.escape(str(out))} exists \(written meanwhile by another process\); "
                                         r"choose a new path \(or --overwrite\)$"):
        with atomic_path(out, replace=False) as first:
            first.write_text("first")
            write_text_atomic(out, "second", replace=False)
    assert out.read_text() == "second" and os.listdir(tmp_path) == ["tokenizer.json"]
    write_text_atomic(out, "third")  # (replace=True: --overwrite)
    assert out.read_text() == "third" and os.listdir(tmp_path) == ["tokenizer.json"]


def test_a_symbolic_link_as_the_output_is_written_through(tmp_path):
    """--overwrite onto a link to a folder failed with "is a directory: lk -> .lk.9rrmwir4.old"
    (the swap renamed the link); onto a link to a file it replaced the link by a file and
    left the target as it was. Both now write through the link, as open() does."""
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "real").mkdir()
    (tmp_path / "store" / "real" / "old.txt").write_text("old")
    (tmp_path / "lk").symlink_to(tmp_path / "store" / "real")
    with atomic_dir(tmp_path / "lk", overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert (tmp_path / "lk").is_symlink() and os.listdir(tmp_path / "store" / "real") == ["new.txt"]
    assert sorted(os.listdir(tmp_path / "store")) == ["real"]  # (nothing left beside it)
    (tmp_path / "store" / "f.gguf").write_text("old")
    (tmp_path / "f.gguf").symlink_to(tmp_path / "store" / "f.gguf")
    write_text_atomic(tmp_path / "f.gguf", "new")
    assert (tmp_path / "f.gguf").is_symlink() and (tmp_path / "store" / "f.gguf").read_text() == "new"
    assert sorted(os.listdir(tmp_path / "store")) == ["f.gguf", "real"]


def test_an_inner_writes_error_names_the_file_as_it_will_be_called(tmp_path):
    """A full disk under an inner atomic write named `OUT/.model.6w70wn7u.tmp/model.safetensors`."""
    out = tmp_path / "model"
    named = re.escape(str(out / "model.safetensors"))
    with pytest.raises(FrawdError, match=rf"^no space left on / while writing {named}$"):
        with atomic_dir(out) as tmp:
            raise FrawdError(f"no space left on / while writing {tmp / 'model.safetensors'}")
