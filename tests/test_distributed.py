"""Training on 2 processes (torchrun, gloo on the CPU) against one process: the same run.

Every run here is a real `frawd pretrain` (or torchrun) subprocess on a tiny model for 20
steps with checkpoints at steps 10 and 20. The reference is one process with batch 8;
two ranks with batch 4 each must give its losses to 1e-5 (fp32), with DDP and FSDP,
resume each other's checkpoints (2 -> 1, 1 -> 2), stop cleanly when a rank dies or hangs,
and resume after torchrun restarts them.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from frawdllm import FrawdLLM
from frawdllm.data import prepare_shards
from frawdllm.tokenizer import train_tokenizer
from frawdllm.train.checkpoint import latest_checkpoint, list_files, load_state

SHAKESPEARE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare.txt"
STEPS = 20
TOL = 1e-5

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="needs ../shared/data/tinyshakespeare.txt")]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A char tokenizer and prepared shards of 200 kB of Shakespeare."""
    root = tmp_path_factory.mktemp("dist")
    text = SHAKESPEARE.read_text(encoding="utf-8")[:200_000]
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    tok = train_tokenizer([text], kind="char")
    tok.save(root / "tokenizer.json")
    prepare_shards(str(root / "corpus.txt"), tok, root / "shards", val_fraction=0.05)
    return root


def train_args(work: Path, out: Path, *extra: str) -> list[str]:
    return ["pretrain", "--preset", "tiny", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4",
            "--set", "context_length=32", "--data", str(work / "shards"), "--tokenizer", str(work / "tokenizer.json"),
            "--batch-size", "8", "--max-steps", str(STEPS), "--eval-interval", "10", "--eval-batches", "2",
            "--log-interval", "1", "--lr", "3e-3", "--warmup-steps", "2", "--compile", "false", "--dtype", "fp32",
            "--no-progress", "--sample-tokens", "8", "--peak-tflops", "1", "--dist-timeout", "30s",
            "--keep-last", "5", "--out", str(out), *extra]


def environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def frawd(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "frawdllm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=environment())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def layout(run: Path) -> set[str]:
    """The run directory's files and folders (a checkpoint's FSDP shards aside)."""
    return {str(p.relative_to(run)) for p in run.rglob("*")
            if "optimizer" not in p.relative_to(run).parts and "data" not in p.relative_to(run).parts[:1]}


def assert_same_losses(run: Path, reference: Path, steps: range) -> None:
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=TOL, abs=TOL), f"step {step}: {got[step]} vs {want[step]}"


def resumed_from_step_10(run: Path, into: Path) -> Path:
    """A copy of `run` as it stood after its step-10 checkpoint."""
    shutil.copytree(run, into)
    shutil.rmtree(into / "checkpoints" / f"step_{STEPS:08d}")
    return into


@pytest.fixture(scope="module")
def single(work) -> Path:
    """The one-process reference, run in this process (no fresh interpreter's `import torch`)."""
    from frawdllm.cli import main

    try:
        main(train_args(work, work / "single"))
    except SystemExit as exc:
        assert exc.code in (0, None), f"frawd pretrain exited {exc.code}"
    return work / "single"


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two_ranks(request, work) -> tuple[str, Path]:
    out = work / f"two-{request.param}"
    frawd(train_args(work, out, "--nproc", "2", "--parallel", request.param))
    return request.param, out


def test_two_ranks_give_the_losses_of_one_process_with_the_whole_batch(single, two_ranks):
    parallel, run = two_ranks
    assert_same_losses(run, single, range(1, STEPS + 1))
    assert layout(run) == layout(single)  # `frawd pretrain --nproc 2` writes what one process writes
    rerun = (run / "config.yaml").read_text().splitlines()[0]  # (it dropped --nproc)
    assert rerun == f"# rerun: frawd pretrain --nproc 2 --config {run / 'config.yaml'} --out NEW_DIR"
    assert (single / "config.yaml").read_text().startswith("# rerun: frawd pretrain --config ")
    sharded = (run / "checkpoints" / f"step_{STEPS:08d}" / "optimizer").is_dir()
    assert sharded == (parallel == "fsdp")
    listed = json.loads((run / "checkpoints" / f"step_{STEPS:08d}" / "files.json").read_text())
    assert {"state.pt", "model/model.safetensors"} <= set(listed)  # (with every rank's optimizer shard)
    assert sum(name.startswith("optimizer/") and name.endswith(".distcp") for name in listed) == 2 * sharded
    # the published model is the trained one
    a, b = FrawdLLM.from_pretrained(run / "model"), FrawdLLM.from_pretrained(single / "model")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert (p - q).abs().max() < 1e-4, name


