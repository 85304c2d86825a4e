"""Memory on 2 MB pages, for what every decode step streams: the native decoder's weights.

A batch-1 decode step reads every weight once. With the usual 4 KB pages the 14 MB of
`tiny` (fp16) span 3,300 pages and the 59 MB of `small` 14,000: more than the TLB holds,
so nearly every page costs a page-table walk on top of the stream it serves. Linux backs
anonymous memory with 2 MB pages where the program asks for them (`madvise(MADV_HUGEPAGE)`;
transparent huge pages in their default "madvise" mode). On a 2-core EPYC a batch-1 step
took 10-23% less time for `tiny` and 16-18% less for `small` with its weights on 2 MB
pages (the same bits: only where the memory sits changed).

`Arena(nbytes)` is one private anonymous mapping, 2 MB aligned and advised, that copies
are placed in one after another. Where that cannot be had (not Linux, less than one 2 MB
page, an `mmap` that fails) the copies are ordinary tensors and nothing else changes;
with transparent huge pages switched off the kernel uses 4 KB pages as before. (The KV
cache of a continuous batch was tried on 2 MB pages too: a 32-row step of `tiny` at 130
cached slots ran no faster, so it stays ordinary memory.)
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch
from torch import Tensor

PAGE = 2 << 20  # bytes in a huge page (x86-64 and the usual aarch64 kernels)
ALIGN = 64  # each tensor starts on a cache line


def huge_page_bytes(nbytes: int) -> Tensor | None:
    """`nbytes` zeroed bytes (uint8) on 2 MB pages, or None where they cannot be had.

    The mapping lives as long as any tensor viewing it (torch.frombuffer holds it)."""
    if nbytes < PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        region = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the faults then take 2 MB pages
    except (OSError, ValueError, AttributeError):
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # (anonymous memory reads as zeros)
    start = (-raw.data_ptr()) % PAGE
    return raw[start:start + nbytes]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Arena:
    """Copies of tensors placed one after another in one block of `nbytes` (2 MB pages
    where possible): `place(t)` returns the copy (or `t` itself where there is no block).
    Size it with `Arena.size_of`."""

    def __init__(self, nbytes: int) -> None:
        self.block = huge_page_bytes(nbytes)
        self.used, self.nbytes = 0, nbytes

    @staticmethod
    def size_of(nbytes: Sequence[int]) -> int:
        """The block size for tensors of these byte sizes."""
        return sum(_aligned(n) for n in nbytes)

    def place(self, t: Tensor) -> Tensor:
        t = t.contiguous()
        n = t.numel() * t.element_size()
        if self.block is None:
            return t
        if self.used + n > self.nbytes:
            raise ValueError(f"the arena holds {self.nbytes} bytes; {self.used} used, {n} more asked")
        copy = self.block[self.used:self.used + n].view(t.dtype).view(t.shape)
        copy.copy_(t)
        self.used += _aligned(n)
        return copy

    @property
    def huge(self) -> bool:
        """True when the block is a 2 MB-aligned mapping advised for huge pages."""
        return self.block is not None


__all__ = ["huge_page_bytes", "Arena", "PAGE"]
