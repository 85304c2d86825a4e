"""Inference: KV cache, sampling, the generation engine, int8 weight-only quantization.

    from frawdllm.infer import Engine, SamplingParams
    engine = Engine(model, tokenizer)
    print(engine.generate("Once upon a time", SamplingParams(temperature=0.8, max_new_tokens=100))[0].text)
"""

from .cache import KVCache
from .engine import Completion, Engine, StreamChunk
from .quantize import quantize_int8
from .sampling import SamplingParams, sample_next

__all__ = ["Engine", "SamplingParams", "Completion", "StreamChunk", "KVCache", "sample_next", "quantize_int8"]
