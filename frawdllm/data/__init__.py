"""Data: corpus sources -> tokenized, memory-mapped shards -> batch loaders.

    from frawdllm.data import prepare_shards, read_split, RandomWindowLoader
    meta = prepare_shards("stdlib", "tok/tokenizer.json", "data/stdlib")
    loader = RandomWindowLoader(read_split("data/stdlib", "train"), batch_size=8, context_length=256)
    x, y = loader.next_batch()   # (8, 256) int64 each; y is x shifted by one token
"""

import importlib

from .shard_format import ShardStream, read_header, read_shard, write_shard
from .shards import META_FILE, TRAIN_FILE, VAL_FILE, prepare_shards, read_split, refuse_other_shards, split_files
from .sources import SourceStats, iter_documents

__all__ = ["iter_documents", "SourceStats", "prepare_shards", "refuse_other_shards", "read_shard", "read_header", "write_shard",
           "ShardStream", "read_split", "split_files",
           "RandomWindowLoader", "SequentialLoader", "TRAIN_FILE", "VAL_FILE", "META_FILE"]


def __getattr__(name: str):
    # The loaders make torch tensors: imported on first use, so that `frawd tokenizer train`
    # (which reads sources from here) starts without torch (~1 s).
    if name in ("RandomWindowLoader", "SequentialLoader"):
        return getattr(importlib.import_module(".loader", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
