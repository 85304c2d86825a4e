"""Training: one loop (`Trainer`) and the jobs that run on it: pretraining here,
translation (`translation.py`), SFT and DPO (`frawdllm.align`).

    from frawdllm.train import PretrainConfig, run_pretraining
    result = run_pretraining(PretrainConfig(data="stdlib", max_time="5m", out="runs/x"))

A new kind of training subclasses `TrainTask` (batches, loss, evaluation, saving) and
hands it to `Trainer` with a `TrainConfig`; see loop.py.
"""

import importlib

from .config import PretrainConfig, TrainConfig, build_config, parse_duration
from .schedule import LRSchedule

# The loop and pretraining import torch (~1 s): loaded on first use, so that the CLI's
# `--help` and config checks, which import this package's config, stay instant.
_LAZY = {"Trainer": "loop", "TrainingDiverged": "loop", "TrainResult": "loop", "TrainTask": "loop",
         "to_device": "loop", "PretrainTask": "pretrain", "run_pretraining": "pretrain"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["TrainConfig", "PretrainConfig", "build_config", "parse_duration", "Trainer", "TrainTask",
           "TrainResult", "TrainingDiverged", "to_device", "PretrainTask", "run_pretraining", "LRSchedule"]
