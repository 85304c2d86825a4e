"""Model configuration: one dataclass describes every model in the family.

`ModelConfig` holds the original FrawdLLM fields (`vocab_size, n_embd, n_layer, n_head,
context_length, dropout, use_rope, use_rmsnorm, use_swiglu`, special token ids) plus the
choices a modern family needs (position encoding, embedding scale, pre/post-LN, GQA,
bias, tied head). It is validated once, at construction; the model code trusts it.

`num_parameters` is computed from the config alone and is exact: it equals
`sum(p.numel() for p in FrawdLLM(cfg).parameters())` (tied weights counted once).
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
import types
import typing
from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import ConfigError, short_repr

POS_ENCODINGS = ("learned", "sinusoidal", "rope", "none")
NORM_PLACEMENTS = ("pre", "post")


@dataclass
class ModelConfig:
    """Every architectural choice of the decoder-only model, checked when built (one
    `ConfigError` line naming the field). `get_config(preset, **overrides)` starts from a
    preset (`PRESETS`); `frawd info --preset NAME` prints a config's size and FLOPs."""

    vocab_size: int = 8192
    n_embd: int = 256
    n_layer: int = 6
    n_head: int = 8
    context_length: int = 256
    dropout: float = 0.0
    # Original boolean switches; `use_rope=True` is the same as `pos_encoding="rope"`.
    use_rope: bool = False
    use_rmsnorm: bool = False
    use_swiglu: bool = False
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_id: int = 3
    # Modern choices.
    pos_encoding: str | None = None  # learned | sinusoidal | rope | none (None: from use_rope)
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(n_embd), as in the paper
    norm_placement: str = "pre"  # pre | post
    n_kv_head: int | None = None  # None: = n_head (MHA); 1: MQA; between: GQA
    bias: bool = True  # biases in linear layers and LayerNorm
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    rope_theta: float = 10000.0
    mlp_hidden: int | None = None  # None: 4*n_embd (GELU) or 8/3*n_embd rounded up to 32 (SwiGLU)
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for f in fields(self):  # (numpy scalars, from a sweep over an array: plain Python numbers)
            setattr(self, f.name, plain_number(getattr(self, f.name)))
        check_types(type(self), {f.name: getattr(self, f.name) for f in fields(self)})
        if self.pos_encoding is None:
            self.pos_encoding = "rope" if self.use_rope else "learned"
        _check_choice("pos_encoding", self.pos_encoding, POS_ENCODINGS)
        if self.use_rope and self.pos_encoding != "rope":
            raise ConfigError(
                f"use_rope=True conflicts with pos_encoding={self.pos_encoding!r}; "
                "set pos_encoding='rope' or use_rope=False"
            )
        self.use_rope = self.pos_encoding == "rope"
        _check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "context_length", "n_kv_head", "mlp_hidden"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= MAX_DIM:
                raise ConfigError(f"{name} must be an integer in [1, {MAX_DIM}], got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if self.n_head % self.n_kv_head != 0:
            raise ConfigError(
                f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})"
            )
        if self.pos_encoding == "rope" and self.head_dim % 2 != 0:  # (RoPE rotates pairs within a head)
            raise ConfigError(
                f"n_embd ({self.n_embd}) / n_head ({self.n_head}), the head size {self.head_dim}, must be even "
                "for pos_encoding='rope'"
            )
        if self.pos_encoding == "sinusoidal" and self.n_embd % 2 != 0:
            raise ConfigError(f"n_embd ({self.n_embd}) must be even for sinusoidal positions")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name} ({value}) must be in [0, vocab_size={self.vocab_size})")

    # ---- derived sizes -------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.use_swiglu:
            # 8/3 * d keeps SwiGLU's three matrices at the parameter cost of GELU's two.
            return 32 * math.ceil(8 * self.n_embd / 3 / 32)
        return 4 * self.n_embd

    @property
    def has_final_norm(self) -> bool:
        # Post-LN blocks already end in a norm; pre-LN needs one before the head.
        return self.norm_placement == "pre"

    def _norm_params(self) -> int:
        return self.n_embd * (1 if self.use_rmsnorm or not self.bias else 2)

    @property
    def num_embedding_parameters(self) -> int:
        """Token embedding (+ learned positions); the tied head is counted here."""
        count = self.vocab_size * self.n_embd
        if self.pos_encoding == "learned":
            count += self.context_length * self.n_embd
        return count

    @property
    def num_parameters(self) -> int:
        """Exact number of unique parameters of `FrawdLLM(self)`."""
        d, hd, b = self.n_embd, self.head_dim, int(self.bias)
        qkv_out = (self.n_head + 2 * self.n_kv_head) * hd
        attn = d * qkv_out + b * qkv_out + d * d + b * d
        h = self.ffn_dim
        if self.use_swiglu:
            mlp = d * 2 * h + b * 2 * h + h * d + b * d
        else:
            mlp = d * h + b * h + h * d + b * d
        block = attn + mlp + 2 * self._norm_params()
        total = self.num_embedding_parameters + self.n_layer * block
        if self.has_final_norm:
            total += self._norm_params()
        if not self.tie_embeddings:
            total += self.vocab_size * d
        return total

    @property
    def num_non_embedding_parameters(self) -> int:
        return self.num_parameters - self.num_embedding_parameters

    def flops_per_token(self, seq_len: int | None = None, frozen: bool = False) -> int:
        """Training FLOPs per token (forward + backward): 6N + attention (PaLM appendix B).

        N counts every parameter but the embedding lookups, plus the LM head (which is the
        token embedding when tied): the matmul weights, and the norms' gains and biases too
        (~0.3% of `tiny`'s N), as nanoGPT's count does. `frozen`: the weights do not train
        (LoRA's base), so the backward computes no weight gradients: 4N.
        """
        seq_len = self.context_length if seq_len is None else seq_len
        matmul_params = self.num_non_embedding_parameters + self.vocab_size * self.n_embd
        if not self.tie_embeddings:
            matmul_params -= self.vocab_size * self.n_embd  # head already in non-embedding
        return (4 if frozen else 6) * matmul_params + 12 * self.n_layer * self.n_embd * seq_len

    # ---- (de)serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def settings(self) -> dict[str, Any]:
        """Every field as the model has it (`mlp_hidden`: the MLP's width, given or derived):
        two configs whose settings are equal build the same model."""
        return {**asdict(self), "mlp_hidden": self.ffn_dim}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return cls(**check_types(cls, check_fields(cls, data, "config field")))

    def replace(self, **overrides: Any) -> "ModelConfig":
        """A copy with fields changed, validated again."""
        data = self.to_dict()
        for key, value in overrides.items():
            if key not in data:
                raise ConfigError(f"unknown config field {key!r}; known: {', '.join(data)}")
            data[key] = value
        data.update(positions_override(overrides, self.pos_encoding))
        if "n_head" in overrides and "n_kv_head" not in overrides and self.n_kv_head == self.n_head:
            data["n_kv_head"] = None
        return type(self).from_dict(data)


