"""Requests into what the engine takes: prompts as token ids (cut by "truncate" to leave
room for the reply), chat history that fits, the checks on their size, and `SamplingParams`
from OpenAI's fields (with a model's generation_config.json defaults)."""

from __future__ import annotations

from typing import Any

from ..errors import FrawdError, check_unicode
from ..infer.engine import Engine
from ..infer.sampling import MIN_TEMPERATURE, SamplingParams
from .errors import ApiError
from .options import ServeOptions
from .schemas import MAX_STOP, CompletionRequest


def _check_text(text: str, what: str, param: str) -> None:
    try:
        check_unicode(text, what)
    except FrawdError as error:
        raise ApiError(400, str(error), param=param) from None


def _prompts(prompt: str | list, most: int) -> list[str | list[int]]:
    """A completion request's prompts: one (text or ids) or a list of them (at most `most`:
    a batch's rows and the queue's places, so that the request can be taken whole)."""
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt is an empty list: give a text, token ids, or a list of either", param="prompt")
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > most:
        raise ApiError(400, f"{len(prompt)} prompts; this server takes at most {most} in one request", param="prompt")
    return list(prompt)


CHARS_PER_TOKEN_MARGIN = 4  # normalization can shorten a text (composing accents): a generous margin


def _reach(engine: Engine) -> int:
    """Characters beyond which a text surely holds more tokens than the context: checked
    before tokenizing, which for a megabyte prompt would hold the event loop for seconds."""
    return (engine.config.context_length + 1) * engine.tokenizer.longest_token_chars * CHARS_PER_TOKEN_MARGIN


def _text_within_reach(text: str, engine: Engine, truncate: bool, what: str) -> str:
    """`text`, or its tail with "truncate" (tokenization is local: the tail's last tokens are
    the text's), or a 400 when it cannot fit the context."""
    reach = _reach(engine)
    if len(text) <= reach:
        return text
    if truncate:
        return text[-reach:]
    raise ApiError(400, f"{what} has {len(text):,} characters, more than the model's context of "
                        f"{engine.config.context_length} tokens can hold; \"truncate\": true keeps its end",
                   param="prompt", code="context_length_exceeded")


def _within_reach(messages: list[dict], engine: Engine, truncate: bool) -> list[dict]:
    """The conversation without turns too long to ever fit the context: with "truncate"
    they, every turn before them and the answers right after them go (whole exchanges, as
    fit_history drops them: the rest never starts with an answer), else a 400; the system
    messages and the newest one must fit either way."""
    reach = _reach(engine)
    long = [i for i, m in enumerate(messages) if len(m["content"]) > reach]
    if not long:
        return messages
    system = [i for i in long if messages[i]["role"] == "system"]
    if not truncate or system or long[-1] == len(messages) - 1:
        i = system[0] if system and truncate else long[-1]
        raise ApiError(400, f"messages[{i}] has {len(messages[i]['content']):,} characters, more than the "
                            f"model's context of {engine.config.context_length} tokens can hold"
                            + ("" if truncate else '; "truncate": true drops old turns'),
                       param="messages", code="context_length_exceeded")
    rest = long[-1] + 1
    while rest < len(messages) - 1 and messages[rest]["role"] == "assistant":  # its answers go with it
        rest += 1
    return [m for m in messages[:rest] if m["role"] == "system"] + messages[rest:]


def _check_fits(ids: list[int], engine: Engine, chat: bool, what: str = "the prompt") -> None:
    context = engine.config.context_length
    if len(ids) > context:
        keeps = "the newest turns" if chat else "its last tokens"
        raise ApiError(400, f"{what} has {len(ids)} tokens but the model's context is {context}; "
                            f'"truncate": true keeps {keeps}', param="messages" if chat else "prompt",
                       code="context_length_exceeded")


def _max_new(body: Any, options: ServeOptions, engine: Engine) -> int:
    """The request's max_completion_tokens (the newer name) or max_tokens, checked against the cap."""
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = getattr(body, name)
    if asked is not None and asked > options.max_tokens:
        raise ApiError(400, f"{name} is {asked}; this server allows at most {options.max_tokens}", param=name)
    if asked == 0 and not isinstance(body, CompletionRequest):
        raise ApiError(400, f"{name} must be at least 1 (0 scores a prompt: completions with echo)", param=name)
    return asked if asked is not None else min(options.default_max_tokens, engine.config.context_length)


