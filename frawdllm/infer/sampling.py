"""Sampling: turn the model's next-token logits into the next token.

One function, `sample_next`, serves every caller (the engine, `frawd generate`, `frawd
chat`, the server's scheduler), so a setting means the same thing everywhere; plain greedy
rows take its argmax rule straight from the logits (`greedy_choice`, `greedy_index`). Applied in order:

    repetition penalty  a logit of a token already in the sequence is divided by the
                        penalty when positive, multiplied by it when negative (CTRL)
    temperature         logits / T; T = 0 means greedy (argmax, every filter skipped)
    top-k               keep the k highest logits (ties with the k-th are kept)
    top-p (nucleus)     keep the smallest set of most likely tokens whose probability
                        reaches p (the token that crosses p is kept)
    min-p               keep tokens whose probability is at least min_p x the top one

Each filter sees the survivors of the previous one (top-p renormalises after top-k), the
same order as Hugging Face's warpers. The draw uses a `torch.Generator`, so a seed gives
the same tokens run after run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..config import check_fields, check_types, is_integer, is_number, plain_number
from ..errors import ConfigError, short_repr, utf8_error_at
from ..seeds import torch_seed


# Bounds that keep logits / temperature and logits x penalty finite in float32 (logits
# are at most a few hundred): a smaller temperature is greedy in all but name.
MIN_TEMPERATURE = 1e-4
MAX_PENALTY = 1e3
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated at construction (`ConfigError`)."""

    # Numbers may be given as int or float (numpy scalars too); sequences as lists or tuples (stored as tuples).
    max_new_tokens: int = 128
    temperature: float | int = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float | int = 1.0  # 1: off
    min_p: float | int = 0.0  # 0: off
    repetition_penalty: float | int = 1.0  # 1: off
    seed: int | None = None  # None: a fresh random seed per call
    num_samples: int = 1  # completions per prompt
    stop: Sequence[str] | str = ()  # stop strings (or one): generation ends before them, they are never emitted
    stop_token_ids: Sequence[int] | int = ()  # extra stop tokens (or one) besides end-of-sequence
    ignore_eos: bool = False  # keep going past <|eos|> (benchmarks)
    logprobs: int | None = None  # None: off; k: each token's log-probability and the k likeliest (0-20)

    def __post_init__(self) -> None:
        # numpy and other numbers.Integral/Real scalars become Python ints and floats.
        for f in fields(self):
            object.__setattr__(self, f.name, plain_number(getattr(self, f.name)))
        # Lists are accepted for convenience and stored as tuples (hashable, immutable).
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int))
        _check(is_integer(self.max_new_tokens) and self.max_new_tokens >= 1,
               f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        _check(is_number(self.temperature) and (self.temperature == 0
                                                 or MIN_TEMPERATURE <= self.temperature < float("inf")),
               f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, "
               f"got {self.temperature!r}")
        _check(is_integer(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check(is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(is_number(self.repetition_penalty)
               and 1 / MAX_PENALTY <= self.repetition_penalty <= MAX_PENALTY,
               f"repetition_penalty must be in [{1 / MAX_PENALTY:g}, {MAX_PENALTY:g}] (1 = off), "
               f"got {self.repetition_penalty!r}")
        _check(self.seed is None or (is_integer(self.seed) and 0 <= self.seed < 2**64),
               f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        _check(is_integer(self.num_samples) and self.num_samples >= 1,
               f"num_samples must be a positive integer, got {self.num_samples!r}")
        _check(self.logprobs is None or (is_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(all(self.stop), "stop strings must not be empty")
        for i, stop in enumerate(self.stop):  # (a lone surrogate can never match decoded text)
            if (at := utf8_error_at(stop)) is not None:
                raise ConfigError(f"stop string {i} is not valid UTF-8 (a lone surrogate at character {at})")
        _check(all(i >= 0 for i in self.stop_token_ids),
               f"stop_token_ids must be >= 0, got {[i for i in self.stop_token_ids if i < 0][:1] or ''}")
        # The rest (ignore_eos: "no" is not a bool) by declared type; the checks above say more.
        check_types(type(self), {f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stop"], data["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """From a mapping such as generation_config.json; unknown keys are an error."""
        return cls(**check_types(cls, check_fields(cls, data, "sampling parameter")))

    def replace(self, **changes: Any) -> "SamplingParams":
        return SamplingParams.from_dict({**self.to_dict(), **changes})


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _as_tuple(name: str, value: Any, kind: type) -> tuple:
    if isinstance(value, (bytes, bytearray)):  # (iterating would give ints)
        raise ConfigError(f"{name} must be a list of {kind.__name__}, got {short_repr(value)}")
    if isinstance(value, (str, int)):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigError(f"{name} must be a list of {kind.__name__}, got {short_repr(value)}") from None
    items = tuple(plain_number(item) for item in items)
    for item in items:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ConfigError(f"{name} must hold {kind.__name__} values, got {item!r}")
    return items


# ---- the filters, each a pure function of logits ----------------------------------------------

def apply_repetition_penalty(
    logits: Float[Tensor, "B V"], seen: Bool[Tensor, "B V"], penalty: float
) -> Float[Tensor, "B V"]:
    """CTRL's penalty on tokens already in the sequence: positive logits / penalty, others x penalty."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def top_k_filter(logits: Float[Tensor, "B V"], k: int) -> Float[Tensor, "B V"]:
    """-inf outside the k highest logits of each row (a tie with the k-th survives)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Float[Tensor, "B V"], p: float) -> Float[Tensor, "B V"]:
    """-inf outside the smallest most-likely set whose probability reaches p.

    Computed as transformers' TopPLogitsWarper does, so that both keep the same tokens: the
    mass is summed from the least likely token up (a float32 sum from the top drifted: at
    200k tokens and p = 0.9999 it kept 149k of the 152k), and tied tokens at the cut are
    taken in the same order."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
    mass_up_to = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # this token and all less likely
    drop_sorted = mass_up_to <= 1 - p  # the tokens above it reach p without it
    drop_sorted[..., -1] = False  # the top token always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: Float[Tensor, "B V"], min_p: float) -> Float[Tensor, "B V"]:
    """-inf where probability < min_p x the row's top probability."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def processed_logits(
    logits: Float[Tensor, "B V"], params: SamplingParams, seen: Bool[Tensor, "B V"] | None = None
) -> Float[Tensor, "B V"]:
    """Logits after penalty, temperature and the filters: what `sample_next` draws from."""
    logits = logits.float()
    if params.repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits
    logits = logits / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return min_p_filter(logits, params.min_p)


def sample_next(
    logits: Float[Tensor, "B V"],
    params: SamplingParams,
    generator: torch.Generator | None = None,
    seen: Bool[Tensor, "B V"] | None = None,
) -> Int[Tensor, "B"]:
    """The next token of each row. `seen` marks the tokens already in each row's sequence."""
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        what = f"a {logits.dim()}-D {logits.dtype} tensor" if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a (batch, vocabulary) floating-point tensor, got {what}")
    logits = processed_logits(logits, params, seen)
    if params.greedy:
        return greedy_choice(logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (from its raw logits: before
    temperature, penalties and filters, as OpenAI and vLLM report them) and the `k`
    likeliest tokens' (id, log-probability), likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: Float[Tensor, "B V"], tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Each row's `tokens[i]` log-probability and its `k` likeliest, in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    chosen = logp.gather(1, torch.tensor(list(tokens), device=logp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = logp.topk(k, dim=-1)  # (B, k)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


def greedy_choice(logits: Float[Tensor, "B V"]) -> Int[Tensor, "B"]:
    """`logits.argmax(dim=-1)`: the first of equal maxima, a NaN above everything. On the
    CPU through numpy's argmax, which is vectorised: a few times faster than torch's for a
    row of a vocabulary, a cost every greedy decode step pays."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))


def greedy_index(logits: Float[np.ndarray, "1 V"]) -> int:
    """The greedy pick of one row as an int, by the rule of `greedy_choice`, from the
    logits as a numpy array: batch-1 decoding picks this way every token, making no tensor."""
    return int(logits.argmax())


SEED_STRIDE = 1_000_003  # sample i of a seeded prompt draws from seed + i * stride


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample `sample` of a prompt (None: fresh entropy). Each row draws from a
    generator of its own, so a prompt's text depends on its seed and sample index only,
    never on what else is in the batch (`Engine.generate`, the server's scheduler)."""
    return None if seed is None else (seed + sample * SEED_STRIDE) % 2**64


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with `seed`, or from fresh entropy when None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(torch_seed(seed))  # (the CPU generator keeps 32 bits: see seeds.py)
    return generator


def checked_params(params: Any) -> SamplingParams:
    """`params`, or the defaults for None; anything else is one line (a dict failed with
    `AttributeError: 'dict' object has no attribute 'num_samples'`)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ConfigError(f"params must be a SamplingParams (SamplingParams.from_dict reads a dict), "
                          f"got {type(params).__name__}")
    return params


__all__ = [
    "SamplingParams", "TokenLogprob", "token_logprobs", "checked_params", "sample_next", "processed_logits",
    "make_generator", "sample_seed", "greedy_choice", "greedy_index", "apply_repetition_penalty", "top_k_filter", "top_p_filter", "min_p_filter",
]
