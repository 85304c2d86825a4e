"""The native decoder's weights on 2 MB pages: placed exactly, really on huge pages where
the kernel offers them, and the same logits as from ordinary memory."""

import mmap
import re
from pathlib import Path

import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.infer import KVCache, hugepages, native
from frawdllm.infer.hugepages import PAGE, Arena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages (always, madvise, never), or None."""
    try:
        found = re.search(r"\[(\w+)\]", THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_an_arena_places_aligned_copies_one_after_another():
    tensors = [torch.randn(700, 1000), torch.arange(10, dtype=torch.int8), torch.randn(3, 5).half()]
    sizes = [t.numel() * t.element_size() for t in tensors]
    arena = Arena(Arena.size_of(sizes))
    assert arena.huge == hasattr(hugepages.mmap, "MADV_HUGEPAGE")
    copies = [arena.place(t) for t in tensors]
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.data_ptr() % 64 == 0
    if arena.huge:
        assert arena.block.data_ptr() % PAGE == 0 and copies[0].data_ptr() == arena.block.data_ptr()
        assert copies[1].data_ptr() == copies[0].data_ptr() + -(-sizes[0] // 64) * 64  # the next cache line
        with pytest.raises(ValueError, match="the arena holds"):
            arena.place(torch.zeros(1))


def test_less_than_a_huge_page_is_ordinary_memory():
    arena = Arena(PAGE - 64)
    t = torch.randn(100)
    assert not arena.huge and arena.place(t) is t
    if hasattr(mmap, "MADV_HUGEPAGE"):  # one whole page is a huge page's worth
        assert Arena(PAGE).huge


@pytest.mark.skipif(not native.available(), reason="no native forward")
@pytest.mark.skipif(thp_mode() not in ("always", "madvise") or not Path("/proc/self/smaps").exists(),
                    reason=f"transparent huge pages are {thp_mode() or 'not readable here'}")
def test_the_decoders_weights_are_on_huge_pages():
    decoder = native.NativeDecoder(FrawdLLM(get_config("tiny")).eval(), "fp32")  # 27 MB of weights
    assert decoder.arena.huge and decoder.arena.used == decoder.weight_bytes
    assert huge_kb_at(decoder.arena.block.data_ptr()) >= 2048


@pytest.mark.skipif(not native.available(), reason="no native forward")
@pytest.mark.parametrize("weights", ["fp32", pytest.param("fp16", marks=pytest.mark.skipif(
    not native.has_fp16(), reason="no F16C"))])
def test_huge_pages_change_no_bit_of_the_logits(monkeypatch, weights):
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", n_layer=2)).eval()
    on_huge = native.NativeDecoder(model, weights)
    monkeypatch.setattr(hugepages, "huge_page_bytes", lambda nbytes: None)
    plain = native.NativeDecoder(model, weights)
    assert on_huge.arena.huge and not plain.arena.huge
    ids = torch.randint(7, model.config.vocab_size, (2, 9))
    logits = []
    for decoder in (on_huge, plain):
        cache = KVCache(model.config, 2, 10)
        cache.begin(9)
        first = decoder.forward(ids, torch.arange(9).expand(2, 9).contiguous(), cache, threads=2).clone()
        cache.begin(1)
        logits.append((first, decoder.forward(first.argmax(-1)[:, None], torch.full((2, 1), 9), cache, threads=2)))
    assert torch.equal(logits[0][0], logits[1][0]) and torch.equal(logits[0][1], logits[1][1])
