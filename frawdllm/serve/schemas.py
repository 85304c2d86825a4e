"""The request bodies of the OpenAI-compatible API, as pydantic models.

They are the server's validation (a bad field is a 400 with OpenAI's error object) and its
OpenAPI document (`/openapi.json`, which schema fuzzing reads). Types are strict, as
OpenAI's are: `"n": "2"` or `"stream": "yes"` is a 400, not a guess. Fields the OpenAI API
has and this server does not support are declared so that a value which would change the
output is refused with a clear message (`serve/prompts.py: _refuse_unsupported`: penalties
other than 0, logit_bias, tools, response_format...) rather than ignored; their
neutral values (null, 0, 1, "text", "none") pass. Unknown fields are ignored, as
OpenAI-compatible servers do, so that clients that always send extras (`user`...) work.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # OpenAI's seed: any int64


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str = Field(max_length=256)
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate at most (capped by the server; "
                                                          "0 with echo: score the prompt, completions only).")
    max_completion_tokens: int | None = Field(None, ge=0, description="The newer name of max_tokens.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy. Default 1.")
    top_p: float | None = Field(None, ge=0, le=1, description="0 = the likeliest token alone (greedy).")
    top_k: int | None = Field(None, ge=0, le=1_000_000, description="FrawdLLM extension: 0 = off.")
    min_p: float | None = Field(None, ge=0, le=1, description="FrawdLLM extension: 0 = off.")
    repetition_penalty: float | None = Field(None, ge=0.001, le=1000,
                                             description="FrawdLLM extension (CTRL's): 1 = off.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0 is supported.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0 is supported.")
    n: int | None = Field(1, ge=1, le=128, description="Completions for the prompt (capped by the server).")
    stop: str | list[str] | None = Field(None, description=f"Up to {MAX_STOP} stop strings.")
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    truncate: bool = Field(False, description="FrawdLLM extension: drop the oldest prompt tokens (chat: "
                                              "whole exchanges) until the prompt leaves room for the reply "
                                              "(max_tokens, at most half the context; chat keeps its newest "
                                              "turn with less room if need be), instead of a 400.")
    user: str | None = None
    # OpenAI fields this server does not support: only their neutral values pass
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: only null or {}.")
    response_format: dict | None = Field(None, description='Not supported: only null, {} or {"type": "text"}.')

    @field_validator("n", "stream", "echo", "prompt", "truncate", mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value, info):
        """OpenAI's API declares these nullable, null meaning the default (generated clients
        send explicit nulls); a null prompt is the empty one. Our "truncate" likewise."""
        if value is not None:
            return value
        return "" if info.field_name == "prompt" else cls.model_fields[info.field_name].default


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["developer", "system", "user", "assistant"]
    content: str | list[TextPart] = Field(description="Text, or text parts (joined).")

    def as_message(self) -> dict:
        """{"role", "content"} as the chat template takes it: a developer message is the
        system prompt (OpenAI's newer name for it), text parts are joined."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = Field(None, description="Each reply token's log-probability (choices[].logprobs.content).")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: the likeliest tokens per "
                                                                    "position, their log-probabilities too.")
    tools: list[dict] | None = Field(None, description="Not supported: only null or [].")
    functions: list[dict] | None = Field(None, description="Not supported: only null or [].")
    tool_choice: str | dict | None = Field(None, description='Not supported: only null, "none" or "auto" (no tools to call).')
    function_call: str | dict | None = Field(None, description='The deprecated tool_choice: only null, "none" or '
                                                               '"auto".')


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] | None = Field(
        description="Text or token ids, or a list of either: n completions for each prompt, "
                    "choice prompt_index * n + sample_index.")
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=5, description="Each generated token's log-probability and "
                                                               "this many likeliest tokens' (with echo: the "
                                                               "prompt's tokens' first).")
    best_of: int | None = Field(None, ge=1, le=20, description="Not supported: only null or 1.")
    suffix: str | None = Field(None, description='Not supported: only null or "".')


__all__ = ["ChatCompletionRequest", "CompletionRequest", "ChatMessage", "TextPart", "MAX_STOP"]
