"""Export of a `Seq2SeqTransformer` as Hugging Face `MarianMTModel` (transformers).

Marian is the 2017 encoder-decoder as `transformers` builds it: post-LN, sinusoidal
positions, embeddings x sqrt(d), one embedding matrix for source, target and output,
biases everywhere, LayerNorm with eps 1e-5. Configs with those settings map exactly (ReLU
or tanh-GELU MLPs, any sizes); anything else is refused, naming each option that does
not map (pre-LN, learned or rotary positions, embeddings not scaled by sqrt(d)
(scale_embeddings=False), RMSNorm, GQA, untied embeddings, no biases, another LayerNorm
eps). So configs/multi30k.yaml's models (norm_placement: pre) do not export.

The tensors are the same numbers under other names, with one twist: our sinusoidal table
interleaves sin and cos (PE[p, 2i] = sin, PE[p, 2i+1] = cos, as the paper writes it),
Marian's puts all sines first, then all cosines. That is a fixed permutation of the model
dimension; permuting every weight that reads or writes the residual stream the same way
(embeddings, LayerNorms, attention inputs and outputs, MLP input and output) gives a
model that computes the same logits.

    ours                            MarianMTModel
    embed.tok                       model.shared (= encoder/decoder embed_tokens, lm_head)
    encoder.i.attn.qkv [q; k; v]    model.encoder.layers.i.self_attn.q_proj | k_proj | v_proj
    encoder.i.attn.proj             ...self_attn.out_proj
    encoder.i.norm1, norm2          ...self_attn_layer_norm, final_layer_norm
    encoder.i.mlp.up, down          ...fc1, fc2
    decoder.i.attn, norm1           model.decoder.layers.i.self_attn, self_attn_layer_norm
    decoder.i.cross.q, kv [k; v]    ...encoder_attn.q_proj, k_proj | v_proj
    decoder.i.cross.proj, norm_cross  ...encoder_attn.out_proj, encoder_attn_layer_norm
"""

from __future__ import annotations

import torch
from jaxtyping import Int
from torch import Tensor

from ..config import Seq2SeqConfig
from ..errors import ConfigError
from ..infer.translate import never_after_bos
from ..modeldir import plain_state

MARIAN = "MarianMTModel"
_NEEDS = {"norm_placement": "post", "pos_encoding": "sinusoidal", "scale_embeddings": True, "use_rmsnorm": False,
          "tie_embeddings": True, "bias": True, "norm_eps": 1e-5}


def marian_mismatches(cfg: Seq2SeqConfig) -> list[str]:
    """The options of `cfg` that MarianMTModel cannot express, as 'field=ours (needs X)'."""
    out = [f"{k}={getattr(cfg, k)!r} (Marian needs {v!r})" for k, v in _NEEDS.items() if getattr(cfg, k) != v]
    if cfg.n_kv_head != cfg.n_head:
        out.append(f"n_kv_head={cfg.n_kv_head} (Marian has no grouped-query attention: needs n_kv_head={cfg.n_head})")
    return out


def to_marian_config(cfg: Seq2SeqConfig):
    """The MarianConfig of `cfg`; a ConfigError names each option Marian cannot express."""
    from transformers import MarianConfig

    bad = marian_mismatches(cfg)
    if bad:
        raise ConfigError(f"this model does not map to {MARIAN}: {'; '.join(bad)}")
    return MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.n_embd,
        encoder_layers=cfg.n_encoder_layer, decoder_layers=cfg.n_layer, encoder_attention_heads=cfg.n_head,
        decoder_attention_heads=cfg.n_head, encoder_ffn_dim=cfg.ffn_dim, decoder_ffn_dim=cfg.ffn_dim,
        activation_function="relu" if cfg.activation == "relu" else "gelu_new", dropout=cfg.dropout,
        attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=cfg.context_length,
        scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id, decoder_start_token_id=cfg.bos_token_id,
        forced_eos_token_id=cfg.eos_token_id, architectures=[MARIAN])