def test_resume_two_ranks_to_one(work, single, two_ranks):
    parallel, run = two_ranks
    copy = resumed_from_step_10(run, work / f"two-{parallel}-to-one")
    env = {k: v for k, v in environment().items() if k != "PYTHONWARNINGS"}  # warnings as a user sees them
    proc = subprocess.run([sys.executable, "-m", "frawdllm.cli", *train_args(work, copy, "--resume")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_losses(copy, single, range(11, STEPS + 1))
    assert "torch.distributed is disabled" not in proc.stderr, proc.stderr  # (DCP's note: a supported resume)


@pytest.mark.parametrize("two_ranks", ["fsdp"], indirect=True)  # (only FSDP writes a sharded optimizer state)
def test_a_planted_or_broken_sharded_index_is_one_line_and_runs_nothing(work, two_ranks, capsys):
    """DCP reads a checkpoint's `optimizer/.metadata` with plain `pickle.load`: a planted
    file ran its code on `--resume`, and an empty one gave four tracebacks."""
    _, run = two_ranks
    copy = resumed_from_step_10(run, work / "planted-index")
    index = copy / "checkpoints" / f"step_{10:08d}" / "optimizer" / ".metadata"
    planted = work / "planted-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {planted}",))

    for content, reason in [(pickle.dumps(Payload()), "posix.system is not part of a checkpoint index"),
                            (b"", "EOFError: Ran out of input")]:
        index.write_bytes(content)
        list_files(index.parent.parent)  # (files.json planted with it: its sizes and CRCs pass)
        proc = frawd_here(capsys, train_args(work, copy, "--resume"))
        assert proc.returncode == 1 and not planted.exists(), proc.stderr[-3000:]
        lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("note: ")]
        assert len(lines) == 1 and lines[0].startswith(f"frawd: error: {index}: cannot read the sharded optimizer "
                                                       f"state's index") and reason in lines[0], lines


@pytest.mark.parametrize("two_ranks", ["fsdp"], indirect=True)
def test_a_truncated_optimizer_shard_is_one_line(work, two_ranks, capsys):
    """A shard cut short (a copy that stopped, a full disk) gave an EOFError traceback (one
    per rank, and torchrun's report, under --nproc)."""
    _, run = two_ranks
    copy = resumed_from_step_10(run, work / "truncated-shard")
    folder = copy / "checkpoints" / f"step_{10:08d}" / "optimizer"
    shard = sorted(folder.glob("*.distcp"))[-1]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    proc = frawd_here(capsys, train_args(work, copy, "--resume"))
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("note: ")]
    assert proc.returncode == 1 and lines == [f"frawd: error: {shard}: changed since the checkpoint was written "
                                              f"(100 bytes, not the {size:,} written: a damaged disk or copy)"], \
        proc.stderr[-3000:]
    listing = folder.parent / "files.json"  # as an earlier FrawdLLM listed it (names alone): read, and found short
    listing.write_text(json.dumps(sorted(json.loads(listing.read_text()))))
    proc = frawd_here(capsys, train_args(work, copy, "--resume"))
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("note: ")]
    assert proc.returncode == 1 and lines == [f"frawd: error: {folder}: cannot read the sharded checkpoint "
                                              "(EOFError)"], proc.stderr[-3000:]


def test_resume_one_process_to_two_ranks(work, single):
    copy = resumed_from_step_10(single, work / "one-to-two-fsdp")
    frawd(train_args(work, copy, "--resume", "--nproc", "2", "--parallel", "fsdp"))
    assert_same_losses(copy, single, range(11, STEPS + 1))


