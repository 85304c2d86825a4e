"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

    source ids (B, S) -> embeddings -> encoder: n_encoder_layer blocks of bidirectional
                         self-attention + MLP                       -> memory (B, S, D)
    target ids (B, T) -> embeddings -> decoder: n_layer blocks of causal self-attention,
                         cross-attention over the memory, MLP       -> logits (B, T, V)

The encoder reads the whole source at once; padding (`src_mask` False), after each
sentence's tokens (positions count from a row's first column), is masked out of every
attention, so a sentence's encoding does not depend on what it was batched with.
The decoder predicts target token t+1 from the target tokens <= t and the whole source.
Training feeds the shifted target ("teacher forcing"): input [BOS, y1 .. yn], labels
[y1 .. yn, EOS]. Generation (`infer/translate.py`) encodes the source once, projects the
memory to each layer's cross-attention keys/values once (`memory_kv`), and caches the
decoder's self-attention keys/values across steps.

The blocks, attention, MLP, norms and embeddings are the decoder-only model's
(`TransformerBlock(causal=False)` for the encoder, `TransformerBlock(cross=True)` for the
decoder). The paper's choices are `Seq2SeqConfig` settings, which the `aiayn-*` presets
choose: post-LN, sinusoidal positions, token embeddings x sqrt(d_model), ReLU, dropout on
every sub-layer output and on the embeddings (and, not in the paper, on the attention
weights), and one embedding matrix shared by source, target and the output projection (a
joint vocabulary). `Seq2SeqConfig`'s own defaults are pre-LN, learned positions and
unscaled embeddings; its ReLU and shared embedding are already the paper's.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from ..config import Seq2SeqConfig
from . import kernels
from .block import TransformerBlock
from .embeddings import Embeddings, rope_at
from .gpt import (check_ids, check_positions, check_targets, embed_ids, first_positions, init_weights,
                  model_config, register_rope, token_loss)
from .norm import make_norm
from .saving import ModelDirectoryMixin

MemoryKV = list[tuple[Tensor, Tensor]]  # per decoder layer: the memory's (k, v), (B, n_kv_head, S, hd) each


def check_src_mask(src: Tensor, src_mask: Any) -> None:
    """`src_mask` is None or a bool tensor of `src`'s shape, else one line naming it (a wrong
    shape or dtype failed inside the attention kernel). No value is read."""
    if src_mask is None:
        return
    if not isinstance(src_mask, Tensor) or src_mask.dtype != torch.bool or src_mask.shape != src.shape:
        what = f"a {src_mask.dtype} tensor of shape {tuple(src_mask.shape)}" if isinstance(src_mask, Tensor) \
            else type(src_mask).__name__
        raise ValueError(f"src_mask must be a bool tensor of src's shape {tuple(src.shape)}, got {what}")


def check_pair(src: Any, tgt: Any) -> None:
    """`src` and `tgt` are id tensors with a row each for the same sentences (a mismatch
    failed inside attention)."""
    check_ids("src", src)
    check_ids("tgt", tgt)
    if src.shape[0] != tgt.shape[0]:
        raise ValueError(f"src has {src.shape[0]} rows but tgt has {tgt.shape[0]}: each target row needs its "
                         "source row")


