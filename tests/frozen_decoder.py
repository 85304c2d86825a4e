"""A frozen copy of model/attention.py and model/block.py as they were before attention
served three uses (commit 6a2bba2).

tests/test_attention.py swaps these blocks into decoder-only models to check that the
generalised attention and blocks changed none of their outputs, bit for bit. Do not
edit: it is the reference.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn

from frawdllm.config import ModelConfig
from frawdllm.model import cpu_attention
from frawdllm.model.embeddings import apply_rope
import torch._inductor.config as inductor_config
from frawdllm.model.mlp import MLP
from frawdllm.model.norm import make_norm


class KVCacheLike(Protocol):
    def update(
        self, layer_idx: int, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]: ...


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # One matmul for q, k and v: (n_head + 2 * n_kv_head) heads of head_dim.
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.dropout = cfg.dropout

    def forward(
        self,
        x: Float[Tensor, "B T D"],
        rope: tuple[Tensor, Tensor] | None = None,
        kv_cache: Any = None,
    ) -> Float[Tensor, "B T D"]:
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
        y = attend(q, k, v, mask, self.dropout if self.training else 0.0)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, D)
        return self.proj(y)


def attend(
    q: Float[Tensor, "B H T hd"],
    k: Float[Tensor, "B Hkv S hd"],
    v: Float[Tensor, "B Hkv S hd"],
    mask: Bool[Tensor, "#B 1 T S"] | None = None,
    dropout_p: float = 0.0,
) -> Float[Tensor, "B H T hd"]:
    """softmax(q k^T / sqrt(hd)) v, causal unless an explicit mask is given."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:  # GQA: each kv head serves n_rep query heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    if mask is None:
        # Without a mask, queries are the last T of S keys (S == T when there is no cache).
        T, S = q.shape[2], k.shape[2]
        if T == 1:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        if T != S:
            raise ValueError(f"a KV cache must give a mask when {T} queries attend {S} keys")
        if q.device.type == "cpu" and torch.is_grad_enabled():  # training on a CPU
            if cpu_attention.usable(q, k, v, dropout_p):
                return cpu_attention.causal_attention(q, k, v)
            if T <= BLOCKED_MAX_T and torch.compiler.is_compiling():
                return blocked_causal_attention(q, k, v, dropout_p)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


BLOCKED_MAX_T = 512  # the blocks keep (T x T) probabilities for backward: fine for short T only


def blocked_causal_attention(
    q: Float[Tensor, "B H T hd"], k: Float[Tensor, "B H T hd"], v: Float[Tensor, "B H T hd"],
    dropout_p: float = 0.0, n_blocks: int = 4,
) -> Float[Tensor, "B H T hd"]:
    """Causal attention as matmuls: query block [a, b) attends keys [0, b) only.

    The same function as causal SDPA. With 4 blocks, 5/8 of the full T x T scores are
    computed instead of all of them; the softmax runs in fp32 (or the inputs' dtype if wider).
    """
    T = q.shape[2]
    size = -(-T // n_blocks)
    scale = q.shape[-1] ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # (T, T)
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # at least fp32
    out = []
    for a in range(0, T, size):
        b = min(a + size, T)
        scores = (q[:, :, a:b] @ k[:, :, :b].transpose(-1, -2)).to(softmax_dtype) * scale  # (B, H, b-a, b)
        probs = scores.masked_fill(~causal[a:b, :b], float("-inf")).softmax(dim=-1).to(q.dtype)
        if dropout_p > 0:
            probs = F.dropout(probs, dropout_p)
        out.append(probs @ v[:, :, :b])  # (B, H, b-a, hd)
    return torch.cat(out, dim=2)


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
        if kv_cache is None and torch.compiler.is_compiling() and not inductor_config.allow_buffer_reuse:
            return _compiled_once(self, x, rope)
        return self.residual_stream(x, rope, kv_cache)

    def residual_stream(
        self, x: Float[Tensor, "B T D"], rope: tuple[Tensor, Tensor] | None = None, kv_cache: Any = None
    ) -> Float[Tensor, "B T D"]:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.norm1(x), rope, kv_cache))
            x = x + self.drop(self.mlp(self.norm2(x)))
        else:
            x = self.norm1(x + self.drop(self.attn(x, rope, kv_cache)))
            x = self.norm2(x + self.drop(self.mlp(x)))
        return x


@torch.compiler.nested_compile_region
def _compiled_once(block: TransformerBlock, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
    """Under torch.compile, every layer runs this one traced region: the compiler works on
    a single block instead of n_layer copies (a faster warm-up, the same code)."""
    return block.residual_stream(x, rope)
