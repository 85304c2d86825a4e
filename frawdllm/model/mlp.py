"""The position-wise feed-forward network: GELU MLP (GPT-2), ReLU (the 2017 paper) or SwiGLU (Llama).

GELU:   down(gelu(up(x)))                     D -> H -> D
ReLU:   down(relu(up(x)))                     D -> H -> D
SwiGLU: down(silu(gate(x)) * up(x))           D -> 2H (gate and up fused) -> D
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from ..config import ModelConfig
from . import cpu_fused


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.use_swiglu
        self.relu = getattr(cfg, "activation", "gelu") == "relu"  # a Seq2SeqConfig field
        hidden = cfg.ffn_dim
        # SwiGLU fuses gate and up into one matmul: the first half is the gate.
        self.up = nn.Linear(cfg.n_embd, 2 * hidden if self.swiglu else hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.down.is_residual_proj = True  # scaled init, see gpt.init_weights

    def forward(self, x: Float[Tensor, "B T D"]) -> Float[Tensor, "B T D"]:
        h = self.up(x)
        if self.swiglu:
            if cpu_fused.usable(h):  # eager fp32 training on a CPU: one pass, not two
                h = cpu_fused.swiglu(h)
            else:
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up
        elif self.relu:
            h = F.relu(h)
        else:
            h = gelu_tanh(h)
        return self.down(h)


def gelu_tanh(h: Float[Tensor, "*B H"]) -> Float[Tensor, "*B H"]:
    """GPT-2's tanh-approximate GELU: 0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3))).

    Under torch.compile it is written with a sigmoid, 0.5 (1 + tanh(z)) = sigmoid(2z):
    the same function, and the compiled CPU kernel is about twice as fast as with tanh.
    """
    if torch.compiler.is_compiling():
        return gelu_tanh_via_sigmoid(h)
    return F.gelu(h, approximate="tanh")


def gelu_tanh_via_sigmoid(h: Float[Tensor, "*B H"]) -> Float[Tensor, "*B H"]:
    x = h.float() if h.dtype in (torch.bfloat16, torch.float16) else h
    return (x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))).to(h.dtype)  # 2 sqrt(2/pi)
