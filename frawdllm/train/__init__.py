"""Training: one loop (`Trainer`) and the jobs that run on it: pretraining here,
translation (`translation.py`), SFT and DPO (`frawdllm.align`).

    from frawdllm.train import PretrainConfig, run_pretraining
    result = run_pretraining(PretrainConfig(data="stdlib", max_time="5m", out="runs/x"))

A new kind of training subclasses `TrainTask` (batches, loss, evaluation, saving) and
hands it to `Trainer` with a `TrainConfig`; see loop.py.
"""

from .config import PretrainConfig, TrainConfig, build_config, parse_duration
from .loop import Trainer, TrainingDiverged, TrainResult, TrainTask, to_device
from .pretrain import PretrainTask, run_pretraining
from .schedule import LRSchedule

__all__ = ["TrainConfig", "PretrainConfig", "build_config", "parse_duration", "Trainer", "TrainTask",
           "TrainResult", "TrainingDiverged", "to_device", "PretrainTask", "run_pretraining", "LRSchedule"]