def test_with_dropout_ranks_draw_their_own_masks_and_resume_exactly(work):
    """Each rank's RNG goes its own way after the start (alike, two ranks' rows shared their
    dropout masks) and is kept per rank in checkpoints (rank 1 came back with rank 0's)."""
    run = work / "dropout"
    frawd(train_args(work, run, "--nproc", "2", "--set", "dropout=0.2"))
    rngs = load_state(run / "checkpoints" / f"step_{10:08d}")["rng_ranks"]
    assert len(rngs) == 2 and not rngs[0]["torch"].equal(rngs[1]["torch"])
    copy = resumed_from_step_10(run, work / "dropout-resumed")
    frawd(train_args(work, copy, "--resume", "--nproc", "2", "--set", "dropout=0.2"))
    got, want = losses(copy), losses(run)
    assert [got[step] for step in range(11, STEPS + 1)] == [want[step] for step in range(11, STEPS + 1)]


def test_a_start_that_rank_0_refuses_is_said_in_one_line(tmp_path):
    """Rank 0 refused the data (only rank 0 prepares it) and the waiting rank 1 then said
    "rank 0 did not finish the run's start ... within --dist-timeout" too, a timeout that
    never happened: a rank's line about another one leaving is said only when that one
    said nothing."""
    (tmp_path / "empty.txt").write_text("")
    proc = subprocess.run([sys.executable, "-m", "frawdllm.cli", "pretrain", "--preset", "tiny", "--data",
                           str(tmp_path / "empty.txt"), "--max-steps", "2", "--nproc", "2", "--no-progress",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                          env=environment())
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("launching 2 processes")]
    assert proc.returncode == 1 and errors == [
        f"frawd: error: data source {str(tmp_path / 'empty.txt')!r} holds no documents (no non-empty text)"], \
        proc.stderr


def test_the_loops_warnings_are_said_once_not_once_per_rank(tmp_path):
    """Every rank warned of each skipped step (the same loss on every rank): N lines each."""
    (tmp_path / "c.txt").write_text("hello world this is a tiny corpus\n\nanother document here\n\nand a third\n")
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run([sys.executable, "-m", "frawdllm.cli", "pretrain", "--preset", "tiny", "--set", "n_layer=1",
                           "--set", "n_embd=32", "--set", "n_head=2", "--set", "context_length=16", "--tokenizer",
                           "char", "--data", str(tmp_path / "c.txt"), "--val-fraction", "0.3", "--batch-size", "2",
                           "--max-steps", "3", "--lr", "1e30", "--grad-clip", "0", "--max-bad-steps", "5", "--dtype",
                           "fp32", "--compile", "false", "--nproc", "2", "--no-progress", "--eval-interval", "0",
                           "--warmup-steps", "0", "--sample-tokens", "0", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")})
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning: step")]
    assert proc.returncode == 0 and warned == [f"warning: step {step}: loss nan; update skipped ({step - 1} in a row)"
                                               for step in (2, 3)], proc.stderr
    # nothing stays in the temporary folder: torchrun left a torchelastic_* folder per run
    assert not list((tmp_path / "tmp").iterdir())


def test_a_rank_that_waits_past_the_timeout_for_rank_0s_start_says_so_in_one_line(monkeypatch):
    # (rank 1 printed a traceback: "RuntimeError: ... Timed out waiting 2000ms for recv operation")
    from frawdllm.train.distributed import Dist, RankLost

    def timed_out(self, obj):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 2000ms for recv")

    monkeypatch.setattr(Dist, "from_main", timed_out)
    with pytest.raises(RankLost, match=re.escape("rank 1: rank 0 did not finish the run's start (tokenizer, data) "
                                                 "within --dist-timeout (or stopped): prepare it beforehand")):
        Dist(rank=1, world_size=2, parallel="ddp").after_main(None, "the run's start (tokenizer, data)")
    with pytest.raises(ValueError):  # anything else is not a lost rank
        monkeypatch.setattr(Dist, "from_main", lambda self, obj: int("x"))
        Dist(rank=1, world_size=2, parallel="ddp").after_main(None, "x")


def _descendants(pid: int) -> list[int]:
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b"".join(env) \
                and f"LOCAL_RANK={rank}".encode() in env:
            return pid
    return None


def _start(args: list[str], **options) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(),
                            start_new_session=True, **options)


def _ranks_once_checkpointed(proc: subprocess.Popen, run: Path, step: int) -> tuple[int, int]:
    """(rank 0's pid, rank 1's pid) once checkpoint `step` exists."""
    deadline = time.monotonic() + 90
    while not (run / "checkpoints" / f"step_{step:08d}").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its checkpoint"
        time.sleep(0.05)
    pids = _rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1)
    assert None not in pids
    return pids


