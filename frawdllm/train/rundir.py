"""The run directory: everything a training run leaves behind.

    OUT/config.yaml      the merged config: `frawd pretrain --config OUT/config.yaml` reruns it
    OUT/metrics.jsonl    one JSON object a line: train lines (step, tokens, loss, lr,
                         grad_norm, tokens_per_s, mfu) and eval lines (val_loss, ...)
    OUT/loss.png         train and validation loss curves, redrawn at each evaluation
    OUT/samples.txt      text sampled from the model at each evaluation
    OUT/checkpoints/     the last few checkpoints and the best (see checkpoint.py)
    OUT/model/           the best model so far by validation loss: a model directory

TensorBoard and Weights & Biases receive the same metrics when switched on (W&B runs
offline unless WANDB_MODE says otherwise, so it needs no network or account).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ..errors import FrawdError
from ..io import atomic_path, write_text_atomic

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
SAMPLES_FILE = "samples.txt"
BEST_MODEL_DIR = "model"


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Appends metric lines to metrics.jsonl and forwards them to the optional loggers."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "frawdllm", config: dict | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.file = open(self.path, "a", encoding="utf-8")
        self.tb = self.wb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise FrawdError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                raise FrawdError("--wandb needs the wandb package: pip install wandb") from None
            os.environ.setdefault("WANDB_MODE", "offline")
            self.wb = wandb_lib.init(project=wandb_project, dir=str(run_dir), config=config,
                                     name=Path(run_dir).name, resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        step = record.get("step", 0)
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, step)
        if self.wb is not None:
            self.wb.log(numbers, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a kill
    return records


def truncate_metrics(run_dir: Path, after_step: int) -> None:
    """Drop lines logged after `after_step`: a resumed run logs those steps again."""
    kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= after_step]
    write_text_atomic(Path(run_dir) / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))


def load_pyplot():
    """matplotlib's pyplot on the file-only Agg backend, imported on first use (it takes
    about a second, which the loop pays before its clock starts, not inside --max-time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(run_dir: Path) -> None:
    """Draw loss.png from metrics.jsonl: the training loss and the validation points."""
    plt = load_pyplot()

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(run_dir).resolve().name)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    fig.tight_layout()
    with atomic_path(Path(run_dir) / PLOT_FILE) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


_SAMPLE_HEADER = re.compile(r"=== step (\d+) sample \d+ ===\n")


def truncate_samples(run_dir: Path, after_step: int) -> None:
    """Drop samples written after `after_step`: a resumed run writes those again."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    cut = next((m.start() for m in _SAMPLE_HEADER.finditer(text) if int(m.group(1)) > after_step), None)
    if cut is not None:
        write_text_atomic(path, text[:cut])


def append_samples(run_dir: Path, step: int, samples: list[str]) -> None:
    with open(Path(run_dir) / SAMPLES_FILE, "a", encoding="utf-8") as f:
        for i, text in enumerate(samples):
            f.write(f"=== step {step} sample {i} ===\n{text}\n\n")
