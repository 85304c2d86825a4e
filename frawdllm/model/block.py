"""A transformer block: attention then MLP, each wrapped in a residual connection.

pre-LN  (GPT-2, Llama):  x = x + attn(norm1(x));   x = x + mlp(norm2(x))
post-LN (the paper):     x = norm1(x + attn(x));   x = norm2(x + mlp(x))

Pre-LN keeps an unnormalised residual stream and trains stably without warmup tricks;
post-LN is the 2017 original.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float
from torch import Tensor, nn

from ..config import ModelConfig
from .attention import CausalSelfAttention
from .mlp import MLP
from .norm import make_norm


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.norm1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: Float[Tensor, "B T D"], rope: tuple[Tensor, Tensor] | None = None, kv_cache: Any = None
    ) -> Float[Tensor, "B T D"]:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.norm1(x), rope, kv_cache))
            x = x + self.drop(self.mlp(self.norm2(x)))
        else:
            x = self.norm1(x + self.drop(self.attn(x, rope, kv_cache)))
            x = self.norm2(x + self.drop(self.mlp(x)))
        return x
