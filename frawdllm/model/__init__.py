"""The model family: embeddings, attention, MLP, norms, blocks and the full LM."""

from .gpt import IGNORE_INDEX, FrawdLLM

__all__ = ["FrawdLLM", "IGNORE_INDEX"]
