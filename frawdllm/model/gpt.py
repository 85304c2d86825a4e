"""FrawdLLM: a decoder-only transformer language model.

token ids (B, T) -> embeddings (B, T, D) -> n_layer blocks -> final norm (pre-LN) -> LM head
-> logits (B, T, V). Trained to predict token t+1 from tokens <= t with cross-entropy:
the caller passes targets already shifted (targets[:, t] = ids[:, t + 1]); targets equal
to -100 are ignored (padding, or any token a job does not train on).

Every architectural choice (positions, norm, MLP, GQA, pre/post-LN, tied head) comes from
`ModelConfig`; this one class serves GPT-2 style and Llama style models, for training
and, through an optional KV cache, for inference.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..config import ModelConfig, Seq2SeqConfig
from ..errors import ConfigError
from ..memory import check_model_fits
from .block import TransformerBlock
from .embeddings import Embeddings, rope_at, rope_tables
from .norm import make_norm
from .saving import ModelDirectoryMixin

IGNORE_INDEX = -100


def init_weights(module: nn.Module, n_layer: int, embedding_std: float = 0.02) -> None:
    """GPT-2 init: N(0, 0.02) (embeddings: N(0, embedding_std)); projections into the
    residual stream scaled by 1/sqrt(2 * n_layer) so the stream's variance does not grow
    with depth."""
    if isinstance(module, nn.Linear):
        std = 0.02
        if getattr(module, "is_residual_proj", False):
            std /= math.sqrt(2 * n_layer)
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=embedding_std)


# Models some eval_mode block has switched to eval: id -> (blocks inside, modules switched).
# Counted, so that threads generating with one model concurrently restore it once, at the end.
_EVAL_LOCK = threading.Lock()
_EVAL_HELD: dict[int, tuple[int, list[nn.Module]]] = {}


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode (no dropout) inside the block, every module's own mode back
    after the last block using it ends. Generation and decoding run under it, so a model
    left in train mode still decodes deterministically. A model in eval mode (the root's
    flag: what `.train()` and `.eval()` set) is used as it is, for one attribute read.
    Not for a model that another thread is training meanwhile."""
    if not model.training and id(model) not in _EVAL_HELD:
        yield model
        return
    with _EVAL_LOCK:
        depth, switched = _EVAL_HELD.get(id(model), (0, []))
        if depth == 0:
            switched = [m for m in model.modules() if m.training]
        _EVAL_HELD[id(model)] = (depth + 1, switched)  # (held before the flags change: see the fast path)
        for m in switched:  # the flag itself: train(False) would also reach children meant to stay as they are
            m.training = False
    try:
        yield model
    finally:
        with _EVAL_LOCK:
            depth, switched = _EVAL_HELD[id(model)]
            if depth == 1:
                for m in switched:
                    m.training = True
                del _EVAL_HELD[id(model)]
            else:
                _EVAL_HELD[id(model)] = (depth - 1, switched)


def model_config(config: Any, cls: type[ModelConfig], model: str) -> ModelConfig:
    """A validated copy of `config` for `model` (the caller's object may change later), or
    a one-line ConfigError when it is the other kind of model's config."""
    wanted_seq2seq = cls is Seq2SeqConfig
    if isinstance(config, Seq2SeqConfig) and not wanted_seq2seq:
        raise ConfigError(f"{model} is decoder-only but got a Seq2SeqConfig (an encoder-decoder model): "
                          "build a Seq2SeqTransformer from it")
    if not isinstance(config, cls):
        hint = ": build a FrawdLLM from it" if wanted_seq2seq and isinstance(config, ModelConfig) else ""
        raise ConfigError(f"{model} needs a {cls.__name__}, got a {type(config).__name__}{hint}")
    cfg = dataclasses.replace(config)
    check_model_fits(cfg, model)
    return cfg


def is_id_tensor(x: Any) -> bool:
    """A tensor of an integer dtype (token ids; bool is not one)."""
    return isinstance(x, Tensor) and not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)


