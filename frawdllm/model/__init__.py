"""The model family: embeddings, attention, MLP, norms, blocks, the full LM and the encoder-decoder."""

from .gpt import IGNORE_INDEX, FrawdLLM
from .seq2seq import Seq2SeqTransformer

__all__ = ["FrawdLLM", "Seq2SeqTransformer", "IGNORE_INDEX"]
