"""Weight mapping between FrawdLLM and Hugging Face `transformers` (GPT-2 and Llama).

One FrawdLLM config is either GPT-2 shaped (learned positions, LayerNorm, GELU-tanh)
or Llama shaped (RoPE, RMSNorm, SwiGLU, GQA); the rest of the family (sinusoidal
positions, post-LN, sqrt(d) embedding scale, mixed choices) has no stock architecture.

The tensors are the same numbers under other names and layouts:

    ours                         GPT2LMHeadModel                 LlamaForCausalLM
    embed.tok / embed.pos        transformer.wte / wpe           model.embed_tokens / -
    blocks.i.norm1, norm2        transformer.h.i.ln_1, ln_2      model.layers.i.input_layernorm,
                                                                 post_attention_layernorm
    blocks.i.attn.qkv  (out,in)  attn.c_attn  (in,out: Conv1D)   self_attn.q_proj|k_proj|v_proj
    blocks.i.attn.proj           attn.c_proj  (transposed)       self_attn.o_proj
    blocks.i.mlp.up   [gate; up] mlp.c_fc     (transposed)       mlp.gate_proj|up_proj
    blocks.i.mlp.down            mlp.c_proj   (transposed)       mlp.down_proj
    norm / lm_head               transformer.ln_f / lm_head      model.norm / lm_head

Our RoPE already uses Llama's "rotate half" layout, so q and k need no permutation.
GPT-2 always has biases: a bias-free FrawdLLM exports zeros there (exactly equivalent).
`transformers` is imported lazily: it is an optional dependency (the `hf` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..config import ModelConfig
from ..errors import ConfigError, FrawdError
from ..modeldir import IMPORTABLE, plain_state

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"

# What each stock architecture fixes; every other ModelConfig field maps to a config value.
_NEEDS: dict[str, dict[str, Any]] = {
    GPT2: {"pos_encoding": "learned", "use_rmsnorm": False, "use_swiglu": False,
           "norm_placement": "pre", "scale_embeddings": False},
    LLAMA: {"pos_encoding": "rope", "use_rmsnorm": True, "use_swiglu": True,
            "norm_placement": "pre", "scale_embeddings": False},
}
_COMPUTES = {GPT2: "learned positions, LayerNorm, GELU MLP", LLAMA: "RoPE, RMSNorm, SwiGLU MLP"}
# GELU activations of transformers that are the tanh approximation we compute.
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# The token embedding's transformers name, per config.json model_type (and per architecture).
HF_EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}
_EMBEDDING = {GPT2: HF_EMBEDDING["gpt2"], LLAMA: HF_EMBEDDING["llama"]}
_IGNORED_HF_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
V = TypeVar("V")


def _mismatches(cfg: ModelConfig, arch: str) -> list[tuple[str, Any, Any]]:
    """(field, value it must have, value it has) for each field `arch` cannot express."""
    wrong = [(k, v, getattr(cfg, k)) for k, v in _NEEDS[arch].items() if getattr(cfg, k) != v]
    if arch == GPT2 and cfg.n_kv_head != cfg.n_head:
        wrong.append(("n_kv_head", cfg.n_head, cfg.n_kv_head))
    return wrong


def hf_architecture(cfg: ModelConfig) -> str:
    """The stock architecture that computes exactly what `cfg` computes, or a FrawdError that
    names, for each architecture (fewest changes first), the settings in its way and the
    `--set` flags that would make the config exportable."""
    wrong = {arch: _mismatches(cfg, arch) for arch in _NEEDS}
    for arch, fields in wrong.items():
        if not fields:
            return arch
    # Fewest changes first (ties: the architecture that keeps the position encoding).
    order = sorted(wrong, key=lambda a: (len(wrong[a]), _NEEDS[a]["pos_encoding"] != cfg.pos_encoding))
    options = []
    for arch in order:
        have = ", ".join(f"{k}={actual!r}" for k, _, actual in wrong[arch])
        sets = " ".join(f"--set {k}={str(need).lower()}" for k, need, _ in wrong[arch])
        options.append(f"{arch} ({_COMPUTES[arch]}) with {sets} (this model has {have})")
    raise FrawdError(
        "cannot export: no stock architecture computes this config; exportable (a config change needs "
        "retraining): " + "; or ".join(options)
    )


# ---- configs --------------------------------------------------------------------------------
def to_hf_config(cfg: ModelConfig):
    """A GPT2Config or LlamaConfig describing the same network as `cfg`."""
    from transformers import GPT2Config, LlamaConfig

    arch = hf_architecture(cfg)
    common = dict(vocab_size=cfg.vocab_size, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                  pad_token_id=cfg.pad_token_id, tie_word_embeddings=cfg.tie_embeddings,
                  architectures=[arch])
    if arch == GPT2:
        return GPT2Config(
            n_positions=cfg.context_length, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_inner=cfg.ffn_dim, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, **common,
        )
    return LlamaConfig(
        hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.context_length, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
        rope_theta=cfg.rope_theta, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        attention_dropout=cfg.dropout, **common,
    )


def first_id(*candidates: Any) -> int | None:
    """The first candidate that is a token id (of a list of ids: its first); None if none is."""
    for value in candidates:
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, int):
            return value
    return None


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise FrawdError(f"rope_type={kind!r} (RoPE scaling) is not supported; only plain RoPE imports")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def from_hf_config(hf_config: Any) -> ModelConfig:
    """The ModelConfig of a transformers GPT-2 or Llama config; anything we cannot compute
    exactly (another activation, RoPE scaling, ...) is a FrawdError naming it."""
    kind = getattr(hf_config, "model_type", None)
    tied = bool(getattr(hf_config, "tie_word_embeddings", True))
    if kind == "gpt2":
        checks = {
            "activation_function": hf_config.activation_function in _TANH_GELUS,
            "scale_attn_weights": hf_config.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": not hf_config.scale_attn_by_inverse_layer_idx,
            "add_cross_attention": not hf_config.add_cross_attention,
        }
        values = dict(
            vocab_size=hf_config.vocab_size, n_embd=hf_config.n_embd, n_layer=hf_config.n_layer,
            n_head=hf_config.n_head, context_length=hf_config.n_positions, pos_encoding="learned",
            use_rmsnorm=False, use_swiglu=False, bias=True, tie_embeddings=tied,
            mlp_hidden=hf_config.n_inner or 4 * hf_config.n_embd, norm_eps=hf_config.layer_norm_epsilon,
        )
    elif kind == "llama":
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        checks = {
            "hidden_act": hf_config.hidden_act == "silu",
            "head_dim": head_dim * hf_config.num_attention_heads == hf_config.hidden_size,
            "attention_bias/mlp_bias": bool(hf_config.attention_bias) == bool(getattr(hf_config, "mlp_bias", False)),
        }
        values = dict(
            vocab_size=hf_config.vocab_size, n_embd=hf_config.hidden_size, n_layer=hf_config.num_hidden_layers,
            n_head=hf_config.num_attention_heads,
            n_kv_head=hf_config.num_key_value_heads or hf_config.num_attention_heads,
            context_length=hf_config.max_position_embeddings, pos_encoding="rope", use_rmsnorm=True,
            use_swiglu=True, bias=bool(hf_config.attention_bias), tie_embeddings=tied,
            rope_theta=_rope_theta(hf_config), mlp_hidden=hf_config.intermediate_size,
            norm_eps=hf_config.rms_norm_eps,
        )
    else:
        raise FrawdError(f"model_type={kind!r} cannot be imported; supported: {', '.join(IMPORTABLE)}")
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        shown = ", ".join(f"{name}=" + "/".join(repr(getattr(hf_config, part, "?")) for part in name.split("/"))
                          for name in bad)  # (attention_bias/mlp_bias=True/False: both values)
        raise FrawdError(f"{kind} config with {shown} has no FrawdLLM equivalent")
    # A missing bos or pad id is the eos (GPT-2 has one id for all three), a missing eos the bos;
    # with neither we refuse: generation stops at the eos, and an id we picked would be an ordinary token.
    eos = first_id(hf_config.eos_token_id, hf_config.bos_token_id)
    if eos is None:
        raise FrawdError(f"{kind} config has no eos_token_id (null), and no tokenizer names an end-of-sequence "
                         "token: set eos_token_id in config.json")
    ids = dict(bos_token_id=first_id(hf_config.bos_token_id, eos), eos_token_id=eos,
               pad_token_id=first_id(hf_config.pad_token_id, eos))
    outside = {name: value for name in ("bos_token_id", "eos_token_id", "pad_token_id")
               if isinstance(value := getattr(hf_config, name, None), int)
               and not 0 <= value < values["vocab_size"]}
    if outside:  # (transformers' defaults for GPT-2, 50256, kept with a smaller vocabulary)
        shown = ", ".join(f"{name}={value}" for name, value in outside.items())
        raise FrawdError(f"{kind} config: {shown} outside the vocabulary (vocab_size={values['vocab_size']}); "
                         "set the special tokens' ids in config.json")
    try:
        cfg = ModelConfig(dropout=0.0, **values, **ids)
    except ConfigError as exc:
        raise FrawdError(f"{kind} config does not fit a FrawdLLM model: {exc}") from None
    default_width = cfg.replace(mlp_hidden=None)
    return default_width if default_width.ffn_dim == cfg.ffn_dim else cfg


# ---- tensors --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMap:
    """Our tensor `ours` is their tensors `theirs` (each transposed when `transpose`),
    concatenated along dim 0 in that order with `sizes` rows each."""

    ours: str
    theirs: tuple[str, ...]
    sizes: tuple[int, ...] = ()
    transpose: bool = False


def _gpt2_layout(cfg: ModelConfig) -> list[TensorMap]:
    maps = [TensorMap("embed.tok.weight", (_EMBEDDING[GPT2],)),
            TensorMap("embed.pos.weight", ("transformer.wpe.weight",))]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b, t in (("norm1", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
                        ("attn.proj", "attn.c_proj", True), ("norm2", "ln_2", False),
                        ("mlp.up", "mlp.c_fc", True), ("mlp.down", "mlp.c_proj", True)):
            maps.append(TensorMap(ours + a + ".weight", (theirs + b + ".weight",), transpose=t))
            maps.append(TensorMap(ours + a + ".bias", (theirs + b + ".bias",)))
    maps += [TensorMap("norm.weight", ("transformer.ln_f.weight",)),
             TensorMap("norm.bias", ("transformer.ln_f.bias",))]
    return maps


def _llama_layout(cfg: ModelConfig) -> list[TensorMap]:
    q, kv, h = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.ffn_dim
    params = ("weight", "bias") if cfg.bias else ("weight",)
    maps = [TensorMap("embed.tok.weight", (_EMBEDDING[LLAMA],))]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        maps += [TensorMap(ours + "norm1.weight", (theirs + "input_layernorm.weight",)),
                 TensorMap(ours + "norm2.weight", (theirs + "post_attention_layernorm.weight",))]
        for p in params:
            attn, mlp = theirs + "self_attn.", theirs + "mlp."
            maps += [
                TensorMap(f"{ours}attn.qkv.{p}", (f"{attn}q_proj.{p}", f"{attn}k_proj.{p}", f"{attn}v_proj.{p}"),
                          (q, kv, kv)),
                TensorMap(f"{ours}attn.proj.{p}", (f"{attn}o_proj.{p}",)),
                TensorMap(f"{ours}mlp.up.{p}", (f"{mlp}gate_proj.{p}", f"{mlp}up_proj.{p}"), (h, h)),
                TensorMap(f"{ours}mlp.down.{p}", (f"{mlp}down_proj.{p}",)),
            ]
    maps.append(TensorMap("norm.weight", ("model.norm.weight",)))
    return maps


def tensor_layout(cfg: ModelConfig) -> list[TensorMap]:
    """Every tensor of the exported model and where it comes from in ours."""
    maps = _gpt2_layout(cfg) if hf_architecture(cfg) == GPT2 else _llama_layout(cfg)
    if not cfg.tie_embeddings:
        maps.append(TensorMap("lm_head.weight", ("lm_head.weight",)))
    return maps


def _ours_or_zero_bias(state: dict[str, Tensor], key: str) -> Tensor:
    if key in state:
        return state[key]
    weight = state.get(key[: -len("bias")] + "weight")
    if key.endswith(".bias") and weight is not None:  # bias=False: GPT-2's bias is zero
        return torch.zeros(weight.shape[0], dtype=weight.dtype)
    raise KeyError(key)


def hf_parts(state: dict[str, Tensor], cfg: ModelConfig) -> Iterator[tuple[str, Tensor, bool]]:
    """(transformers name, our slice for it in nn.Linear (out, in) layout, whether
    transformers stores it transposed) for every tensor of the exported model."""
    for m in tensor_layout(cfg):
        tensor = _ours_or_zero_bias(state, m.ours)
        parts = tensor.split(list(m.sizes)) if m.sizes else (tensor,)
        for name, part in zip(m.theirs, parts):
            yield name, part, m.transpose


def to_hf_state_dict(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict as transformers names it (tied head omitted, as transformers saves it)."""
    return {name: (part.t() if transpose else part).contiguous() for name, part, transpose in hf_parts(state, cfg)}


