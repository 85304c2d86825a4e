"""Normalisation layers: LayerNorm (GPT-2, the paper) and RMSNorm (Llama).

LayerNorm centres each vector and scales it to unit variance, then applies a learned
gain (and bias). RMSNorm skips the centring: x / rms(x) * gain. It is cheaper and works
as well in practice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from ..config import ModelConfig
from . import cpu_fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Float[Tensor, "*B D"]) -> Float[Tensor, "*B D"]:
        if cpu_fused.usable(x, self.weight):  # eager fp32 training on a CPU: one pass, not six
            return cpu_fused.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.use_rmsnorm:
        return RMSNorm(cfg.n_embd, cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
