"""A conversation as a prompt: the chat template plus history that fits the context.

The template itself is the tokenizer's (`Tokenizer.render_chat`, the one template of the
project):

    <|bos|><|system|>...<|eos|><|user|>...<|eos|><|assistant|>...<|eos|><|user|>...<|eos|><|assistant|>

A model sees at most `context_length` tokens, and the reply needs room too. `fit_history`
drops the oldest exchanges, a user turn with the replies after it, until the rendered
prompt leaves `reserve` tokens for the reply. The system messages (wherever they stand)
and the newest user message always stay, and a shortened history starts with a user
turn: a reply kept without its question would read as the model's own unprompted words
and change the answers. When even they leave less than `reserve`, they are the prompt as
long as they fit the context, and the reply gets the room left (it ends there). `frawd chat` and the
server's "truncate" go through it.

Chat replies end at <|eos|>; a role token (<|user|>, <|system|>, <|assistant|>) inside a
reply means the model is writing the next turn itself, so those stop a reply too.
"""

from __future__ import annotations

import itertools
from typing import Any

from ..errors import FrawdError
from ..tokenizer import ASSISTANT_ID, BOS_ID, SYSTEM_ID, USER_ID

ROLE_TOKEN_IDS = (USER_ID, SYSTEM_ID, ASSISTANT_ID)


def reply_reserve(context_length: int, max_new_tokens: int) -> int:
    """Tokens kept free for the reply: max_new_tokens, but at most half the context."""
    return max(1, min(max_new_tokens, context_length // 2))


def fit_history(
    tokenizer: Any, messages: list[dict], context_length: int, reserve: int
) -> tuple[list[int], int]:
    """(prompt ids, number of oldest messages dropped) for a prompt of at most context - reserve
    tokens, dropping whole exchanges (the kept turns start at a user turn) and never a system
    message, wherever it stands (OpenAI's clients may send one after some turns: the kept ones
    stay in their order); or, if the newest user turn (with the system messages) leaves less,
    that turn and the replies after it, up to the whole context (a FrawdError beyond it).

    Each message is tokenized once (the template is <|bos|>, a part per message, then
    <|assistant|>): trying each start by rendering the rest again took time quadratic in
    the number of messages, seconds for a few thousand (and a long pasted message was
    tokenized three times before it was refused)."""
    turns = tokenizer.chat_turns(messages)  # (also checks every message)

    def render(kept: list[int]) -> list[int]:
        """`tokenizer.render_chat` of messages[i] for i in kept, from the turns already made."""
        ids = [BOS_ID]
        for i in kept:
            role_id, part = turns[i]
            ids.append(role_id)
            ids.extend(part)
        return ids + [ASSISTANT_ID]

    ids = render(list(range(len(messages))))
    budget = context_length - reserve
    if len(ids) <= budget:
        return ids, 0
    system = [m.get("role") == "system" for m in messages]
    sizes = [1 + len(part) for _, part in turns]  # role token, content, <|eos|>
    frame = len(ids) - sum(sizes)  # <|bos|>, <|assistant|>

    after = list(itertools.accumulate(reversed(sizes), initial=0))[::-1]  # after[i]: sizes of messages[i:]
    systems_before = list(itertools.accumulate((n if is_system else 0 for n, is_system in zip(sizes, system)),
                                               initial=0))

    def from_turn(start: int) -> tuple[list[int], int]:
        """The prompt when the history restarts at `start` (the system messages before it
        kept), and the count of messages dropped."""
        kept = [i for i in range(len(messages)) if i >= start or system[i]]
        return render(kept), len(messages) - len(kept)

    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    for start in users:  # from a user turn on: never from an answer on
        if frame + systems_before[start] + after[start] <= budget:
            return from_turn(start)
    start = users[-1] if users else 0
    need = frame + systems_before[start] + after[start]
    if need <= context_length:  # less room for the reply than asked, as without dropping anything
        return from_turn(start)
    systems = [m["content"] for m, is_system in zip(messages, system) if is_system]
    if systems:
        check_system_message(tokenizer, systems, context_length, reserve=0,
                             what="the system message" + ("s" if len(systems) > 1 else ""))
    raise FrawdError(
        f"the message needs {need} tokens with the template"
        + (" and the system message" + ("s" if len(systems) > 1 else "") if systems else "")
        + f" but the model's context is {context_length}; shorten it"
    )


def check_system_message(tokenizer: Any, system: str | list[str], context_length: int, reserve: int,
                         what: str = "the system message") -> None:
    """Refuse a system message (or several) that leaves no room for any user message and the reply."""
    systems = [system] if isinstance(system, str) else system
    need = len(tokenizer.render_chat([{"role": "system", "content": s} for s in systems]
                                     + [{"role": "user", "content": ""}], add_generation_prompt=True))
    budget = context_length - reserve
    if need > budget:
        room = f"leaves {budget} (context {context_length} - {reserve} for the reply)" if reserve else \
            f"is {context_length}"
        raise FrawdError(f"{what} need{'' if len(systems) > 1 else 's'} {need} tokens with the template (an empty "
                         f"user message included) but the model's context {room}; shorten "
                         + ("them" if len(systems) > 1 else "it"))


__all__ = ["fit_history", "check_system_message", "reply_reserve", "ROLE_TOKEN_IDS"]
