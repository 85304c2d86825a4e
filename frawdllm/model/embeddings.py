"""Token and position embeddings.

Attention alone is blind to order, so each token's vector gets position information:

- learned:    a trainable vector per position, added to the token embedding (GPT-2);
- sinusoidal: the fixed table of "Attention Is All You Need",
              PE[p, 2i] = sin(p / 10000^(2i/D)),  PE[p, 2i+1] = cos(p / 10000^(2i/D));
- rope:       rotary embeddings (RoFormer): q and k are rotated by an angle proportional
              to their position, so q·k depends only on the distance between them;
- none:       no positions at all (causal masking still leaks some order).

Token embeddings can be scaled by sqrt(D), as in the paper, so that they are not
drowned by the position signal.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from . import cpu_fused


def sinusoidal_table(n_pos: int, dim: int) -> Float[Tensor, "P D"]:
    position = torch.arange(n_pos, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_pos, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table.float()


def rope_tables(n_pos: int, head_dim: int, theta: float) -> tuple[Float[Tensor, "P half"], Float[Tensor, "P half"]]:
    """cos and sin of the rotation angles, shape (positions, head_dim/2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(n_pos, dtype=torch.float64), inv_freq)  # (P, hd/2)
    return angles.cos().float(), angles.sin().float()


def rope_at(
    cos: Float[Tensor, "P half"], sin: Float[Tensor, "P half"], positions: Int[Tensor, "#B T"]
) -> tuple[Float[Tensor, "#B 1 T half"], Float[Tensor, "#B 1 T half"]]:
    """The tables' rows at `positions`, with a head axis to broadcast over: (1 or B, 1, T, hd/2)."""
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rope(
    x: Float[Tensor, "B H T hd"], cos: Float[Tensor, "*b T half"], sin: Float[Tensor, "*b T half"]
) -> Float[Tensor, "B H T hd"]:
    """Rotate pairs (x[i], x[i + hd/2]) by the position's angles (the "rotate half" layout
    that Hugging Face Llama uses, so weights map across without permutation).

    cos/sin are (1, 1, T, hd/2) for shared positions or (B, 1, T, hd/2) for per-row ones.
    """
    if cpu_fused.rope_usable(x, cos, sin):  # eager fp32 training on a CPU: one pass, not seven
        return cpu_fused.rope(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Embeddings(nn.Module):
    """Token embedding (optionally x sqrt(D)) plus learned or sinusoidal positions."""

    def __init__(self, vocab_size: int, dim: int, context_length: int, pos_encoding: str,
                 scale: bool, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.scale = math.sqrt(dim) if scale else 1.0
        self.pos_encoding = pos_encoding
        if pos_encoding == "learned":
            self.pos = nn.Embedding(context_length, dim)
        elif pos_encoding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(context_length, dim), persistent=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, token_ids: Int[Tensor, "B T"], positions: Int[Tensor, "#B T"]) -> Float[Tensor, "B T D"]:
        x = self.tok(token_ids)  # (B, T, D)
        if self.scale != 1.0:
            x = x * self.scale
        if self.pos_encoding == "learned":
            x = x + self.pos(positions)
        elif self.pos_encoding == "sinusoidal":
            x = x + self.pos_table[positions]
        return self.drop(x)
