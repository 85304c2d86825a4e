"""Loaders: windows are true slices shifted by one, seeded, exactly resumable, split by
rank, and the validation pass covers every non-overlapping window once."""

import re

import numpy as np
import pytest
import torch

from frawdllm.data import RandomWindowLoader, SequentialLoader, read_shard, write_shard
from frawdllm.errors import FrawdError

N = 1000


@pytest.fixture
def tokens() -> np.ndarray:
    return np.arange(N, dtype=np.uint32)  # token i == position i, so windows show where they start


def test_random_windows_are_contiguous_slices_with_targets_shifted_by_one(tokens):
    x, y = RandomWindowLoader(tokens, batch_size=8, context_length=16, seed=3).next_batch()
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    starts = x[:, 0]
    assert torch.equal(x, starts[:, None] + torch.arange(16))
    assert torch.equal(y, x + 1)


def test_random_windows_reach_every_start_including_the_last(tokens):
    small = tokens[:20]
    loader = RandomWindowLoader(small, batch_size=64, context_length=5, seed=0)
    starts = set()
    for _ in range(20):
        x, _ = loader.next_batch()
        starts.update(x[:, 0].tolist())
    assert starts == set(range(20 - 5))  # the last window ends exactly at the last token


def test_same_seed_same_batches_other_seed_other_batches(tokens):
    a = RandomWindowLoader(tokens, 4, 8, seed=1)
    b = RandomWindowLoader(tokens, 4, 8, seed=1)
    c = RandomWindowLoader(tokens, 4, 8, seed=2)
    batches_a = [a.next_batch()[0] for _ in range(3)]
    assert all(torch.equal(p, b.next_batch()[0]) for p in batches_a)
    assert not all(torch.equal(p, c.next_batch()[0]) for p in batches_a)
    assert not torch.equal(batches_a[0], batches_a[1])
    # seed and step draw together, not as their sum: seed 2's first batch is not seed 1's second
    assert not torch.equal(RandomWindowLoader(tokens, 4, 8, seed=2).next_batch()[0], batches_a[1])


def test_resume_from_state_dict_equals_an_uninterrupted_run(tokens):
    straight = RandomWindowLoader(tokens, 4, 8, seed=7)
    expected = [straight.next_batch() for _ in range(10)]
    first = RandomWindowLoader(tokens, 4, 8, seed=7)
    for _ in range(6):
        first.next_batch()
    state = first.state_dict()
    assert state == {"seed": 7, "step": 6}
    resumed = RandomWindowLoader(tokens, 4, 8, seed=0)
    resumed.load_state_dict(state)
    for x_exp, y_exp in expected[6:]:
        x, y = resumed.next_batch()
        assert torch.equal(x, x_exp) and torch.equal(y, y_exp)
    with pytest.raises(FrawdError, match="keys seed and step"):
        resumed.load_state_dict({"step": 1})
    # a state loaded in the middle of a step starts that step's micro-batches over
    accumulating = RandomWindowLoader(tokens, 2, 8, seed=7, grad_accum=2)
    start, first = accumulating.state_dict(), accumulating.next_batch()
    accumulating.load_state_dict(start)
    assert torch.equal(accumulating.next_batch()[0], first[0])


def test_ranks_together_see_the_single_process_global_batch(tokens):
    single = RandomWindowLoader(tokens, batch_size=6, context_length=8, seed=5)
    ranks = [RandomWindowLoader(tokens, batch_size=3, context_length=8, seed=5, rank=r, world_size=2)
             for r in range(2)]
    for _ in range(3):
        x_all, _ = single.next_batch()
        parts = [loader.next_batch()[0] for loader in ranks]
        assert torch.equal(torch.cat(parts), x_all)
    assert not torch.equal(parts[0], parts[1])


@pytest.mark.parametrize("world, accum, batch", [(1, 4, 2), (2, 2, 2), (4, 1, 2), (2, 1, 4)])
def test_a_step_trains_on_the_same_windows_whatever_the_ranks_and_accumulation(tokens, world, accum, batch):
    """Global batch 8: one process with 8 windows per step, or `world` ranks of `accum` micro-batches."""
    single = RandomWindowLoader(tokens, batch_size=8, context_length=8, seed=5)
    ranks = [RandomWindowLoader(tokens, batch_size=batch, context_length=8, seed=5, rank=r, world_size=world,
                                grad_accum=accum) for r in range(world)]
    for step in range(3):
        x_all, _ = single.next_batch()
        parts = [loader.next_batch()[0] for _ in range(accum) for loader in ranks]
        # (micro-batch m of rank r is slice m x world + r of the step's draw: in that order, the whole)
        assert torch.equal(torch.cat(parts), x_all)
    assert all(loader.state_dict() == {"seed": 5, "step": 3} for loader in ranks)