def check_ids(name: str, ids: Any) -> None:
    """`ids` is a (B, T) integer tensor, else one line naming it (a 1-D tensor failed with
    `IndexError: tuple index out of range`, float ids inside the embedding). No value is
    read: that would wait for a GPU at every step."""
    if not is_id_tensor(ids) or ids.dim() != 2:
        what = f"a {ids.dim()}-D {ids.dtype} tensor" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be a (batch, time) integer tensor, got {what}")
    if ids.dtype not in (torch.int64, torch.int32):  # (PyTorch's embedding takes these two, and said so deep inside)
        raise ValueError(f"{name} must hold int64 or int32 ids, got a {ids.dtype} tensor: convert it with .long()")


def check_length(n: int, context_length: int, what: str) -> None:
    """A sequence of `n` tokens fits the context, else one line."""
    if n > context_length:
        raise ValueError(f"{what} length {n} exceeds the model's context_length {context_length}")


def first_positions(ids: Int[Tensor, "B T"], context_length: int, what: str) -> Int[Tensor, "1 T"]:
    """Positions 0..T-1 for a sequence of T tokens that starts the context (one line when it
    is longer than the context)."""
    check_length(ids.shape[1], context_length, what)
    return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # (1, T)


def register_rope(module: nn.Module, cfg: ModelConfig) -> None:
    """RoPE's cos/sin tables as buffers of `module` (not saved: made from the config)."""
    cos, sin = rope_tables(cfg.context_length, cfg.head_dim, cfg.rope_theta)
    module.register_buffer("rope_cos", cos, persistent=False)  # (C, hd/2)
    module.register_buffer("rope_sin", sin, persistent=False)


def check_positions(positions: Int[Tensor, "#B T"], ids: Tensor, context_length: int) -> None:
    """Positions given by the caller are a (1 or B, T) integer tensor for the (B, T) `ids`,
    in [0, context_length), else one line: a 1-D arange(T) rotated head h of every token by
    position h when T equalled the head count, and a (1, 1) one gave every token one
    position, silently; past the end a raw IndexError; a negative one read RoPE's tables from
    the end. Reads two values: skipped while compiling, where a data-dependent check would
    break the graph."""
    B, T = ids.shape
    if not is_id_tensor(positions) or positions.dim() != 2 or positions.shape[1] != T \
            or positions.shape[0] not in (1, B):
        what = (f"a {tuple(positions.shape)} {positions.dtype} tensor" if isinstance(positions, Tensor)
                else type(positions).__name__)
        raise ValueError(f"positions must be a (1 or batch {B}, time {T}) integer tensor, got {what}")
    if torch.compiler.is_compiling() or not positions.numel():
        return
    low, high = torch.stack(torch.aminmax(positions)).tolist()  # (one read: a GPU waits once)
    if high >= context_length:
        raise ValueError(f"position {high} is past the model's context_length {context_length}")
    if low < 0:
        raise ValueError(f"position {low} is negative")


def check_targets(targets: Any, ids: Tensor, ids_name: str = "token_ids") -> None:
    """`targets` is an integer tensor of the shape of the `ids` they follow (they are
    flattened for the loss: a (T, B) target ran silently against (B, T) ids)."""
    check_ids("targets", targets)
    if targets.shape != ids.shape:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match {ids_name} of shape "
                         f"{tuple(ids.shape)}")


