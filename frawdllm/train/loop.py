"""The training loop: pretraining runs on it, and so can any job that plugs in a `TrainTask`.

A job plugs in a `TrainTask`: where batches come from, how a batch becomes a loss (and,
beside it, any named metrics, e.g. DPO's `rewards/margins`), which extra modules it
needs but never trains (e.g. DPO's frozen reference), how to evaluate, what to sample,
how to save the model. The `Trainer` owns everything else:

    for each optimizer step, until --max-steps / --max-tokens / --max-time:
        lr = schedule(step, progress)
        grad_accum times: batch -> loss (autocast) -> backward
        NaN/inf loss: skip the update (too many in a row: stop, checkpoints intact)
        clip the gradients' global norm, AdamW step
        every eval_interval steps (and at the end): evaluate, publish OUT/model if
        the validation loss is the best so far, checkpoint, sample (last: optional)

Resuming restores weights, optimizer moments, schedule, counters, RNG states and the
task's data position, so an interrupted-and-resumed run computes exactly the losses of
an uninterrupted one (bitwise in fp32 on CPU). SIGINT/SIGTERM finish the current step,
save a checkpoint and return.

Time is counted from `started_at` (the command's start: `frawd pretrain` passes the
process's start, so tokenizer training and data preparation count too; by default the
start of `fit`) and includes the peak measurement, torch.compile's warm-up, evaluations
and checkpoints. The run stops early enough to leave time for its last evaluation and
checkpoint (as long as the previous ones took).

`dtype: auto` and `compile: auto` are decided here, by measurement (`compile.AutoPlan`):
the first steps run eagerly, timed in each dtype the hardware computes natively, then
the loop keeps the option that gets the most steps done in the budget left, compiling
only if the warm-up pays back. Each decision is said in one line, and kept in the
checkpoints: a resumed run continues with it rather than timing again.

Under torchrun the same loop runs on every rank (`distributed`): a step calls the model
through DDP or FSDP, the ranks agree on the loss, the stop and the `auto` decisions, and
rank 0 alone writes the logs, samples and model directories.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import numbers
import os
import signal
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import FrawdError, counted, first_line
from ..io import atomic_dir
from ..seeds import torch_seed
from . import checkpoint as ckpt
from . import compile as compiling
from . import distributed
from .config import TrainConfig, parse_duration
from .device import (autocast, choose_dtype, cpu_has_bf16, forget_peak, format_mfu, keep_freed_memory, matmul_dtype,
                     mfu, peak_flops, pick_device, rng_state, set_rng_state)
from .optim import build_optimizer
from .progress import bar_update, budget_value, progress_bar, si
from .rundir import (BEST_MODEL_DIR, LOOP_OUTPUTS, MetricsLog, append_samples, budget_spent, claim_run_dir,
                     load_pyplot, plot_losses, release_run_dir, settle_run_dir, truncate_metrics, truncate_samples)
from .schedule import LRSchedule

STATE_VERSION = 1
STOP_REASONS = (None, "max_steps", "max_tokens", "max_time", "interrupted", "data_exhausted")
# A run whose fastest logged window computed more than this times the cached peak had it
# measured on a busy machine (a quiet measurement is not beaten: the demo runs at ~90% MFU).
PEAK_SLACK = 1.05
# Steady steps in the median before the evaluation's cost in steps is trusted (see _rebase_costs).
_STEADY_STEPS = 5


class _DataExhausted(Exception):
    """The task's `next_batch` raised StopIteration (a finite dataset ran out)."""


class TrainingDiverged(FrawdError):
    """The loss was NaN/inf for too many steps in a row."""


LossOutput = Tensor | tuple[Tensor, dict[str, Tensor]]


def _kind(value: Any) -> str:
    return f"a {value.dim()}-D tensor" if isinstance(value, Tensor) else type(value).__name__


class TaskOutputError(TypeError):
    """A task's `loss` or `evaluate` returned the wrong kind of value (the task's mistake,
    never taken for a torch.compile failure)."""