def sin_cos_permutation(dim: int) -> Int[Tensor, " dim"]:
    """Marian's model dimension j holds our dimension perm[j]: the sines (even) first, then the cosines."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


def to_marian_state_dict(state: dict[str, Tensor], cfg: Seq2SeqConfig) -> dict[str, Tensor]:
    """Our weights under MarianMTModel's names. Marian's sinusoidal table puts every sine
    before every cosine where ours interleaves them, so the model dimension is permuted
    (`sin_cos_permutation`) wherever the residual stream is read or written."""
    perm = sin_cos_permutation(cfg.n_embd)
    q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    out: dict[str, Tensor] = {}

    def reads(name: str, w: Tensor, b: Tensor | None) -> None:  # a linear layer reading the stream: w (out, D)
        out[f"{name}.weight"] = w[:, perm]
        if b is not None:
            out[f"{name}.bias"] = b

    def writes(name: str, w: Tensor, b: Tensor) -> None:  # a linear layer writing the stream: w (D, in)
        out[f"{name}.weight"], out[f"{name}.bias"] = w[perm], b[perm]

    def norm(name: str, ours: str) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = state[f"{ours}.weight"][perm], state[f"{ours}.bias"][perm]

    def block(side: str, i: int) -> None:
        ours, theirs = f"{side}.{i}", f"model.{side}.layers.{i}"
        w, b = state[f"{ours}.attn.qkv.weight"], state[f"{ours}.attn.qkv.bias"]
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            rows = slice(j * q_rows, (j + 1) * q_rows)
            reads(f"{theirs}.self_attn.{name}", w[rows], b[rows])
        writes(f"{theirs}.self_attn.out_proj", state[f"{ours}.attn.proj.weight"], state[f"{ours}.attn.proj.bias"])
        norm(f"{theirs}.self_attn_layer_norm", f"{ours}.norm1")
        reads(f"{theirs}.fc1", state[f"{ours}.mlp.up.weight"], state[f"{ours}.mlp.up.bias"])
        writes(f"{theirs}.fc2", state[f"{ours}.mlp.down.weight"], state[f"{ours}.mlp.down.bias"])
        norm(f"{theirs}.final_layer_norm", f"{ours}.norm2")
        if side == "decoder":
            reads(f"{theirs}.encoder_attn.q_proj", state[f"{ours}.cross.q.weight"], state[f"{ours}.cross.q.bias"])
            w, b = state[f"{ours}.cross.kv.weight"], state[f"{ours}.cross.kv.bias"]
            reads(f"{theirs}.encoder_attn.k_proj", w[:kv_rows], b[:kv_rows])
            reads(f"{theirs}.encoder_attn.v_proj", w[kv_rows:], b[kv_rows:])
            writes(f"{theirs}.encoder_attn.out_proj", state[f"{ours}.cross.proj.weight"],
                   state[f"{ours}.cross.proj.bias"])
            norm(f"{theirs}.encoder_attn_layer_norm", f"{ours}.norm_cross")

    embedding = state["embed.tok.weight"][:, perm]
    for name in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens", "lm_head"):
        out[f"{name}.weight"] = embedding
    out["final_logits_bias"] = torch.zeros(1, cfg.vocab_size, dtype=embedding.dtype)
    for i in range(cfg.n_encoder_layer):
        block("encoder", i)
    for i in range(cfg.n_layer):
        block("decoder", i)
    return {k: v.contiguous() for k, v in out.items()}


def to_marian_model(model: torch.nn.Module):
    """A `MarianMTModel` computing the same logits as `model` (eval mode)."""
    from transformers import MarianMTModel

    cfg = model.config
    hf = MarianMTModel(to_marian_config(cfg)).eval()
    state = to_marian_state_dict({k: v.detach() for k, v in plain_state(model, "cannot export to Marian").items()}, cfg)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    ignorable = {"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"}
    if set(missing) - ignorable or unexpected:
        raise RuntimeError(f"Marian weights do not line up: missing {missing}, unexpected {unexpected}")
    hf.generation_config.bad_words_ids = [[i] for i in never_after_bos(cfg)]  # as our decoding (generate() reads it)
    # Our decoding's cap: BOS and at most context_length - 1 tokens (else generate() stops at 20 in
    # all). Our other limit, source length + 50, has no generate() setting: pass max_new_tokens.
    hf.generation_config.max_length = cfg.context_length
    return hf
