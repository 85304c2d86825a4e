"""Batch loaders over a token array (usually a memory-mapped shard).

A language model learns to predict token t+1 from tokens 0..t, so a training example
is a window of `context_length + 1` tokens: x is the first T of them, y the last T.

- `RandomWindowLoader` (pretraining) draws window starts uniformly at random. Each
  optimizer step draws one global batch of `batch_size * grad_accum * world_size` windows
  that depends only on (seed, step), so its whole state is `{"seed", "step"}` and a
  resumed run sees exactly the batches an uninterrupted one would. Micro-batch m of rank
  r is slice `m * world_size + r` of it: whatever the split into ranks and accumulation
  steps, a step trains on the same windows (so a run can resume with another world size).
- `SequentialLoader` (validation) walks non-overlapping windows in order, the same ones
  on every call; rank r takes windows r, r + world_size, ... The last batch may be short.

Both check each batch's ids (one `max` over the gathered windows): an id at or above the
shard's vocabulary (its header's, or meta.json's through `read_split`), or the `vocab_size`
given (a model's), is one line naming the shard file and the id's position, never an index
error deep in the model's embedding.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from ..config import is_integer
from ..errors import FrawdError
from .shard_format import TokenArray, bad_id_error, id_limit


class _IdBound:
    """What bounds the ids of `tokens`: the shards' vocabulary, or `vocab_size` when smaller."""

    def __init__(self, tokens: TokenArray, vocab_size: int | None):
        shards = id_limit(tokens)
        self.limit = id_limit(tokens, vocab_size)
        self.model_bound = vocab_size is not None and (shards is None or vocab_size < shards)


def _check_layout(tokens: TokenArray, batch_size: int, context_length: int, rank: int, world_size: int,
                  vocab_size: int | None) -> _IdBound:
    """Refuse a bad layout in one line; return what bounds the ids."""
    shape, dtype = getattr(tokens, "shape", None), getattr(tokens, "dtype", None)
    if shape is None or len(shape) != 1 or getattr(dtype, "kind", None) not in ("i", "u"):
        what = f"a {len(shape)}-D {dtype} array" if shape is not None else type(tokens).__name__
        if isinstance(tokens, torch.Tensor):  # ("got a 1-D torch.int64 array" read as a contradiction)
            what = f"a torch tensor ({dtype}; pass tokens.numpy())"
        raise FrawdError(f"tokens must be a 1-D integer array (read_shard, read_split), got {what}")
    for name, value in (("batch_size", batch_size), ("context_length", context_length), ("rank", rank),
                        ("world_size", world_size)):
        if not is_integer(value):
            raise FrawdError(f"{name} must be an integer, got {value!r}")
    if batch_size < 1 or context_length < 1:
        raise FrawdError(f"batch_size and context_length must be positive, got {batch_size} and {context_length}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise FrawdError(f"rank {rank} is outside world_size {world_size}")
    if vocab_size is not None and (not is_integer(vocab_size) or vocab_size < 1):
        raise FrawdError(f"vocab_size must be a positive integer or None, got {vocab_size!r}")
    check_one_window(len(tokens), context_length)
    return _IdBound(tokens, vocab_size)


def check_one_window(n_tokens: int, context_length: int) -> None:
    """Refuse data shorter than one window of `context_length` inputs and their targets."""
    if n_tokens < context_length + 1:
        raise FrawdError(f"only {n_tokens} tokens; a window of context_length {context_length} needs "
                         f"{context_length + 1}: use more data or a shorter context")


def _windows(tokens: TokenArray, starts: np.ndarray, context_length: int,
             bound: _IdBound) -> tuple[Int[Tensor, "B T"], Int[Tensor, "B T"]]:
    index = starts[:, None] + np.arange(context_length + 1)  # (B, T+1)
    ids = tokens[index]  # one gather from the memmap
    limit = bound.limit
    if limit is not None and ids.size and (ids.max() >= limit or (ids.dtype.kind == "i" and ids.min() < 0)):
        raise bad_id_error(tokens, ids, index, limit, bound.model_bound)
    window = torch.from_numpy(ids.astype(np.int64))
    return window[:, :-1], window[:, 1:]


class RandomWindowLoader:
    """Seeded random windows for pretraining; exactly resumable from `state_dict()`."""

    def __init__(self, tokens: TokenArray, batch_size: int, context_length: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, grad_accum: int = 1, vocab_size: int | None = None):
        self.id_bound = _check_layout(tokens, batch_size, context_length, rank, world_size, vocab_size)
        if not is_integer(grad_accum) or grad_accum < 1:
            raise FrawdError(f"grad_accum must be a positive integer, got {grad_accum!r}")
        if not is_integer(seed) or seed < 0:  # (numpy's own error came at the first batch)
            raise FrawdError(f"seed must be an integer >= 0, got {seed!r}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.context_length = context_length
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.step = 0  # optimizer steps drawn
        self._micro = 0  # micro-batches of the current step already given

    def next_batch(self) -> tuple[Int[Tensor, "B T"], Int[Tensor, "B T"]]:
        rng = np.random.default_rng([self.seed, self.step])
        n_starts = len(self.tokens) - self.context_length  # last start still leaves T+1 tokens
        starts = rng.integers(0, n_starts, size=self.batch_size * self.world_size * self.grad_accum)
        part = self._micro * self.world_size + self.rank
        mine = starts[part * self.batch_size:(part + 1) * self.batch_size]
        self._micro += 1
        if self._micro == self.grad_accum:
            self.step, self._micro = self.step + 1, 0
        return _windows(self.tokens, mine, self.context_length, self.id_bound)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"seed", "step"}:
            raise FrawdError(f"loader state must be a mapping with keys seed and step, got {state!r:.100}")
        if not all(is_integer(state[key]) and state[key] >= 0 for key in ("seed", "step")):
            raise FrawdError(f"loader state: seed and step must be integers >= 0, got {state!r}")
        self.seed = int(state["seed"])
        self.step = int(state["step"])
        self._micro = 0


class SequentialLoader:
    """Every non-overlapping window once, in order: the same batches on every pass."""

    def __init__(self, tokens: TokenArray, batch_size: int, context_length: int,
                 max_batches: int | None = None, rank: int = 0, world_size: int = 1,
                 vocab_size: int | None = None):
        self.id_bound = _check_layout(tokens, batch_size, context_length, rank, world_size, vocab_size)
        if max_batches is not None and (not is_integer(max_batches) or max_batches < 1):
            raise FrawdError(f"max_batches must be a positive integer or None, got {max_batches!r}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.context_length = context_length
        self.max_batches = max_batches
        n_windows = (len(tokens) - 1) // context_length
        self.starts = np.arange(rank, n_windows, world_size) * context_length

    def __len__(self) -> int:
        n = -(-len(self.starts) // self.batch_size)
        return n if self.max_batches is None else min(n, self.max_batches)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for b in range(len(self)):
            starts = self.starts[b * self.batch_size:(b + 1) * self.batch_size]
            yield _windows(self.tokens, starts, self.context_length, self.id_bound)
