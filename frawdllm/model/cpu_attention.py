"""Causal attention for training on CPU: `cpu_attention.c` as a PyTorch operator.

`causal_attention(q, k, v)` is softmax(q k^T / sqrt(hd), causal) v with its backward
pass, each one C call that keeps a head's scores in cache (the C file's header says how).
It is registered with `torch.library` (`frawdllm::causal_attention` and its backward), so
autograd differentiates it and `torch.compile` calls it as one opaque kernel inside the
compiled graph. Two versions, chosen by the inputs' dtype:

- bf16 (on CPUs with AVX512-BF16): bf16 products with fp32 accumulation, an fp32
  softmax; the (unnormalised) probabilities are rounded to bf16 before they multiply v,
  as PyTorch's own CPU flash attention does in bf16;
- fp32 (any CPU the C file compiles for: AVX2, AVX-512, ARM): fp32 throughout, equal to
  PyTorch's attention to float rounding. Used in eager fp32 training (`usable`); under
  torch.compile `kernels.blocked_causal_attention` fuses better.

`attend` uses it when `usable` says so; everything else (GPUs, inference, dropout,
no C compiler, `FRAWD_NATIVE=0`) keeps PyTorch's attention.
"""

import ctypes
from pathlib import Path

import torch
from jaxtyping import Float
from torch import Tensor

from ..cbuild import CLibrary, constant_under_compile

MAX_T = 2048  # a thread holds a (T x T) bf16 matrix per head: 8 MB at this length
MAX_T_F32 = 512  # fp32: two (T x T) matrices per head (2 MB here); longer rows run faster in PyTorch's flash kernel
i64 = ctypes.c_int64


class _View(ctypes.Structure):  # mirrors `View` in cpu_attention.c
    _fields_ = [("p", ctypes.c_void_p), ("sb", i64), ("sh", i64), ("st", i64)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.frawd_attention_available.restype = ctypes.c_int
    lib.frawd_attention_forward.restype = ctypes.c_int
    lib.frawd_attention_forward.argtypes = [_View] * 4 + [ctypes.c_void_p] + [i64] * 5
    lib.frawd_attention_backward.restype = ctypes.c_int
    lib.frawd_attention_backward.argtypes = [_View] * 5 + [ctypes.c_void_p] + [_View] * 3 + [i64] * 5
    lib.frawd_attention_f32_columns.restype = ctypes.c_int
    for name in ("frawd_attention_forward_f32", "frawd_attention_backward_f32"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = getattr(lib, name.removesuffix("_f32")).argtypes


LIBRARY = CLibrary(Path(__file__).with_name("cpu_attention.c"), "the CPU attention kernel", _declare)


@constant_under_compile  # decided once, outside any compiled graph
def available() -> bool:
    """True when the kernel builds and this CPU has AVX512-BF16."""
    return LIBRARY.unavailable_reason() is None and bool(LIBRARY.load().frawd_attention_available())


@constant_under_compile
def f32_columns() -> int:
    """The fp32 kernel's tile width (head_dim must be a multiple), 0 when the library is unavailable."""
    return LIBRARY.load().frawd_attention_f32_columns() if LIBRARY.unavailable_reason() is None else 0


def usable(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> bool:
    """Whether `causal_attention` can replace PyTorch's for these inputs (while training)."""
    if q.device.type != "cpu" or dropout_p != 0.0 or not q.shape == k.shape == v.shape:
        return False
    if q.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16):
        return q.shape[-1] % 32 == 0 and q.shape[2] <= MAX_T and available()
    if q.dtype == torch.float32 and not torch.compiler.is_compiling():
        columns = f32_columns()
        return columns > 0 and q.shape[-1] % columns == 0 and q.shape[2] <= MAX_T_F32
    return False


def causal_attention(
    q: Float[Tensor, "B H T hd"], k: Float[Tensor, "B H T hd"], v: Float[Tensor, "B H T hd"]
) -> Float[Tensor, "B H T hd"]:
    """softmax(q k^T / sqrt(hd), causal) v: in fp32 for fp32 inputs outside bf16 autocast,
    else in bf16 (inputs are rounded to bf16 first)."""
    autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    if not (q.dtype == k.dtype == v.dtype == torch.float32 and not autocast):
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    return torch.ops.frawdllm.causal_attention(q, k, v)[0]


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _view(t: Tensor) -> _View:
    return _View(t.data_ptr(), *t.stride()[:3])


def _like_bthd(t: Tensor) -> Tensor:
    """An empty (B, H, T, hd) tensor stored as (B, T, H, hd): the heads of a token side by
    side, so that the caller's transpose back to (B, T, D) is free."""
    B, H, T, hd = t.shape
    return t.new_empty(B, T, H, hd).transpose(1, 2)


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"the CPU attention kernel's {what} failed ({'out of memory' if status == 1 else status})")


@torch.library.custom_op("frawdllm::causal_attention", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    q, k, v = _rows(q), _rows(k), _rows(v)
    B, H, T, hd = q.shape
    out, lse = _like_bthd(q), q.new_empty(B, H, T, dtype=torch.float32)
    forward = LIBRARY.load().frawd_attention_forward_f32 if q.dtype == torch.float32 else LIBRARY.load().frawd_attention_forward
    _check(forward(_view(q), _view(k), _view(v), _view(out), lse.data_ptr(), B, H, T, hd, torch.get_num_threads()),
           "forward")
    return out, lse


@_forward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    B, H, T, _ = q.shape
    return _like_bthd(q), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("frawdllm::causal_attention_backward", mutates_args=())
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
              ) -> tuple[Tensor, Tensor, Tensor]:
    dout, q, k, v, out = (_rows(t) for t in (dout, q, k, v, out))
    B, H, T, hd = q.shape
    dq, dk, dv = _like_bthd(q), _like_bthd(q), _like_bthd(q)
    lib = LIBRARY.load()
    backward = lib.frawd_attention_backward_f32 if q.dtype == torch.float32 else lib.frawd_attention_backward
    _check(backward(
        _view(dout), _view(q), _view(k), _view(v), _view(out), lse.contiguous().data_ptr(),
        _view(dq), _view(dk), _view(dv), B, H, T, hd, torch.get_num_threads()), "backward")
    return dq, dk, dv


@_backward.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _like_bthd(q), _like_bthd(q), _like_bthd(q)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, *output)
    ctx.mark_non_differentiable(output[1])  # lse: kept for the backward pass only


def _differentiate(ctx, dout: Tensor, _dlse: Tensor):
    return _backward(dout, *ctx.saved_tensors)


_forward.register_autograd(_differentiate, setup_context=_setup_context)
