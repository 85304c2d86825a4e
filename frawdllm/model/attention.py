"""Attention, for three uses: causal self-attention, bidirectional self-attention, cross-attention.

Each query is compared with every key it may see; its output is the average of the
values weighted by softmax(q · k / sqrt(hd)). Written out for one head, with the mask
adding -inf where a query may not look:

    attention(Q, K, V) = softmax(Q K^T / sqrt(hd) + mask) V          (T x hd)

`reference_attention` is exactly that, in a few lines; the model calls
`kernels.attend`, which computes the same function with the fastest kernel at hand (the
tests hold every kernel to the reference). The three uses differ only in where q, k and
v come from and in the mask:

- causal self-attention (a decoder): q, k, v from the same tokens; token t sees tokens <= t;
- bidirectional self-attention (an encoder): every token sees every real token of its
  sequence; padding keys are masked out (`key_padding_mask`, True = a real token);
- cross-attention (an encoder-decoder): queries from the decoder, keys and values from
  the encoder's output, which is fixed for a source: `CrossAttention.memory_kv` projects
  it once, and every decoder step reuses those keys and values.

Heads: each token's vector is projected to n_head queries (and keys/values) of head_dim;
head outputs are concatenated and projected back to D. Grouped-query attention (GQA) gives
n_kv_head < n_head key/value heads, each shared by n_head / n_kv_head query heads: the KV
cache shrinks by that factor. n_kv_head == 1 is multi-query attention (MQA).

KV cache protocol: the inference engine passes an object with
`update(layer_idx, k, v) -> (k_all, v_all, mask)`, which stores this step's keys and values
(B, n_kv_head, T, hd) and returns everything to attend over (B, n_kv_head, S, hd) and a
boolean mask (B or 1, 1, T, S), True = may attend, or None when plain causal masking is right.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn

from ..config import ModelConfig
from . import kernels
from .embeddings import apply_rope


class KVCacheLike(Protocol):
    def update(
        self, layer_idx: int, k: Float[Tensor, "B Hkv T hd"], v: Float[Tensor, "B Hkv T hd"]
    ) -> tuple[Float[Tensor, "B Hkv S hd"], Float[Tensor, "B Hkv S hd"], Bool[Tensor, "#B 1 #T S"] | None]: ...


def reference_attention(
    q: Float[Tensor, "B H T hd"],
    k: Float[Tensor, "B Hkv S hd"],
    v: Float[Tensor, "B Hkv S hd"],
    mask: Bool[Tensor, "#B 1 #T S"] | None = None,
    causal: bool = False,
) -> Float[Tensor, "B H T hd"]:
    """softmax(q k^T / sqrt(hd) + mask) v, computed in fp32 (at least): the definition.

    causal: the T queries are the last T of the S keys, each sees the keys up to its own.
    """
    out_dtype = q.dtype
    q, k, v = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # GQA
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    T, S = scores.shape[-2:]
    if causal:
        seen = torch.arange(S, device=q.device) <= torch.arange(S - T, S, device=q.device)[:, None]  # (T, S)
        scores = scores.masked_fill(~seen, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v).to(out_dtype)


class SelfAttention(nn.Module):
    """Self-attention, causal (a decoder) or bidirectional (an encoder)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, causal: bool = True) -> None:
        super().__init__()
        self.layer_idx, self.causal = layer_idx, causal
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # One matmul for q, k and v: (n_head + 2 * n_kv_head) heads of head_dim.
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.dropout = cfg.dropout

    def forward(
        self,
        x: Float[Tensor, "B T D"],
        rope: tuple[Float[Tensor, "#B 1 T half"], Float[Tensor, "#B 1 T half"]] | None = None,
        kv_cache: Any = None,
        key_padding_mask: Bool[Tensor, "B T"] | None = None,
    ) -> Float[Tensor, "B T D"]:
        """key_padding_mask (bidirectional only): True where x holds a real token."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim],
            dim=-1,
        )
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None
        if kv_cache is not None:
            k, v, mask = kv_cache.update(self.layer_idx, k, v)  # (B, nkv, S, hd)
        if key_padding_mask is not None:
            if self.causal:  # (`attend` lets a mask alone decide: the layer would see the future)
                raise ValueError("key_padding_mask is for bidirectional attention; a causal layer masks "
                                 "through its kv_cache (KVCache.begin takes the rows' valid slots)")
            mask = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
        dropout = self.dropout if self.training else 0.0
        y = kernels.attend(q, k, v, mask, dropout, self.causal)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, D)
        return self.proj(y)


class CrossAttention(nn.Module):
    """Queries from the decoder, keys and values from the encoder output (`memory`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=cfg.bias)
        self.kv = nn.Linear(cfg.n_embd, 2 * cfg.n_kv_head * cfg.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.dropout = cfg.dropout

    def memory_kv(self, memory: Float[Tensor, "B S D"]) -> tuple[Float[Tensor, "B Hkv S hd"], Float[Tensor, "B Hkv S hd"]]:
        """The encoder output's keys and values: computed once per source, reused at every step."""
        B, S, _ = memory.shape
        k, v = self.kv(memory).view(B, S, 2 * self.n_kv_head, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        return k, v  # (B, nkv, S, hd) each

    def forward(
        self,
        x: Float[Tensor, "B T D"],
        memory_kv: tuple[Float[Tensor, "B Hkv S hd"], Float[Tensor, "B Hkv S hd"]],
        memory_mask: Bool[Tensor, "B S"] | None = None,
    ) -> Float[Tensor, "B T D"]:
        """memory_mask: True where the source holds a real token (padding is never attended)."""
        B, T, D = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k, v = memory_kv
        mask = None if memory_mask is None else memory_mask[:, None, None, :]  # (B, 1, 1, S)
        dropout = self.dropout if self.training else 0.0
        y = kernels.attend(q, k, v, mask, dropout, causal=False)  # (B, nh, T, hd)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))
