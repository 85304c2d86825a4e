"""FrawdLLM: small transformer language models from scratch, through their whole life.

    from frawdllm import ModelConfig, get_config, FrawdLLM
    model = FrawdLLM(get_config("tiny"))
    logits, loss = model(token_ids, targets)

The model (and so torch) is imported on first use, so commands that only tokenize or
prepare data start fast.
"""

from typing import Any

from .config import PRESETS, ModelConfig, get_config
from .errors import ConfigError, FrawdError

__version__ = "0.1.0"
__all__ = ["ModelConfig", "get_config", "PRESETS", "FrawdLLM", "FrawdError", "ConfigError"]


def __getattr__(name: str) -> Any:
    if name == "FrawdLLM":
        from .model import FrawdLLM

        return FrawdLLM
    raise AttributeError(f"module 'frawdllm' has no attribute {name!r}")
