"""The position-wise feed-forward network: GELU MLP (GPT-2) or SwiGLU (Llama).

GELU:   down(gelu(up(x)))                     D -> H -> D
SwiGLU: down(silu(gate(x)) * up(x))           D -> 2H (gate and up fused) -> D
"""

from __future__ import annotations

import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from ..config import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.use_swiglu
        hidden = cfg.ffn_dim
        # SwiGLU fuses gate and up into one matmul: the first half is the gate.
        self.up = nn.Linear(cfg.n_embd, 2 * hidden if self.swiglu else hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.down.is_residual_proj = True  # scaled init, see FrawdLLM._init_weights

    def forward(self, x: Float[Tensor, "B T D"]) -> Float[Tensor, "B T D"]:
        h = self.up(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.down(h)
