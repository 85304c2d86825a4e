"""Dealing fine-tuning data a step at a time, the part SFT's and DPO's loaders share.

The data is cut into units (SFT: packed rows of examples; DPO: one pair each), put in a
seeded order that is drawn again each epoch. Each optimizer step takes the next
`share.step_rows` units of that order, and this rank's micro-batches are its parts of
them (`distributed.Share`). The position (epoch, units taken) is all a checkpoint needs:
the order is drawn again from the seed on resume.
"""

from __future__ import annotations

import numpy as np

from ..train.distributed import Share


class StepDealer:
    """A step's units in the epoch's seeded order; subclasses say what an epoch's units are."""

    def __init__(self, seed: int, share: Share) -> None:
        self.seed, self.share = seed, share
        self.epoch, self.position = 0, 0
        self.step: list = []  # the current step's units (every rank's)
        self._micro = 0  # micro-batches of the current step already given
        self.units = self.epoch_units()

    def epoch_order(self, n: int) -> np.ndarray:
        """This epoch's permutation of `n` items (seeded by the seed and the epoch alone)."""
        return np.random.default_rng([self.seed, self.epoch]).permutation(n)

    def epoch_units(self) -> list:
        raise NotImplementedError

    def next_units(self) -> list:
        """The units of this rank's next micro-batch (a new step's after its last one)."""
        if self._micro == 0:
            self.step = [self._next_unit() for _ in range(self.share.step_rows)]
            self.new_step()
        mine = self.step[self.share.rows(self._micro)]
        self._micro = (self._micro + 1) % self.share.accum
        return mine

    def new_step(self) -> None:
        """Called once `step` holds a new step's units."""

    def _next_unit(self):
        if self.position >= len(self.units):
            self.epoch, self.position = self.epoch + 1, 0
            self.units = self.epoch_units()
        self.position += 1
        return self.units[self.position - 1]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._micro = 0
        self.units = self.epoch_units()
