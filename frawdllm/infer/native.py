"""The native forward: `native.c`, compiled on first use and called through ctypes.

At batch 1 a PyTorch decode step of a small model costs far more in dispatching ~150
small operations than in arithmetic. `native.c` does the same forward as one C call
(see its header for the why and the how); this module builds it, describes a model to it
and calls it for prefill and decode.

Weights: the decoder owns its copies of the linear weights, packed in the tiled layout
`native.c` streams, together in one block of 2 MB pages (`hugepages`: fewer TLB misses;
the model given is never changed; embeddings and norms are read in place). "fp32" copies them exactly (results equal PyTorch's up to rounding order).
"fp16" stores them as fp16: half the memory traffic, so about twice the decode speed,
at a rounding of 2^-11 relative per weight (logits move by ~1e-3;
`benchmarks/int8_perplexity.py` measures the perplexity change). A model quantized with
`quantize_int8` is read as int8 with its per-row scales (a quarter of the bytes; the
products run on fp32 activations). The engine's default on CPU is fp16 where the CPU
converts it (F16C, aarch64; else fp32), the way inference servers run fp32 checkpoints
in half precision; `weights="fp32"` (`--native fp32`) is exact. The KV cache may be
fp16 too (keys and values rounded once as they are stored; `Engine.kv_dtype` picks it
with fp16 or int8 weights): half the cache's memory, and of what attention reads. On CPUs
with AMX, fp16 weights get a second copy split exactly into two bf16 planes (`amx_planes`,
4 bytes a weight) for many-row products on the tile unit; it is freed where timing says
those never pay, and `FRAWD_AMX=0` keeps it from being made.

Building: the first use compiles the file with the system C compiler (`$CC`, else `cc`;
see `frawdllm.cbuild`, which says so on stderr), cached by source, compiler and CPU.
Without a compiler, or with `FRAWD_NATIVE=0`, `available()` is False and the engine uses
PyTorch.

Forms: how the weight stream is read (the prefetch hint of one-row and of many-row
products, fp16 converted 16 or 8 at a time, whether a decode step prefetches cached keys
and values) changes speed a lot from one CPU to another and never the results; nor does
from how many rows products run on AMX, except in the last bits (the tile unit sums in
another order). Each decoder times them on its own decode steps, once per CPU and model
shape (`NativeDecoder.stream_forms` says what it chose).

Sharing: one decoder may serve several Python threads; calls run one at a time and each
returns logits of its own.

What it covers: every FrawdLLM architecture (positions, norms, MLPs, GQA, pre/post-LN,
biases, tied heads) with fp32 parameters on CPU; `supports(model)` says whether a model
qualifies (bf16 weights or a GPU use PyTorch).
"""

from __future__ import annotations

import copy
import ctypes
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import BFloat16, Float, Int, Num
from torch import Tensor, nn

from ..cbuild import CLibrary, build
from ..errors import FrawdError
from .cache import KVCache
from .hugepages import Arena
from .quantize import Int8Linear

POS_CODES = {"none": 0, "learned": 1, "sinusoidal": 2, "rope": 3}
_ERRORS = {1: "a token id is outside the vocabulary", 2: "a position is past the model's context",
           3: "a row's cache slots are outside the cache", 4: "this build cannot read an fp16 KV cache"}
KV_OVERFLOW = 5  # computed, but a key or value passed fp16's range in the fp16 cache (cached as inf)


def _check(status: int) -> None:
    """A failed call as an error: a caller's mistake is a ValueError; a model whose keys or
    values do not fit an fp16 cache is a FrawdError naming the way out."""
    if status == KV_OVERFLOW:
        raise FrawdError("this model's keys/values exceed fp16's range (65504) in the fp16 KV cache "
                         "(they would decode as NaN); use an fp32 cache: --native fp32 (weights='fp32'), "
                         "or for an int8 model --native off (native=False)")
    if status:
        raise ValueError(f"native forward: {_ERRORS.get(status, f'error {status}')}")

i64, f32p = ctypes.c_int64, ctypes.POINTER(ctypes.c_float)


