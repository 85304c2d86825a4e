"""RMSNorm, RoPE and SwiGLU in one pass each for eager fp32 training on CPU (`cpu_fused.c`).

`rms_norm`, `rope` and `swiglu` compute what `F.rms_norm`, `embeddings.apply_rope` and
`silu(gate) * up` compute, as `torch.autograd.Function`s whose forward and backward are
one C call each instead of a chain of elementwise kernels (the C file's header says why).
`usable(*tensors)` says when they replace PyTorch's: fp32 tensors on a CPU while autograd
records (training), outside torch.compile (which fuses the chains by itself) and bf16
autocast, with the C library at hand; elsewhere (inference, GPUs, bf16, no C compiler,
`FRAWD_NATIVE=0`) the callers keep PyTorch's ops. Results equal PyTorch's to float
rounding and do not depend on the thread count.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from jaxtyping import Float
from torch import Tensor

from ..cbuild import CLibrary, constant_under_compile

_p, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
CHUNK = 64  # rows per partial sum of RMSNorm's weight gradient (as in the C file)


def _declare(lib: ctypes.CDLL) -> None:
    signatures = {
        "frawd_rmsnorm_forward": [_p, _p, _p, _p, _i64, _i64, _f32, _int],
        "frawd_rmsnorm_backward": [_p, _p, _p, _p, _p, _p, _p, _i64, _i64, _int],
        "frawd_rope": [_p, _i64, _i64, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _f32, _int],
        "frawd_swiglu_forward": [_p, _p, _i64, _i64, _int],
        "frawd_swiglu_backward": [_p, _p, _p, _i64, _i64, _int],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = argtypes


LIBRARY = CLibrary(Path(__file__).with_name("cpu_fused.c"), "the library of fused CPU training kernels", _declare)


@constant_under_compile  # decided once, outside any compiled graph
def available() -> bool:
    return LIBRARY.unavailable_reason() is None


def usable(*tensors: Tensor) -> bool:
    """Whether the fused kernels replace PyTorch's ops for these inputs."""
    return (not torch.compiler.is_compiling() and torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu")
            and all(type(t) in (Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
                    for t in tensors)
            and available())


def _threads() -> int:
    return torch.get_num_threads()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x = x.contiguous()
        D = x.shape[-1]
        y, rstd = torch.empty_like(x), x.new_empty(x.numel() // D)
        LIBRARY.load().frawd_rmsnorm_forward(x.data_ptr(), weight.contiguous().data_ptr(), y.data_ptr(),
                                             rstd.data_ptr(), rstd.numel(), D, eps, _threads())
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        N, D = rstd.numel(), x.shape[-1]
        gy = gy.contiguous()
        gx, gw = torch.empty_like(x), torch.empty_like(weight)
        partial = x.new_empty(-(-N // CHUNK), D)
        LIBRARY.load().frawd_rmsnorm_backward(gy.data_ptr(), x.data_ptr(), weight.contiguous().data_ptr(),
                                              rstd.data_ptr(), gx.data_ptr(), gw.data_ptr(), partial.data_ptr(),
                                              N, D, _threads())
        return gx, gw, None


def rms_norm(x: Float[Tensor, "*B D"], weight: Float[Tensor, " D"], eps: float) -> Float[Tensor, "*B D"]:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (`F.rms_norm`)."""
    return _RMSNorm.apply(x, weight, eps)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, H, T, hd = x.shape
    out = x.new_empty(B, T, H, hd)  # heads of a token side by side: a free transpose back to (B, T, D)
    LIBRARY.load().frawd_rope(x.data_ptr(), *x.stride()[:3], cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                              B, H, T, hd, sign, _threads())
    return out.transpose(1, 2)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None  # a rotation's gradient rotates back


def rope_usable(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """`rope` takes positions shared by the batch: cos/sin of shape (T, hd/2) or (1, 1, T, hd/2)."""
    if not (usable(x, cos, sin) and x.dim() == 4 and x.shape[-1] % 2 == 0 and cos.shape == sin.shape):
        return False
    T, half = x.shape[2], x.shape[-1] // 2
    return cos.shape[-2:] == (T, half) and cos.numel() == T * half


def rope(x: Float[Tensor, "B H T hd"], cos: Float[Tensor, "*one T half"], sin: Float[Tensor, "*one T half"]
         ) -> Float[Tensor, "B H T hd"]:
    """`embeddings.apply_rope` for positions shared by the batch (see `rope_usable`)."""
    T, half = x.shape[2], x.shape[-1] // 2
    return _Rope.apply(x, cos.reshape(T, half), sin.reshape(T, half))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        h = h.contiguous()
        F = h.shape[-1] // 2
        y = h.new_empty(*h.shape[:-1], F)
        LIBRARY.load().frawd_swiglu_forward(h.data_ptr(), y.data_ptr(), h.numel() // (2 * F), F, _threads())
        ctx.save_for_backward(h)
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        (h,) = ctx.saved_tensors
        F = h.shape[-1] // 2
        gy, gh = gy.contiguous(), torch.empty_like(h)
        LIBRARY.load().frawd_swiglu_backward(gy.data_ptr(), h.data_ptr(), gh.data_ptr(), h.numel() // (2 * F), F,
                                             _threads())
        return gh


def swiglu(h: Float[Tensor, "*B twoF"]) -> Float[Tensor, "*B F"]:
    """silu(gate) * up where h = [gate | up] along the last dimension."""
    return _SwiGLU.apply(h)
