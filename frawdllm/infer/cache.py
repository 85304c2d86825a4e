"""KV cache: every layer's keys and values, preallocated once and written in place.

Generation runs the prompt through the model once (prefill), then one token per step
(decode). Without a cache each step would recompute keys and values for the whole
sequence; with it a step computes them for the new token only and attends over the
stored ones.

Storage: per layer, (B, n_kv_head, max_len, head_dim) for keys and for values (separate
tensors, so that a compiled step updates each in place without copying). A GQA model
stores only its n_kv_head heads. Keys are stored after RoPE, so a cached key keeps the
rotation of the position it was computed at.

Slots are shared by the batch: a forward of T tokens writes slots [length, length + T) of
every row. Prompts of different lengths are left-padded so they end at the same slot;
`valid` marks the slots that hold real tokens and the attention mask keeps the padding
out. Each row's absolute positions (what learned, sinusoidal and rotary encodings see)
are position = slot - padding of that row: `new_positions` gives them for the forward
`begin` announced (a model given no positions takes them from there).

Storage dtype: the model's, or fp16 (`Engine.kv_dtype`: where the native forward reads
fp16 weights): keys and values are rounded once as they are stored, and `update` returns
them in the dtype the model computes in (fp32, or autocast's).

Two ways to run a decode step:

- dynamic (eager): attend over the filled slots [0, length) only;
- static (for `torch.compile`): the slot to write is a tensor and attention always spans
  all max_len slots, future ones masked; every step has the same shapes, so one compiled
  graph serves the whole generation.
"""

