"""Data: corpus sources -> tokenized, memory-mapped shards -> batch loaders.

    from frawdllm.data import iter_documents, prepare_shards, read_shard, RandomWindowLoader
"""

from .loader import RandomWindowLoader, SequentialLoader
from .shard_format import read_header, read_shard, write_shard

__all__ = ["read_shard", "read_header", "write_shard", "RandomWindowLoader", "SequentialLoader"]