def token_loss(logits: Float[Tensor, "B T V"], targets: Int[Tensor, "B T"],
               label_smoothing: float = 0.0) -> Float[Tensor, ""]:
    """Mean cross-entropy over the targets that are not IGNORE_INDEX, in fp32; 0 when every
    target is (F.cross_entropy's mean gives NaN there; the fused training loss, 0). A target
    outside the vocabulary is one line naming it (PyTorch's "IndexError: Target 64 is out
    of bounds" named neither targets nor the vocabulary; read only then, as token ids are)."""
    V = logits.size(-1)
    targets = targets.reshape(-1).long()
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)  # (no read: a GPU does not wait)
    try:
        return F.cross_entropy(logits.float().view(-1, V), targets, ignore_index=IGNORE_INDEX,
                               label_smoothing=label_smoothing, reduction="sum") / count
    except IndexError:
        bad = targets[((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= V)]
        if not bad.numel():
            raise
        raise ValueError(f"target id {int(bad[0])} is outside the model's vocabulary (vocab_size {V}; "
                         f"{IGNORE_INDEX} marks a target to ignore)") from None


def embed_ids(embed: Embeddings, ids: Int[Tensor, "B T"], positions: Int[Tensor, "#B T"]) -> Float[Tensor, "B T D"]:
    """`embed(ids, positions)`; an id outside the vocabulary is one line naming it (PyTorch
    says "IndexError: index out of range in self"). Ids are read only then (eager on the CPU:
    a GPU would wait; a GPU asserts on the device instead, and a compiled forward raises
    inductor's own error)."""
    try:
        return embed(ids, positions)
    except IndexError:
        vocab_size = embed.tok.num_embeddings
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if not bad.numel():
            raise
        raise ValueError(f"token id {int(bad[0])} is outside the model's vocabulary "
                         f"(vocab_size {vocab_size})") from None


class FrawdLLM(ModelDirectoryMixin, nn.Module):
    """The decoder-only language model (module docstring). Call it as
    `logits, loss = model(token_ids, targets)`: token_ids (B, T) -> logits (B, T, V);
    `loss` is the mean cross-entropy over the targets that are not -100 (IGNORE_INDEX), or
    None without targets. Save and load it with `save_pretrained` / `from_pretrained`;
    generate with `frawdllm.infer.Engine`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = cfg = model_config(config, ModelConfig, "FrawdLLM")
        self.embed = Embeddings(
            cfg.vocab_size, cfg.n_embd, cfg.context_length, cfg.pos_encoding, cfg.scale_embeddings, cfg.dropout
        )
        if cfg.pos_encoding == "rope":
            register_rope(self, cfg)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layer))
        self.norm = make_norm(cfg) if cfg.has_final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.n_layer)

    # ---- forward ------------------------------------------------------------------------
    def hidden_states(
        self,
        token_ids: Int[Tensor, "B T"],
        positions: Int[Tensor, "#B T"] | None = None,
        kv_cache: Any = None,
    ) -> Float[Tensor, "B T D"]:
        """The final normalised hidden states (before the LM head).

        positions: absolute position of each token (default 0..T-1, or, with a KV cache that
        has `new_positions(T)`, where its announced tokens sit; the engine passes them).
        kv_cache: anything with `update(layer, k, v)
        -> (k_all, v_all, mask)` (`attention.KVCacheLike`): the engine's caches
        (`infer/cache.py`), or packed SFT's `DocumentMask` (`align/packing.py`), which
        stores nothing and masks attention to each row's own documents.
        """
        check_ids("token_ids", token_ids)
        T = token_ids.shape[1]
        if positions is None and hasattr(kv_cache, "new_positions"):
            positions = kv_cache.new_positions(T)  # (None when no forward is announced: `update` says so)
        if positions is None:
            positions = first_positions(token_ids, self.config.context_length, "sequence")  # (1, T)
        else:
            check_positions(positions, token_ids, self.config.context_length)
        x = embed_ids(self.embed, token_ids, positions)  # (B, T, D)
        rope = rope_at(self.rope_cos, self.rope_sin, positions) if self.config.pos_encoding == "rope" else None
        for block in self.blocks:
            x = block(x, rope, kv_cache)
        return self.norm(x)

    def forward(
        self,
        token_ids: Int[Tensor, "B T"],
        targets: Int[Tensor, "B T"] | None = None,
        positions: Int[Tensor, "#B T"] | None = None,
        kv_cache: Any = None,
    ) -> tuple[Float[Tensor, "B T V"], Float[Tensor, ""] | None]:
        """Logits for the token after each of `token_ids`'s, and with `targets` (already
        shifted: targets[:, t] = token_ids[:, t + 1]) the mean cross-entropy over those that
        are not -100 (0 when every target is -100). `positions` and `kv_cache`: see
        `hidden_states`."""
        if targets is not None:
            check_targets(targets, token_ids)
        logits = self.lm_head(self.hidden_states(token_ids, positions, kv_cache))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = token_loss(logits, targets)
        return logits, loss