from __future__ import annotations

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from ..config import ModelConfig
from ..errors import FrawdError

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """`torch.zeros(shape)`; on the CPU from numpy's calloc, whose pages the OS hands out
    already zeroed. torch.zeros fills in parallel: a cache of `tiny` is 12 such tensors, each
    an OpenMP region (~0.2 ms on a quiet 2-core machine; several ms when another process keeps
    a core busy and the pool's second thread must be woken) at every `generate` call."""
    if torch.device(device).type == "cpu" and dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.zeros(shape, dtype=_NUMPY_DTYPES[dtype]))
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    """Keys and values of a batch that starts together (module docstring): call `begin(n)`
    before each forward of n new tokens per row, then pass the cache to the model's forward
    as `kv_cache`; `reset` reuses it for the next batch."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        static: bool = False,
        storage: tuple[list[Tensor], list[Tensor]] | None = None,
    ) -> None:
        """storage: per-layer (batch_size, n_kv_head, max_len, head_dim) keys and values to
        write into (another cache's rows, `RowKVCache.row_view`); by default, new zeroed ones."""
        shape = (batch_size, config.n_kv_head, max_len, config.head_dim)
        if storage is not None:
            self.k, self.v = list(storage[0]), list(storage[1])
            dtype, device = self.k[0].dtype, self.k[0].device
        else:
            self.k = [zeroed(shape, dtype, device) for _ in range(config.n_layer)]
            self.v = [zeroed(shape, dtype, device) for _ in range(config.n_layer)]
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # slot holds a real token
        self.batch_size, self.max_len, self.static = batch_size, max_len, static
        self.length = 0  # slots written so far
        self.padded = False  # some row has padding slots
        self._start = 0  # first slot of the current forward
        self._announced = False  # begin() announced a forward that has not yet written (eager forwards)
        self._mask: Tensor | None = None
        self._slot = torch.zeros(1, dtype=torch.long, device=device)  # static mode: the slot being written
        self._static_mask = self.valid[:, None, None, :]  # (B, 1, 1, max_len), a view: follows `valid`
        self._valid_np = self.valid.numpy() if self.valid.device.type == "cpu" else None  # a view, for decode steps

    def reset(self) -> None:
        """Forget every token (storage is kept and overwritten)."""
        self.length, self.padded, self._mask, self._start, self._announced = 0, False, None, 0, False
        self.valid.zero_()

    @property
    def free(self) -> int:
        return self.max_len - self.length

    def begin(self, n_new: int, valid: Bool[Tensor, "B T"] | None = None) -> None:
        """Announce the next forward: n_new tokens per row go to slots [length, length + n_new).

        valid: which of the new tokens are real (False = left padding); default all real.
        """
        a, b = self.length, self.length + n_new
        if b > self.max_len:
            raise ValueError(f"KV cache full: {a} + {n_new} tokens > max_len {self.max_len}")
        if valid is None and self._valid_np is not None:
            self._valid_np[:, a:b] = True  # (through numpy: a fraction of a torch op's cost, paid every step)
        elif valid is None:
            self.valid[:, a:b] = True
        else:
            self.valid[:, a:b] = valid
            self.padded = self.padded or not bool(valid.all())
        self._start, self.length, self._announced = a, b, True
        if self.static and n_new == 1:
            self._slot.fill_(a)
            self._mask = self._static_mask
        elif n_new == 1:
            # One query per row: every filled slot is in its past; only padding is masked.
            self._mask = self.valid[:, None, None, :b] if self.padded else None
        elif a == 0 and not self.padded:
            self._mask = None  # plain causal attention over the prompt
        else:
            self._mask = self._prefill_mask(a, b)

    def _prefill_mask(self, a: int, b: int) -> Bool[Tensor, "B 1 T S"]:
        query_slot = torch.arange(a, b, device=self.valid.device)[:, None]  # (T, 1)
        key_slot = torch.arange(b, device=self.valid.device)[None, :]  # (1, S)
        causal = key_slot <= query_slot  # (T, S)
        # A padding query may look at its (padding) past too: no softmax row is empty, so
        # no NaN is born there; real queries never see padding.
        key_ok = self.valid[:, None, :b] | ~self.valid[:, a:b, None]  # (B, T, S)
        return (causal & key_ok).unsqueeze(1)

    def row_starts(self, rows: int, n_new: int) -> Int[Tensor, " B"]:
        """The first slot each row writes in the forward `begin(n_new)` announced (all the same here)."""
        return torch.full((rows,), self.length - n_new, dtype=torch.long)

    def new_positions(self, n_new: int) -> Int[Tensor, "B T"] | None:
        """Positions of the n_new tokens `begin` announced: the real tokens before each in its
        row (a left-padded row's first real token is at 0; padding gets 0); None when no such
        forward is announced (`update` then refuses it). For a forward given no positions."""
        if not self._announced or self.length - self._start != n_new:
            return None
        before = self.valid[:, :self.length].long().cumsum(1)[:, self._start:]  # (B, n_new), counts itself
        return (before - 1).clamp_(min=0)

    def update(
        self, layer_idx: int, k: Float[Tensor, "B H T hd"], v: Float[Tensor, "B H T hd"]
    ) -> tuple[Float[Tensor, "B H S hd"], Float[Tensor, "B H S hd"], Bool[Tensor, "B 1 T S"] | None]:
        """Store this forward's keys/values; return all to attend over (S slots) and the mask.
        `begin(T)` announces each forward: a forward it did not announce is refused (outside
        torch.compile, whose static-cache decode step is the engine's own)."""
        if layer_idx == 0 and not torch.compiler.is_compiling():
            # A forward's first write: announced? (else an overwrite of the last slot, or a shape error)
            if not self._announced or k.shape[2] != self.length - self._start:
                self._refuse_unannounced(k.shape[2])
            if k.shape[0] != self.batch_size:
                raise FrawdError(f"KVCache got a batch of {k.shape[0]} rows; it holds {self.batch_size}")
            self._announced = False
        if self.static and k.shape[2] == 1:
            self.k[layer_idx].index_copy_(2, self._slot, k.to(self.k[layer_idx].dtype))
            self.v[layer_idx].index_copy_(2, self._slot, v.to(self.v[layer_idx].dtype))
            k_all, v_all = self.k[layer_idx], self.v[layer_idx]
        else:
            a, b = self._start, self.length
            self.k[layer_idx][:, :, a:b] = k
            self.v[layer_idx][:, :, a:b] = v
            k_all, v_all = self.k[layer_idx][:, :, :b], self.v[layer_idx][:, :, :b]
        if k_all.dtype != k.dtype:  # under autocast the model computes in a lower precision
            k_all, v_all = k_all.to(k.dtype), v_all.to(k.dtype)
        return k_all, v_all, self._mask

    def _refuse_unannounced(self, n_new: int) -> None:
        tokens = f"{n_new} new token{'s' * (n_new != 1)}"
        told = f"{tokens} but begin() announced {self.length - self._start}" if self._announced \
            else f"a forward of {tokens} that no begin() announced"
        raise FrawdError(f"KVCache got {told}: call cache.begin(n) before each forward of n tokens")

    def select_rows(self, rows: Int[Tensor, " R"]) -> None:
        """Keep only the given batch rows (finished rows dropped), in that order."""
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]
        self.valid = self.valid[rows]
        self.batch_size = len(rows)
        self._static_mask = self.valid[:, None, None, :]
        self._valid_np = self.valid.numpy() if self.valid.device.type == "cpu" else None