def _refuse_unsupported(body: Any) -> None:
    """A 400 for an OpenAI field this server cannot honour, when its value would change the
    output (its neutral values pass: clients send them by default)."""
    def no(name: str, why: str) -> ApiError:
        return ApiError(400, f"{name} {why}", param=name)

    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0):
            raise no(name, "is not supported; use repetition_penalty (1 = off, 1.1-1.3 typical)")
    if getattr(body, "top_logprobs", None) and not body.logprobs:
        raise no("top_logprobs", "needs logprobs: true")
    if body.logit_bias:
        raise no("logit_bias", "is not supported by this server")
    if body.response_format not in (None, {}, {"type": "text"}):
        raise no("response_format", 'is not supported: only {"type": "text"} (this server has no JSON mode)')
    for name in ("tools", "functions"):  # (functions: tools' old name)
        if getattr(body, name, None):
            raise no(name, "are not supported: this server's models have no tool calls")
    for name in ("tool_choice", "function_call"):  # (function_call: tool_choice's old name)
        if getattr(body, name, None) not in (None, "none", "auto"):
            raise no(name, 'is not supported: only "none" or "auto" (this server\'s models have no tool calls)')
    if getattr(body, "best_of", None) not in (None, 1):
        raise no("best_of", "is not supported; n gives several completions")
    if getattr(body, "suffix", None):
        raise no("suffix", "is not supported (no fill-in-the-middle)")
    if body.stream_options is not None and not body.stream:
        raise no("stream_options", "is only allowed when stream is true")


def _settings(values: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json's settings as SamplingParams holds them (one stop string a
    tuple of one, one stop id a tuple): only the fields the file sets."""
    params = SamplingParams.from_dict(values)
    return {name: getattr(params, name) for name in values}


def _params(body: Any, max_new: int, options: ServeOptions, defaults: dict[str, Any] | None = None,
            stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """A request's SamplingParams. `defaults`, the model's generation_config.json, fill what
    the request leaves out: temperature (else OpenAI's 1), top_p, top_k, min_p,
    repetition_penalty and the stop strings; its stop_token_ids always end a reply, as in
    `frawd generate`. (Its seed, num_samples and max_new_tokens do not apply: a request's
    own, `n` and --default-max-tokens do.)"""
    defaults = defaults or {}
    if body.n > options.max_n:
        raise ApiError(400, f"n is {body.n}; this server allows at most {options.max_n}", param="n")
    if body.n > options.max_batch:
        raise ApiError(400, f"n is {body.n} but a batch holds {options.max_batch} rows", param="n")
    _refuse_unsupported(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"at most {MAX_STOP} stop strings", param="stop")
    if any(s == "" for s in stop):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    for i, text in enumerate(stop):
        _check_text(text, "stop" if isinstance(body.stop, str) else f"stop[{i}]", param="stop")
    if body.stop is None:  # the model's own (checked when the server started; the cap is the requests')
        stop = list(defaults.get("stop", ()))
    seed = None if body.seed is None else body.seed % 2**64  # OpenAI's seeds are any int64 (-1 included): one each
    if isinstance(body, CompletionRequest):  # a count (0: the sampled token's alone)
        logprobs = body.logprobs
    else:  # a switch, and a count beside it
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    ends = tuple(dict.fromkeys((*defaults.get("stop_token_ids", ()), *stop_token_ids)))
    temperature = defaults.get("temperature", 1.0) if body.temperature is None else body.temperature
    values = dict(max_new_tokens=max_new, num_samples=body.n, stop=stop, stop_token_ids=ends,
                  seed=seed, temperature=temperature, logprobs=logprobs)
    for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None or defaults.get(name) is not None:
            values[name] = value if value is not None else defaults[name]
    if 0 < values["temperature"] < MIN_TEMPERATURE or values.get("top_p") == 0:
        values["temperature"] = 0  # below the sampler's floor, or top_p 0 (the likeliest token): greedy
        values.pop("top_p", None)
    try:
        return SamplingParams(**values)
    except FrawdError as error:
        raise ApiError(400, str(error)) from None