class Seq2SeqTransformer(ModelDirectoryMixin, nn.Module):
    """The encoder-decoder Transformer (module docstring). Train it teacher-forced with
    `logits, loss = model(src, tgt, targets, src_mask)`; translate with `encode`, then
    `decode` one step at a time (or `frawdllm.infer.translate`'s greedy and beam search)."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = cfg = model_config(config, Seq2SeqConfig, "Seq2SeqTransformer")

        def embeddings() -> Embeddings:
            return Embeddings(cfg.vocab_size, cfg.n_embd, cfg.context_length, cfg.pos_encoding,
                              cfg.scale_embeddings, cfg.dropout)

        self.embed = embeddings()  # the target's; the source's too when tied
        if not cfg.tie_embeddings:
            self.src_embed = embeddings()
        if cfg.pos_encoding == "rope":
            register_rope(self, cfg)
        self.encoder = nn.ModuleList(TransformerBlock(cfg, i, causal=False) for i in range(cfg.n_encoder_layer))
        self.encoder_norm = make_norm(cfg) if cfg.has_final_norm else nn.Identity()
        self.decoder = nn.ModuleList(TransformerBlock(cfg, i, cross=True) for i in range(cfg.n_layer))
        self.norm = make_norm(cfg) if cfg.has_final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for module in list(self.modules()):  # the same dropout, drawn faster on a CPU (kernels.py)
            for name, child in module.named_children():
                if type(child) is nn.Dropout:
                    setattr(module, name, kernels.Dropout(child.p))
        # Scaled by sqrt(D), embeddings drawn with std D^-1/2 enter the stream at unit scale
        # (learned position tables, an option, are drawn at the same std and not scaled). A
        # table tied to the output layer is that layer too, and is drawn as one (0.02): at
        # D^-1/2 the untrained model scores each input token far above the rest (validation
        # loss 13.7 at step 0 against ln V = 9.0), and the multi30k recipe ended worse at the
        # same step (docs/seq2seq.md). The residual projections' 1/sqrt(2 * n_layer) counts
        # the encoder's and decoder's layers together.
        embedding_std = cfg.n_embd ** -0.5 if cfg.scale_embeddings and not cfg.tie_embeddings else 0.02
        self.apply(lambda m: init_weights(m, cfg.n_encoder_layer + cfg.n_layer, embedding_std))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight

    @property
    def source_embed(self) -> Embeddings:
        return self.embed if self.config.tie_embeddings else self.src_embed

    def _rope(self, positions: Int[Tensor, "#B T"]
              ) -> tuple[Float[Tensor, "#B 1 T half"], Float[Tensor, "#B 1 T half"]] | None:
        return rope_at(self.rope_cos, self.rope_sin, positions) if self.config.pos_encoding == "rope" else None

    # ---- encoder -------------------------------------------------------------------------
    def encode(
        self, src: Int[Tensor, "B S"], src_mask: Bool[Tensor, "B S"] | None = None
    ) -> Float[Tensor, "B S D"]:
        """The memory: the encoder's output for each source token. src_mask: True = a real
        token; padding goes after a row's tokens (right padding: positions count from column 0)."""
        check_ids("src", src)
        check_src_mask(src, src_mask)
        positions = first_positions(src, self.config.context_length, "source")  # (1, S)
        x = embed_ids(self.source_embed, src, positions)  # (B, S, D)
        rope = self._rope(positions)
        if src_mask is None:
            src_mask = torch.ones_like(src, dtype=torch.bool)
        for block in self.encoder:
            x = block(x, rope, key_padding_mask=src_mask)
        return self.encoder_norm(x)

    def memory_kv(self, memory: Float[Tensor, "B S D"]) -> MemoryKV:
        """Every decoder layer's cross-attention keys and values: computed once per source."""
        return [block.memory_kv(memory) for block in self.decoder]

    # ---- decoder -------------------------------------------------------------------------
    def decode(
        self,
        tgt: Int[Tensor, "B T"],
        memory_kv: MemoryKV,
        src_mask: Bool[Tensor, "B S"] | None = None,
        positions: Int[Tensor, "#B T"] | None = None,
        kv_cache: Any = None,
    ) -> Float[Tensor, "B T V"]:
        """Logits for the next target token after each of `tgt`'s.

        positions: where the tokens sit; by default 0..T-1, or with a KV cache
        (`infer.cache.KVCache` of the decoder's n_layer layers) its `new_positions(T)`, as
        `FrawdLLM` takes them.
        """
        return self.lm_head(self.decoder_states(tgt, memory_kv, src_mask, positions, kv_cache))  # (B, T, V)

    def decoder_states(
        self,
        tgt: Int[Tensor, "B T"],
        memory_kv: MemoryKV,
        src_mask: Bool[Tensor, "B S"] | None = None,
        positions: Int[Tensor, "#B T"] | None = None,
        kv_cache: Any = None,
    ) -> Float[Tensor, "B T D"]:
        """The decoder's final normalised hidden states: `decode` without the output projection."""
        if positions is None and hasattr(kv_cache, "new_positions"):
            positions = kv_cache.new_positions(tgt.shape[1])  # (None when no forward is announced)
        if positions is None:
            positions = first_positions(tgt, self.config.context_length, "target")  # (1, T)
        else:
            check_positions(positions, tgt, self.config.context_length)
        x = embed_ids(self.embed, tgt, positions)  # (B, T, D)
        rope = self._rope(positions)
        for block, kv in zip(self.decoder, memory_kv):
            x = block(x, rope, kv_cache, memory_kv=kv, memory_mask=src_mask)
        return self.norm(x)

    def hidden_states(
        self, src: Int[Tensor, "B S"], tgt: Int[Tensor, "B T"], src_mask: Bool[Tensor, "B S"] | None = None
    ) -> Float[Tensor, "B T D"]:
        """Teacher forcing up to the output projection: what the fused training loss takes."""
        check_pair(src, tgt)
        return self.decoder_states(tgt, self.memory_kv(self.encode(src, src_mask)), src_mask)

    def forward(
        self,
        src: Int[Tensor, "B S"],
        tgt: Int[Tensor, "B T"],
        targets: Int[Tensor, "B T"] | None = None,
        src_mask: Bool[Tensor, "B S"] | None = None,
        label_smoothing: float = 0.0,
    ) -> tuple[Float[Tensor, "B T V"], Float[Tensor, ""] | None]:
        """Teacher-forced logits; with `targets`, the mean cross-entropy over the targets
        that are not IGNORE_INDEX (padding), label-smoothed if asked."""
        check_pair(src, tgt)
        if targets is not None:
            check_targets(targets, tgt, "tgt")
        memory = self.encode(src, src_mask)
        logits = self.decode(tgt, self.memory_kv(memory), src_mask)
        loss = None
        if targets is not None:
            loss = token_loss(logits, targets, label_smoothing)
        return logits, loss