class RowKVCache:
    """A KV cache whose rows each keep their own length: the cache of a continuous batch.

    `KVCache` shares one slot cursor between rows (prompts left-padded to end together),
    which suits a batch that starts together. Requests of a server arrive at any time:
    here row b holds its sequence in slots [0, lengths[b]) and a forward of one token per
    row writes slot lengths[b] of each row, so a row can join (`load`, its prompt
    prefilled elsewhere) or leave (`move` the last row into its place) between steps
    without touching the others. No slot is padding, so a row attends exactly the slots
    it would attend alone (`native.c` reads `row_starts`; PyTorch gets a mask).

    The first `rows` rows are the batch; the storage holds `capacity` rows of `max_len`
    slots, allocated once.
    """

    def __init__(self, config: ModelConfig, capacity: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (capacity, config.n_kv_head, max_len, config.head_dim)
        self.k = [zeroed(shape, dtype, device) for _ in range(config.n_layer)]
        self.v = [zeroed(shape, dtype, device) for _ in range(config.n_layer)]
        self.lengths = torch.zeros(capacity, dtype=torch.long)  # slots filled, per row
        self._lengths_np = self.lengths.numpy()  # the same memory
        self.valid = torch.zeros(capacity, max_len, dtype=torch.bool)  # never read (no row is padded); the C forward takes its pointer
        self.capacity, self.max_len, self.static, self.padded = capacity, max_len, False, False
        self.config = config
        # numpy views of the storage on the CPU: a row copy through torch (12 small strided
        # copies, each possibly an OpenMP region) took 60 us on a quiet machine and ~0.5 ms in
        # a busy serving loop, through numpy 18 us
        self._storage_np = [t.numpy() for t in (*self.k, *self.v)] if self.k[0].device.type == "cpu" \
            and dtype in _NUMPY_DTYPES else None
        self.rows = 0  # rows in the batch
        self._starts = self.lengths[:0]
        self._mask: Tensor | None = None
        self._span = 0  # slots a PyTorch forward attends over: the longest row
        self._announced = False  # begin() announced a forward that has not yet written (PyTorch path)

    def row_view(self, row: int) -> KVCache:
        """A one-row, empty `KVCache` over row `row`'s storage: a prefill through it writes
        the row in place (then `set_length`), with no cache of its own to copy from."""
        return KVCache(self.config, 1, self.max_len, storage=([k[row:row + 1] for k in self.k],
                                                             [v[row:row + 1] for v in self.v]))

    def set_length(self, row: int, length: int) -> None:
        """Row `row` holds `length` slots (written through `row_view`)."""
        self._lengths_np[row] = length

    def move(self, dst: int, src: int) -> None:
        """Row `dst` := row `src` (the batch stays dense when a row leaves; n samples of a
        prompt copy its prefilled row)."""
        n = int(self._lengths_np[src])
        for t in self._storage_np or (*self.k, *self.v):
            t[dst, :, :n] = t[src, :, :n]
        self._lengths_np[dst] = n

    def begin(self, n_new: int = 1) -> None:
        """Announce a forward of n_new tokens for each of the first `rows` rows (through numpy
        views: a decode step calls this once, and torch ops cost ~10 us each)."""
        lengths = self._lengths_np[: self.rows]
        if self.rows and int(lengths.max()) + n_new > self.max_len:
            raise ValueError(f"KV cache full: a row would pass max_len {self.max_len}")
        self._starts = self.lengths[: self.rows].clone()
        lengths += n_new
        self._span = int(lengths.max()) if self.rows else 0
        self._mask = None  # made when the PyTorch path asks (`update`); the native forward reads lengths
        self._announced = True

    def row_starts(self, rows: int, n_new: int) -> Int[Tensor, " B"]:
        return self._starts

    def new_positions(self, n_new: int) -> Int[Tensor, "B 1"] | None:
        """Positions of the tokens `begin` announced (a row's slot is its position); None when none is."""
        return self._starts[:, None] if self._announced and n_new == 1 else None

    def update(
        self, layer_idx: int, k: Float[Tensor, "B H 1 hd"], v: Float[Tensor, "B H 1 hd"]
    ) -> tuple[Float[Tensor, "B H S hd"], Float[Tensor, "B H S hd"], Bool[Tensor, "B 1 1 S"]]:
        """PyTorch path, one token per row: write each row's slot, attend over its own filled slots.
        `begin()` announces each forward: one it did not announce is refused (it would
        overwrite the last slots)."""
        if k.shape[2] != 1:
            raise ValueError("a RowKVCache takes one new token per row")
        if layer_idx == 0 and not torch.compiler.is_compiling():
            if not self._announced:
                raise FrawdError("RowKVCache got a forward that no begin() announced: call cache.begin() before "
                                 "each forward")
            self._announced = False
        index = torch.arange(self.rows, device=k.device)
        starts = self._starts.to(k.device)
        self.k[layer_idx][index, :, starts] = k[:, :, 0].to(self.k[layer_idx].dtype)
        self.v[layer_idx][index, :, starts] = v[:, :, 0].to(self.v[layer_idx].dtype)
        if self._mask is None:
            slots = torch.arange(self._span, device=self.k[0].device)
            lengths = self.lengths[: self.rows, None].to(slots.device)
            self._mask = (slots[None, :] < lengths)[:, None, None, :]  # (B, 1, 1, S)
        k_all = self.k[layer_idx][: self.rows, :, : self._span]
        v_all = self.v[layer_idx][: self.rows, :, : self._span]
        if k_all.dtype != k.dtype:
            k_all, v_all = k_all.to(k.dtype), v_all.to(k.dtype)
        return k_all, v_all, self._mask


class HalfKVModel(nn.Module):
    """`model` as computed with an fp16 KV cache: its full forward through a cache of that
    dtype, so that every key and value is rounded to fp16 before attention reads it (what
    an engine with `kv_dtype` fp16 computes). For tests and perplexity measurements;
    `forward(token_ids, targets)` returns what the model's does."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, token_ids: Int[Tensor, "B T"], targets: Int[Tensor, "B T"] | None = None
                ) -> tuple[Float[Tensor, "B T V"], Float[Tensor, ""] | None]:
        B, T = token_ids.shape
        cache = KVCache(self.config, B, T, dtype=torch.float16, device=token_ids.device)
        cache.begin(T)
        return self.model(token_ids, targets, kv_cache=cache)


__all__ = ["KVCache", "RowKVCache", "HalfKVModel"]