def _kill_rank_after(proc: subprocess.Popen, run: Path, step: int, how: int = signal.SIGKILL) -> tuple[int, int]:
    """Once checkpoint `step` exists, send `how` to rank 1; (rank 0's pid, rank 1's pid)."""
    pids = _ranks_once_checkpointed(proc, run, step)
    os.kill(pids[1], how)
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _finish(proc: subprocess.Popen, timeout: float, leftovers: tuple[int, ...] = ()) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        for pid in leftovers:  # the ranks this test started, if anything went wrong
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out


def _assert_loadable(run: Path) -> None:
    last = latest_checkpoint(run)
    assert last is not None
    FrawdLLM.from_pretrained(last / "model")
    assert load_state(last)["step"] >= 5


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_rank_ends_the_run_with_a_clear_error_and_a_loadable_checkpoint(work, how):
    """A killed rank: torchrun stops the others. A hung one (stopped, its sockets open): rank
    0's next collective times out (--dist-timeout 5s) and ends the run with one line."""
    run = work / f"lost-{how}"
    args = train_args(work, run, "--nproc", "2", "--max-steps", "100000", "--eval-interval", "5",
                      "--dist-timeout", "5s")
    proc = _start([sys.executable, "-m", "frawdllm.cli", *args])
    rank0, rank1 = _kill_rank_after(proc, run, 5, how)
    start = time.monotonic()
    while _alive(rank0) and time.monotonic() - start < 60:
        time.sleep(0.1)
    assert not _alive(rank0), "rank 0 still runs 60 s after it lost rank 1"
    if how == signal.SIGSTOP:
        os.kill(rank1, signal.SIGCONT)  # lets torchrun's SIGTERM end it at once
    out = _finish(proc, 60, (rank0, rank1))
    assert proc.returncode != 0
    if how == signal.SIGSTOP:
        assert "frawd: error: rank 0: lost the other ranks" in out and "continue with --resume" in out, out[-3000:]
    else:  # torchrun names the rank that died
        assert "rank      : 1" in out and "SIGKILL" in out, out[-3000:]
    _assert_loadable(run)