# ctypes mirrors of the structs in native.c (same fields, same order).
class _Linear(ctypes.Structure):
    _fields_ = [("w", f32p), ("wh", ctypes.c_void_p), ("wq", ctypes.c_void_p), ("scale", f32p), ("b", f32p),
                ("in_", i64), ("out", i64), ("hint", i64), ("narrow", i64), ("hint_rows", i64),
                ("wb", ctypes.c_void_p), ("amx_rows", i64)]


class _Norm(ctypes.Structure):
    _fields_ = [("w", f32p), ("b", f32p)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", _Norm), ("norm2", _Norm), ("qkv", _Linear), ("proj", _Linear),
                ("up", _Linear), ("down", _Linear)]


class _Model(ctypes.Structure):
    _fields_ = [
        *[(name, i64) for name in ("n_layer", "d", "n_head", "n_kv_head", "head_dim", "vocab", "context",
                                   "ffn", "pos_encoding", "rmsnorm", "swiglu", "pre_norm", "final_norm")],
        ("embed_scale", ctypes.c_float), ("eps", ctypes.c_float),
        ("tok", f32p), ("tok_s0", i64), ("tok_s1", i64), ("pos", f32p), ("rope_cos", f32p), ("rope_sin", f32p),
        ("final_norm_w", _Norm), ("head", _Linear), ("layers", ctypes.POINTER(_Layer)), ("kv_prefetch", i64),
    ]


