"""Learning-rate schedules: linear warmup, then a decay to a floor.

    warmup    lr rises linearly from peak/warmup to peak over the first `warmup_steps`
    cosine    peak -> floor along half a cosine
    linear    peak -> floor along a straight line
    wsd       warmup-stable-decay: peak, then linear to the floor over the last
              `decay_fraction` of the decay span (a run can be extended before then)
    constant  peak until the end
    noam      the inverse square root of "Attention Is All You Need": linear warmup, then
              peak * sqrt(warmup_steps / (step + 1)) (steps counted from 0), by steps alone
              (no floor). The paper's d^-0.5 * min(s^-0.5, s * warmup^-1.5), s = step + 1,
              is this with peak = (d * warmup)^-0.5 (7e-4 for d 512 and 4000 warmup steps).

The decay is driven by `progress` in [0, 1]: how much of the run's budget (steps,
tokens or time, whichever is furthest along) is used. A step budget alone gives the
classic step-based schedule (the last step runs at (N-1)/N, as transformers' schedules
do); a time budget decays to the floor when training time runs out (the budget less what
the final evaluation is expected to take). `t`, the position inside the decay, starts where warmup ended:
t = (progress - p_w) / (1 - p_w), where p_w is the progress at the end of warmup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LRSchedule:
    peak: float
    kind: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    warmup_end_progress: float | None = None  # p_w, recorded when warmup ends (resumable state)

    @property
    def floor(self) -> float:
        return self.peak * self.min_lr_ratio

    def __call__(self, step: int, progress: float) -> float:
        """The learning rate of optimizer step `step` (0-based) at `progress` of the budget."""
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        if self.kind == "noam":
            return self.peak * math.sqrt(max(self.warmup_steps, 1) / (step + 1))
        if self.warmup_end_progress is None:
            self.warmup_end_progress = progress if self.warmup_steps else 0.0
        p_w = self.warmup_end_progress
        t = min(1.0, max(0.0, (progress - p_w) / (1.0 - p_w))) if p_w < 1.0 else 1.0
        return self.floor + (self.peak - self.floor) * self.decay_factor(t)

    def decay_factor(self, t: float) -> float:
        """1 at the start of the decay, 0 at its end."""
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * t))
        if self.kind == "linear":
            return 1.0 - t
        if self.kind == "wsd":
            start = 1.0 - self.decay_fraction
            return 1.0 if t <= start else (1.0 - t) / self.decay_fraction
        return 1.0  # constant

    def state_dict(self) -> dict:
        return {"warmup_end_progress": self.warmup_end_progress}

    def load_state_dict(self, state: dict) -> None:
        self.warmup_end_progress = state["warmup_end_progress"]
