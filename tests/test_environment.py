"""What FrawdLLM takes from the process's surroundings: where the user cache goes ($HOME,
$XDG_CACHE_HOME, no home at all), `~` in config files, and the CPUs the process may use."""

import errno
import io
import os
import pathlib
import pwd
import stat
import subprocess
import sys
import tempfile

import pytest

from frawdllm import cbuild
from frawdllm.cli.sampling_flags import load_engine
from frawdllm.data.shards import check_prepare_options
from frawdllm.errors import FrawdError
from frawdllm.infer import paths
from frawdllm.train import PretrainConfig
from frawdllm.train import device
from frawdllm.train.config import build_config

from conftest import ROOT


def no_passwd_entry(uid):
    raise KeyError(f"getpwuid(): uid not found: {uid}")  # (`docker run -u 12345`: a user id /etc/passwd lacks)


@pytest.fixture
def homeless(tmp_path, monkeypatch):
    """No $HOME, no passwd entry, no cache variables; the temporary folder is tmp_path/tmp."""
    for name in ("HOME", "FRAWD_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_passwd_entry)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(cbuild, "_process_folder", None, raising=False)
    return tmp_path / "tmp"


def test_without_a_home_the_cache_is_a_private_folder_in_the_temporary_folder(homeless):
    with pytest.raises(RuntimeError):
        pathlib.Path.home()  # (what the cache folder was found with)
    folder = homeless / f"frawdllm-cache-{os.getuid()}"
    assert cbuild.cache_dir() == folder / "native"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_temporary_cache_folder_another_user_could_write_is_not_used(homeless):
    taken = homeless / f"frawdllm-cache-{os.getuid()}"
    taken.mkdir()
    taken.chmod(0o777)  # (as if made by someone else: anyone could put a library in it)
    folder = cbuild.cache_dir().parent
    assert folder != taken and folder == cbuild.process_folder() and folder.parent == homeless


def test_training_starts_without_a_home(tmp_path):
    """The peak and compile caches of `frawd pretrain` (--compile auto) read and write the
    user cache; a process without a home used to stop there with a traceback."""
    script = (
        "import pwd, sys, tempfile\n"
        "def no_entry(uid): raise KeyError(uid)\n"
        "pwd.getpwuid = no_entry\n"
        "tempfile.tempdir = sys.argv[1]\n"
        "import torch\n"
        "from frawdllm.train import compile, device\n"
        "cpu = torch.device('cpu')\n"
        "device.update_cache('peaks.json', 'key', 1.0)\n"
        "print(device.cached_peak(cpu, 'fp32'), compile.known_failure(cpu), device.read_cache('peaks.json'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "FRAWD_CACHE_DIR", "XDG_CACHE_HOME")}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "None None {'key': 1.0}\n"
    assert (tmp_path / f"frawdllm-cache-{os.getuid()}" / "peaks.json").is_file()


def test_the_cache_follows_xdg_cache_home_and_frawd_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("FRAWD_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cbuild.cache_dir() == tmp_path / "xdg" / "frawdllm" / "native"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # (the XDG spec: ignored)
    assert cbuild.cache_dir() == tmp_path / "home" / ".cache" / "frawdllm" / "native"
    monkeypatch.setenv("FRAWD_CACHE_DIR", "~/frawdcache")  # (quoted: the shell left the ~)
    assert cbuild.cache_dir() == tmp_path / "home" / "frawdcache" / "native"


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path, monkeypatch):
    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(device, "user_cache_dir", lambda: tmp_path / "new" / "cache")
    monkeypatch.setattr(pathlib.Path, "mkdir", disk_full)
    device.update_cache("peaks.json", "key", 1.0)  # (a full disk becomes a FrawdError in io: not here)
    assert device.read_cache("peaks.json") == {}


def test_paths_in_a_config_file_expand_the_home_folder(tmp_path, monkeypatch):
    """YAML does not expand `~` as the shell does: `out: ~/x` made a folder named `~` here."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text("out: ~/x\ndata: ~/s.txt\ntokenizer: ~/tok/tokenizer.json\ninit_from: ~/model\n")
    cfg = build_config(PretrainConfig, config)
    home = tmp_path / "home"
    assert (cfg.out, cfg.data, cfg.tokenizer, cfg.init_from) == (
        str(home / "x"), str(home / "s.txt"), str(home / "tok" / "tokenizer.json"), str(home / "model"))
    config.write_text("out: runs/~x\ndata: stdlib\ntokenizer: bpe\n")  # (only a leading ~ is a home)
    cfg = build_config(PretrainConfig, config)
    assert (cfg.out, cfg.data, cfg.tokenizer) == ("runs/~x", "stdlib", "bpe")


@pytest.fixture
def one_cpu(monkeypatch):
    """The process may run on CPU 0 only (`taskset -c 0`), whatever the machine has."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)


def test_a_process_pinned_to_one_cpu_counts_one(one_cpu):
    assert cbuild.usable_cpus() == 1
    with pytest.raises(FrawdError, match=r"^--threads 9 is more than 8x the 1 CPUs this process may use \(at most 8;"):
        load_engine("no-model-needed", threads=9)
    with pytest.raises(FrawdError, match=r"^workers must be at most 4 here \(4 per CPU, this process may use 1\), "
                                         r"got 5: more only wait for a core$"):
        check_prepare_options(0.1, 5)


def test_busy_counts_only_the_cores_the_process_may_use(one_cpu, monkeypatch):
    """/proc/stat: core 1 busy, core 0 (this process's) nearly idle."""
    stat_text = "cpu  100 0 100 1000 0 0 0 0\ncpu0 10 0 10 500 0 0 0 0\ncpu1 90 0 90 500 0 0 0 0\nintr 1\n"
    real_open = open
    monkeypatch.setattr(paths, "open", lambda path, *a, **k: io.StringIO(stat_text) if path == "/proc/stat"
                        else real_open(path, *a, **k), raising=False)
    assert paths._machine_cpu_seconds() == 20 / os.sysconf("SC_CLK_TCK")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert paths._machine_cpu_seconds() == 200 / os.sysconf("SC_CLK_TCK")