def test_batch_layout_keeps_the_global_batch():
    from frawdllm.train.distributed import batch_layout

    assert batch_layout(8, 1, 2) == (4, 1)  # smaller micro-batches
    assert batch_layout(8, 4, 2) == (8, 2)  # fewer accumulation steps first
    assert batch_layout(8, 4, 1) == (8, 4)
    with pytest.raises(FrawdError, match="multiple of 3"):
        batch_layout(8, 4, 3)
    assert batch_layout(None, 4, 2) == (None, 2)  # token batches (translation): whole batches per rank
    assert batch_layout(None, 4, 3) == (None, 4)  # or every batch dealt out, on any number of ranks


def test_sequential_pass_covers_non_overlapping_windows_in_order(tokens):
    loader = SequentialLoader(tokens, batch_size=4, context_length=64)
    xs, ys = zip(*loader)
    x, y = torch.cat(xs), torch.cat(ys)
    n_windows = (N - 1) // 64
    assert x.shape == (n_windows, 64) and len(loader) == len(xs) == -(-n_windows // 4)
    assert torch.equal(x[:, 0], torch.arange(n_windows) * 64)
    assert torch.equal(x, x[:, :1] + torch.arange(64)) and torch.equal(y, x + 1)
    assert xs[-1].shape[0] == n_windows - 4 * (len(xs) - 1)  # a short last batch, nothing dropped
    again = torch.cat([b[0] for b in loader])
    assert torch.equal(again, x)


def test_sequential_max_batches_and_rank_split(tokens):
    assert len(list(SequentialLoader(tokens, 2, 10, max_batches=3))) == 3
    whole = torch.cat([b[0] for b in SequentialLoader(tokens, 5, 10)])
    parts = [torch.cat([b[0] for b in SequentialLoader(tokens, 5, 10, rank=r, world_size=3)]) for r in range(3)]
    assert sorted(torch.cat(parts)[:, 0].tolist()) == whole[:, 0].tolist()
    assert torch.equal(parts[1], whole[1::3])


def test_loaders_read_a_memory_mapped_uint16_shard(tmp_path):
    write_shard(tmp_path / "s.bin", np.arange(300) % 250, vocab_size=250)
    shard = read_shard(tmp_path / "s.bin")
    assert isinstance(shard, np.memmap) and shard.dtype == np.uint16
    x, y = RandomWindowLoader(shard, 2, 10, seed=0).next_batch()
    assert x.dtype == torch.int64 and torch.equal(y[:, :-1], x[:, 1:])
    assert sum(b[0].shape[0] for b in SequentialLoader(shard, 8, 10)) == 29


def test_too_few_tokens_or_bad_rank_is_a_clear_error(tokens):
    with pytest.raises(FrawdError, match="only 10 tokens; a window of context_length 10 needs 11"):
        RandomWindowLoader(tokens[:10], 2, 10)
    with pytest.raises(FrawdError, match="only 5 tokens"):
        SequentialLoader(tokens[:5], 2, 8)
    with pytest.raises(FrawdError, match="rank 2 is outside world_size 2"):
        RandomWindowLoader(tokens, 2, 8, rank=2, world_size=2)


@pytest.mark.parametrize("bad, error", [
    (np.zeros(100, dtype=np.float32), "got a 1-D float32 array"),
    (np.zeros((10, 10), dtype=np.int64), "got a 2-D int64 array"),
], ids=["float", "2-D"])
def test_loaders_refuse_tokens_that_are_not_a_1d_integer_array(bad, error):
    refused = rf"^tokens must be a 1-D integer array \(read_shard, read_split\), {error}$"
    for loader in (RandomWindowLoader, SequentialLoader):
        with pytest.raises(FrawdError, match=refused):
            loader(bad, 2, 8)


def test_loader_sizes_and_state_must_be_integers(tokens):
    with pytest.raises(FrawdError, match="^batch_size must be an integer, got True$"):
        RandomWindowLoader(tokens, True, 8)
    for seed in (-1, True):  # (a float or a string: the tests' run-time type checks refuse them first)
        with pytest.raises(FrawdError, match=re.escape(f"seed must be an integer >= 0, got {seed!r}")):
            RandomWindowLoader(tokens, 2, 8, seed=seed)
    with pytest.raises(FrawdError, match="^max_batches must be a positive integer or None, got 0$"):
        SequentialLoader(tokens, 2, 8, max_batches=0)
    loader = RandomWindowLoader(tokens, 2, 8)
    with pytest.raises(FrawdError, match="seed and step must be integers >= 0, got {'seed': 'x', 'step': 1}"):
        loader.load_state_dict({"seed": "x", "step": 1})
    for bad in ({"seed": 0, "step": -1}, {"seed": -1, "step": 0}):
        with pytest.raises(FrawdError, match=f"seed and step must be integers >= 0, got {bad}"):
            loader.load_state_dict(bad)
    for bad in ({"seed": 1}, {"seed": 1, "step": 2, "epoch": 3}):
        with pytest.raises(FrawdError, match=re.escape(f"keys seed and step, got {bad}")):
            loader.load_state_dict(bad)
    assert loader.state_dict() == {"seed": 0, "step": 0}  # a refused state changes nothing


# ---- token ids outside the vocabulary -------------------------------------------------------------

def _shard_with_bad_id(path, n=400, vocab=100, position=123, bad=60000):
    """A uint16 shard of ids i % vocab, one of them (at `position`) patched to `bad`."""
    write_shard(path, np.arange(n) % vocab, vocab_size=vocab)
    raw = bytearray(path.read_bytes())
    raw[64 + 2 * position:64 + 2 * position + 2] = int(bad).to_bytes(2, "little")
    path.write_bytes(bytes(raw))
    return path


def test_an_id_outside_the_shards_vocabulary_is_one_line_naming_file_id_and_position(tmp_path):
    path = _shard_with_bad_id(tmp_path / "val.bin")
    expected = re.escape(f"{path}: token id 60000 at position 123 (byte 310) is outside the vocabulary [0, 100)")
    with pytest.raises(FrawdError, match=expected):  # validation and frawd eval
        list(SequentialLoader(read_shard(path), batch_size=4, context_length=16))
    loader = RandomWindowLoader(read_shard(path), batch_size=16, context_length=16, seed=0)
    with pytest.raises(FrawdError, match=expected):  # training: some batch reaches it
        for _ in range(200):
            loader.next_batch()


def test_an_id_outside_a_vocabulary_the_model_shares_with_the_shard_is_a_damaged_shard(tmp_path):
    """The model's vocabulary equals the shard's (as in pretraining and eval): the id is past
    the shard's own vocabulary, so the shard is damaged, not made with another tokenizer."""
    path = _shard_with_bad_id(tmp_path / "val.bin")
    with pytest.raises(FrawdError, match=r"is outside the vocabulary \[0, 100\); the shard is damaged"):
        list(SequentialLoader(read_shard(path), 4, 16, vocab_size=100))


def test_an_id_outside_the_vocabulary_in_a_later_shard_of_a_stream_names_that_shard(tmp_path):
    from frawdllm.data import ShardStream

    write_shard(tmp_path / "train-00000.bin", np.arange(300) % 100, vocab_size=100)
    second = _shard_with_bad_id(tmp_path / "train-00001.bin", n=200, position=7, bad=100)
    stream = ShardStream([read_shard(tmp_path / "train-00000.bin"), read_shard(second)])
    with pytest.raises(FrawdError, match=re.escape(f"{second}: token id 100 at position 7 (byte 78)")):
        list(SequentialLoader(stream, batch_size=8, context_length=10))


def test_the_loaders_vocab_size_bounds_ids_of_any_array(tokens, tmp_path):
    """A model's vocabulary, when the caller gives it, bounds the ids too (a plain array has no header)."""
    assert len(list(SequentialLoader(tokens, 8, 16, vocab_size=N))) > 0
    with pytest.raises(FrawdError, match=r"token id 500 at position 500 is outside the vocabulary \[0, 500\)"):
        list(SequentialLoader(tokens, 8, 16, vocab_size=500))
    negative = np.arange(N, dtype=np.int64)
    negative[300] = -1
    with pytest.raises(FrawdError, match=r"token id -1 at position 300 is outside the vocabulary \[0, 1000\)"):
        list(SequentialLoader(negative, 8, 16, vocab_size=N))
    path = tmp_path / "train.bin"
    write_shard(path, np.arange(400) % 100, vocab_size=100)  # fine for its own vocabulary, not a model's of 50
    with pytest.raises(FrawdError, match=re.escape(f"{path}: token id 50 at position 50 (byte 164) is outside the "
                                                   "model's vocabulary [0, 50); the shards were made with another")):
        list(SequentialLoader(read_shard(path), 8, 16, vocab_size=50))
    with pytest.raises(FrawdError, match="vocab_size must be a positive integer"):
        RandomWindowLoader(tokens, 8, 16, vocab_size=0)


def test_a_shard_the_system_will_not_map_is_one_line_naming_it(tmp_path, monkeypatch):
    """Past vm.max_map_count (a split of ~100k shards) numpy's memmap raised a bare
    "[Errno 12] Cannot allocate memory" naming no file."""
    import errno

    from frawdllm.data import shard_format
    from frawdllm.errors import FrawdError

    write_shard(tmp_path / "s.bin", np.arange(10, dtype=np.uint16), vocab_size=100)

    def refused(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(shard_format.np, "memmap", refused)
    with pytest.raises(FrawdError, match=re.escape(f"{tmp_path / 's.bin'}: cannot map the shard (Cannot allocate "
                                                   "memory; a process may map only so many files at once "
                                                   "(vm.max_map_count): prepare the data into fewer, larger "
                                                   "shards)")):
        read_shard(tmp_path / "s.bin")