def test_ranks_stop_with_a_checkpoint_when_their_launcher_is_killed(work):
    """kill -9 of `frawd pretrain --nproc 2`: its ranks (torchrun's children) went on as
    orphans, writing checkpoints under a resume. Now Linux sends them SIGHUP, once per thread
    of the dying launcher (as SIGTERM, the second stopped them without a checkpoint)."""
    run = work / "orphans"
    proc = _start([sys.executable, "-m", "frawdllm.cli",
                   *train_args(work, run, "--nproc", "2", "--max-steps", "100000", "--eval-interval", "5")])
    ranks = _ranks_once_checkpointed(proc, run, 5)
    errors = next(line.split(b"=", 1)[1].decode() for line in Path(f"/proc/{ranks[0]}/environ").read_bytes().split(b"\0")
                  if line.startswith(b"FRAWD_RANK_ERRORS="))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    start = time.monotonic()
    while any(map(_alive, ranks)) and time.monotonic() - start < 60:
        time.sleep(0.1)
    alive = [pid for pid in ranks if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "ranks still run 60 s after their launcher was killed"
    out = proc.stdout.read()  # (the ranks wrote into the launcher's pipe)
    assert load_state(latest_checkpoint(run))["step"] > 5, out[-3000:]  # (they stopped as at Ctrl-C: a checkpoint)
    # with no launcher to say it, rank 0 says where the checkpoint is (it was left in a file
    # nobody read), and the launcher's folder for such lines does not stay behind in /tmp
    assert out.count("interrupted: checkpoint ") == 1, out[-3000:]
    assert not Path(errors).exists()


def test_a_sigterm_to_one_rank_stops_the_run_as_one_process_stops(work):
    """SIGTERM to rank 1 alone: every rank stops at the same step with a checkpoint, and the
    command exits 130 with the one "interrupted" line (it printed torchrun's failure table
    naming rank 0, and exited 1)."""
    run = work / "sigterm-rank"
    proc = _start([sys.executable, "-m", "frawdllm.cli",
                   *train_args(work, run, "--nproc", "2", "--max-steps", "100000", "--eval-interval", "5")])
    ranks = _ranks_once_checkpointed(proc, run, 5)
    os.kill(ranks[1], signal.SIGTERM)
    out = _finish(proc, 60, ranks)
    assert proc.returncode == 130, out[-3000:]
    assert out.count("interrupted: checkpoint ") == 1 and "Root Cause" not in out, out[-3000:]
    _assert_loadable(run)


def test_under_nohup_a_hangup_leaves_the_run_going_and_a_killed_launcher_still_stops_the_ranks(work):
    """`nohup frawd pretrain --nproc 2`: torchrun's own SIGHUP handler replaced nohup's SIG_IGN
    in the launcher, so a dropped ssh connection ended the run. The ranks ignore SIGHUP as
    nohup set it, except the one the kernel sends when the launcher dies (their parent
    changes): a launcher killed with SIGKILL still stops them, with a checkpoint."""
    run = work / "nohup"
    proc = _start([sys.executable, "-m", "frawdllm.cli",
                   *train_args(work, run, "--nproc", "2", "--max-steps", "100000", "--eval-interval", "5")],
                  preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    ranks = _ranks_once_checkpointed(proc, run, 5)
    try:
        for pid in (proc.pid, *ranks):  # the hangup of the terminal: the launcher and the ranks of its job
            os.kill(pid, signal.SIGHUP)
        _ranks_once_checkpointed(proc, run, 10)  # (still training: it asserts the launcher runs)
        assert all(map(_alive, ranks))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        start = time.monotonic()
        while any(map(_alive, ranks)) and time.monotonic() - start < 60:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), "ranks still run 60 s after their launcher was killed"
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    out = proc.stdout.read()
    assert load_state(latest_checkpoint(run))["step"] > 10, out[-3000:]


def test_torchrun_max_restarts_resumes_from_the_last_checkpoint(work, single):
    """Rank 1 killed after the step-5 checkpoint: torchrun restarts both ranks, which join a
    fresh process group (`distributed.attempt_store`) and resume from that checkpoint."""
    run = work / "restarted"
    args = train_args(work, run, "--eval-interval", "5")
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "--max-restarts=1", "-m", "frawdllm.cli", *args])
    pids = _kill_rank_after(proc, run, 5)
    out = _finish(proc, 90, pids)
    assert proc.returncode == 0, out[-3000:]
    assert "restart 1 by torchrun: resuming" in out
    assert_same_losses(run, single, range(1, STEPS + 1))


def frawd_here(capsys, args: list[str]) -> subprocess.CompletedProcess:
    """`frawd ARGS` run in this process, for what starts no rank (a check before torchrun, a
    one-process run): no fresh interpreter's `import torch` to pay."""
    from cli_helpers import run_cli

    code, out, err = run_cli(capsys, *args)
    return subprocess.CompletedProcess(args, code, out, err)


def test_nproc_checks_the_settings_before_starting_any_rank(tmp_path, capsys):
    proc = frawd_here(capsys, ["pretrain", "--nproc", "2", "--data", str(tmp_path / "missing.txt"),
                               "--max-steps", "3", "--out", str(tmp_path / "run")])
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"frawd: error: data source not found: '{tmp_path / 'missing.txt'}' "
        "(expected stdlib, hf:NAME, a file, a folder or a glob)"]
    assert not (tmp_path / "run").exists()


def test_fsdp_without_ranks_says_it_is_one_process(work, capsys):
    """--parallel fsdp without --nproc or torchrun trains (one process, nothing to shard)
    and says so; it was silent."""
    proc = frawd_here(capsys, train_args(work, work / "fsdp-alone", "--parallel", "fsdp", "--max-steps", "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: --parallel fsdp shards the model over ranks, and this is one process" in proc.stderr


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "3", "--grad-accum", "1"], "the global batch (batch_size 3 x grad_accum 1) does not split over 2"),
    (["--parallel", "fsdp", "--dtype", "fp16"], "--parallel fsdp trains in bf16 or fp32"),
])
def test_what_every_rank_would_refuse_is_one_line_before_torchrun(tmp_path, capsys, extra, message):
    """It was refused by each rank after launch: twice, then torchrun's traceback."""
    for dry in ([], ["--dry-run"]):
        proc = frawd_here(capsys, ["pretrain", "--nproc", "2", "--max-steps", "3", "--out", str(tmp_path / "run"),
                                   *extra, *dry])
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"frawd: error: {message}"), lines
        assert not (tmp_path / "run").exists()


