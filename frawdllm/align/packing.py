"""Packing: several short examples share one row of the batch, without seeing each other.

A row of length L holds examples back to back (then padding). Three things keep them apart:

    positions   restart at 0 for each example (rotary / learned positions as if alone)
    mask        block-diagonal causal: token i attends token j only if j <= i and both
                belong to the same example (padding attends only padding)
    targets     each example predicts only its own next tokens (-100 elsewhere)

so each example's loss is what it would be alone in a row (tests check this to 1e-5).
The mask reaches attention through the model's KV-cache protocol (`DocumentMask.update`
returns the keys and values unchanged, and the mask): no separate attention code.

Rows are filled greedily in the (shuffled) example order: an example that does not fit
in the current row starts the next one.
"""

from __future__ import annotations

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..model.gpt import IGNORE_INDEX
from ..train.distributed import Share
from .dealer import StepDealer
from .examples import Example


class DocumentMask:
    """What a packed batch attends over: its own keys and values, under a block-diagonal
    causal mask (the `KVCacheLike` protocol of model/attention.py)."""

    def __init__(self, documents: Int[Tensor, "B T"]) -> None:
        self.mask = document_mask(documents)

    def update(
        self, layer_idx: int, k: Float[Tensor, "B Hkv T hd"], v: Float[Tensor, "B Hkv T hd"]
    ) -> tuple[Float[Tensor, "B Hkv T hd"], Float[Tensor, "B Hkv T hd"], Bool[Tensor, "B 1 T T"]]:
        return k, v, self.mask


def document_mask(documents: Int[Tensor, "B T"]) -> Bool[Tensor, "B 1 T T"]:
    """True where query i may attend key j: same document, j <= i."""
    T = documents.shape[1]
    same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (same & causal).unsqueeze(1)


def pack_rows(examples: list[Example], length: int, pack: bool = True) -> list[list[int]]:
    """Greedy rows: lists of example indices whose inputs (len(ids) - 1 tokens) fit in `length`
    (one example per row if not `pack`)."""
    rows, row, used = [], [], 0
    for i, example in enumerate(examples):
        n = len(example.ids) - 1
        if n > length:
            raise ValueError(f"example {i} has {n} input tokens, more than the row length {length}")
        if (used + n > length or not pack) and row:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += n
    if row:
        rows.append(row)
    return rows


def collate(examples: list[Example], rows: list[list[int]], length: int) -> dict[str, Tensor]:
    """A batch of packed rows: tokens, targets, positions and document ids, each (B, L).
    Padding has token 0, target -100 and document -1 (it attends only padding)."""
    B = len(rows)
    tokens = np.zeros((B, length), dtype=np.int64)
    targets = np.full((B, length), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((B, length), dtype=np.int64)
    documents = np.full((B, length), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for doc, i in enumerate(row):
            ids, trained = examples[i].ids, examples[i].trained
            n = len(ids) - 1
            tokens[r, at:at + n] = ids[:-1]
            targets[r, at:at + n] = np.where(trained[1:], ids[1:], IGNORE_INDEX)
            positions[r, at:at + n] = np.arange(n)
            documents[r, at:at + n] = doc
            at += n
    return {"tokens": torch.from_numpy(tokens), "targets": torch.from_numpy(targets),
            "positions": torch.from_numpy(positions), "documents": torch.from_numpy(documents)}


class PackedLoader(StepDealer):
    """Packed rows over the examples, reshuffled each epoch (seeded); resumable through
    `state_dict`. Each optimizer step takes the next `share.step_rows` rows of that order
    and this rank its part of them (`distributed.Share`; default: `batch_size` rows a
    step, one process). A batch carries `normalizer`, what the loss divides its sum by:
    the trained tokens of the whole step per one-process micro-batch (their mean count),
    over `share.scale`. So a step's loss is the mean over all its trained tokens however
    it is cut into micro-batches and ranks (averaging each micro-batch's own mean gave a
    token of a short micro-batch more weight: ~30x in a mix of 4- and 124-token ones)."""

    def __init__(self, examples: list[Example], batch_size: int, length: int, seed: int, pack: bool = True,
                 share: Share | None = None) -> None:
        self.examples, self.length, self.pack = examples, length, pack
        self.trained = [int(sum(e.trained[1:])) for e in examples]  # the targets each example trains
        self._step_trained = 0  # the trained tokens of the step's rows
        super().__init__(seed, share or Share(batch_size, 1))

    def epoch_units(self) -> list[list[int]]:
        """This epoch's packed rows, each a list of example indices."""
        order = self.epoch_order(len(self.examples))
        rows = pack_rows([self.examples[i] for i in order], self.length, self.pack)
        return [[int(order[i]) for i in row] for row in rows]

    def new_step(self) -> None:
        self._step_trained = sum(self.trained[i] for row in self.step for i in row)

    def next_batch(self) -> dict[str, Tensor]:
        batch = collate(self.examples, self.next_units(), self.length)
        batch["normalizer"] = torch.tensor(self._step_trained / self.share.grad_accum / self.share.scale)
        return batch


def fixed_batches(examples: list[Example], batch_size: int, length: int, pack: bool = True,
                  ) -> list[dict[str, Tensor]]:
    """Every example once, in order: evaluation batches."""
    rows = pack_rows(examples, length, pack)
    return [collate(examples, rows[i:i + batch_size], length) for i in range(0, len(rows), batch_size)]