def positions_override(layer: dict[str, Any], before: str | None = None) -> dict[str, Any]:
    """What a mapping of overrides that sets only one of `use_rope` and `pos_encoding` implies
    for the other (the two say the same thing), given the `pos_encoding` in force before it
    (None: not known here, the preset's): a later `pos_encoding=learned` replaces an earlier
    `use_rope=true` instead of conflicting with it, and the other way round; `use_rope=false`
    undoes only RoPE (sinusoidal or no positions stay), `pos_encoding=null` leaves `use_rope` be."""
    if "use_rope" in layer and "pos_encoding" not in layer:
        # (None: from use_rope, so RoPE, or learned positions where RoPE is undone)
        return {"pos_encoding": None} if layer["use_rope"] or before == "rope" else {}
    if layer.get("pos_encoding") is not None and "use_rope" not in layer:
        return {"use_rope": layer["pos_encoding"] == "rope"}
    return {}


# Largest size of any one dimension: tensor indices and kernels use 32-bit sizes.
MAX_DIM = 2**31 - 1


def _type_name(hint: Any) -> str:
    options = typing.get_args(hint) or (hint,)
    if float in options:  # ("a number" takes integers too)
        options = tuple(o for o in options if o is not int)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             type(None): "null"}
    return " or ".join(names.get(o, str(o)) for o in options)