def test_a_lost_ranks_reason_is_gloos_sentence_cut_at_a_word():
    """gloo's text came with its C++ source location and was cut mid-word at 200 characters
    ("... Check the logs of the remote wo)")."""
    from frawdllm.errors import first_line

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:3511. This is typically caused by a remote worker crashing. " + "Check " * 40
                        + "\nsecond line")
    line = first_line(gloo)
    assert line.startswith("Connection closed by peer [127.0.0.1]:3511. This is typically caused")
    assert line.endswith(" Check...") and len(line) <= 203
    assert first_line(EOFError(), "EOFError") == "EOFError" and first_line(ValueError("short")) == "short"


def test_a_dry_run_with_nproc_shows_each_ranks_share(tmp_path, capsys, monkeypatch):
    """--dry-run --nproc 2 showed the one-process plan (the whole batch, every thread)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    proc = frawd_here(capsys, ["pretrain", "--nproc", "2", "--max-steps", "3", "--batch-size", "8", "--grad-accum",
                               "3", "--out", str(tmp_path / "run"), "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("batch:"))
    assert lines[at + 1] == "processes:     2 (torchrun, --parallel ddp), each 4 x 3 rows a step and 3 torch threads"
    # the device line (and the peak measured for MFU) is a rank's: it was this process's threads
    assert "device:        cpu (3 threads)" in lines
    assert not (tmp_path / "run").exists()


def test_nproc_runs_torchruns_launcher_and_passes_on_how_it_ended(monkeypatch, capsys):
    """`--nproc` calls torch.distributed.run in the frawd process: the ranks get the command
    without --nproc and a share of the cores; a failed rank exits 1 with torchrun's table, a
    stop signal 128+N."""
    from types import SimpleNamespace

    import torch
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from frawdllm.cli.launch import relaunch_under_torchrun

    cfg = SimpleNamespace(batch_size=4, grad_accum=1, parallel="ddp", dtype="fp32")
    monkeypatch.setattr(sys, "argv", ["frawd", "pretrain", "--nproc", "2", "--max-steps", "3", "--nproc=2"])
    outcomes = iter([None, SignalException("stopped", signal.SIGTERM),
                     ChildFailedError("frawdllm.cli", {1: ProcessFailure(1, 4321, -signal.SIGKILL, "<N/A>")})])
    launched = []

    def fake_run(args):
        launched.append(args)
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(torchrun, "run", fake_run)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 5)
    codes = []
    for _ in range(3):
        with pytest.raises(SystemExit) as stop:
            relaunch_under_torchrun(2, cfg)
        codes.append(stop.value.code)
    assert codes == [0, 128 + signal.SIGTERM, 1]
    assert os.environ["OMP_NUM_THREADS"] == "2"  # each rank's share of this process's 5 threads
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stays
    outcomes = iter([None])
    with pytest.raises(SystemExit):
        relaunch_under_torchrun(2, cfg)
    assert os.environ["OMP_NUM_THREADS"] == "3"
    args = launched[0]
    assert (args.standalone, args.nproc_per_node, args.module, args.training_script) == (True, "2", True, "frawdllm.cli")
    assert args.training_script_args == ["pretrain", "--max-steps", "3"]
    err = capsys.readouterr().err
    assert "rank      : 1" in err and "SIGKILL" in err and "4321" in err


def test_ranks_stopped_by_a_signal_or_by_torchrun_are_not_reported_as_failures(monkeypatch, capsys):
    """A SIGTERM to the ranks (not the launcher) stopped them with a checkpoint, and then the
    launcher printed torchrun's failure table naming rank 0 (exit code 130) and exited 1; a
    rank's error at the start came with rank 0's "aborted" and the same table."""
    from types import SimpleNamespace

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from frawdllm.cli.launch import RANK_ERRORS, relaunch_under_torchrun

    cfg = SimpleNamespace(batch_size=4, grad_accum=1, parallel="ddp", dtype="fp32")
    monkeypatch.setattr(sys, "argv", ["frawd", "pretrain", "--nproc", "2"])
    interrupted = "interrupted: checkpoint runs/x/checkpoints/step_00000012; continue with frawd pretrain --out " \
                  "runs/x --resume"
    cases = [  # (files the ranks leave, their exit codes, the launcher's status, its stderr)
        ({"stopped0": interrupted + "\n", "stopped1": ""}, {0: 130, 1: 130}, 130, interrupted + "\n"),
        ({"rank1": "rank 1: bad data\n", "stopped0": "aborted\n"}, {0: 130, 1: 1}, 1, "frawd: error: rank 1: bad data\n"),
    ]
    for files, codes, status, err in cases:
        def fake_run(args, files=files, codes=codes):
            for name, text in files.items():
                Path(os.environ[RANK_ERRORS], name).write_text(text)
            raise ChildFailedError("frawdllm.cli", {r: ProcessFailure(r, 4000 + r, c, "<N/A>") for r, c in codes.items()})

        monkeypatch.setattr(torchrun, "run", fake_run)
        with pytest.raises(SystemExit) as stop:
            relaunch_under_torchrun(2, cfg)
        assert stop.value.code == status
        assert capsys.readouterr().err.split("\n", 1)[1] == err  # (after "launching 2 processes")


def _torchrun_with_extra_args_on_rank_1(tmp_path: Path, args: list[str], extra: list[str]) -> tuple[int, list, float]:
    """`torchrun --nproc-per-node 2 --no-python wrap.sh ARGS`, wrap.sh adding `extra` to rank 1's
    command: (torchrun's exit status, each rank's stderr lines, seconds taken)."""
    wrap, logs = tmp_path / "wrap.sh", tmp_path / "logs"
    logs.mkdir()
    wrap.write_text(f'#!/bin/sh\nif [ "$RANK" = 1 ]; then set -- "$@" {" ".join(extra)}; fi\n'
                    f'exec "{sys.executable}" -m frawdllm.cli "$@" 2>"{logs}/rank$RANK.err"\n')
    wrap.chmod(0o755)
    start = time.monotonic()
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "--no-python", str(wrap), *args])
    _finish(proc, 90)
    return proc.returncode, [(logs / f"rank{r}.err").read_text().splitlines() for r in (0, 1)], \
        time.monotonic() - start


@pytest.mark.parametrize("parallel, extra, differ", [
    ("ddp", ["--lr", "0.1", "--seed", "7"], "seed 7 (rank 0: 1337), lr 0.1 (rank 0: 0.003)"),
    ("fsdp", ["--set", "n_layer=3"], "model.n_layer 3 (rank 0: 2)"),  # (FSDP hung until --dist-timeout)
], ids=["lr-seed", "n_layer"])
def test_ranks_started_with_other_settings_are_refused_in_one_line(work, tmp_path, parallel, extra, differ):
    """Rank 1 started with another --lr and --seed: the run finished, each rank stepping its own
    weights, rank 0 saving its own. With another model: a traceback per rank under DDP, a hang
    until --dist-timeout under FSDP. Now every rank stops at the start, in one line, and
    nothing of the run is written."""
    run = tmp_path / "run"
    code, stderr, took = _torchrun_with_extra_args_on_rank_1(
        tmp_path, train_args(work, run, "--max-steps", "2", "--parallel", parallel, "--dist-timeout", "60s"), extra)
    assert code == 1 and took < 45, (code, took, stderr)  # (a hang ends at --dist-timeout, before _finish's 90 s)
    line = f"frawd: error: rank 1 was started with other settings than rank 0: {differ}; start every rank with the " \
           "same command"
    assert stderr == [[line], [line]]
    assert not run.exists()


def test_the_settings_check_names_every_differing_rank_and_lets_progress_differ(monkeypatch):
    from frawdllm.errors import FrawdError
    from frawdllm.train import distributed
    from frawdllm.train.config import PretrainConfig

    base = PretrainConfig(max_steps=2)
    ranks = [base, PretrainConfig(max_steps=2, progress=False), PretrainConfig(max_steps=2, batch_size=6),
             PretrainConfig(max_steps=2, model={"dropout": 0.1}, sample_prompt="x" * 100)]
    monkeypatch.setattr(distributed, "_current", distributed.Dist(0, 4, 0, "ddp"))
    configs = []  # what each rank hands to the gather
    monkeypatch.setattr(distributed.Dist, "gather", lambda self, obj: configs.append(obj) or [obj])
    for cfg in ranks:
        distributed.check_same_settings(cfg)
    monkeypatch.setattr(distributed.Dist, "gather", lambda self, obj: configs)
    with pytest.raises(FrawdError) as refused:
        distributed.check_same_settings(base)
    assert str(refused.value) == (
        "rank 2 was started with other settings than rank 0: batch_size 6 (rank 0: 16); rank 3 was started with "
        f"other settings than rank 0: sample_prompt '{'x' * 76}... (rank 0: ''), model.dropout 0.1 (rank 0: "
        "(not set)); start every rank with the same command")
    monkeypatch.setattr(distributed.Dist, "gather", lambda self, obj: [obj] * 4)  # the same: nothing said
    distributed.check_same_settings(base)
    monkeypatch.setattr(distributed, "_current", distributed.Dist())  # one process: nothing gathered
    monkeypatch.setattr(distributed.Dist, "gather", None)
    distributed.check_same_settings(base)


def test_ranks_agree_on_the_stop_and_the_largest_reserve(monkeypatch):
    """agree_stop: rank 0's budget reason, or a signal any rank got, and the largest of the
    ranks' seconds (a sum grew the schedule's reserve N-fold). The collective is faked: it
    combines this rank's tensor with rank 1's by the operation it is asked for."""
    import torch
    import torch.distributed as dist

    from frawdllm.train import distributed

    other = torch.tensor([0, 1, 2_000_000])  # rank 1: no reason of its own (only rank 0's counts), a signal, 2 s

    def all_reduce(t, op=dist.ReduceOp.SUM):
        t.copy_(torch.maximum(t, other) if op == dist.ReduceOp.MAX else t + other)

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    main, cpu, reasons = distributed.Dist(0, 2, 0, "ddp"), torch.device("cpu"), (None, "max_steps", "max_time")
    assert main.agree_stop("max_time", False, reasons, cpu, 1.0) == ("interrupted", 2.0)
    other.copy_(torch.tensor([0, 0, 500_000]))
    assert main.agree_stop("max_time", False, reasons, cpu, 1.0) == ("max_time", 1.0)
    assert main.agree_stop(None, False, reasons, cpu, 0.25) == (None, 0.5)


def test_each_rank_follows_the_run_config_and_a_restart_resumes(monkeypatch):
    """rank_config: progress on rank 0 only; after a torchrun restart every rank resumes, and
    a run started with --overwrite does not delete what it resumes ("choose one" on every rank)."""
    from frawdllm.train import distributed
    from frawdllm.train.config import PretrainConfig

    monkeypatch.setattr(distributed, "check_same_settings", lambda cfg: None)
    cfg = PretrainConfig(max_steps=2, progress=True, overwrite=True)
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "_current", distributed.Dist(rank, 2, rank, "ddp"))
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
        first = distributed.rank_config(cfg)
        assert first.progress is (rank == 0) and first.overwrite and not first.resume
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        again = distributed.rank_config(cfg)
        assert again.resume and not again.overwrite and again.progress is (rank == 0)


def test_a_sharded_save_or_read_failure_is_one_line(monkeypatch, tmp_path):
    """torch.distributed.checkpoint wraps every rank's error in a CheckpointException (a
    BaseException): a full disk under FSDP printed a traceback per rank (~200 lines), not
    the one "no space left" line a one-process or DDP save gives."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from frawdllm.errors import FrawdError
    from frawdllm.train import distributed

    full = OSError(errno.ENOSPC, "No space left on device")

    def failing_save(state, checkpoint_id):
        raise CheckpointException("save failed", {0: (full, None), 1: (OSError(errno.ENOSPC, "again"), None)})

    monkeypatch.setattr(dcp, "save", failing_save)
    with pytest.raises(OSError) as info:
        distributed.save_sharded({}, tmp_path / "ckpt")
    assert info.value is full  # (the CLI says it as any full disk: one line)
    with pytest.raises(FrawdError, match=re.escape(f"{tmp_path}: cannot read the sharded checkpoint (EOFError: "
                                                   "Ran out of input)")):
        with distributed._checkpoint_failures(tmp_path, "read"):
            raise CheckpointException("load failed", {0: (EOFError("Ran out of input"), None)})