def normalise_hf_names(state: dict[str, V], gpt2: bool) -> dict[str, V]:
    """Drop non-weight buffers; add the `transformer.` prefix that original GPT-2 files lack.
    (Values are tensors, or anything else kept under the same names: safetensors headers.)"""
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_HF_BUFFERS)}
    if gpt2 and _EMBEDDING[GPT2] not in state:
        state = {k if k.startswith("lm_head.") else "transformer." + k: v for k, v in state.items()}
    return state


def head_differs(state: dict[str, Tensor], cfg: ModelConfig) -> bool:
    """True when `cfg` ties the head but `state` (transformers names) holds an lm_head.weight
    that differs from the embedding: transformers then keeps that head, untied."""
    if not cfg.tie_embeddings:
        return False
    arch = hf_architecture(cfg)
    state = normalise_hf_names(state, arch == GPT2)
    head, embedding = state.get("lm_head.weight"), state.get(_EMBEDDING[arch])
    return head is not None and embedding is not None and not torch.equal(head, embedding)


def from_hf_state_dict(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A transformers state dict (GPT-2 or Llama, per `cfg`) as our state dict."""
    if head_differs(state, cfg):  # tying would silently drop the head (see `head_differs`)
        raise FrawdError("lm_head.weight differs from the token embedding, so the head cannot be tied; "
                         "convert with tie_embeddings=False")
    state = normalise_hf_names(state, hf_architecture(cfg) == GPT2)
    layout = tensor_layout(cfg)
    needed = {name for m in layout for name in m.theirs}
    # (a tied model saved with both names holds an lm_head.weight too)
    expected = needed | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing, unexpected = sorted(needed - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise FrawdError(
            f"checkpoint tensors do not match its config (missing: {', '.join(missing[:4]) or '-'}; "
            f"unexpected: {', '.join(unexpected[:4]) or '-'})"
        )
    integer = next((name for name in sorted(state) if not state[name].is_floating_point()), None)
    if integer is not None:  # (load_state_dict casts it: a float32 bias relabelled I32 read as 9.4e8)
        raise FrawdError(f"checkpoint tensor {integer} holds {str(state[integer].dtype).removeprefix('torch.')}, "
                         "not floating-point weights")
    out: dict[str, Tensor] = {}
    for m in layout:
        parts = [state[name].t() if m.transpose else state[name] for name in m.theirs]
        out[m.ours] = torch.cat(parts).contiguous() if len(parts) > 1 else parts[0].contiguous()
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.tok.weight"]
    return out


# ---- whole models ---------------------------------------------------------------------------
def to_hf_model(model: torch.nn.Module):
    """A transformers model computing the same function as our `model` (weights copied)."""
    from transformers import AutoModelForCausalLM

    cfg: ModelConfig = model.config
    hf_model = AutoModelForCausalLM.from_config(to_hf_config(cfg))
    state = to_hf_state_dict(plain_state(model, "cannot export to transformers"), cfg)
    result = hf_model.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if missing or result.unexpected_keys:
        raise RuntimeError(f"mapping bug: missing {sorted(missing)}, unexpected {result.unexpected_keys}")
    return hf_model.eval()


def from_hf_model(hf_model: torch.nn.Module):
    """Our FrawdLLM computing the same function as a transformers GPT-2 or Llama model."""
    from ..model import FrawdLLM

    cfg = from_hf_config(hf_model.config)
    state = hf_model.state_dict()
    if head_differs(state, cfg):
        cfg = cfg.replace(tie_embeddings=False)
    model = FrawdLLM(cfg)
    model.load_state_dict(from_hf_state_dict(state, cfg))
    return model.eval()


__all__ = [
    "GPT2", "LLAMA", "TensorMap", "hf_architecture", "to_hf_config", "from_hf_config",
    "tensor_layout", "hf_parts", "to_hf_state_dict", "head_differs", "from_hf_state_dict", "to_hf_model",
    "from_hf_model",
]
