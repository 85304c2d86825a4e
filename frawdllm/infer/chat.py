"""A conversation as a prompt: the chat template plus history that fits the context.

The template itself is the tokenizer's (`Tokenizer.render_chat`, the one template of the
project):

    <|bos|><|system|>...<|eos|><|user|>...<|eos|><|assistant|>...<|eos|><|user|>...<|eos|><|assistant|>

A model sees at most `context_length` tokens, and the reply needs room too. `fit_history`
drops the oldest exchanges, a user turn with the replies after it, until the rendered
prompt leaves `reserve` tokens for the reply. The system message and the newest user
message always stay, and a shortened history starts with a user turn: a reply kept
without its question would read as the model's own unprompted words and change the
answers. When even they leave less than `reserve`, they are the prompt as long as they
fit the context, and the reply gets the room left (it ends there). `frawd chat` and the
server's "truncate" go through it.

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
    """(prompt ids, number of oldest messages dropped) for a prompt of at most context - reserve
    tokens, dropping whole exchanges (the kept turns start at a user or system turn); or, if
    the newest user turn (with the system message) leaves less, that turn and the replies
    after it, up to the whole context (a FrawdError beyond it).

    Each message is tokenized once (the template is <|bos|>, a part per message, then
    <|assistant|>): trying each start by rendering the rest again took time quadratic in
    the number of messages, seconds for a few thousand."""
    ids = tokenizer.render_chat(messages, add_generation_prompt=True)  # (also checks every message)
    budget = context_length - reserve
    if len(ids) <= budget:
        return ids, 0
    system = [m for m in messages[:1] if m.get("role") == "system"]
    turns = messages[len(system):]
    frame = len(tokenizer.render_chat(system, add_generation_prompt=True))  # <|bos|>, system, <|assistant|>
    sizes = [len(tokenizer.render_chat([m], add_generation_prompt=False)) - 1 for m in turns]  # less <|bos|>
    need = frame + sum(sizes)
    # from a later user (or system) turn on: never from an answer on
    for dropped in range(1, len(turns)):
        need -= sizes[dropped - 1]
        if turns[dropped].get("role") != "assistant" and need <= budget:
            return tokenizer.render_chat(system + turns[dropped:], add_generation_prompt=True), dropped
    last = max([0] + [i for i, m in enumerate(turns) if m.get("role") != "assistant"])
    need = frame + sum(sizes[last:])
    if need <= context_length:  # less room for the reply than asked, as without dropping anything
        return tokenizer.render_chat(system + turns[last:], add_generation_prompt=True), last
    if system:
        check_system_message(tokenizer, system[0]["content"], context_length, reserve=0)
    raise FrawdError(
        f"the message needs {need} tokens with the template"
        + (" and the system message" if system else "")
        + f" but the model's context is {context_length}; shorten it"
    )


def check_system_message(tokenizer: Any, system: str, context_length: int, reserve: int,
                         what: str = "the system message") -> None:
    """Refuse a system message that leaves no room for any user message and the reply."""
    need = len(tokenizer.render_chat([{"role": "system", "content": system}, {"role": "user", "content": ""}],
                                     add_generation_prompt=True))
    budget = context_length - reserve
    if need > budget:
        room = f"leaves {budget} (context {context_length} - {reserve} for the reply)" if reserve else \
            f"is {context_length}"
        raise FrawdError(f"{what} needs {need} tokens with the template (an empty user message included) but "
                         f"the model's context {room}; shorten it")


__all__ = ["fit_history", "check_system_message", "reply_reserve", "ROLE_TOKEN_IDS"]
