"""FrawdLLM: small transformer language models from scratch, through their whole life.

    from frawdllm import ModelConfig, get_config, FrawdLLM
    model = FrawdLLM(get_config("tiny"))
    logits, loss = model(token_ids, targets)

    from frawdllm import Seq2SeqTransformer      # the encoder-decoder of the 2017 paper
    model = Seq2SeqTransformer(get_config("aiayn-base"))

The model (and so torch) is imported on first use, so `--help` and commands that only
train a tokenizer start fast.
"""

from typing import Any

from .config import PRESETS, SEQ2SEQ_PRESETS, ModelConfig, Seq2SeqConfig, get_config
from .errors import ConfigError, FrawdError

__version__ = "0.1.0"
__all__ = ["ModelConfig", "Seq2SeqConfig", "get_config", "PRESETS", "SEQ2SEQ_PRESETS", "FrawdLLM",
           "Seq2SeqTransformer", "FrawdError", "ConfigError"]


def __getattr__(name: str) -> Any:
    if name in ("FrawdLLM", "Seq2SeqTransformer"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'frawdllm' has no attribute {name!r}")


def __dir__() -> list[str]:  # (the lazily imported names too: help(), tab completion)
    return sorted(set(globals()) | set(__all__))
