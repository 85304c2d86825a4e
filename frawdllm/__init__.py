"""FrawdLLM: small transformer language models from scratch, through their whole life.

    from frawdllm import ModelConfig, get_config, FrawdLLM
    model = FrawdLLM(get_config("tiny"))
    logits, loss = model(token_ids, targets)
"""

from .config import PRESETS, ModelConfig, get_config
from .errors import ConfigError, FrawdError
from .model import FrawdLLM

__version__ = "0.1.0"
__all__ = ["ModelConfig", "get_config", "PRESETS", "FrawdLLM", "FrawdError", "ConfigError"]
