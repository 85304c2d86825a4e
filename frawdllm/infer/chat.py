"""A conversation as a prompt: the chat template plus history that fits the context.

The template itself is the tokenizer's (`Tokenizer.render_chat`, the one template of the
project):

    <|bos|><|system|>...<|eos|><|user|>...<|eos|><|assistant|>...<|eos|><|user|>...<|eos|><|assistant|>

A model sees at most `context_length` tokens, and the reply needs room too. `fit_history`
drops the oldest turns (never the system message, never the newest user message) until
the rendered prompt leaves `reserve` tokens for the reply. `frawd chat` goes through it.

Chat replies end at <|eos|>; a role token (<|user|>, <|system|>, <|assistant|>) inside a
reply means the model is writing the next turn itself, so those stop a reply too.
"""

from __future__ import annotations

from typing import Any

from ..errors import FrawdError
from ..tokenizer import ASSISTANT_ID, SYSTEM_ID, USER_ID

ROLE_TOKEN_IDS = (USER_ID, SYSTEM_ID, ASSISTANT_ID)


def reply_reserve(context_length: int, max_new_tokens: int) -> int:
    """Tokens kept free for the reply: max_new_tokens, but at most half the context."""
    return max(1, min(max_new_tokens, context_length // 2))


def fit_history(
    tokenizer: Any, messages: list[dict], context_length: int, reserve: int
) -> tuple[list[int], int]:
    """(prompt ids, number of oldest messages dropped) for a prompt of at most context - reserve tokens."""
    system = [m for m in messages[:1] if m.get("role") == "system"]
    turns = messages[len(system):]
    budget = context_length - reserve
    for dropped in range(len(turns)):
        ids = tokenizer.render_chat(system + turns[dropped:], add_generation_prompt=True)
        if len(ids) <= budget:
            return ids, dropped
    need = len(tokenizer.render_chat(system + turns[-1:], add_generation_prompt=True)) if turns else 0
    raise FrawdError(
        f"the message needs {need} tokens with the template but the model's context leaves "
        f"{budget} (context {context_length} - {reserve} for the reply); shorten it"
        + (" or the system message" if system else "")
    )


__all__ = ["fit_history", "reply_reserve", "ROLE_TOKEN_IDS"]
