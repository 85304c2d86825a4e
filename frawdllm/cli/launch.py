"""`--nproc N`: run a training command on N processes of this machine under torchrun.

The command starts again as `torchrun --standalone --nproc-per-node N -m frawdllm.cli <the
same arguments>`: PyTorch's own launcher starts the ranks, watches them and stops them all
when one fails. The launcher runs inside this process (`torch.distributed.run`'s own entry
point), which has imported torch already: a separate torchrun process would import it again.
Each rank gets its share of the cores. Several machines, restarts after a failure
(`--max-restarts`) and other rendezvous options: call torchrun yourself (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any
from collections.abc import Callable

import click

from ..errors import FrawdError

# The environment variable naming the folder where ranks started by --nproc leave their
# one-line errors (`say_error`), for the launcher to say once.
RANK_ERRORS = "FRAWD_RANK_ERRORS"
RANK_LAUNCHER = "FRAWD_RANK_LAUNCHER"  # the launcher's pid: the ranks' parent while it lives


def nproc_option():
    return click.option("--nproc", type=click.IntRange(min=1), default=None,
                        help="Train on N processes of this machine (one per GPU; CPU: gloo, the cores shared "
                             "out): runs this command under torchrun --standalone --nproc-per-node N. See "
                             "--parallel, docs/distributed.md.")


def without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def relaunch_under_torchrun(nproc: int, cfg: Any, token_batches: bool = False) -> None:
    """Run this command again on `nproc` ranks; exits with torchrun's status. What the ranks
    would each refuse (a global batch that does not split, fp16 under FSDP) is refused here,
    in one line, before torchrun starts."""
    from ..train.distributed import check_ranks, launched

    if launched():
        raise FrawdError("--nproc starts torchrun, and this process already runs under it: leave --nproc out")
    check_ranks(cfg, nproc, token_batches)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ["OMP_NUM_THREADS"] = str(rank_threads(nproc))  # (torchrun would give every rank 1, and warn)
    # torchrun stops the ranks at SIGHUP too (its --signals-to-handle), which under `nohup` would
    # replace nohup's SIG_IGN: a dropped ssh connection ended a `nohup frawd ... --nproc N` run
    signals = [] if not _hangup_ignored() else ["--signals-to-handle=SIGTERM,SIGINT,SIGQUIT"]
    click.echo(f"launching {nproc} process{'es' if nproc > 1 else ''}: torchrun --standalone "
               f"--nproc-per-node={nproc} ...", err=True)
    with tempfile.TemporaryDirectory(prefix="frawd-rank-errors-") as errors:
        # torchrun's log folder goes inside ours: left to itself, it made a /tmp/torchelastic_*
        # folder per run and never removed it
        args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", *signals,
                                             f"--log-dir={os.path.join(errors, 'torchelastic')}",
                                             "-m", "frawdllm.cli", *without_nproc(sys.argv[1:])])
        os.environ[RANK_ERRORS], os.environ[RANK_LAUNCHER] = errors, str(os.getpid())
        # torchrun's own log lines, said better below: "failed (exitcode: 1)" per rank, and
        # "Received 15 death signal, shutting down workers" at Ctrl-C or SIGTERM
        quieted = {"torch.distributed.elastic.multiprocessing.api": logging.CRITICAL,
                   "torch.distributed.elastic.agent.server.api": logging.ERROR}
        levels = {name: logging.getLogger(name).level for name in quieted}
        try:
            for name, level in quieted.items():
                logging.getLogger(name).setLevel(level)
            run(args)
        except ChildFailedError as exc:
            said, lost = _rank_errors(Path(errors), "rank"), _rank_errors(Path(errors), "lost")
            stopped = _rank_errors(Path(errors), "stopped")  # by a signal: torchrun's, or a user's
            if not said and not lost and set(exc.failures) <= set(stopped):
                # the ranks themselves were signalled (not this launcher): stopped as one process
                # stops, rank 0 having said where the checkpoint is (or "aborted")
                _say_once(stopped)
                raise SystemExit(130) from None
            # a rank that saw another leave ("rank 0 did not finish the run's start", "lost the
            # other ranks") is said only where the one that left said nothing
            _say_once(said or lost, "frawd: error: ")
            if not set(exc.failures) <= set(said) | set(lost) | set(stopped):
                click.echo(str(exc), err=True)  # a rank that ended without saying why: torchrun's report
            raise SystemExit(1) from None
        except SignalException as exc:  # this launcher was stopped (Ctrl-C, SIGTERM), and the ranks with it
            _say_once(_rank_errors(Path(errors), "stopped"))
            raise SystemExit(128 + int(exc.sigval)) from None
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            os.environ.pop(RANK_ERRORS, None)
            os.environ.pop(RANK_LAUNCHER, None)
    raise SystemExit(0)


def rank_threads(nproc: int) -> int:
    """The torch threads each of `nproc` ranks gets: OMP_NUM_THREADS where the user set it,
    else this process's cores shared out."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    import torch

    return max(1, torch.get_num_threads() // nproc)


def ranks_plan(cfg: Any, nproc: int, threads: int) -> str:
    """`--dry-run --nproc N`'s line: the ranks, each one's share of the batch and its `threads`."""
    from ..train.distributed import batch_layout

    micro, accum = batch_layout(cfg.batch_size, cfg.grad_accum, nproc)
    return (f"processes:     {nproc} (torchrun, --parallel {cfg.parallel}), each {micro} x {accum} rows a step "
            f"and {threads} torch thread{'s' if threads != 1 else ''}")


def _say_once(lines_by_rank: dict[int, list[str]], prefix: str = "") -> None:
    """Each different line once, in rank order."""
    for line in dict.fromkeys(line for lines in lines_by_rank.values() for line in lines):
        click.echo(f"{prefix}{line}", err=True)


def rank_stopped(line: str | None = None) -> bool:
    """On a rank `--nproc` started: note for the launcher that this rank stops at a signal,
    with `line` to say for it once (None: nothing; rank 0 said it); True if noted. Elsewhere
    (one process, the user's own torchrun, a launcher killed) False: the caller says it itself."""
    return leave_for_launcher("stopped", line)


def leave_for_launcher(kind: str, line: str | None) -> bool:
    """On a rank `--nproc` started, add `line` to this rank's `kind` file in the launcher's
    folder, for the launcher to say once; True if left. False where there is no launcher to
    read it: one process, the user's own torchrun, or a launcher that was killed (kill -9:
    its ranks stop on their own), whose folder, which it can no longer remove, goes."""
    folder = os.environ.get(RANK_ERRORS)
    if not (folder and os.path.isdir(folder) and "RANK" in os.environ):
        return False
    if os.environ.get(RANK_LAUNCHER) != str(os.getppid()):
        shutil.rmtree(folder, ignore_errors=True)
        return False
    try:
        with open(os.path.join(folder, f"{kind}{int(os.environ['RANK'])}"), "a", encoding="utf-8") as f:
            f.write("" if line is None else line + "\n")
    except (OSError, ValueError):
        return False
    return True


def _hangup_ignored() -> bool:
    return hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def _rank_errors(folder: Path, kind: str) -> dict[int, list[str]]:
    """{rank: the error lines it left in `folder`}, by rank: `kind` "rank" for its own
    errors, "lost" for another rank's leaving (see `say_error`)."""
    said = {}
    for file in folder.glob(f"{kind}*"):
        with contextlib.suppress(ValueError, OSError):
            said[int(file.name[len(kind):])] = file.read_text(encoding="utf-8", errors="replace").splitlines()
    return dict(sorted(said.items()))


def train_on_this_rank(train: Callable[[], object], command: str, cfg: Any) -> None:
    """Run `train()` (a training job returning a TrainResult) on this rank and report as
    one process would: rank 0 prints the summary; a lost rank ends the process at once."""
    from ..train import distributed

    if cfg.parallel == "fsdp" and not distributed.launched():
        click.echo("note: --parallel fsdp shards the model over ranks, and this is one process: "
                   "--nproc N (or torchrun) starts several", err=True)
    try:
        result = train()
        rank = distributed.current().rank
    except distributed.RankLost as exc:
        # leave at once: the process group's destructor would wait for the lost rank
        from . import say_error

        say_error(str(exc), lost=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        distributed.teardown()
    interrupted = result.stop_reason == "interrupted"
    if rank != 0:  # rank 0 reports for all
        if interrupted:  # every rank stopped at the signal: each exits as rank 0 does
            rank_stopped()
            raise SystemExit(130)
        return
    click.echo(result.summary())
    if interrupted:
        line = f"interrupted: checkpoint {result.checkpoint}; continue with frawd {command} --out {cfg.out} --resume"
        if not rank_stopped(line):  # (under --nproc the launcher says it, once)
            click.echo(line, err=True)
        raise SystemExit(130)
