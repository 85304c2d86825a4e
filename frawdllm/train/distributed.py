"""Training on several processes with PyTorch's own engine: `torch.distributed`, launched by `torchrun`.

`torchrun --nproc-per-node N -m frawdllm.cli pretrain ...` (or `frawd pretrain --nproc N`,
which runs that for you) starts N copies of the same command. Each reads its place from
the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), joins one
process group (`nccl` on CUDA, `gloo` on CPU) and trains its share:

- **Same run, any world size.** The global batch (`batch_size x grad_accum` of the config)
  does not change with the number of ranks: each rank takes `batch_size x grad_accum /
  world_size` windows per step (fewer accumulation steps if they divide, else smaller
  micro-batches). The loader draws one global batch per step and each rank reads its own
  slice, so N ranks see exactly the windows one process would.
- **DDP** (`--parallel ddp`): every rank holds the whole model; gradients are averaged
  after backward. **FSDP** (`--parallel fsdp`, FSDP2's `fully_shard` on every block and on
  the root): each rank holds 1/N of the weights, gradients and AdamW moments and gathers a
  block's weights just before it runs. bf16/fp16 compute through a mixed-precision policy
  (weights gathered in the low precision, gradients reduced in fp32).
- **What a step calls** is `TaskModule`: the model with the task's loss as its `forward`, so
  DDP and FSDP see (and hook) the whole step, whatever methods of the model the loss uses.
- **Rank 0 alone** logs, plots, samples and writes the model directories. Checkpoints: the
  model directory (gathered to rank 0) and the training state as before; with FSDP the
  AdamW moments are written sharded by `torch.distributed.checkpoint`, which reshards
  them on load, so a run saved with N ranks resumes with M (and one process reads them too).
- **Same settings on every rank**: right after joining, the ranks compare their configs
  (`check_same_settings`); a rank started with other settings ends the run in one line.
- **Faults**: every collective has a timeout (`dist_timeout`), and a lost rank ends the
  others with one line naming the last checkpoint (torchrun's `--max-restarts` can then
  restart the group, which resumes from it).
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import FrawdError, RankLost, first_line
from ..orphans import signal_when_parent_dies
from .config import PARALLEL_CHOICES

SHARDED_OPTIMIZER_DIR = "optimizer"  # inside a checkpoint: FSDP's sharded AdamW moments (DCP)


@dataclass
class Dist:
    """This process's place in the run (world_size 1: a plain single-process run)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    parallel: str = "none"  # none (one process), ddp, fsdp
    device: torch.device | None = None  # cuda:LOCAL_RANK under torchrun on GPUs

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.parallel != "none"

    @property
    def sharded(self) -> bool:
        return self.parallel == "fsdp"

    # ---- agreement between ranks (no-ops in one process) --------------------------------
    def mean(self, value: float, device: torch.device) -> float:
        """The mean over ranks of a per-rank number (the loss of its share)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t) / self.world_size

    def sums(self, values: list[int | float], device: torch.device) -> list[float]:
        """Each number summed over ranks, in one all-reduce (float64: exact for counts)."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def from_main(self, obj: Any) -> Any:
        """Rank 0's value of `obj` on every rank (a decision only one rank may take)."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def after_main(self, obj: Any, what: str) -> Any:
        """`from_main` at a point where the other ranks wait while rank 0 alone does `what`
        (trains the tokenizer, prepares the data): a wait past --dist-timeout is one line."""
        try:
            return self.from_main(obj)
        except Exception as exc:
            if not (self.active and not self.is_main and is_rank_failure(exc)):
                raise
            raise RankLost(f"rank {self.rank}: rank 0 did not finish {what} within --dist-timeout (or stopped): "
                           "prepare it beforehand (frawd data prepare, frawd tokenizer train) or raise "
                           "--dist-timeout") from None

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order, on every rank ([obj] in one process)."""
        if not self.active:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def agree_stop(self, main_reason: str | None, interrupted: bool, reasons: tuple,
                   device: torch.device, seconds: float = 0.0) -> tuple[str | None, float]:
        """One stop decision for all ranks: rank 0's budget check, or a signal on any rank; and,
        in the same collective, the largest of the ranks' `seconds` (to the microsecond)."""
        if not self.active:
            return ("interrupted" if interrupted else main_reason), seconds
        code = reasons.index(main_reason) if self.is_main else 0
        t = torch.tensor([code, int(interrupted), round(seconds * 1e6)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return ("interrupted" if int(t[1]) else reasons[int(t[0])]), int(t[2]) / 1e6

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


_current = Dist()


def current() -> Dist:
    return _current


def launched() -> bool:
    """Whether torchrun (or another launcher that sets its variables) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def restart_count() -> int:
    """How many times torchrun (`--max-restarts`) has restarted this group of ranks."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def setup(parallel: str = "ddp", device_spec: str = "auto", timeout_s: float = 600.0) -> Dist:
    """Join torchrun's process group (once per process); outside torchrun, one plain process."""
    global _current
    if _current.active or not launched():
        return _current
    if parallel not in PARALLEL_CHOICES:
        raise FrawdError(f"parallel must be one of {', '.join(PARALLEL_CHOICES)}, got {parallel!r}")
    from .device import pick_device

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    _end_with_the_launcher()
    device = pick_device(device_spec)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise FrawdError(f"distributed training runs on CUDA (nccl) or the CPU (gloo), not {device.type}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's store, shared by every attempt
        kwargs.update(store=attempt_store(rank, world, timeout), rank=rank, world_size=world)
    dist.init_process_group(backend, timeout=timeout, **kwargs)
    _current = Dist(rank, world, local_rank, parallel, device)
    return _current


LAUNCHER_GONE = signal.SIGHUP  # what a rank gets when torchrun (its parent) dies


def _end_with_the_launcher() -> None:
    """Ask Linux for LAUNCHER_GONE when torchrun (this rank's parent) dies: a launcher killed
    with SIGKILL cannot stop its ranks, which went on training and writing checkpoints as
    orphans. The training loop stops on it as on Ctrl-C (a checkpoint, then exit), however
    often it comes: the kernel sends it once per thread of the dying launcher (a SIGTERM's
    second coming would stop at once, without the checkpoint); before the loop it ends the
    rank."""
    global _launcher
    _launcher = os.getppid()
    signal_when_parent_dies(LAUNCHER_GONE)


_launcher: int | None = None  # torchrun's pid, as this rank's parent when it joined


def launcher_gone() -> bool:
    """Whether torchrun, this rank's parent, has died (the rank has another parent now). Under
    `nohup` a rank's SIGHUP may be a hangup the user asked to ignore: only this tells them apart."""
    return _launcher is not None and os.getppid() != _launcher


def attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """torchrun's store, seen through a prefix that is new for every start of the group.

    torchrun (2.5 and later) hosts one store for the whole job and hands the same address
    to every restart (`--max-restarts`). The keys the ranks of a failed attempt wrote stay
    in it: without a fresh prefix, a restarted rank reads a dead rank's address and gloo's
    (or nccl's) start-up fails or hangs. TORCHELASTIC_RESTART_COUNT cannot name the attempt,
    since each machine's agent counts its own restarts. So rank 0 draws the attempt's
    number from a counter in the store and hands it to each rank, answering whatever start
    count that rank last registered until the rank acknowledges (an answer to a start
    count of a rank that died is never read)."""
    deadline = time.monotonic() + timeout.total_seconds()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    base = "frawdllm/attempts"
    started = store.add(f"{base}/starts/{rank}", 1)  # this rank's start count, new each start
    if rank == 0:
        attempt = store.add(f"{base}/counter", 1)
        answered: dict[int, int] = {}
        waiting = set(range(1, world))
        while waiting:
            for other in list(waiting):
                if store.check([f"{base}/{attempt}/ack/{other}"]):
                    waiting.discard(other)
                    continue
                seen = store.add(f"{base}/starts/{other}", 0)
                if answered.get(other) != seen:
                    store.set(f"{base}/answer/{other}/{seen}", str(attempt))
                    answered[other] = seen
            if waiting and time.monotonic() > deadline:
                raise RankLost(f"rank 0: ranks {sorted(waiting)} did not join within {timeout}")
            time.sleep(0.02)
    else:
        attempt = int(store.get(f"{base}/answer/{rank}/{started}"))  # waits (up to the timeout)
        store.set(f"{base}/{attempt}/ack/{rank}", "1")
    return dist.PrefixStore(f"{base}/{attempt}", store)


PER_RANK_SETTINGS = ("progress",)  # may differ between ranks: only rank 0 shows a bar (`rank_config`)


def check_same_settings(cfg: Any) -> None:
    """Refuse, on every rank and in one line, a run whose ranks were started with other
    settings than rank 0 (torchrun starts each with its own command line): ranks with
    another --lr, --batch-size or --seed trained silently different runs, and another
    model (`--set n_layer=3`) failed inside DDP with a traceback per rank, or hung FSDP
    until --dist-timeout. Every rank's config (`to_dict()`, the model's fields one by one,
    less PER_RANK_SETTINGS) is gathered on every rank right after the process group is
    up, before anything is written, read or built."""
    place = current()
    if not place.active:
        return
    unset = "(not set)"

    def flat(data: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in data.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            elif f"{prefix}{key}" not in PER_RANK_SETTINGS:
                out[f"{prefix}{key}"] = value
        return out

    def shown(value: Any) -> str:
        text = repr(value) if isinstance(value, str) and value is not unset else str(value)
        return text if len(text) <= 80 else text[:77] + "..."

    every = place.gather({"command": type(cfg).__name__, **flat(cfg.to_dict())})
    main, problems = every[0], []
    for rank, theirs in enumerate(every[1:], start=1):
        keys = [*main, *(key for key in theirs if key not in main)]
        differ = [f"{key} {shown(theirs.get(key, unset))} (rank 0: {shown(main.get(key, unset))})"
                  for key in keys if key not in main or key not in theirs or theirs[key] != main[key]]
        if differ:
            problems.append(f"rank {rank} was started with other settings than rank 0: {', '.join(differ)}")
    if problems:
        raise FrawdError(f"{'; '.join(problems)}; start every rank with the same command")


def rank_config(cfg: Any) -> Any:
    """The run's config as this rank follows it, once `check_same_settings` found it the same
    on every rank: no progress output off rank 0, and after a restart by torchrun
    (`--max-restarts`) a resume from the last checkpoint, never a fresh start over it."""
    check_same_settings(cfg)
    place = current()
    if not place.is_main:
        cfg = type(cfg).from_dict({**cfg.to_dict(), "progress": False})
    if restart_count() and not cfg.resume:
        cfg = type(cfg).from_dict({**cfg.to_dict(), "resume": True, "overwrite": False})
        if place.is_main:
            print(f"restart {restart_count()} by torchrun: resuming {cfg.out}", file=sys.stderr, flush=True)
    return cfg


def teardown() -> None:
    global _current
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _current = Dist()


def check_ranks(cfg: Any, world_size: int, token_batches: bool = False) -> None:
    """What a run on `world_size` ranks would refuse at its start, checked before launching them."""
    batch_layout(None if token_batches else cfg.batch_size, cfg.grad_accum, world_size)
    if cfg.parallel == "fsdp" and cfg.dtype == "fp16":
        raise FrawdError(FSDP_FP16)


def batch_layout(batch_size: int | None, grad_accum: int, world_size: int) -> tuple[int | None, int]:
    """(per-rank micro-batch, accumulation steps) that keep the global batch
    `batch_size x grad_accum` on `world_size` ranks. `batch_size` None: batches of no fixed
    row count that the task deals out to any number of ranks (translation's token batches)."""
    if grad_accum % world_size == 0:
        return batch_size, grad_accum // world_size
    if batch_size is None:
        return None, grad_accum
    if batch_size % world_size == 0:
        return batch_size // world_size, grad_accum
    raise FrawdError(f"the global batch (batch_size {batch_size} x grad_accum {grad_accum}) does not split "
                     f"over {world_size} ranks: make batch_size or grad_accum a multiple of {world_size}")


@dataclass(frozen=True)
class Share:
    """This rank's part of each optimizer step, for loaders of whole rows (SFT's packed rows,
    DPO's pairs).

    A step takes the next `batch_size x grad_accum` rows of the data's (seeded) order, on
    any number of ranks. One process cuts them into `grad_accum` micro-batches of
    `batch_size` rows ("units"); rank r's micro-batch m is part `m x world_size + r` of
    `micro` rows (`batch_layout`), a whole unit or a slice of one. `scale` (1, or
    world_size when units are sliced) turns a loss that is a mean over a unit into each
    rank's share: rank loss = scale x (sum over its rows) / (the unit's count)."""

    batch_size: int
    grad_accum: int
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of_this_rank(cls, batch_size: int, grad_accum: int) -> "Share":
        place = current()
        return cls(batch_size, grad_accum, place.rank, place.world_size)

    @property
    def micro(self) -> int:
        return batch_layout(self.batch_size, self.grad_accum, self.world_size)[0]

    @property
    def accum(self) -> int:
        return batch_layout(self.batch_size, self.grad_accum, self.world_size)[1]

    @property
    def step_rows(self) -> int:
        return self.batch_size * self.grad_accum

    @property
    def scale(self) -> int:
        return self.batch_size // self.micro

    def rows(self, micro: int) -> slice:
        """Where this rank's micro-batch `micro` lies in the step's rows."""
        part = micro * self.world_size + self.rank
        return slice(part * self.micro, (part + 1) * self.micro)



def is_rank_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because another rank died or timed out."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("Gloo", "gloo", "NCCL", "Connection closed", "Connection reset",
                                  "timed out", "Timed out"))


# ---- the wrapped step ---------------------------------------------------------------------------------

class TaskModule(nn.Module):
    """The model with a function of it as `forward`: `module(fn, *args) == fn(model, *args)`.

    The loop calls the task's loss (and evaluation) through this, so DDP and FSDP wrap the
    whole step: DDP prepares its gradient reduction in `forward`, FSDP gathers the root's
    weights (embeddings, final norm, head) in its forward hook."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn, *args):
        return fn(self.model, *args)


FSDP_FP16 = "--parallel fsdp trains in bf16 or fp32 (fp16 needs a sharded gradient scaler): use --dtype bf16"


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: FSDP's units (one gather of weights per block)."""
    from ..model.block import TransformerBlock

    found = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if not found:  # another family: every child of a ModuleList
        found = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    return found


def wrap(model: nn.Module, dist_info: Dist, dtype: str) -> nn.Module:
    """What a training step calls: `TaskModule(model)`, under DDP or FSDP when distributed."""
    step_module = TaskModule(model)
    if dist_info.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
        return DistributedDataParallel(step_module, device_ids=ids, forward_sync_buffers=False)
    if dist_info.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if dtype == "fp16":
            raise FrawdError(FSDP_FP16)
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
        from torch.distributed.fsdp import register_fsdp_forward_method

        for block in _blocks(model):
            fully_shard(block, mp_policy=policy)
            if hasattr(block, "cross"):  # a decoder block's cross-attention keys/values, called outside forward
                register_fsdp_forward_method(block, "memory_kv")
        fully_shard(step_module, mp_policy=policy)
    return step_module


def gradient_sync(step_module: nn.Module, sync: bool):
    """A context for one micro-batch: gradients are reduced across ranks only on the last."""
    if sync:
        return nullcontext()
    if hasattr(step_module, "no_sync"):  # DDP
        return step_module.no_sync()
    if hasattr(step_module, "set_requires_gradient_sync"):  # FSDP
        step_module.set_requires_gradient_sync(False)

        class _Restore:
            def __enter__(self):
                return None

            def __exit__(self, *exc):
                step_module.set_requires_gradient_sync(True)

        return _Restore()
    return nullcontext()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks' shards under FSDP); the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor: this rank's shard of the reduction
        norm = norm.full_tensor()
    return float(norm)


# ---- checkpoints -------------------------------------------------------------------------------------

def full_model(step_module: nn.Module, model: nn.Module, dist_info: Dist, cache: dict) -> nn.Module | None:
    """The whole model, to save or sample from: the model itself unless sharded; under FSDP
    a plain copy on rank 0's CPU (every rank takes part in the gather; None off rank 0)."""
    if not dist_info.sharded:
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(step_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist_info.is_main:
        return None
    if "plain" not in cache:
        with torch.random.fork_rng(devices=[]):  # its random init must not move the run's RNG
            cache["plain"] = type(model)(model.config)  # the same class, on the CPU
    plain = cache["plain"]
    prefix = "model."
    plain.load_state_dict({k[len(prefix):]: v for k, v in state.items()}, strict=False)
    return plain.eval()


def sharded_optimizer_state(step_module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {"optimizer": get_optimizer_state_dict(step_module, optimizer)}


def save_sharded(state: dict, path: Path) -> None:
    """Every rank writes its shards of `state` under `path` (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    with _checkpoint_failures(path, "write"):
        dcp.save(state, checkpoint_id=str(path))


@contextmanager
def _checkpoint_failures(path: Path, doing: str):
    """torch.distributed.checkpoint's failures as this project's: it wraps every rank's error
    in a CheckpointException (a BaseException: a traceback per rank). The first rank's
    OSError (a full disk) goes on as itself (one line, as any write's); anything else (a
    truncated or missing shard) is a FrawdError naming the folder."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = [error for error, _ in exc.failures.values()] or [exc]
        first = failures[0]
        if isinstance(first, OSError):
            raise first from None
        detail = first_line(first)
        raise FrawdError(f"{path}: cannot {doing} the sharded checkpoint ({type(first).__name__}"
                         f"{': ' + detail if detail else ''})") from None


class _IndexUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint keeps a checkpoint's index (`.metadata`) as a pickle, and
    its reader runs `pickle.load`: a planted file would run code on resume. This reads it
    admitting only the classes such an index is made of (dataclasses of DCP's metadata,
    torch dtypes, sizes and layouts, paths)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif (module, name) in (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                                ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                                ("pathlib", "PureWindowsPath")):
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def read_sharded_metadata(directory: Path) -> Any:
    """The index of a sharded checkpoint, read with `_IndexUnpickler`; one line if it is
    missing, corrupt or holds anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / ".metadata"
    try:
        with open(path, "rb") as file:
            metadata = _IndexUnpickler(file).load()
    except Exception as exc:  # (unpickling arbitrary bytes raises many kinds)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0] or "empty"
        raise FrawdError(f"{path}: cannot read the sharded optimizer state's index ({type(exc).__name__}: "
                         f"{reason}); resume from an earlier checkpoint (move this one away)") from None
    if not isinstance(metadata, Metadata):
        raise FrawdError(f"{path}: not a torch.distributed.checkpoint index (holds a {type(metadata).__name__})")
    return metadata


def _SafeReader(directory: Path) -> Any:
    """DCP's file reader, its index read by `read_sharded_metadata` instead of `pickle.load`
    (the shards themselves it reads with `torch.load(weights_only=True)`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_sharded_metadata(directory)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(directory))


def _check_moments(saved: Any, params: list[Tensor], checkpoint: Path) -> None:
    """A whole optimizer state whose moments fit `params` (by index), or one FrawdError line:
    load_state_dict checks the parameter count, not the shapes, and AdamW's fused step then
    wrote past a moment of the wrong shape (a segmentation fault)."""
    state = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(state, dict) or not isinstance(saved.get("param_groups"), list):
        raise FrawdError(f"{checkpoint}: the optimizer state is not AdamW's (no state or param_groups)")
    for index, moments in state.items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(moments, dict):
            raise FrawdError(f"{checkpoint}: the optimizer state names parameter {index!r}, which this model lacks")
        for name, value in moments.items():
            if name != "step" and isinstance(value, Tensor) and value.shape != params[index].shape:
                raise FrawdError(f"{checkpoint}: the optimizer's {name} of parameter {index} has shape "
                                 f"{tuple(value.shape)}, the parameter {tuple(params[index].shape)}")


def load_optimizer(step_module: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path,
                   saved: dict | None, dist_info: Dist) -> None:
    """Restore AdamW's moments from a checkpoint written with any world size and parallelism:
    the sharded copy (`optimizer/`, written under FSDP) resharded to this run, or the whole
    state saved in state.pt (one process or DDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    sharded_dir = Path(checkpoint) / SHARDED_OPTIMIZER_DIR
    if sharded_dir.is_dir():
        import torch.distributed.checkpoint as dcp

        template = sharded_optimizer_state(step_module, optimizer)  # this run's layout, filled in place
        read_sharded_metadata(sharded_dir)  # (a clear line on every rank for a bad index, before the collective)
        with warnings.catch_warnings():  # one process reading a sharded run is a supported resume, not news
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            with _checkpoint_failures(sharded_dir, "read"):
                dcp.load(template, storage_reader=_SafeReader(sharded_dir))
        set_optimizer_state_dict(step_module, optimizer, template["optimizer"])
        return
    if saved is None:
        raise FrawdError(f"{checkpoint}: no optimizer state")
    _check_moments(saved, [p for g in optimizer.param_groups for p in g["params"]], checkpoint)
    if not dist_info.sharded:
        optimizer.load_state_dict(saved)  # the same parameters in the same order
        return
    # a whole state keyed by parameter index: name the parameters, then torch shards it
    names = {id(p): name for name, p in step_module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {"state": {order[i]: v for i, v in saved["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]}
    set_optimizer_state_dict(step_module, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def save_checkpoint(run_dir: Path, step: int, save_model, state: dict, sharded: dict | None,
                    dist_info: Dist) -> Path:
    """`checkpoint.save_checkpoint` for every rank: rank 0 builds the checkpoint in its
    temporary folder (the model directory, state.pt), every rank writes its shards there
    (FSDP), and the folder is renamed into place once all are written."""
    from ..io import atomic_dir
    from . import checkpoint as ckpt

    if not dist_info.active:
        return ckpt.save_checkpoint(run_dir, step, save_model, state)
    path = ckpt.checkpoint_path(run_dir, step)
    if dist_info.is_main:
        with atomic_dir(path, overwrite=True) as tmp:
            dist_info.from_main(str(tmp))
            if sharded is not None:
                save_sharded(sharded, tmp / SHARDED_OPTIMIZER_DIR)  # returns once every rank has written
            save_model(tmp / ckpt.MODEL_SUBDIR)
            torch.save(state, tmp / ckpt.STATE_FILE)
            ckpt.list_files(tmp)  # (every rank's shards are written: save_sharded returned)
    else:
        tmp = Path(dist_info.from_main(None))
        if sharded is not None:
            save_sharded(sharded, tmp / SHARDED_OPTIMIZER_DIR)
    dist_info.barrier()  # the checkpoint is in place for every rank
    return path
