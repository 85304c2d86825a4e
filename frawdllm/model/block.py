"""A transformer block: attention then MLP, each wrapped in a residual connection.

pre-LN  (GPT-2, Llama):  x = x + attn(norm1(x));   x = x + mlp(norm2(x))
post-LN (the paper):     x = norm1(x + attn(x));   x = norm2(x + mlp(x))

Pre-LN keeps an unnormalised residual stream, whose gradients stay well scaled at
initialisation, so it trains stably with little or no warmup (Xiong et al., 2020, "On Layer
Normalization in the Transformer Architecture"); post-LN is the 2017 original.

The same block serves the three stacks: a decoder-only model's (causal self-attention),
an encoder's (`causal=False`: bidirectional, padding masked) and an encoder-decoder's
decoder (`cross=True`: a cross-attention sub-layer over the encoder output between
self-attention and MLP, with its own norm `norm_cross`).

Under torch.compile (training) the layers can share one compiled region, so warm-up costs
one block, not n_layer of them. torch 2.13's inductor miscompiles the backward of a region
that is called more than once when it reuses buffers (gradients off by thousands of times:
~3300-4000x measured), so the region is shared only while
`torch._inductor.config.allow_buffer_reuse` is off, as `frawdllm.train.compile.compile_step`
sets it; a plain `torch.compile(model)` inlines every layer (correct, a longer warm-up).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn

from ..config import ModelConfig
from .attention import CrossAttention, SelfAttention
from .mlp import MLP
from .norm import make_norm


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, causal: bool = True, cross: bool = False) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.norm1 = make_norm(cfg)
        self.attn = SelfAttention(cfg, layer_idx, causal)
        if cross:
            self.norm_cross = make_norm(cfg)
            self.cross = CrossAttention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def memory_kv(
        self, memory: Float[Tensor, "B S D"]
    ) -> tuple[Float[Tensor, "B Hkv S hd"], Float[Tensor, "B Hkv S hd"]]:
        """This (decoder) block's cross-attention keys and values of the encoder output. A
        method of the block, not of its `cross` child: FSDP shards per block and gathers a
        block's weights around the methods registered on it (`distributed.wrap`); and the
        tensors it returns are not views (FSDP warns that a view returned from a wrapped
        method may break backward)."""
        k, v = self.cross.memory_kv(memory)  # (views of one projection's output)
        return k.contiguous(), v.contiguous()

    def forward(
        self, x: Float[Tensor, "B T D"],
        rope: tuple[Float[Tensor, "#B 1 T half"], Float[Tensor, "#B 1 T half"]] | None = None, kv_cache: Any = None,
        key_padding_mask: Bool[Tensor, "B T"] | None = None,
        memory_kv: tuple[Float[Tensor, "B Hkv S hd"], Float[Tensor, "B Hkv S hd"]] | None = None,
        memory_mask: Bool[Tensor, "B S"] | None = None,
    ) -> Float[Tensor, "B T D"]:
        """key_padding_mask: an encoder's real tokens; memory_kv, memory_mask: the encoder
        output's keys/values for this block's cross-attention and its real tokens."""
        if memory_kv is not None or key_padding_mask is not None:
            return self.residual_stream(x, rope, kv_cache, key_padding_mask, memory_kv, memory_mask)
        if kv_cache is None and torch.compiler.is_compiling() and not _buffer_reuse():
            return _compiled_once(self, x, rope)
        return self.residual_stream(x, rope, kv_cache)

    def residual_stream(
        self, x: Float[Tensor, "B T D"],
        rope: tuple[Float[Tensor, "#B 1 T half"], Float[Tensor, "#B 1 T half"]] | None = None, kv_cache: Any = None,
        key_padding_mask: Bool[Tensor, "B T"] | None = None,
        memory_kv: tuple[Float[Tensor, "B Hkv S hd"], Float[Tensor, "B Hkv S hd"]] | None = None,
        memory_mask: Bool[Tensor, "B S"] | None = None,
    ) -> Float[Tensor, "B T D"]:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.norm1(x), rope, kv_cache, key_padding_mask))
            if memory_kv is not None:
                x = x + self.drop(self.cross(self.norm_cross(x), memory_kv, memory_mask))
            x = x + self.drop(self.mlp(self.norm2(x)))
        else:
            x = self.norm1(x + self.drop(self.attn(x, rope, kv_cache, key_padding_mask)))
            if memory_kv is not None:
                x = self.norm_cross(x + self.drop(self.cross(x, memory_kv, memory_mask)))
            x = self.norm2(x + self.drop(self.mlp(x)))
        return x


def _buffer_reuse() -> bool:
    # imported here, not at the top: importing inductor takes seconds, and only a compiling
    # caller (which has imported it already) asks
    import torch._inductor.config as inductor_config

    return inductor_config.allow_buffer_reuse


@torch.compiler.nested_compile_region
def _compiled_once(block: TransformerBlock, x: Float[Tensor, "B T D"],
                   rope: tuple[Float[Tensor, "#B 1 T half"], Float[Tensor, "#B 1 T half"]] | None
                   ) -> Float[Tensor, "B T D"]:
    """Under torch.compile, every layer runs this one traced region: the compiler works on
    a single block instead of n_layer copies (a faster warm-up, the same code)."""
    return block.residual_stream(x, rope)