def checked_loss(out: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """A task's `loss` result as (loss, metrics), else a TaskOutputError saying what it must
    be (the loop's own code failed on it: `'float' object has no attribute 'detach'`...)."""
    loss, metrics = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise TaskOutputError(f"the task's loss must return a scalar tensor or (loss, {{name: scalar tensor}}), "
                        f"got {_kind(out if isinstance(out, tuple) and len(out) != 2 else loss)}")
    if not loss.requires_grad:
        raise TaskOutputError("the task's loss has no gradient (not computed from the model's trainable parameters, "
                        "or under no_grad)")
    if not isinstance(metrics, dict):
        raise TaskOutputError(f"the task's metrics must be a dict of scalar tensors, got {_kind(metrics)}")
    for name, value in metrics.items():
        if not isinstance(value, Tensor) or value.dim() != 0:
            raise TaskOutputError(f"the task's metric {name!r} must be a scalar tensor, got {_kind(value)}")
    return loss, metrics


def checked_results(results: Any) -> dict[str, float]:
    """A task's `evaluate` result as {name: float} (a scalar tensor or numpy number becomes
    its value), else a TaskOutputError naming the value."""
    if not isinstance(results, dict):
        raise TaskOutputError(f"the task's evaluate must return a dict of numbers, got {_kind(results)}")
    checked = {}
    for name, value in results.items():
        if isinstance(value, Tensor) and value.dim() == 0:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TaskOutputError(f"the task's evaluate result {name!r} must be a number, got {_kind(value)}")
        checked[name] = float(value)
    return checked


def first_tensor(batch: Any) -> Any:
    """A batch's first tensor, through nested tuples, lists and dicts."""
    while isinstance(batch, (tuple, list, dict)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return batch


class TrainTask:
    """What a training job plugs into the loop. Override `next_batch` and `loss`; the rest
    has defaults. Batches are tensors or (nested) tuples/lists/dicts of tensors on the CPU;
    the loop moves them to the device."""

    flops_per_token: int | None = None  # training FLOPs per token, for MFU (None: no MFU)
    bar_metrics: tuple[str, ...] = ()  # named metrics (see `loss`) shown on the progress bar
    token_batches: bool = False  # batches of no fixed row count (not `batch_size` rows), dealt out by the task
    loss_unit: str = "nats/token"  # what the loss is a mean of, for loss.png's axis

    def next_batch(self) -> Any:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> LossOutput:
        """The scalar loss of a batch already on the device (runs under autocast), or
        `(loss, metrics)`: metrics are named scalar tensors (no gradient needed) that the
        loop averages over the step's micro-batches and logs beside the loss (metrics.jsonl,
        loss.png, and the progress bar for the names in `bar_metrics`)."""
        raise NotImplementedError

    def frozen_modules(self) -> dict[str, nn.Module]:
        """Modules the task uses but never trains (e.g. DPO's reference model). The loop
        moves them to the device once, keeps them in eval mode without gradients, gives
        them to no optimizer and saves them in no checkpoint (the task rebuilds them)."""
        return {}

    def batch_tokens(self, batch: Any) -> int:
        """Tokens a batch counts for --max-tokens and tokens/s: its first tensor's size."""
        return int(first_tensor(batch).numel())

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Validation metrics with at least `val_loss` (eval mode, no_grad, autocast); {} if none."""
        return {}

    def evaluation_key(self) -> dict[str, Any]:
        """What `evaluate`'s val_loss measures: {name: plain value} for each thing that changes
        it, a setting (SFT's train_on) or a `content_hash` of the held-out data it reads. Kept
        in checkpoints: a resume where it differs (other --data, --val-fraction, ...) chooses
        the best model afresh, as the best val_loss so far measured something else. {}: unknown
        (the best is kept)."""
        return {}

    def samples(self, model: nn.Module, device: torch.device) -> list[str]:
        return []

    def prepare_samples(self, device: torch.device) -> None:
        """One-time work the first `samples` would do (the native forward's C build, 25-30 s
        on a new machine), done at start-up: inside an evaluation it was taken for what
        every evaluation costs, and a time budget kept it in reserve (runs ended 9-18% early)."""

    def evaluation_extra_s(self) -> float:
        """Seconds a whole evaluation takes beyond the last `evaluate` + `samples` (asked right
        after them): work they skipped (translation's BLEU on an untrained model), which a
        time budget must keep in reserve for the final evaluation."""
        return 0.0

    def save_model(self, model: nn.Module, directory: Path) -> None:
        """Write `model` as a model directory (the best model, and each checkpoint's)."""
        model.save_pretrained(directory)

    def load_model(self, model: nn.Module, directory: Path) -> None:
        """Resume: load a checkpoint's model directory (written by `save_model`) into `model`.
        A task whose saved model is not its trained state (e.g. LoRA adapters merged on save)
        restores that state from its `state_dict` instead."""
        ckpt.load_weights(model, directory)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def content_hash(*parts: Any) -> str:
    """A short hash of tensors, numpy arrays and JSON values (lists of ids...), for
    `TrainTask.evaluation_key`."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Tensor):
            part = part.numpy(force=True)
        if isinstance(part, np.ndarray):
            h.update(f"{part.dtype} {part.shape}".encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(json.dumps(part).encode())
    return h.hexdigest()[:16]


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        if device.type == "cuda":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


@dataclass
class TrainResult:
    steps: int
    tokens: int
    elapsed_s: float
    stop_reason: str  # max_steps | max_tokens | max_time | interrupted | data_exhausted
    last_loss: float | None
    val_loss: float | None  # at the final evaluation
    best_val_loss: float | None
    best_step: int | None
    tokens_per_s: float
    mfu: float | None  # None: no peak, or a computed MFU above 100% (a wrong peak)
    checkpoint: Path | None
    run_dir: Path
    flops_known: bool = False  # the task counts its FLOPs (MFU is shown, n/a without a peak)
    ran_as: str = ""  # how this session's steps ran, e.g. "bf16, compiled" (what dtype/compile auto chose)
    val_step: int | None = None  # the step of the evaluation val_loss comes from

    def summary(self) -> str:
        # steps, tokens and time count the whole run (earlier sessions of a resumed run too);
        # the speed is this session's average, so each is labelled with what it covers
        speed = f"this session {si(self.tokens_per_s)} tok/s" + (f" ({self.ran_as})" if self.ran_as else "")
        if self.flops_known:
            speed += f", MFU {format_mfu(self.mfu)}"
        parts = [f"{self.stop_reason}: {counted(self.steps, 'step')}, {si(self.tokens)} tokens in {self.elapsed_s:.1f} s "
                 "(the run so far)", speed]
        if self.last_loss is not None:
            parts.append(f"loss {self.last_loss:.4f}")
        if self.val_loss is not None:
            parts.append(f"val_loss {self.val_loss:.4f}" + (  # (an interrupt comes between evaluations)
                f" (at step {self.val_step})" if self.val_step not in (None, self.steps) else ""))
        if self.best_val_loss is not None:
            parts.append(f"best val_loss {self.best_val_loss:.4f} at step {self.best_step}")
        where = f"model in {self.run_dir / BEST_MODEL_DIR}"
        if not (self.run_dir / BEST_MODEL_DIR).is_dir():  # stopped before any evaluation published one
            where = "no model published yet (no evaluation ran)" + (
                f"; the latest weights are in {self.checkpoint / ckpt.MODEL_SUBDIR}, --resume continues"
                if self.checkpoint else "")
        elif self.best_step == 0 and self.steps > 0:  # no evaluation after the start beat it
            where += (" (the starting weights: no later evaluation beat them"
                      + (f"; the latest weights are in {self.checkpoint})" if self.checkpoint else ")"))
        return "; ".join(parts + [where])


class Trainer:
    """The one training loop (module docstring): `Trainer(model, task, cfg, run_dir).fit()`
    trains `model` on what `task` (a `TrainTask`) gives, as `cfg` (a `TrainConfig`) says,
    resuming from the checkpoints in `run_dir` when `cfg.resume` is set."""

    def __init__(self, model: nn.Module, task: TrainTask, cfg: TrainConfig, run_dir: str | Path | None = None,
                 callbacks: list[Callable[["Trainer", dict], None]] | None = None,
                 config_for_loggers: dict | None = None, started_at: float | None = None) -> None:
        """`started_at`: the `time.perf_counter()` from which --max-time counts (default: fit's start).

        `run_dir` (default `cfg.out`) is made ready as `frawd pretrain` makes OUT: an earlier
        run there is continued with `cfg.resume`, deleted with `cfg.overwrite`, else refused."""
        cfg.require_budget()  # before anything is written
        self.dist = distributed.setup(cfg.parallel, cfg.device, parse_duration(cfg.dist_timeout))
        if not self.dist.is_main:
            cfg = cfg.from_dict({**cfg.to_dict(), "progress": False})
        self.cfg, self.task = cfg, task
        self.started_at = started_at
        self.run_dir = Path(run_dir if run_dir is not None else cfg.out)
        self.resumes = self._settle_run_dir()
        self.callbacks = list(callbacks or [])
        self.device = self.dist.device or pick_device(cfg.device)
        # the same global batch on any number of ranks
        rows = None if task.token_batches else cfg.batch_size
        self.micro_batch, self.grad_accum = distributed.batch_layout(rows, cfg.grad_accum, self.dist.world_size)
        self.dtype, self.dtype_why = choose_dtype(cfg.dtype, self.device)
        if self.device.type == "cpu" and matmul_dtype(self.dtype, self.device) != self.dtype:
            self._warn(f"{self.dtype} is emulated on this CPU (no native {self.dtype} matmuls): "
                          "training will be far slower than in fp32")
        if self.device.type == "cpu":
            keep_freed_memory()
        self.model = model.to(self.device)
        self._resume_from = self._resume_weights() if self.resumes else None  # before FSDP shards them
        self.step_module = distributed.wrap(self.model, self.dist, self.dtype)  # what a step calls
        self._plain: dict = {}  # FSDP: rank 0's whole copy of the model, for saving and samples
        self.frozen = task.frozen_modules()
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        if any(id(p) in trainable for m in self.frozen.values() for p in m.parameters()):
            raise ValueError("a frozen module shares parameters with the trained model")
        for module in self.frozen.values():
            module.to(self.device).eval().requires_grad_(False)
        self._compiled = False  # whether the step is (meant to be) compiled
        self._compiled_ok = False  # a compiled step has run (a failure after that is no compile problem)
        self._compile_retried = False
        self._warmup_s: float | None = None  # the first compiled step's duration
        self._cost_remembered = False  # this session's compile cost went into the cache
        self._last_step_s: float | None = None
        self._eager_s: dict[str, float] = {}  # timed eager step per dtype (auto)
        self._cost_keys: dict[str, str] = {}
        self.compile_why = "off (compile: false)"
        self.plan: compiling.AutoPlan | None = None
        self.loss_fn = task.loss
        self._plan_compile(cfg)
        self.optimizer = build_optimizer(model, cfg)
        self.schedule = LRSchedule(cfg.lr, cfg.schedule, cfg.warmup_steps, cfg.min_lr_ratio, cfg.decay_fraction)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == "fp16")
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        # counters (saved in checkpoints)
        self.step = 0
        self.tokens = 0
        self.elapsed_before = 0.0  # training time spent by earlier sessions of a resumed run
        self.best_val_loss = math.inf
        self.best_step: int | None = None
        self.evaluates = task.evaluation_key()  # what val_loss measures (saved in checkpoints)
        self.bad_steps = 0
        # this session
        self.stop_reason: str | None = None
        self._signal: str | None = None
        self._start = 0.0  # perf_counter from which this session's time counts
        self._fit_start = 0.0  # perf_counter at the start of fit()
        self._session_step, self._session_tokens, self._session_progress = 0, 0, 0.0
        self._eta_from: tuple[float, int, int] | None = None  # (time, step, tokens) of the session's first bar update
        self._schedule_reserve_s: float | None = None  # (see _learning_rate)
        self._warmup_end: list | None = None  # step, tokens, time and reserve where warmup ended (see _learning_rate)
        self._eval_s: float | None = None  # what the last evaluation cost (with the work it skipped)
        self._publish_s: float | None = None  # the last publish of the best model (its weights)
        self._save_s: float | None = None  # how long the last checkpoint took
        self._costs_step_s: float | None = None  # the typical step when those were measured
        self._costs_steps = 0  # how many of this session's steady steps that typical step had seen
        self._steady_steps = 0  # this session's steps in _step_times (not its first, nor timing steps)
        self._eval_steps: list[float] = []  # recent evaluations' durations, in typical steps
        self._evaluating_s = 0.0  # this session's evaluations, publishes and checkpoints
        self._step_times: list[float] = []  # recent step durations, the session's first excluded
        self._window = (0.0, 0)  # (time, tokens) where the current tokens/s window starts
        self._rate = 0.0  # tokens/s over that window
        self._top_rate = 0.0  # the fastest logged window of this session (checked against the peak)
        self._last_eval_step: int | None = None
        self._owed_eval = False  # resumed from a checkpoint whose step's evaluation a signal cut off
        self._evaluated_before = False  # resumed from a step-0 checkpoint whose evaluation is logged
        self._last_checkpoint_step: int | None = None
        self.last_loss: float | None = None
        self.last_val_loss: float | None = None
        self.last_val_step: int | None = None
        self.last_checkpoint: Path | None = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:
            ckpt.remove_partial(self.run_dir)
        self.peak_flops = cfg.peak_tflops * 1e12 if cfg.peak_tflops else None
        self._peaks: dict[str, float | None] = {}
        if task.flops_per_token and self.peak_flops is None:  # measured (once per machine) before any
            for d in (self.plan.dtypes if self.plan else [self.dtype]):  # RNG state is restored
                self._peaks[d] = peak_flops(self.device, d, say=self._say)
            self.peak_flops = self._peaks.get(self.dtype)
        if self.plan is not None:
            self.plan.peaks = self._peaks
        if self.resumes:
            self._resume()
            self._refuse_a_spent_budget()
        elif self.dist.rank > 0:
            _own_dropout_seed(self.dist.rank)
        self.metrics = MetricsLog(self.run_dir, cfg.tensorboard, cfg.wandb, cfg.wandb_project,
                                  config_for_loggers) if self.dist.is_main else _NoMetrics()
        if self.resumes:
            self.metrics.rewind(self.step)

    def _settle_run_dir(self) -> bool:
        """Whether the run resumes. A job's start (`prepare_run_dir`) leaves no loop output in
        OUT, only its config.yaml; any output means an earlier run, which `settle_run_dir`
        continues, deletes or refuses, as the CLI does. Rank 0 decides; every rank follows."""
        decision: bool | str = self.cfg.resume
        if self.dist.is_main:
            try:
                claim_run_dir(self.run_dir)  # (a job's start claimed it already; `fit` lets go)
                decision = settle_run_dir(self.run_dir, self.cfg.resume, self.cfg.overwrite, LOOP_OUTPUTS)
            except FrawdError as error:
                decision = str(error)  # raised on every rank, so none waits for the others
        decision = self.dist.from_main(decision)
        if isinstance(decision, str):
            raise FrawdError(decision)
        return decision

    def _warn(self, message: str) -> None:
        """A warning, on rank 0 only: the ranks share every decision, loss and budget (each
        of N ranks said it: N lines)."""
        if self.dist.is_main:
            warnings.warn(message, stacklevel=3)

    def _say(self, message: str) -> None:
        """A one-line message on stderr (above the progress bar, if one is shown), on rank 0.
        Also without the bar: `--no-progress` is for logs, and a log should say what the
        next silent minute is (a compile's warm-up, a peak measured)."""
        if not self.dist.is_main:
            return
        if self.cfg.progress:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def _plan_compile(self, cfg: TrainConfig) -> None:
        """Compile now, never, or after timing the first steps (`AutoPlan`)."""
        blocker = compiling.known_failure(self.device) if cfg.compile != "false" else None
        if cfg.compile == "true" and blocker is not None and "before" not in blocker:
            self._warn(f"compile: true, but {blocker}; training without torch.compile")
        if cfg.compile == "true" and (blocker is None or "before" in blocker):
            self._use_compiled(True)
            self.compile_why = "on (compile: true)"
        elif cfg.compile == "auto" and blocker is not None:
            self.compile_why = f"off: {blocker}"
            if "before" in blocker:  # (a remembered failure: said, or later runs were eager without a word)
                self._say(f"compile {self.compile_why}")
        candidates = [self.dtype]
        if cfg.dtype == "auto" and self.device.type == "cpu" and cpu_has_bf16() and cfg.compile != "true" \
                and not self.dist.active:  # under FSDP the precision is fixed when sharding
            candidates = ["bf16", "fp32"]  # both native: eager bf16 (casts) is not always the faster
        if (cfg.compile == "auto" and blocker is None) or len(candidates) > 1:
            setting = "auto" if cfg.compile == "auto" and blocker is None else "false"
            self.plan = compiling.AutoPlan(candidates, setting, self._cost_keys)
            if setting == "auto":
                self.compile_why = "auto: decided after timing the first steps"
        if self._compiled or (self.plan and self.plan.compile_setting == "auto"):
            compiling.use_persistent_cache()

    def _use_compiled(self, on: bool) -> None:
        # Compiling the task's loss (not just model.forward) lets torch.compile see the whole
        # step: the model, a fused loss, a reference model (DPO)...
        self._compiled = on
        self.loss_fn = compiling.compile_step(self.task.loss) if on else self.task.loss

    def _cost_key(self, dtype: str, batch: Any) -> str:
        if dtype not in self._cost_keys:
            first = first_tensor(batch)
            shape = tuple(first.shape) if isinstance(first, Tensor) else ()
            self._cost_keys[dtype] = compiling.shape_key(self.device, dtype, self.model, shape)
        return self._cost_keys[dtype]

    def _decide(self) -> None:
        """End of the timing steps: pick the dtype and whether to compile, say it."""
        plan, cfg = self.plan, self.cfg
        remaining = math.inf
        if cfg.max_time_s:
            remaining = cfg.max_time_s - self.elapsed() - self._final_eval_s()
        steps_left = []
        if cfg.max_steps:
            steps_left.append(cfg.max_steps - self.step)
        if cfg.max_tokens and self.step:
            steps_left.append((cfg.max_tokens - self.tokens) / (self.tokens / self.step))
        counted_steps = None  # the steps left, where they bound the run (not its time)
        if steps_left:
            by_steps = min(steps_left) * min(plan.eager_step_s(d) for d in plan.dtypes)
            if by_steps < remaining:
                remaining, counted_steps = by_steps, max(min(steps_left), 0)
        if self.task.flops_per_token and self.step > self._session_step:
            plan.step_flops = self.task.flops_per_token * (self.tokens - self._session_tokens) / (
                self.step - self._session_step)
        dtype, compiled, why = self.dist.from_main(plan.decide(max(remaining, 0.0), counted_steps))
        if len(plan.dtypes) > 1:
            self.dtype_why = f"auto: {dtype} ran faster here" if not compiled else f"auto: {dtype}"
        self.dtype = dtype
        self._eager_s = {d: plan.eager_step_s(d) for d in plan.dtypes}
        self.peak_flops = self._peaks.get(dtype, self.peak_flops)
        if plan.compile_setting == "auto":
            self.compile_why = f"auto: {'on' if compiled else 'off'}: {why}"
            self._say(f"compile {self.compile_why}")
        elif len(plan.dtypes) > 1:
            self._say(f"dtype {self.dtype_why} ({why})")
        self.plan = None
        if compiled:
            self._use_compiled(True)

    @property
    def compiled(self) -> bool:
        """Whether the training step runs under torch.compile (now)."""
        return self._compiled

    # ---- the loop ---------------------------------------------------------------------
    def request_stop(self, reason: str = "interrupted") -> None:
        """Stop after the current step, with a checkpoint (signal handlers call this)."""
        self._signal = reason

    def fit(self) -> TrainResult:
        """Train until a stopping rule (--max-steps / --max-tokens / --max-time, a signal, too
        many non-finite losses) holds; evaluates, checkpoints and samples on the way."""
        cfg = self.cfg
        self._refuse_a_spent_budget()
        self.model.train()
        load_pyplot()
        if cfg.sample_tokens and self.dist.is_main:  # (start-up: inside the budget; sharded, samples run on the CPU)
            self.task.prepare_samples(torch.device("cpu") if self.dist.sharded else self.device)
        self._fit_start = time.perf_counter()
        self._window = (self._fit_start, self.tokens)
        self._session_step, self._session_tokens = self.step, self.tokens
        self._session_progress = self.progress()
        self._eta_from = None
        late = bool(cfg.max_time_s and self.step == 0 and self.elapsed() >= cfg.max_time_s)
        if late:
            self._warn(f"start-up (tokenizer, data, model, native build) took {self.elapsed():.1f} s, the whole "
                          f"--max-time {cfg.max_time_s:g} s: the run makes one step and its evaluation, and runs over")
        guard = _StderrGuard(sys.stderr, self.request_stop)
        sys.stderr = guard  # (before the bar: tqdm keeps the stream it was made with)
        bar = progress_bar(cfg.progress, self._session_progress)
        restore = _install_signal_handlers(self)
        try:
            self._fit(bar)
            if not late:  # (a late start has said so)
                self._warn_overrun()
        except Exception as exc:
            if not (self.dist.active and distributed.is_rank_failure(exc)):
                raise
            last = ckpt.latest_checkpoint(self.run_dir)
            first = first_line(exc, type(exc).__name__)
            raise distributed.RankLost(
                f"rank {self.dist.rank}: lost the other ranks at step {self.step + 1} ({first}); "
                + (f"the last checkpoint is {last}: continue with --resume" if last else "no checkpoint yet")) from None
        finally:
            restore()
            if bar is not None:
                bar.close()
            sys.stderr = guard.stream
            self.metrics.close()
            release_run_dir(self.run_dir)
        if guard.reader_left:  # (the checkpoint is written: now the exit of a command whose reader left)
            raise BrokenPipeError("standard error's reader left")
        self._check_cached_peak()
        if self._compiled and self._warmup_s is not None and not self._cost_remembered and self.dist.is_main:
            # a short run (fewer than 5 compiled steps after the warm-up): its warm-up, the
            # cold one a later `auto` must count on, is kept all the same
            self._remember_compile_cost(step_known=bool(self._step_times))
        return self._result()

    def _refuse_a_spent_budget(self) -> None:
        """A resumed run with nothing left to do is refused in one line, this session's time
        counted from `started_at` (set here). The constructor asks first, inside a job's start
        (`undo_failed_start`): a refused resume leaves the run's config.yaml as it was (the file
        had the refused budget, and the next resume took it); `fit` asks again."""
        cfg = self.cfg
        # (this session's start-up counts: a resume with a second left of 20 s used 2.9 s more)
        self._start = self.started_at if self.started_at is not None else time.perf_counter()
        spent = self._check_stop() if self.step > 0 else None
        if spent is None and self.step > 0 and self._too_late_to_resume():
            spent = "max_time"
        if spent is None:
            return
        if spent == "max_steps":
            done = f"{self.step} steps of --max-steps {cfg.max_steps}"
        elif spent == "max_tokens":
            done = f"{si(self.tokens)} tokens of --max-tokens {si(cfg.max_tokens)}"
        else:
            done = f"{self.elapsed():.1f} s of --max-time {cfg.max_time_s:g} s"
            if self.elapsed() < cfg.max_time_s:
                done += f", and a step with the final evaluation and checkpoint takes {self._schedule_reserve():.1f} s"
        release_run_dir(self.run_dir)
        raise FrawdError(budget_spent(self.run_dir, done))

    def _check_cached_peak(self) -> None:
        """A measured peak that this run out-computed (by more than the timing's noise) was
        measured on a busy machine: it is dropped, to be measured again next run, and said."""
        peak = self._peaks.get(self.dtype)
        if not peak or not self.task.flops_per_token or not self.dist.is_main:  # (--peak-tflops: not in _peaks)
            return
        achieved = self._top_rate * self.task.flops_per_token / self.dist.world_size  # FLOP/s of one device
        if achieved > PEAK_SLACK * peak:
            forget_peak(self.device, self.dtype)
            self._warn(f"this run computed {achieved / 1e9:.1f} GFLOP/s, above the cached matmul peak of "
                          f"{peak / 1e9:.1f} (measured while the machine was busy, so MFU showed n/a): the next "
                          "run measures it again")

    def _warn_overrun(self) -> None:
        """A run that ended over its --max-time (by more than 5%) says where the time went."""
        cfg, elapsed = self.cfg, self.elapsed()
        if not cfg.max_time_s or elapsed <= 1.05 * cfg.max_time_s or self.stop_reason == "interrupted" \
                or not self.dist.is_main:
            return
        start_up = self._fit_start - self._start
        steps = self.step - self._session_step
        training = time.perf_counter() - self._fit_start - self._evaluating_s
        earlier = f"earlier sessions {self.elapsed_before:.1f} s, " if self.elapsed_before else ""
        why = ""
        if self._warmup_s is not None and self._warmup_s > 0.1 * cfg.max_time_s:
            why = (f" (torch.compile's warm-up took {self._warmup_s:.1f} s of the first step: a budget this short "
                   "trains more without compile; compile: auto decides by the budget)")
        elif steps == 1 and training > 0.1 * cfg.max_time_s:
            why = " (a step outlasts what the budget left: a smaller --batch-size or model fits)"
        threads, load = torch.get_num_threads(), _load_average() if self.device.type == "cpu" else None
        if load is not None and load > threads + 1:  # other processes' threads beside this run's own
            why += (f"; the machine was busy (load average {load:.1f}, {counted(threads, 'torch thread')} here), "
                    "which slows every step" + (": on a shared machine start with OMP_NUM_THREADS=1"
                                                if threads > 1 else ""))
        self._warn(f"the run took {elapsed:.1f} s of --max-time {cfg.max_time_s:g} s: {earlier}start-up "
                      f"{start_up:.1f} s, evaluations and checkpoints {self._evaluating_s:.1f} s "
                      f"({cfg.eval_batches} validation batches each: --eval-batches sets it), {steps} training "
                      f"step{'s' * (steps != 1)} {training:.1f} s" + why)

    def _fit(self, bar) -> None:
        cfg = self.cfg
        # the starting point, and what an evaluation costs (a time budget keeps the final one in
        # reserve); or, resumed where a stop cut off a due evaluation, that one (as uninterrupted)
        if (self.step == 0 and (cfg.eval_interval or cfg.max_time_s) and not self._evaluated_before) \
                or self._owed_eval:
            self._evaluate(save=False)
            # a signal during it: no step after it (agreed, as every stop is)
            self.stop_reason, _ = self.dist.agree_stop(None, self._signal is not None, STOP_REASONS, self.device)
        while self.stop_reason is None:
            try:
                record = self.train_step()
            except _DataExhausted:
                self._data_exhausted()
                break
            bar_update(bar, self, record, time.perf_counter())
            for callback in self.callbacks:
                callback(self, record)
            # A time budget's schedule keeps the largest reserve the stop rule has needed (agreed by
            # every rank): fixed at its first estimate, a run whose steps slowed down stopped early
            # with the rate far above its floor (0.4-0.5 of the peak where the floor was 0).
            reserve = self._schedule_reserve() if self._schedule_reserve_s is not None else 0.0
            self.stop_reason, reserve = self.dist.agree_stop(self._check_stop(), self._signal is not None,
                                                             STOP_REASONS, self.device, reserve)
            if self._schedule_reserve_s is not None:
                self._schedule_reserve_s = max(self._schedule_reserve_s, reserve)
            # no checkpoint in the middle of a NaN streak: the last one stays the last good one
            if self.stop_reason is None and cfg.eval_interval and self.step % cfg.eval_interval == 0 \
                    and not self.bad_steps and self._due_evaluation_fits():
                self._evaluate(save=True)
        if self.stop_reason == "interrupted":  # leave quickly: a checkpoint, no evaluation
            if self._last_checkpoint_step != self.step:
                self._save_checkpoint()
        elif self._last_eval_step != self.step or self._last_checkpoint_step != self.step:
            self._evaluate(save=True)

    def train_step(self) -> dict:
        """One optimizer step (grad_accum micro-batches); returns its metrics record."""
        cfg = self.cfg
        started = time.perf_counter()
        lr = self._learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        timing = self.plan.next_dtype() if self.plan is not None else None
        if timing is not None:
            self.dtype = timing
        warming = self._compiled and not self._compiled_ok
        if warming:
            self._say("torch.compile warm-up (first step)...")
        total = torch.zeros((), device=self.device)
        named: dict[str, Tensor] = {}  # the task's metrics, summed over micro-batches
        step_tokens = 0
        for micro in range(self.grad_accum):
            try:
                batch = to_device(self.task.next_batch(), self.device)
            except StopIteration:  # (leaving a generator as StopIteration would be a RuntimeError)
                raise _DataExhausted from None
            step_tokens += self.task.batch_tokens(batch)  # (this rank's: summed over ranks below)
            with distributed.gradient_sync(self.step_module, micro == self.grad_accum - 1):
                loss, metrics = self._forward_backward(batch)
            total += loss
            for key, value in metrics.items():
                named[key] = named[key] + value if key in named else value
            self._cost_key(self.dtype, batch)
        # the loss's mean over ranks and the step's tokens, each rank's counted (rows of
        # conversations or sentence pairs differ in length from rank to rank)
        loss_sum, step_tokens = self.dist.sums([float(total) / self.grad_accum, step_tokens], self.device)
        loss_value, step_tokens = loss_sum / self.dist.world_size, int(step_tokens)
        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = distributed.clip_grad_norm(self.params, max_norm)
        # fp16 overflows are the scaler's business (it skips that step and lowers the scale).
        finite = math.isfinite(loss_value) and (self.dtype == "fp16" or math.isfinite(grad_norm))
        if finite:
            self.scaler.step(self.optimizer)
            self.bad_steps = 0
        else:
            self._bad_step(loss_value, grad_norm)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += step_tokens
        self.last_loss = loss_value
        record = {"step": self.step, "tokens": self.tokens, "loss": loss_value, "lr": lr, "grad_norm": grad_norm}
        record.update({key: self.dist.mean(float(value) / self.grad_accum, self.device)
                       for key, value in sorted(named.items())})
        now = time.perf_counter()
        self._last_step_s = now - started
        if self.plan is not None:
            self.plan.record(self.dtype, now - started)
            if self.plan.next_dtype() is None:
                self._decide()
                self._step_times = [] if self._compiled else [self._eager_s[self.dtype]]
        elif warming:
            self._warmup_s = now - started
        elif self.step > self._session_step + 1:  # the first step of a session warms up (compiles)
            self._step_times = self._step_times[-8:] + [now - started]
            self._steady_steps += 1
            if self._costs_step_s is None or self._costs_steps < _STEADY_STEPS <= self._steady_steps:
                self._rebase_costs()
            if self._compiled and len(self._step_times) == 5 and self._warmup_s is not None:
                self._remember_compile_cost()
                self._cost_remembered = True
        since, tokens_then = self._window
        self._rate = (self.tokens - tokens_then) / max(now - since, 1e-9)
        if self.step % cfg.log_interval == 0:
            record.update(self._speed(self._rate), elapsed_s=round(self.elapsed(), 3))
            if self.step > self._session_step + 1:  # (not the warm-up step)
                self._top_rate = max(self._top_rate, self._rate)
            self.metrics.log(record)
            self._window = (now, self.tokens)
        return record

    def _data_exhausted(self) -> None:
        """A finite dataset ran out: the run ends as a budget would end it (a final evaluation
        and checkpoint); the micro-batches of the step it cut short are dropped."""
        if self.dist.active:  # (the other ranks are inside this step's collectives)
            raise FrawdError(f"the task's next_batch ran out of data (StopIteration) at step {self.step + 1} on "
                             f"rank {self.dist.rank}: under torchrun every rank's data must last the whole budget")
        if self.step == 0:
            raise FrawdError("the task's next_batch gave no batch (StopIteration before the first step)")
        self.optimizer.zero_grad(set_to_none=True)
        self.stop_reason = "data_exhausted"

    def _forward_backward(self, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """The micro-batch's loss and named metrics (detached, fp32), its gradients accumulated."""
        try:
            with autocast(self.device, self.dtype):
                loss = self.step_module(self.loss_fn, batch)
            loss, metrics = checked_loss(loss)
            self.scaler.scale(loss / self.grad_accum).backward()
        except Exception as exc:  # noqa: BLE001 - only the first compiled step is retried
            if not self._compiled or self._compiled_ok or isinstance(exc, TaskOutputError):
                raise
            self.optimizer.zero_grad(set_to_none=True)
            reason = compiling.failure_reason(exc)
            if compiling.is_cache_corruption(exc) and not self._compile_retried:
                # e.g. a kernel truncated by a killed run: compile again into a fresh cache folder
                self._compile_retried = True
                where = compiling.use_fresh_cache()
                self._say(f"torch.compile's cache is damaged ({reason}); compiling again in {where}")
                self._use_compiled(True)
                return self._forward_backward(batch)
            # e.g. no working C++ compiler on this machine: train without torch.compile
            self._warn(f"torch.compile failed ({reason}); training without it")
            if self._signal is None:  # Ctrl-C or SIGTERM reach inductor's compilers too: no fault of this machine
                compiling.remember_failure(self.device, reason)
            self.compile_why = f"off: torch.compile failed ({reason})"
            self._use_compiled(False)
            return self._forward_backward(batch)
        if self._compiled:
            self._compiled_ok = True
        return loss.detach().float(), {key: value.detach().float() for key, value in metrics.items()}

    def _remember_compile_cost(self, step_known: bool = True) -> None:
        """Cache this machine's warm-up and speedup for this model, for later `auto` decisions
        (`step_known` False: no compiled step was timed after the warm-up, which is kept alone)."""
        compiled_s = self._step_s() if step_known else None
        eager_s = self._eager_s.get(self.dtype)
        key = self._cost_keys.get(self.dtype)
        if key is not None:
            compiling.record_cost(key, max(0.0, self._warmup_s - (compiled_s or 0.0)),
                                  eager_s / compiled_s if eager_s and compiled_s else None, compiled_s)
            compiling.forget_failure(self.device)

    def _bad_step(self, loss_value: float, grad_norm: float) -> None:
        self.bad_steps += 1
        what = f"loss {loss_value}" if not math.isfinite(loss_value) else f"gradient norm {grad_norm}"
        self._warn(f"step {self.step + 1}: {what}; update skipped ({self.bad_steps} in a row)")
        if self.bad_steps >= self.cfg.max_bad_steps:
            last = ckpt.latest_checkpoint(self.run_dir)
            where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
            raise TrainingDiverged(
                f"the loss was NaN/inf for {self.bad_steps} steps in a row (up to step {self.step + 1}); "
                f"stopped ({where}); try a lower --lr, --grad-clip or fp32")

    def _speed(self, tokens_per_s: float) -> dict:
        """tokens/s and MFU; MFU None (null in metrics.jsonl) where it is n/a, so that every
        training line has the same keys."""
        peak = self.peak_flops * self.dist.world_size if self.peak_flops else None  # one device per rank
        value = mfu(tokens_per_s, self.task.flops_per_token, peak)
        return {"tokens_per_s": round(tokens_per_s, 1), "mfu": None if value is None else round(value, 4)}

    # ---- budget -------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self._start if self._start else 0.0)

    def progress(self, reserve_s: float = 0.0, at: tuple[int, int, float] | None = None) -> float:
        """Share of the budget used: the furthest along of steps, tokens and time (time
        against the budget less `reserve_s`); now, or `at` (step, tokens, elapsed seconds)."""
        step, tokens, elapsed = at if at is not None else (self.step, self.tokens, self.elapsed())
        cfg, used = self.cfg, [0.0]
        if cfg.max_steps:
            used.append(step / cfg.max_steps)
        if cfg.max_tokens:
            used.append(tokens / cfg.max_tokens)
        if cfg.max_time_s:
            used.append(elapsed / max(cfg.max_time_s - reserve_s, 1e-9))
        return min(1.0, max(used))

    def _learning_rate(self) -> float:
        """This step's rate, at the progress the schedule follows: a time budget's training
        stops early by the final evaluation's reserve (else a short run's cosine ended at a
        quarter to half of its peak). The reserve is estimated after the run's first
        evaluation, on rank 0 for every rank, then grows to the largest the stop rule has needed
        since (agreed by every rank at each step's stop check; `_schedule_reserve`), and is kept
        in checkpoints: it never shrinks (a reserve that did moved the rate back up), and a run
        whose steps slowed down still reaches its floor where it stops.

        The step where warmup ends keeps its counters (`_warmup_end`): the decay starts at
        their progress, which a resume recomputes under its own budget, so that a run resumed
        with a larger --max-steps follows the schedule of a run started with it."""
        at, reserve = (self.step, self.tokens, self.elapsed()), self._schedule_reserve_s or 0.0
        ending = self.schedule.warmup_end_progress is None and self.schedule.warmup_steps > 0
        lr = self.schedule(self.step, self.progress(reserve, at))
        if ending and self.schedule.warmup_end_progress is not None:
            self._warmup_end = [*at, reserve]
        return lr

    def _schedule_reserve(self) -> float:
        """The time a budget's training must stop short of its end, as the stop rule now
        sees it: the final evaluation's reserve and a step (`_check_stop`)."""
        return self._final_eval_s() + self._step_s() if self.cfg.max_time_s else 0.0

    def _budget(self) -> list:
        return [self.cfg.max_steps, self.cfg.max_tokens, self.cfg.max_time_s]

    def _check_stop(self) -> str | None:
        cfg = self.cfg
        if self._signal:
            return self._signal
        if cfg.max_steps and self.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_tokens and self.tokens >= cfg.max_tokens:
            return "max_tokens"
        if cfg.max_time_s:
            if self.elapsed() >= cfg.max_time_s:
                return "max_time"
            # After torch.compile's warm-up the next step's time is unknown (the warm-up, often
            # most of a minute, says nothing of it): take one step to measure it.
            next_step_s = 0.0 if self._compiled and self._warmup_s is not None and not self._step_times \
                else self._step_s()
            # (an evaluation due now that would not leave this room is left to the final one:
            # `_due_evaluation_fits`)
            if self._last_step_s is not None and \
                    self.elapsed() + self._final_eval_s() + next_step_s >= cfg.max_time_s:
                return "max_time"  # the next step would not leave time for the final evaluation
        return None

    def _due_evaluation_fits(self) -> bool:
        """Whether a periodic evaluation due now leaves a step and the final evaluation room in
        a time budget; else it is left to the final one, a few steps on (stopping here instead
        ended training an evaluation early, with the rate above its floor: 0.79 of the peak
        where evaluations were a quarter of the budget). Rank 0 decides for every rank."""
        cfg = self.cfg
        if not cfg.max_time_s or self._eval_s is None:  # (before one was measured: run it, and learn)
            return True
        fits = self.elapsed() + 2 * self._final_eval_s() + self._step_s() < cfg.max_time_s
        return bool(self.dist.from_main(fits))

    def _too_late_to_resume(self) -> bool:
        """A resumed --max-time run whose budget cannot hold one more step and the final
        evaluation, by the checkpoint's costs (`_schedule_reserve`: the typical step then; an
        older checkpoint has none and is not judged)."""
        return bool(self.cfg.max_time_s and self._eval_s is not None and
                    self.elapsed() + self._schedule_reserve() >= self.cfg.max_time_s)

    def _rebase_costs(self) -> None:
        """Measure the evaluation's cost again in typical steps, against today's typical step:
        at the first steady step (the evaluation before the first step had none), and once
        _STEADY_STEPS of them are in the median. Before that the typical step leans on the timing
        steps' estimate or one step, and one stall there (a step of 0.1 s among 6 ms ones) made
        an evaluation a tenth of the steps it is, a reserve a tenth too short for the rest of a
        run that evaluates only at its end."""
        step_s = self._step_s()
        if not step_s:
            return
        if self._eval_steps and self._costs_step_s:
            self._eval_steps = [steps * self._costs_step_s / step_s for steps in self._eval_steps]
        else:  # (an evaluation measured before any step was timed)
            self._eval_steps = [self._eval_s / step_s] if self._eval_s else []
        self._costs_step_s, self._costs_steps = step_s, self._steady_steps

    def _step_s(self) -> float:
        """A typical step's duration: the median of the recent ones (or of the timing steps;
        before any, a resumed run's typical step when its costs were measured, else the last
        step, a warm-up that overestimates: 2 s for 0.1 s steps made a 3 s evaluation 60 s)."""
        if self._step_times:
            return statistics.median(self._step_times)
        if self.plan is not None and self.plan.times.get(self.dtype):
            return self.plan.eager_step_s(self.dtype)
        return self._costs_step_s or self._last_step_s or 0.0

    def _final_eval_s(self) -> float:
        """What the final evaluation, model publish and checkpoint will take, with a 50% margin.
        The evaluation: the median (the lower of two) of the last three in typical steps, times
        today's typical step (a shared machine slows down and speeds up; one evaluation that met
        a burst of load must not idle the rest of the run); before any, a forward pass per
        validation batch (a third of an eager step; evaluation is not compiled, so a whole
        compiled step). Each evaluation counts with the work it skipped
        (`TrainTask.evaluation_extra_s`: translation's BLEU on an untrained model). Publish and
        checkpoint: as long as the last ones, times how much slower steps have become since;
        before any, the weights at 100 MB/s and a checkpoint three times the weights (with two
        AdamW moments)."""
        step_s = self._step_s()
        if self._eval_steps and step_s:
            eval_s = statistics.median_low(self._eval_steps) * step_s
        elif self._eval_s is not None:
            eval_s = self._eval_s
        else:
            eval_s = self.cfg.eval_batches * step_s / self.grad_accum / (1 if self._compiled else 3) + \
                self.task.evaluation_extra_s()
        publish_s = self._publish_s
        if publish_s is None:
            publish_s = 4 * sum(p.numel() for p in self.params) / 100e6
        save_s = self._save_s if self._save_s is not None else 3 * publish_s
        slower = max(1.0, step_s / self._costs_step_s) if self._costs_step_s else 1.0
        return 1.5 * (eval_s + slower * (publish_s + save_s))

    # ---- evaluation and checkpoints ----------------------------------------------------
    def _evaluate(self, save: bool) -> None:
        start = time.perf_counter()
        self.model.eval()
        main = self.dist.is_main
        try:
            with torch.no_grad(), autocast(self.device, self.dtype):
                # through the step module: under FSDP every rank takes part in each forward
                results = self.dist.from_main(self.step_module(lambda m: self.task.evaluate(m, self.device)))
                whole = distributed.full_model(self.step_module, self.model, self.dist, self._plain)
        finally:
            self.model.train()
        self._last_eval_step = self.step
        if results:
            results = checked_results(results)
            self.last_val_loss, self.last_val_step = results.get("val_loss"), self.step
            self.metrics.log({"step": self.step, "tokens": self.tokens, **results,
                              "elapsed_s": round(self.elapsed(), 3)})
        improved = self.last_val_loss is not None and self.last_val_loss < self.best_val_loss
        if improved:
            self.best_val_loss, self.best_step = self.last_val_loss, self.step
        if main:
            plot_losses(self.run_dir, self.task.loss_unit)
        saving = time.perf_counter()
        evaluating_s = saving - start
        if (improved or (not results and save)) and main:
            self._publish_model(whole)
            self._publish_s = time.perf_counter() - saving
        if save:
            checkpointing = time.perf_counter()
            self._save_checkpoint(whole)
            self._save_s = time.perf_counter() - checkpointing
        # The samples last: they are optional, so whatever they meet cannot cost the checkpoint.
        # Their time counts as the evaluation's (a time budget keeps it in reserve).
        sampling = time.perf_counter()
        if self.cfg.sample_tokens and main:
            self._write_samples(whole)
        # what a whole evaluation costs: this one's time and the work it skipped (translation's
        # BLEU on an untrained model), so a cheap one cannot halve the median of the last three
        self._eval_s = evaluating_s + time.perf_counter() - sampling + self.task.evaluation_extra_s()
        self._costs_step_s = self._step_s() or None  # (None before the first step: it sets it)
        self._costs_steps = self._steady_steps
        if self._step_times and self._costs_step_s:  # (not against a session's first step: a warm-up)
            self._eval_steps = self._eval_steps[-2:] + [self._eval_s / self._costs_step_s]
        if self.cfg.max_time_s and self._schedule_reserve_s is None:  # (all ranks evaluate together)
            self._schedule_reserve_s = self.dist.from_main(self._final_eval_s())
        now = time.perf_counter()
        self._evaluating_s += now - start
        self._window = (now, self.tokens)  # tokens/s measures training, not evaluation

    def _write_samples(self, whole: nn.Module) -> None:
        """The task's samples into samples.txt. Samples are optional: weights that hold NaN or
        inf (a diverging run) give none, and a sample that fails (a diverging run's logits
        were NaN) is a warning line, never the end of the run."""
        if not all(torch.isfinite(p).all() for p in whole.parameters()):
            self._warn(f"step {self.step}: no sample (the weights hold NaN or inf)")
            return
        self.model.eval()
        try:
            with torch.no_grad(), autocast(self.device, self.dtype):
                samples = self.task.samples(whole, next(whole.parameters()).device)
        except Exception as error:  # noqa: BLE001 - said, and the run goes on
            first = first_line(error)
            why = first if isinstance(error, FrawdError) else f"{type(error).__name__}: {first}"
            self._warn(f"step {self.step}: no sample ({why})")
            return
        finally:
            self.model.train()
        if samples:
            append_samples(self.run_dir, self.step, samples)

    def _publish_model(self, whole: nn.Module) -> None:
        with atomic_dir(self.run_dir / BEST_MODEL_DIR, overwrite=True) as tmp:
            self.task.save_model(whole, tmp)

    def _save_checkpoint(self, whole: nn.Module | None | str = "gather") -> None:
        """Every rank calls this (under FSDP each writes its shard of the AdamW moments);
        `whole`: the model to save, from `distributed.full_model` (None off rank 0)."""
        if whole == "gather":
            whole = distributed.full_model(self.step_module, self.model, self.dist, self._plain)
        sharded = distributed.sharded_optimizer_state(self.step_module, self.optimizer) \
            if self.dist.sharded else None
        state = {
            "version": STATE_VERSION,
            "step": self.step,
            "tokens": self.tokens,
            "elapsed_s": self.elapsed(),
            "best_val_loss": self.best_val_loss,
            "best_step": -1 if self.best_step is None else self.best_step,
            "evaluates": self.evaluates,
            "evaluated": self._last_eval_step == self.step,
            # what `auto` settled on (none while the first steps are still being timed)
            "decided": {} if self.plan is not None else {"dtype": self.dtype, "compiled": self._compiled},
            **({} if sharded else {"optimizer": self.optimizer.state_dict()}),
            "schedule": self.schedule.state_dict(),
            "schedule_reserve_s": self._schedule_reserve_s,
            # what evaluations, publishes and checkpoints cost: a resumed session reserves by them
            # (it evaluates at once only where one was owed; without them it guessed 20 batches' worth)
            "costs": {"eval_s": self._eval_s, "eval_steps": self._eval_steps, "costs_step_s": self._costs_step_s,
                      "publish_s": self._publish_s, "save_s": self._save_s,
                      "steady_steps": min(self._costs_steps, _STEADY_STEPS)},
            "warmup_end": self._warmup_end,
            "bad_steps": self.bad_steps,  # (a stop's checkpoint can fall inside a NaN streak)
            "budget": self._budget(),
            "scaler": self.scaler.state_dict(),
            "task": self.task.state_dict(),
        }
        # Each rank's RNG: their dropout masks differ, and under token batches (translation)
        # ranks draw different amounts. "rng" stays rank 0's (the state of one process).
        rngs = self.dist.gather(rng_state())
        state["rng"] = rngs[0]
        if len(rngs) > 1:
            state["rng_ranks"] = rngs
        self.last_checkpoint = distributed.save_checkpoint(
            self.run_dir, self.step, lambda d: self.task.save_model(whole, d), state, sharded, self.dist)
        self._last_checkpoint_step = self.step
        keep = {self.best_step} if self.best_step is not None else set()
        if self.dist.is_main:
            ckpt.prune(self.run_dir, self.cfg.keep_last, keep)

    def _resume_weights(self) -> Path:
        """The latest checkpoint, its weights loaded into the (not yet wrapped) model."""
        path = ckpt.latest_checkpoint(self.run_dir)
        if path is None:
            raise FrawdError(f"{self.run_dir}: no checkpoint to resume from")
        with self._naming_an_earlier_checkpoint(path):
            ckpt.check_unchanged(path)
            self.task.load_model(self.model, path / ckpt.MODEL_SUBDIR)
        return path

    @contextlib.contextmanager
    def _naming_an_earlier_checkpoint(self, path: Path) -> Iterator[None]:
        """A checkpoint that cannot be read (a truncated file): the refusal also names the
        one before it, which --resume takes once this one is moved aside."""
        try:
            yield
        except FrawdError as exc:
            earlier = [p for _, p in ckpt.list_checkpoints(self.run_dir) if p != path]
            if not earlier:
                raise
            raise FrawdError(f"{exc}; the checkpoint before it is {earlier[-1]}: move {path} out of "
                             f"{path.parent} to resume from that one") from None

    def _resume(self) -> None:
        path = self._resume_from
        with self._naming_an_earlier_checkpoint(path):
            state = ckpt.load_state(path)
        where = path / ckpt.STATE_FILE
        if state.get("version") != STATE_VERSION:
            raise FrawdError(f"{path}: training state version {state.get('version')!r}; "
                             f"this FrawdLLM reads version {STATE_VERSION}")
        counts = {name: state.get(name) for name in ("step", "tokens", "best_step")}
        bad = [f"{name} {value!r}" for name, value in counts.items()
               if not isinstance(value, int) or isinstance(value, bool) or value < (-1 if name == "best_step" else 0)]
        elapsed = state.get("elapsed_s")
        if not isinstance(elapsed, (int, float)) or not math.isfinite(elapsed) or elapsed < 0:
            bad.append(f"elapsed_s {elapsed!r}")
        if bad:
            raise FrawdError(f"{where}: not a training state this run can resume ({', '.join(bad)})")
        try:
            self._restore(path, state)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # a damaged or foreign state
            detail = first_line(exc)
            raise FrawdError(f"{where}: not a training state this run can resume ({type(exc).__name__}"
                             f"{': ' + detail if detail else ''})") from None

    def _restore(self, path: Path, state: dict) -> None:
        """Everything a checkpoint's state holds, back in this trainer (see `_save_checkpoint`)."""
        distributed.load_optimizer(self.step_module, self.optimizer, path, state.get("optimizer"), self.dist)
        self.schedule.load_state_dict(state["schedule"])
        self._schedule_reserve_s = state.get("schedule_reserve_s")  # (None: taken at this session's first evaluation)
        costs = state.get("costs") or {}  # (none in an older checkpoint)
        self._eval_s, self._publish_s, self._save_s = costs.get("eval_s"), costs.get("publish_s"), costs.get("save_s")
        self._eval_steps, self._costs_step_s = list(costs.get("eval_steps") or []), costs.get("costs_step_s")
        self._costs_steps = int(costs.get("steady_steps", 0))  # (fewer than _STEADY_STEPS: rebased in this session)
        self._warmup_end = state.get("warmup_end")  # (None: warmup not over, or an older checkpoint)
        if self._warmup_end is not None:  # the end of warmup's progress under this budget (as saved, if the same)
            *at, reserve = self._warmup_end
            self.schedule.warmup_end_progress = self.progress(reserve, tuple(at))
        self.scaler.load_state_dict(state["scaler"])
        self.task.load_state_dict(state["task"])
        ranks = state.get("rng_ranks") or [state["rng"]]
        # (a rank a checkpoint of fewer ranks did not have: rank 0's state, moved on as at a start)
        set_rng_state(ranks[self.dist.rank] if self.dist.rank < len(ranks) else state["rng"])
        if self.dist.rank >= len(ranks):
            _own_dropout_seed(self.dist.rank)
        self.step, self.tokens = state["step"], state["tokens"]
        self.bad_steps = int(state.get("bad_steps", 0))  # the streak goes on where it was stopped
        self.elapsed_before = state["elapsed_s"]
        self.best_val_loss = state["best_val_loss"]
        self.best_step = None if state["best_step"] < 0 else state["best_step"]
        self._forget_a_best_measured_otherwise(state.get("evaluates"))
        self._note_new_budget(state.get("budget"))
        interval = self.cfg.eval_interval
        self._owed_eval = not state.get("evaluated", True) and bool(interval) and self.step % interval == 0
        self._evaluated_before = self.step == 0 and state.get("evaluated", True)  # (its costs came with it)
        self._adopt(state.get("decided") or {})
        self.last_checkpoint = path
        if self.dist.is_main:
            truncate_metrics(self.run_dir, self.step)
            truncate_samples(self.run_dir, self.step)

    def _note_new_budget(self, before: list | None) -> None:
        """A resume with another budget: the learning rate's decay spans the new one (see
        `_learning_rate`), so it can rise again where the old budget had run it down: said."""
        now = self._budget()
        if before is None or list(before) == now or self.schedule.kind in ("constant", "noam") \
                or not self.dist.is_main:
            return
        shown = [f"{name} {budget_value(new)} (was {budget_value(old)})"
                 for name, old, new in zip(("max_steps", "max_tokens", "max_time"), before, now) if old != new]
        print(f"{self.run_dir}: a new budget, {', '.join(shown)}: from step {self.step + 1} the learning rate "
              f"follows the schedule of a run started with it (its {self.schedule.kind} decay spans the new budget)",
              file=sys.stderr, flush=True)

    def _forget_a_best_measured_otherwise(self, before: dict | None) -> None:
        """Resumed with other held-out data or another measure (--data, --val-fraction,
        --train-on...): the best val_loss so far is no bar for the new ones, which would never
        publish a model if they are higher. The best is chosen afresh from here."""
        if before is None or before == self.evaluates or self.best_step is None:  # (None: an older checkpoint)
            return
        changed = [name for name in {**before, **self.evaluates} if before.get(name) != self.evaluates.get(name)]
        if self.dist.is_main:
            print(f"{self.run_dir}: val_loss now measures something else ({', '.join(changed)} changed): the best "
                  f"model is chosen afresh from step {self.step}", file=sys.stderr, flush=True)
        self.best_val_loss, self.best_step = math.inf, None

    def _adopt(self, decided: dict) -> None:
        """Resume with the dtype and compile choice `auto` made before (timing again could
        choose otherwise, and the run would not continue exactly); a resume on a machine that
        cannot compute that dtype natively decides again."""
        plan = self.plan
        if plan is None or not decided or decided["dtype"] not in plan.dtypes:
            return
        if len(plan.dtypes) > 1:
            self.dtype = decided["dtype"]
            self.dtype_why = f"auto: {self.dtype}, as decided before the resume"
            self.peak_flops = self._peaks.get(self.dtype, self.peak_flops)
        if plan.compile_setting == "auto":
            self.compile_why = f"auto: {'on' if decided['compiled'] else 'off'}, as decided before the resume"
            if decided["compiled"]:
                self._use_compiled(True)
        self.plan = None

    def _result(self) -> TrainResult:
        elapsed = self.elapsed()
        # the average over this session, warm-up and evaluations included
        trained_s = time.perf_counter() - self._fit_start if self._fit_start else 0.0
        speed = self._speed((self.tokens - self._session_tokens) / max(trained_s, 1e-9))
        return TrainResult(
            steps=self.step, tokens=self.tokens, elapsed_s=elapsed, stop_reason=self.stop_reason or "",
            last_loss=self.last_loss, val_loss=self.last_val_loss, val_step=self.last_val_step,
            best_val_loss=None if math.isinf(self.best_val_loss) else self.best_val_loss,
            best_step=self.best_step, tokens_per_s=speed["tokens_per_s"], mfu=speed.get("mfu"),
            checkpoint=self.last_checkpoint, run_dir=self.run_dir, flops_known=bool(self.task.flops_per_token),
            ran_as=f"{self.dtype}, {'compiled' if self.compiled else 'eager'}")


class _NoMetrics:
    """The metrics log of ranks other than 0: they write nothing."""

    def log(self, record: dict) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


# ---- signals ---------------------------------------------------------------------------

def _load_average() -> float | None:
    """The machine's 1-minute load average (runnable threads, this run's own among them), or
    None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _own_dropout_seed(rank: int) -> None:
    """Every rank was seeded alike (so that they build the same model); from here each draws
    its own dropout masks (alike, two ranks' rows would share them). Rank 0 keeps the
    single-process stream."""
    torch.manual_seed(torch_seed(torch.initial_seed() + 1_000_003 * rank))


class _StderrGuard:
    """sys.stderr while training. Where its reader leaves (`frawd pretrain ... 2>&1 | less`,
    and less quits), the next progress line raised BrokenPipeError and ended the run at once,
    without a checkpoint: now that write asks for a stop after the step, with a checkpoint
    (as a signal does), and the rest goes to /dev/null."""

    def __init__(self, stream: Any, stop: Callable[[str], None]) -> None:
        self.stream, self.stop, self.reader_left = stream, stop, False

    def _left(self) -> None:
        if not self.reader_left:
            self.reader_left = True
            self.stop("interrupted")
            with contextlib.suppress(AttributeError, ValueError, OSError):  # (a stream that is no file)
                fd = self.stream.fileno()
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._left()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._left()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding...: the stream's
        return getattr(self.stream, name)


def _install_signal_handlers(trainer: Trainer) -> Callable[[], None]:
    """SIGINT/SIGTERM ask the trainer to stop after the current step (a second one kills);
    under torchrun so does the signal of a launcher that died, however often it comes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    gone = {distributed.LAUNCHER_GONE: signal.getsignal(distributed.LAUNCHER_GONE)} if trainer.dist.active else {}

    # under `nohup` (the signal ignored) a hangup is not the launcher's death: only that stops
    only_death = any(old is signal.SIG_IGN for old in gone.values())

    def handler(signum, frame) -> None:
        trainer.request_stop("interrupted")
        for sig, old in previous.items():  # a second signal acts at once
            signal.signal(sig, old)
        if trainer.dist.is_main:  # a step (a compile's warm-up above all) can take minutes: say so now,
            # with os.write: the handler may run inside the progress bar's own write to stderr
            with contextlib.suppress(OSError):  # (a stderr whose reader left: the stop still holds)
                os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint "
                            "(another stops at once, without one)\n".encode())

    def on_launcher_gone(signum, frame) -> None:
        if not only_death or distributed.launcher_gone():
            trainer.request_stop("interrupted")

    for sig in previous:
        signal.signal(sig, handler)
    for sig in gone:
        signal.signal(sig, on_launcher_gone)
    if only_death and distributed.launcher_gone():  # (it died before: its signal was ignored)
        trainer.request_stop("interrupted")

    def restore() -> None:
        for sig, old in {**previous, **gone}.items():
            signal.signal(sig, old)

    return restore