def is_integer(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool (which Python counts as one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def plain_number(value: Any) -> Any:
    """`np.int64(5)` -> 5, `np.float32(0.5)` -> 0.5, `np.True_` -> True; the rest as given."""
    numpy = sys.modules.get("numpy")  # (not imported: no numpy scalar exists, and none is imported here)
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def is_number(value: Any) -> bool:
    """An int or float, not a bool, not NaN (not a number anyone means)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _fits(value: Any, kind: Any) -> bool:
    if typing.get_origin(kind) is not None:
        return True
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:  # an int is a fine float
        return is_number(value)
    return isinstance(value, kind)


def check_types(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """`values` unchanged if each holds the declared type of its field of dataclass `cls`,
    else a ConfigError: `"no"` is not a bool, 0.5 not an int, "1" not a number, NaN not a
    number. Generic hints (`Sequence[str]`) are left to the class's own checks."""
    hints = _type_hints(cls)
    for name, value in values.items():
        if name not in hints:
            continue
        options = typing.get_args(hints[name]) if _is_union(hints[name]) else (hints[name],)
        if not any(_fits(value, o) for o in options):
            wanted = "a number, not NaN" if value != value else _type_name(hints[name])
            raise ConfigError(f"{name} must be {wanted}, got {short_repr(value)}")
    return values


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, resolved once per class (it evaluates every annotation:
    ~0.1 ms, which a server would pay for every request's SamplingParams)."""
    return typing.get_type_hints(cls)


def _is_union(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def check_fields(cls: type, data: dict[str, Any], what: str) -> dict[str, Any]:
    """`data` unchanged if every key is a field of dataclass `cls`, else a ConfigError."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {what}(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return data


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


_GPT2 = dict(use_rmsnorm=False, use_swiglu=False, bias=True, tie_embeddings=True)
_LLAMA = dict(use_rope=True, use_rmsnorm=True, use_swiglu=True, bias=False, tie_embeddings=True)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=8192, n_embd=256, n_layer=6, n_head=8, context_length=256, **_GPT2),
    "small": dict(vocab_size=8192, n_embd=512, n_layer=8, n_head=8, context_length=512, **_GPT2),
    "base": dict(vocab_size=8192, n_embd=768, n_layer=12, n_head=12, context_length=1024, **_GPT2),
    "100m": dict(
        vocab_size=32000, n_embd=768, n_layer=12, n_head=12, context_length=1024,
        **{**_GPT2, "use_rope": True},
    ),
    "tiny-llama": dict(
        vocab_size=8192, n_embd=256, n_layer=6, n_head=8, n_kv_head=4, context_length=256, **_LLAMA
    ),
    "small-llama": dict(
        vocab_size=8192, n_embd=512, n_layer=8, n_head=8, n_kv_head=4, context_length=512, **_LLAMA
    ),
}


@dataclass
class Seq2SeqConfig(ModelConfig):
    """An encoder-decoder model (`Seq2SeqTransformer`): every ModelConfig field means the
    same (n_layer counts the decoder's layers), plus the encoder's depth and the MLP's
    activation. One vocabulary serves source and target; `tie_embeddings` shares one
    embedding between them and the output projection, as the paper does."""

    n_encoder_layer: int = 6
    activation: str = "relu"  # relu (the paper) | gelu

    model_type = "seq2seq"  # written to config.json (a class attribute, not a field)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.n_encoder_layer <= MAX_DIM:
            raise ConfigError(f"n_encoder_layer must be an integer in [1, {MAX_DIM}], got {self.n_encoder_layer!r}")
        _check_choice("activation", self.activation, ("relu", "gelu"))
        if self.use_swiglu:
            raise ConfigError("use_swiglu is not available in a seq2seq model; choose activation relu or gelu")

    def _attn_params(self) -> int:
        d, hd, b = self.n_embd, self.head_dim, int(self.bias)
        qkv_out = (self.n_head + 2 * self.n_kv_head) * hd  # self-attention's fused q, k, v; cross-attention
        return d * qkv_out + b * qkv_out + d * d + b * d   # splits them as q and kv: the same count

    @property
    def num_embedding_parameters(self) -> int:
        """Token embeddings (+ learned positions): one table if tied, source and target if not."""
        one = self.vocab_size * self.n_embd + (self.context_length * self.n_embd if self.pos_encoding == "learned" else 0)
        return one if self.tie_embeddings else 2 * one

    @property
    def num_parameters(self) -> int:
        """Exact number of unique parameters of `Seq2SeqTransformer(self)`."""
        d, h, b = self.n_embd, self.ffn_dim, int(self.bias)
        attn, mlp, norm = self._attn_params(), d * h + b * h + h * d + b * d, self._norm_params()
        encoder = self.n_encoder_layer * (attn + mlp + 2 * norm)
        decoder = self.n_layer * (2 * attn + mlp + 3 * norm)
        total = self.num_embedding_parameters + encoder + decoder
        if self.has_final_norm:
            total += 2 * norm  # pre-LN: the encoder's and the decoder's final norms
        if not self.tie_embeddings:
            total += self.vocab_size * d
        return total

    def flops_per_token(self, seq_len: int | None = None, frozen: bool = False) -> int:
        """Training FLOPs per target token, source and target of `seq_len` tokens:
        6N for the parameters but the embedding lookups (the output projection included;
        norms and biases counted as matmul weights) + the attention scores (encoder self, decoder self and cross).
        `frozen`: the weights do not train (LoRA's base): 4N, no weight gradients."""
        seq_len = self.context_length if seq_len is None else seq_len
        matmul_params = self.num_parameters - self.num_embedding_parameters + self.vocab_size * self.n_embd
        if not self.tie_embeddings:
            matmul_params -= self.vocab_size * self.n_embd
        attention = 12 * (self.n_encoder_layer + 2 * self.n_layer) * self.n_embd * seq_len
        return (4 if frozen else 6) * matmul_params + attention

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Seq2SeqConfig":
        data = dict(data)
        if data.pop("model_type", cls.model_type) != cls.model_type:
            raise ConfigError(f"model_type must be {cls.model_type!r}")
        return cls(**check_types(cls, check_fields(cls, data, "config field")))


# The paper's settings: post-LN, sinusoidal positions, embeddings x sqrt(d), ReLU, dropout 0.1,
# one vocabulary and one embedding for source, target and output.
_AIAYN = dict(pos_encoding="sinusoidal", scale_embeddings=True, norm_placement="post", bias=True,
              tie_embeddings=True, activation="relu")

SEQ2SEQ_PRESETS: dict[str, dict[str, Any]] = {
    "aiayn-base": dict(vocab_size=37000, n_embd=512, n_layer=6, n_encoder_layer=6, n_head=8, mlp_hidden=2048,
                       dropout=0.1, context_length=1024, **_AIAYN),
    "aiayn-big": dict(vocab_size=37000, n_embd=1024, n_layer=6, n_encoder_layer=6, n_head=16, mlp_hidden=4096,
                      dropout=0.3, context_length=1024, **_AIAYN),
    # trains on 2 CPU cores: Multi30k-sized data in under an hour
    "aiayn-tiny": dict(vocab_size=8000, n_embd=256, n_layer=3, n_encoder_layer=3, n_head=4, mlp_hidden=1024,
                       dropout=0.1, context_length=256, **_AIAYN),
}


def config_class(preset: str) -> type[ModelConfig]:
    """The config dataclass of a preset: Seq2SeqConfig for the encoder-decoder ones."""
    return Seq2SeqConfig if preset in SEQ2SEQ_PRESETS else ModelConfig


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """A preset by name, with fields overridden: `get_config("tiny", n_layer=2)`;
    an encoder-decoder preset (aiayn-*) gives a `Seq2SeqConfig`."""
    presets = {**PRESETS, **SEQ2SEQ_PRESETS}
    if name not in presets:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(presets)}")
    data = dict(presets[name])
    cls = config_class(name)
    known = {f.name for f in fields(cls)}
    for key in overrides:
        if key not in known:
            raise ConfigError(f"unknown config field {key!r}; known: {', '.join(sorted(known))}")
    kv, heads = data.get("n_kv_head"), overrides.get("n_head")
    if kv and "n_kv_head" not in overrides and is_integer(heads) and heads > 0 and heads % kv:
        raise ConfigError(f"n_head ({heads}) must be divisible by n_kv_head ({kv}, the {name} preset's): set "
                          f"n_kv_head as well (a divisor of {heads}; null = n_head, no grouping)")
    before = data.get("pos_encoding")
    data.update(overrides)
    data.update(positions_override(overrides, before))
    return cls.from_dict(data)


NONE_IS_A_VALUE = {"pos_encoding"}  # fields where the word "none" is a choice, not "unset"


def parse_value(cls: type, name: str, text: str) -> Any:
    """Parse `text` as the declared type of dataclass field `name` (for `--set k=v` flags)."""
    hints = typing.get_type_hints(cls)
    if name not in hints:
        known = ", ".join(f.name for f in fields(cls))
        raise ConfigError(f"unknown field {name!r}; known: {known}")
    hint = hints[name]
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    if name in NONE_IS_A_VALUE and text.lower() == "none":
        return "none"  # pos_encoding=none: no positions (pos_encoding=null: from use_rope)
    if type(None) in options and text.lower() in ("none", "null", ""):
        return None
    for option in options:
        if option is type(None):
            continue
        try:
            if option is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(text)
            return option(text)
        except ValueError:
            continue
    raise ConfigError(f"{name}: cannot parse {text!r} as {_type_name(hint)}")


def parse_overrides(cls: type, pairs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Turn `["n_layer=2", "use_rope=true"]` into typed overrides for dataclass `cls`."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"expected field=value, got {pair!r}")
        key, text = pair.split("=", 1)
        out[key.strip()] = parse_value(cls, key.strip(), text.strip())
    return out


def typed_overrides(cls: type, overrides: dict[str, Any]) -> dict[str, Any]:
    """A config file's `model:` mapping with its text values parsed as `cls`'s field types
    (YAML gives `n_layer: 2` as an int, a --set or an older file may give "2"). An unknown
    field is left for `get_config` to name, as it names one given any other way."""
    known = {f.name for f in fields(cls)}
    return {k: parse_value(cls, k, v) if isinstance(v, str) and k in known and k not in NONE_IS_A_VALUE else v
            for k, v in overrides.items()}  # (a file's `pos_encoding: None`, Python's null, is refused: not "none")


__all__ = ["ModelConfig", "Seq2SeqConfig", "PRESETS", "SEQ2SEQ_PRESETS", "config_class", "get_config", "parse_overrides",
           "parse_value", "typed_overrides"]
