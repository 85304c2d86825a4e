"""int8 weight-only quantization: linear weights stored as int8 with one scale per output row.

    scale_r = max_c |W[r, c]| / 127          W_q[r, c] = round(W[r, c] / scale_r)  in [-127, 127]
    y = (x @ W_q^T) * scale + b

Weights take a quarter of fp32's memory, and decoding (which streams every weight once
per step) speeds up accordingly. Activations stay floating point: on CPU the product runs
in PyTorch's int8-weight kernel with bf16 activations; elsewhere, for widths it does not
support, or inside `fp32_activations()`, the weight is dequantized on the fly and the
activations stay fp32. An engine whose native forward reads the int8 weights runs its
PyTorch phases that way: both compute the same products in fp32, so a row's result does not
depend on which path a phase took (bf16 activations moved log-probabilities by ~0.01-0.03).
Embeddings and norms stay as they are; a tied LM head gets its own int8 copy while the
embedding table stays exact.

`benchmarks/int8_perplexity.py` measures what this costs in held-out perplexity.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int8
from torch import Tensor, nn


def quantize_rows(weight: Float[Tensor, "N K"]) -> tuple[Int8[Tensor, "N K"], Float[Tensor, "N"]]:
    """Symmetric per-row int8: returns (int8 weight, fp32 scale per row)."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (N,)
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


_FP32 = threading.local()  # per thread: a server's engine thread and a scoring thread differ


@contextmanager
def fp32_activations() -> Iterator[None]:
    """Int8 layers run inside the block dequantize their weights and keep fp32 activations
    (as the native forward computes), not PyTorch's bf16-activation kernel."""
    before = getattr(_FP32, "on", False)
    _FP32.on = True
    try:
        yield
    finally:
        _FP32.on = before


class Int8Linear(nn.Module):
    """A drop-in for `nn.Linear` at inference, holding an int8 weight and per-row scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("weight_int8", q.contiguous())  # (N, K)
        self.register_buffer("scale", scale)  # (N,) fp32
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))  # for the CPU kernel
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        # PyTorch's CPU int8-weight kernel needs the inner width to be a multiple of 16.
        self.use_kernel = q.device.type == "cpu" and self.in_features % 16 == 0

    def forward(self, x: Float[Tensor, "*B K"]) -> Float[Tensor, "*B N"]:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        if self.use_kernel and not getattr(_FP32, "on", False):
            y = torch._weight_int8pack_mm(flat.to(torch.bfloat16), self.weight_int8, self.scale_bf16).to(x.dtype)
        else:
            y = F.linear(flat, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> Float[Tensor, "N K"]:
        return self.weight_int8.float() * self.scale[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` of `model` (LM head included) by an `Int8Linear`, in place."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model


def is_int8(model: nn.Module) -> bool:
    """Whether `model` has int8 layers (`quantize_int8`)."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def int8_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of all linear weights as stored now, the same weights in fp32)."""
    stored = fp32 = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):
            stored += module.weight_int8.numel() + 4 * module.scale.numel()
            fp32 += 4 * module.weight_int8.numel()
        elif isinstance(module, nn.Linear):
            stored += module.weight.numel() * module.weight.element_size()
            fp32 += 4 * module.weight.numel()
    return stored, fp32


__all__ = ["Int8Linear", "quantize_int8", "quantize_rows", "int8_weight_bytes", "is_int8"]