class _Args(ctypes.Structure):  # ForwardArgs: frawd_forward's arguments
    _fields_ = [("B", i64), ("T", i64), ("token", ctypes.c_void_p), ("position", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("max_len", i64),
                ("start", ctypes.c_void_p), ("valid", ctypes.c_void_p), ("padded", i64),
                ("logits", ctypes.c_void_p), ("work", ctypes.c_void_p), ("threads", i64), ("kv_half", i64)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.frawd_forward.restype = ctypes.c_int
    lib.frawd_forward.argtypes = [
        ctypes.POINTER(_Model), i64, i64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, i64, ctypes.c_void_p, ctypes.c_void_p, i64,
        ctypes.c_void_p, ctypes.c_void_p, i64, i64,
    ]
    lib.frawd_forward_args.restype = ctypes.c_int
    lib.frawd_forward_args.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.frawd_has_fp16.restype = ctypes.c_int
    lib.frawd_has_narrow.restype = ctypes.c_int
    lib.frawd_tile.restype = i64
    lib.frawd_workspace_floats.restype = i64
    lib.frawd_workspace_floats.argtypes = [ctypes.POINTER(_Model), i64, i64, i64]
    lib.frawd_set_forms.argtypes = [ctypes.POINTER(_Model), i64, i64, i64, i64, i64]
    lib.frawd_has_amx.restype = ctypes.c_int
    lib.frawd_amx_init.restype = ctypes.c_int
    lib.frawd_test_late_threads.argtypes = [i64, i64]  # (tests: see native.c)


LIBRARY = CLibrary(Path(__file__).with_name("native.c"), "the native forward", _declare)


def library() -> ctypes.CDLL:
    """The compiled library (built on first call); raises FrawdError saying why if it cannot be."""
    return LIBRARY.load()


def available() -> bool:
    """True when the compiled forward can be used in this process (building it if needed)."""
    return unavailable_reason() is None


def build_for(device: torch.device) -> None:
    """Build the compiled forward now (once per machine and build; a line on stderr says so)
    where an `Engine` on `device` would use it: on the CPU."""
    if device.type == "cpu":
        available()


def unavailable_reason() -> str | None:
    """None when the compiled forward loads, else why not (no compiler, FRAWD_NATIVE=0...)."""
    return LIBRARY.unavailable_reason()


def has_fp16() -> bool:
    """True when the compiled forward can read fp16 weights (x86 CPUs since 2013 can)."""
    return available() and bool(library().frawd_has_fp16())


PREFETCH_HINTS = ("nta", "t0", "none")  # native.c's PF_NTA, PF_T0, PF_NONE


def supports(model: nn.Module) -> str | None:
    """None when `native.c` can run this model, else the reason it cannot."""
    from ..model.gpt import FrawdLLM

    if not isinstance(model, FrawdLLM):
        return f"{type(model).__name__} is not a FrawdLLM"
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type != "cpu":
            return f"{name} is on {tensor.device}, not the CPU"
    for name, param in model.named_parameters():  # (buffers may hold other types: int8 weights)
        if param.dtype != torch.float32:
            return f"{name} is {param.dtype}, not float32"
    from ..align.lora import LoRALinear

    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            return f"{name} has LoRA adapters (lora.merged_copy(model) merges them)"
    return None


def packed_tiles(
    weight: Num[Tensor, "out inputs"], tile: int, dtype: torch.dtype
) -> Num[Tensor, "tiles inputs tile"]:
    """W (out, in) as `native.c` reads it: (tiles, in, tile), tile t = W^T[:, t*tile:(t+1)*tile],
    the outputs padded with zero columns to whole tiles."""
    out, inputs = weight.shape
    tiles = -(-out // tile)
    padded = torch.zeros(tiles * tile, inputs, dtype=dtype)
    padded[:out] = weight.detach()
    return padded.view(tiles, tile, inputs).transpose(1, 2).contiguous()


def amx_planes(weight: Float[Tensor, "out inputs"], tile: int) -> BFloat16[Tensor, "blocks chunks 2 16 16 2"]:
    """W (out, in), rounded to fp16, as the two bf16 planes `native.c`'s AMX products read
    (wh = bf16(w), wl = w - wh, both exact): per 16 outputs (padded to whole tiles), per 32
    inputs, wh then wl, each 16 input pairs x 16 outputs x 2 (the tile unit's layout)."""
    out, inputs = weight.shape
    blocks = -(-out // tile) * tile // 16
    w = torch.zeros(blocks * 16, inputs)
    w[:out] = weight.detach().to(torch.float16).float()
    hi = w.to(torch.bfloat16)
    lo = (w - hi.float()).to(torch.bfloat16)

    def tiles(plane: Tensor) -> Tensor:  # (outputs, in) -> (blocks, in/32, 16 pairs, 16 outputs, 2)
        return plane.view(blocks, 16, inputs // 32, 16, 2).permute(0, 2, 3, 1, 4)

    return torch.stack([tiles(hi), tiles(lo)], dim=2).contiguous()


AMX_ROWS = (32, 16, 8, 4, 2)  # the row counts from which AMX products are timed, largest first


def has_amx() -> bool:
    """Whether many-row products run on AMX tiles (an AMX build that Linux let use them;
    `FRAWD_AMX=0` turns them off)."""
    global _AMX
    if _AMX is None:
        lib = library() if os.environ.get("FRAWD_AMX", "1") != "0" and available() else None
        _AMX = bool(lib and lib.frawd_has_amx() and lib.frawd_amx_init())
    return _AMX


_AMX: bool | None = None


def _padded(vector: Tensor | None, tile: int) -> Tensor | None:
    """A per-output vector (bias, scale) as a copy padded with zeros to whole tiles."""
    if vector is None:
        return None
    out = torch.zeros(-(-vector.numel() // tile) * tile, dtype=torch.float32)
    out[: vector.numel()] = vector.detach().float()
    return out


def fp16_rounded_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with its linear weights rounded to fp16 (and back to fp32): the
    model that weights="fp16" computes, for tests and perplexity measurements. The
    embedding table stays fp32 (a tied LM head gets its own rounded copy)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        if getattr(ref.lm_head, "weight", None) is ref.embed.tok.weight:
            ref.lm_head.weight = nn.Parameter(ref.lm_head.weight.detach().clone())
        for module in ref.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(module.weight.half().float())
    return ref


def dequantized_copy(model: nn.Module) -> nn.Module:
    """A copy of an int8 model (`quantize_int8`) with each `Int8Linear` back to an
    `nn.Linear` holding W_q * scale: what the native forward computes for it, in fp32."""
    ref = copy.deepcopy(model)
    for module in list(ref.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Int8Linear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    linear.weight.copy_(child.dequantized_weight())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(module, name, linear)
    return ref


def _signature(model: nn.Module) -> list[tuple[int, int, tuple[int, ...]]]:
    """Where each tensor lives, its in-place version counter and strides: any change
    (an optimizer step, `p.data = ...`, a move) shows up here."""
    return [(t.data_ptr(), t._version, t.stride()) for t in (*model.parameters(), *model.buffers())]


class _Probe:
    """A few values of each tensor the decoder copied (the linear layers'), read through views
    of their memory: writes that leave the version counter alone and change the probed
    values show up here (torch's fused AdamW step does not count as an in-place write, nor
    does `p.data.mul_(...)`: a decoder built before such an update went on multiplying by the
    old weights, beside the new embeddings and norms it points to). A `.data` write to entries
    between the probes is not seen: `Engine.refresh()` is for that."""

    PER_TENSOR = 16

    def __init__(self, tensors: list[Tensor]) -> None:
        groups: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            t = t.detach()
            if t.numel() and t.is_contiguous():  # (a view that aliases; others are in the signature only)
                flat = t.view(-1)
                groups.setdefault(t.dtype, []).append(flat[:: max(1, flat.numel() // self.PER_TENSOR)])
        self.views = list(groups.values())
        self.values = self._read()

    def _read(self) -> list[Tensor]:
        return [torch.cat(views) for views in self.views]  # one small copy per dtype

    def unchanged(self) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self._read(), self.values))


WEIGHT_DTYPES = ("fp32", "fp16")

FP16_WEIGHT_LIMIT = 65000.0  # the largest weight the fp16 copies take (fp16's largest is 65504)


def fits_fp16(model: nn.Module) -> bool:
    """Every linear weight of `model` fits the fp16 copies (a run diverged by too high a
    learning rate grows weights past them)."""
    return all(float(m.weight.detach().abs().max()) <= FP16_WEIGHT_LIMIT
               for m in model.modules() if isinstance(m, nn.Linear) and m.weight.is_floating_point())



class NativeDecoder:
    """The C forward for one model: its own packed copies of the linear weights (fp32,
    fp16 or the model's int8), pointers into the model for embeddings and norms.

    weights="fp32" copies the matrices exactly (results equal PyTorch's up to rounding
    order); "fp16" keeps half the bytes, converted back to fp32 in registers (embeddings,
    norms and biases stay fp32; arithmetic is fp32 throughout). The model is not changed.

    The copies reflect the model as it was at construction: `is_current()` says whether
    the model is still that (the engine rebuilds the decoder when it is not).
    """

    def __init__(self, model: nn.Module, weights: str = "fp32", amx_rows: int | None = None) -> None:
        """`amx_rows` (fp16 weights on a CPU with AMX): products of at least that many rows on
        the tile unit, 0 never; None (the default): as timed (`_choose_forms`)."""
        reason = supports(model)
        if reason is not None:
            raise FrawdError(f"the native forward cannot run this model: {reason}")
        if weights not in WEIGHT_DTYPES:
            raise FrawdError(f"native weights must be one of {', '.join(WEIGHT_DTYPES)}; got {weights!r}")
        self.lib = library()
        if weights == "fp16" and not has_fp16():
            raise FrawdError("fp16 weights need a CPU with F16C (x86-64 since 2013)")
        self.weights = weights
        self.source = model
        self._signature = _signature(model)
        cfg = model.config
        self._keep: list[Tensor] = []  # tensors whose memory the struct points into

        def ptr(t: Tensor | None, as_type=f32p):
            if t is None:
                return None
            t = t.detach()
            self._keep.append(t)
            return ctypes.cast(t.data_ptr(), as_type)

        tile = int(self.lib.frawd_tile())
        self.weight_bytes = 0  # bytes of linear weights a batch-1 step streams

        def stream(t: Tensor, scale: Tensor | None = None) -> None:
            self.weight_bytes += t.numel() * t.element_size() + (0 if scale is None else 4 * scale.numel())

        def pack(module: nn.Module) -> Tensor:
            """The packed copy `native.c` streams: int8 as quantized, else fp16 or fp32."""
            if isinstance(module, Int8Linear):  # int8, a quarter of fp32's bytes
                return packed_tiles(module.weight_int8, tile, torch.int8)
            if weights == "fp16":
                if float(module.weight.detach().abs().max()) > FP16_WEIGHT_LIMIT:
                    raise FrawdError(f"a weight of {module} is too large for fp16; use fp32 weights")
                return packed_tiles(module.weight.to(torch.float16), tile, torch.float16)
            return packed_tiles(module.weight, tile, torch.float32)

        amx = weights == "fp16" and has_amx()  # many-row products on AMX tiles (see native.c)
        self._planes: list[Tensor] = []  # their weights (2 MB pages), while timing says they pay (_choose_forms)
        # Every matrix packed first, so that one block of 2 MB pages holds them all, one after another.
        linears = [m for b in model.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.up, b.mlp.down)]
        self._probe = _Probe([t for m in (*linears, model.lm_head)
                              for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))])
        packs = {id(m): pack(m) for m in (*linears, model.lm_head)}
        self.arena = Arena(Arena.size_of([t.numel() * t.element_size() for t in packs.values()]))
        with_planes = {id(m) for m in (*linears, model.lm_head)
                       if amx and not isinstance(m, Int8Linear) and m.in_features % 32 == 0}
        self._plane_arena = Arena(Arena.size_of([  # (each made as its matrix is placed: one at a time in memory)
            4 * -(-m.out_features // tile) * tile * m.in_features for m in (*linears, model.lm_head)
            if id(m) in with_planes]))

        def linear(module: nn.Module) -> _Linear:
            bias = ptr(_padded(module.bias, tile))
            w = self.arena.place(packs.pop(id(module)))  # (the packed original is freed as it moves)
            sizes = module.in_features, module.out_features
            if w.dtype == torch.int8:
                stream(w, module.scale)
                return _Linear(None, None, ptr(w, ctypes.c_void_p), ptr(_padded(module.scale, tile)), bias, *sizes)
            stream(w)
            if w.dtype == torch.float16:
                made = _Linear(None, ptr(w, ctypes.c_void_p), None, None, bias, *sizes)
                if id(module) in with_planes:
                    self._planes.append(self._plane_arena.place(amx_planes(module.weight, tile)))
                    made.wb = self._planes[-1].data_ptr()
                return made
            return _Linear(ptr(w), None, None, None, bias, *sizes)

        def norm(module: nn.Module) -> _Norm:
            return _Norm(ptr(module.weight), ptr(getattr(module, "bias", None)))

        layers = (_Layer * cfg.n_layer)(*[
            _Layer(norm(b.norm1), norm(b.norm2), linear(b.attn.qkv), linear(b.attn.proj),
                   linear(b.mlp.up), linear(b.mlp.down))
            for b in model.blocks
        ])
        self._layers = layers
        tok = model.embed.tok.weight.detach()
        pos = None
        if cfg.pos_encoding == "learned":
            pos = model.embed.pos.weight.detach().contiguous()
        elif cfg.pos_encoding == "sinusoidal":
            pos = model.embed.pos_table.contiguous()
        rope = cfg.pos_encoding == "rope"
        self.model = _Model(
            cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.vocab_size, cfg.context_length,
            cfg.ffn_dim, POS_CODES[cfg.pos_encoding], int(cfg.use_rmsnorm), int(cfg.use_swiglu),
            int(cfg.norm_placement == "pre"), int(cfg.has_final_norm),
            model.embed.scale, cfg.norm_eps,
            ptr(tok), tok.stride(0), tok.stride(1), ptr(pos),
            ptr(model.rope_cos.contiguous()) if rope else None, ptr(model.rope_sin.contiguous()) if rope else None,
            norm(model.norm) if cfg.has_final_norm else _Norm(None, None), linear(model.lm_head),
            ctypes.cast(layers, ctypes.POINTER(_Layer)),
        )
        self.vocab = cfg.vocab_size
        self._cache_k: list[Tensor] | None = None
        self._kv_half = False
        self._cache_rows = 0
        self._work: Tensor | None = None
        self._lock = threading.Lock()
        self.stream_forms = self._choose_forms(amx_rows)

    def _choose_forms(self, amx_rows: int | None = None) -> str:
        """How this machine streams these weights fastest, timed on real decode steps once per
        CPU, build and model shape (kept with the engine's paths, `paths.remembered`: ~0.1 s
        for `tiny`, ~0.5 s for `small`, more with AMX). Four choices:

        - one-row products (batch-1 decode): the prefetch hint of the weight stream (NTA,
          T0 or none) and, for fp16 weights in AVX-512 builds, conversions 8 at a time
          (without prefetch): one row after 8 cached tokens; every form gives the same bits;
        - many-row products (batches, prefill): the hint, on a step of 8 rows;
        - with AMX (fp16 weights): from how many rows products run on the tile unit, timed
          at 32 rows, then 16, 8, 4 and 2 while it keeps winning (never: its planes freed);
        - whether decode steps prefetch the next attention task's keys and values: on a
          32-row step with 128 cached tokens (where the cache is read most).
        NTA paid on an AMD Zen 4 and ran 1.6-4.4x slower on an Intel Xeon with AMX. The
        first form (NTA, what native.c used before it was timed; AMX off) stays unless
        another is 3% faster."""
        from . import paths

        model = ctypes.byref(self.model)

        def measure() -> list[int]:
            if sum(p.numel() for p in self.source.parameters()) > paths.LOUD_PARAMS:  # (~1.7 s at 100M)
                print("timing how this CPU reads this model's weights (once)...", file=sys.stderr, flush=True)
            forms = [(0, 0), (1, 0), (2, 0)]  # (hint: native.c's PF_NTA 0, PF_T0 1, PF_NONE 2; narrow)
            if self.weights == "fp16" and self.lib.frawd_has_narrow():
                forms.append((2, 1))
            hint, narrow = forms[self._fastest(forms, lambda f: self.lib.frawd_set_forms(model, *f, 0, 0, 1), 1)]
            rows = self._fastest([0, 1, 2], lambda h: self.lib.frawd_set_forms(model, hint, narrow, h, 0, 1), 8)
            amx = 0
            for count in AMX_ROWS if self._planes else ():
                if not self._fastest([0, count], lambda a: self.lib.frawd_set_forms(model, hint, narrow, rows, a, 1),
                                     count, rounds=7):  # (more rounds: a wrong "never" is kept for good)
                    break
                amx = count
            kv = 1 - self._fastest([1, 0], lambda k: self.lib.frawd_set_forms(model, hint, narrow, rows, amx, k),
                                   32, fill=128, prefill=False)
            return [hint, narrow, rows, amx, kv]

        forms = paths.remembered("forms", self.source, self.weights, measure)
        if not (isinstance(forms, list) and len(forms) == 5 and all(f in (0, 1, 2) for f in forms[:3])
                and forms[3] in (0, *AMX_ROWS) and forms[4] in (0, 1)):
            forms = measure()  # (a file written by something else, or before AMX was timed)
        hint, narrow, rows, amx, kv = forms
        self.set_forms(hint, narrow, rows, amx if amx_rows is None else amx_rows, kv)
        amx = self.amx_rows
        if not amx and self._planes:  # AMX does not pay here: its copies of the weights go
            for layer in self._layers:
                for linear in (layer.qkv, layer.proj, layer.up, layer.down):
                    linear.wb = None
            self.model.head.wb = None
            self._planes.clear()
            self._plane_arena = None
        return (f"prefetch {PREFETCH_HINTS[hint]}" + (", fp16 8 at a time" if narrow else "")
                + f"; {PREFETCH_HINTS[rows]} in batches" + (f"; AMX from {amx} rows" if self.amx_rows else "")
                + ("" if kv else "; no cache prefetch"))

    def set_forms(self, hint: int, narrow: int, rows: int, amx_rows: int, kv_prefetch: int = 1) -> None:
        """Read the weights in these forms from now on (see `_choose_forms`; tests and
        benchmarks set them to compare). `amx_rows`: products of at least this many rows run on
        AMX (0: never); where the decoder has no AMX planes it is 0. `kv_prefetch`: decode
        steps ask for their next attention task's keys and values ahead."""
        if not isinstance(amx_rows, int) or amx_rows < 0:
            raise ValueError(f"amx_rows must be a row count >= 0 (0: never); got {amx_rows!r}")
        self.amx_rows = amx_rows if self._planes else 0
        self.forms = (hint, narrow, rows, self.amx_rows, kv_prefetch)
        self.lib.frawd_set_forms(ctypes.byref(self.model), hint, narrow, rows, self.amx_rows, kv_prefetch)

    def _fastest(self, options: list, apply, rows: int, fill: int = 8, rounds: int = 4, prefill: bool = True) -> int:
        """The index of the option (set by `apply`) whose decode steps of `rows` rows after
        `fill` cached tokens run fastest: options interleaved, the best of `rounds` - 1 rounds
        of 2 steps after a warm-up round; the first is kept unless another is 3% faster.
        `prefill=False`: the cached tokens are zeros, not computed (as much to read, no work)."""
        cfg = self.source.config
        fill = min(fill, cfg.context_length - 1)
        if fill < 1:
            apply(options[0])
            return 0
        dtype = torch.float16 if self.weights != "fp32" and has_fp16() else torch.float32
        cache = KVCache(cfg, rows, fill + 1, dtype=dtype)
        tokens = torch.zeros(rows, fill, dtype=torch.long)
        cache.begin(fill)
        if prefill:
            self.forward(tokens, torch.arange(fill).expand(rows, fill).contiguous(), cache)
        else:
            for t in (*cache.k, *cache.v):
                t.zero_()
        step, position = tokens[:, :1].contiguous(), torch.full((rows, 1), fill)
        best = [float("inf")] * len(options)
        for rnd in range(rounds):
            for i, option in enumerate(options):
                apply(option)
                start = time.perf_counter()
                for _ in range(2):
                    cache.length = fill
                    cache.begin(1)
                    self.forward(step, position, cache)
                if rnd:  # (round 0 warms up)
                    best[i] = min(best[i], time.perf_counter() - start)
        chosen = 0
        for i in range(1, len(options)):
            if best[i] < 0.97 * best[chosen]:
                chosen = i
        apply(options[chosen])
        return chosen

    def is_current(self, model: nn.Module) -> bool:
        """True while `model`'s tensors are the ones this decoder was built on, unmodified."""
        return model is self.source and _signature(model) == self._signature and self._probe.unchanged()

    def forward(
        self, tokens: Int[Tensor, "B T"], positions: Int[Tensor, "B T"], cache: Any, threads: int | None = None
    ) -> Float[Tensor, "B V"]:
        """Logits (B, V) of each row's last token, for tokens and positions (B, T) (int64)
        that `cache.begin(T)` has just announced: their keys and values go into the cache
        (at the slots `cache.row_starts(B, T)` names: one cursor for all rows, or one per row).

        T = 1 is a decode step, T > 1 a prefill. Each call returns a logits tensor of its
        own, so threads sharing the decoder never see each other's.
        """
        with self._lock:  # one scratch buffer, and ctypes lets other Python threads run meanwhile
            return self._forward(tokens, positions, cache, threads)

    def _forward(self, tokens: Tensor, positions: Tensor, cache: Any, threads: int | None) -> Tensor:
        B, T = tokens.shape
        threads = threads or torch.get_num_threads()
        if not (tokens.is_contiguous() and positions.is_contiguous()):
            tokens, positions = tokens.contiguous(), positions.contiguous()
        if tokens.dtype != torch.int64 or positions.dtype != torch.int64 or positions.shape != tokens.shape:
            raise TypeError("token ids and positions must be int64 tensors of the same shape (B, T)")
        if self._cache_k is not cache.k or self._cache_rows < B:
            self._point_at(cache, B)
        self._reserve(B * T, cache.max_len, threads)
        logits = torch.empty(B, self.vocab, dtype=torch.float32)
        starts = cache.row_starts(B, T)  # (B,) int64: the first slot each row writes
        status = self.lib.frawd_forward(
            ctypes.byref(self.model), B, T, tokens.data_ptr(), positions.data_ptr(), self._k_ptrs, self._v_ptrs,
            cache.max_len, starts.data_ptr(), cache.valid.data_ptr(), int(cache.padded),
            logits.data_ptr(), self._work.data_ptr(), threads, int(self._kv_half),
        )
        _check(status)
        return logits

    def _point_at(self, cache, B: int) -> None:
        """The cache's per-layer pointers, for a new cache. A cache may hold more rows than
        the forward uses (a continuous batch runs its first B)."""
        self._kv_half = kv_is_half(cache)
        for t in (*cache.k, *cache.v):
            if not t.is_contiguous() or t.shape[0] < B:
                raise ValueError(f"the KV cache must be contiguous, at least batch {B}")
        self._k_ptrs = (ctypes.c_void_p * len(cache.k))(*[k.data_ptr() for k in cache.k])
        self._v_ptrs = (ctypes.c_void_p * len(cache.v))(*[v.data_ptr() for v in cache.v])
        self._cache_k, self._cache_rows = cache.k, cache.k[0].shape[0]
        self._cache_v = cache.v  # keep the lists (and so the tensors) alive with the pointers

    def _reserve(self, N: int, max_len: int, threads: int) -> None:
        """Scratch memory for N tokens: kept while big enough (a continuous batch changes its
        row count every few steps; reallocating each time cost more than the step's Python)."""
        n = self.lib.frawd_workspace_floats(ctypes.byref(self.model), N, max_len, threads)
        if self._work is None or self._work.numel() < n:
            self._work = torch.empty(n, dtype=torch.float32)


def kv_is_half(cache: Any) -> bool:
    """True for an fp16 KV cache, False for fp32 (what the C forward reads); else ValueError."""
    dtypes = {t.dtype for t in (*cache.k, *cache.v)}
    if dtypes == {torch.float16} and has_fp16():
        return True
    if dtypes != {torch.float32}:
        raise ValueError(f"the native forward reads a float32 or (with F16C) float16 KV cache, not {dtypes}")
    return False


class RowStep:
    """Batch-1 decode steps of one generation, with nothing made per step.

    A step of a small model takes ~0.1 ms in C, so what Python does around it counts:
    `NativeDecoder.forward` checks its tensors, makes a logits tensor and a slot tensor
    and converts fifteen ctypes arguments every call (~20 us). Here the arguments live
    in one struct built once (cache pointers, scratch memory, a logits buffer); a step
    writes the token, position and slot into a small array the struct points to and
    makes one call. The logits returned are the same (1, V) buffer every step: read them
    before the next one.
    """

    def __init__(self, decoder: NativeDecoder, cache: Any) -> None:
        kv_half = kv_is_half(cache)
        for t in (*cache.k, *cache.v):
            if not t.is_contiguous() or t.shape[0] != 1 or t.device.type != "cpu":
                raise ValueError("a one-row step needs a contiguous CPU cache of one row")
        self.decoder, self.cache = decoder, cache
        self.ids = np.zeros(3, dtype=np.int64)  # token, position, cache slot
        self.logits = torch.empty(1, decoder.vocab, dtype=torch.float32)
        self.values = self.logits.numpy()  # the same memory, for numpy readers
        self._k = (ctypes.c_void_p * len(cache.k))(*[k.data_ptr() for k in cache.k])
        self._v = (ctypes.c_void_p * len(cache.v))(*[v.data_ptr() for v in cache.v])
        at = self.ids.ctypes.data
        self._args = _Args(1, 1, at, at + 8, ctypes.addressof(self._k), ctypes.addressof(self._v), cache.max_len,
                           at + 16, cache.valid.data_ptr(), 0, self.logits.data_ptr(), None, 0, int(kv_half))
        self._threads = 0  # the most threads the scratch memory holds
        self._call = decoder.lib.frawd_forward_args
        self._model_at, self._args_at = ctypes.addressof(decoder.model), ctypes.addressof(self._args)

    def __call__(self, token: int, position: int, slot: int, threads: int) -> Float[Tensor, "1 V"]:
        """Logits after feeding `token` at `position` into cache slot `slot` (0-based)."""
        if threads > self._threads:
            n = self.decoder.lib.frawd_workspace_floats(ctypes.byref(self.decoder.model), 1, self.cache.max_len, threads)
            self._work = torch.empty(n, dtype=torch.float32)
            self._args.work, self._threads = self._work.data_ptr(), threads
        ids, args = self.ids, self._args
        ids[0], ids[1], ids[2] = token, position, slot
        args.threads, args.padded = threads, self.cache.padded
        with self.decoder._lock:  # the engine's rule: one native call at a time
            status = self._call(self._model_at, self._args_at)
        _check(status)
        return self.logits


__all__ = ["NativeDecoder", "RowStep", "WEIGHT_DTYPES", "fits_fp16", "fp16_rounded_copy", "dequantized_copy", "has_fp16", "packed_tiles", "available", "unavailable_reason", "supports", "library"]

if __name__ == "__main__":  # `python -m frawdllm.infer.native`: build and say where it went
    print(build(LIBRARY.source) if available() else f"unavailable: {unavailable_reason()}", file=sys.stderr)
