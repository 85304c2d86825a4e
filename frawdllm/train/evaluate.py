"""Evaluating a language model on held-out tokens: loss, perplexity, bits per byte.

    loss  mean next-token cross-entropy in nats, over every non-overlapping window of
          the split (each window predicts its tokens 1..T from the ones before)
    ppl   exp(loss): the model is as unsure as a uniform choice among ppl tokens
    bpb   bits per byte of UTF-8 text = loss / ln 2 / (bytes per token). Unlike loss and
          perplexity it does not depend on the tokenizer, so models with different
          vocabularies compare fairly. The bytes per token come from the shard's metadata.

The caller chooses the precision (autocast) and puts the model in eval mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..data import SequentialLoader
from ..data.shard_format import TokenArray


def lm_loss(model: nn.Module, tokens: TokenArray, batch_size: int, context_length: int,
            device: torch.device, max_batches: int | None = None, progress: bool = False) -> tuple[float, int]:
    """(mean loss in nats, number of predicted tokens) over the windows of `tokens`."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)  # an id the embedding lacks: one line
    loader = SequentialLoader(tokens, batch_size, context_length, max_batches=max_batches, vocab_size=vocab)
    batches = loader
    if progress:
        from tqdm import tqdm

        batches = tqdm(loader, total=len(loader), desc="evaluating", unit="batch", dynamic_ncols=True)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            _, loss = model(x, y)  # mean over the batch's tokens
            total += loss.double() * y.numel()
            count += y.numel()
    return float(total) / max(count, 1), count


def lm_metrics(loss: float, bytes_per_token: float | None, prefix: str = "") -> dict[str, float]:
    out = {f"{prefix}loss": loss, f"{prefix}ppl": math.exp(min(loss, 700.0))}
    if bytes_per_token:
        out[f"{prefix}bpb"] = loss / math.log(2) / bytes_per_token
    return out
