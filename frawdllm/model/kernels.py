"""The fast attention kernels and the choice between them: the speed side of `attention.py`.

`attend(q, k, v, mask, dropout_p, causal)` computes the same function as
`attention.reference_attention` given the same `causal` (attend's default is causal, the
reference's is not), with whichever kernel is fastest here:

- PyTorch's `scaled_dot_product_attention` (flash / memory-efficient kernels where
  available): the default, and the one for masks and bidirectional attention except
  with dropout on a CPU (below);
- training on a CPU, causal, without dropout: `cpu_attention` (a fused C kernel, forward and backward),
  because PyTorch's CPU backward is slow for short sequences: in bf16 on CPUs with
  AVX512-BF16, in fp32 on any CPU in eager mode (T <= 512); head_dim a multiple of the
  kernel's tile width (`cpu_attention.usable`), else PyTorch's;
- training on a CPU under `torch.compile`, causal, where `cpu_attention` does not apply
  (fp32, or bf16 without AVX512-BF16; T <= 512): `blocked_causal_attention`,
  plain matmuls over a few query blocks (block i attends only the keys up to its end,
  skipping most of the masked half), which torch.compile fuses into about twice the speed.
- training on a CPU with dropout and a mask (an encoder's padding, cross-attention, packed
  SFT rows):
  `dropout_attention`, the reference's math with `dropout` below; PyTorch's own attention
  falls back to the same math for dropout, with a far slower random draw.

Tests compare each of them with the reference attention.

`dropout(x, p)` is `F.dropout` with a faster keep-mask on a CPU: PyTorch's CPU Bernoulli
draw generates one number at a time (one of the costliest operations of a small model's
training step). Where the C compiler is at hand, `cpu_dropout.c` draws the mask on every
thread from counter-based random numbers seeded by PyTorch's generator, in one pass
(several times faster than even `torch.rand`); elsewhere, and inside a compiled graph, the
mask is uniform floats (`torch.rand` >= p). The same distribution either way. The
encoder-decoder model uses it (`Dropout`); the decoder-only model keeps `nn.Dropout` (its
unmasked attention keeps PyTorch's draw too), so pretraining's random streams stay those
of earlier runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn

from ..cbuild import CLibrary
from . import cpu_attention


def attend(
    q: Float[Tensor, "B H T hd"],
    k: Float[Tensor, "B Hkv S hd"],
    v: Float[Tensor, "B Hkv S hd"],
    mask: Bool[Tensor, "#B 1 #T S"] | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
) -> Float[Tensor, "B H T hd"]:
    """softmax(q k^T / sqrt(hd)) v over the keys `mask` allows (True = may attend).

    causal without a mask: the queries are the last T of the S keys and each sees the keys
    up to its own. causal with a mask: the mask alone decides (a KV cache builds it).
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:  # GQA: each kv head serves n_rep query heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    if mask is None and causal:
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
    if mask is not None and dropout_p > 0 and q.device.type == "cpu":
        return dropout_attention(q, k, v, mask, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def dropout_attention(
    q: Float[Tensor, "B H T hd"], k: Float[Tensor, "B H S hd"], v: Float[Tensor, "B H S hd"],
    mask: Bool[Tensor, "#B 1 #T S"], dropout_p: float,
) -> Float[Tensor, "B H T hd"]:
    """softmax(q k^T / sqrt(hd) + mask) v with dropout on the weights, in plain ops: what
    PyTorch's CPU attention computes with dropout, with `dropout`'s faster draw. Every
    query must see at least one key (true of padding masks: a sentence is never empty)."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)  # (B, H, T, S)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return dropout(probs, dropout_p) @ v


def dropout(x: Float[Tensor, "..."], p: float, training: bool = True) -> Float[Tensor, "..."]:
    """Zero each element with probability p, scale the others by 1 / (1 - p) (`F.dropout`)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or not 0.0 < p < 1.0:
        return F.dropout(x, p)
    if not torch.compiler.is_compiling() and _dropout_library() is not None:
        return x * _c_keep_mask(x, p)  # the mask is saved for backward, as F.dropout's
    keep = torch.rand(x.shape, device=x.device) >= p  # fp32 draws: p is met to 2^-24 in any dtype
    return x * keep.to(x.dtype).div_(1.0 - p)


def _declare_dropout(lib: ctypes.CDLL) -> None:
    lib.frawd_dropout_mask.restype = ctypes.c_int
    lib.frawd_dropout_mask.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint64,
                                       ctypes.c_float, ctypes.c_int]


DROPOUT_LIBRARY = CLibrary(Path(__file__).with_name("cpu_dropout.c"), "the CPU dropout kernel", _declare_dropout)


def _dropout_library() -> ctypes.CDLL | None:
    return DROPOUT_LIBRARY.load() if DROPOUT_LIBRARY.unavailable_reason() is None else None


def _c_keep_mask(x: Tensor, p: float) -> Tensor:
    """1 / (1 - p) where an element is kept, 0 where dropped: x's shape and dtype, from C."""
    mask = torch.empty(x.shape, dtype=torch.float32)
    seed = int(torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64)) % 2**64  # from torch's generator
    _dropout_library().frawd_dropout_mask(mask.data_ptr(), mask.numel(), seed, round(p * 2**32),
                                          1.0 / (1.0 - p), torch.get_num_threads())
    return mask.to(x.dtype)


class Dropout(nn.Dropout):
    """`nn.Dropout` drawing its mask with `dropout`."""

    def forward(self, x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
        return dropout(x, self.p, self.training)


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
