"""Chat and preference examples: records -> token ids, with which tokens carry the loss.

SFT records (JSONL / Parquet / hf: rows), one of:

    {"messages": [{"role": "system|user|assistant", "content": "..."}, ...]}
    {"prompt": "...", "response": "..."}              (one user turn, one answer)
    {"prompt": [...], "completion": [...]}            (TRL's; either field a string or messages)

In the prompt/response (or completion) shape only the response is learned, as TRL's
SFTTrainer learns only the completion: the prompt's assistant turns are context.

DPO records: {"prompt": ..., "chosen": "...", "rejected": "..."}, the prompt a string (one
user turn) or a list of messages.

Tokens follow the one chat template (`Tokenizer.render_chat`):
<|bos|><|user|>question<|eos|><|assistant|>answer<|eos|>. An SFT example trains on the
assistant's content and its closing <|eos|> (so the model learns to stop), in every
assistant turn (`train_on="assistant"`), only the last one (`"last"`), or on every token
(`"all"`); the role token <|assistant|> is part of the prompt, as at chat time.

Truncation (an example longer than the context): the prompt keeps its tail (the text
nearest the answer; <|bos|> stays first, then the role token of the turn the tail starts
inside, so that it is still the chat template) and the response keeps its head, the prompt
getting at most half the context when the response needs the rest. The "prompt" is
everything before the first trained token. Truncated examples are counted and reported.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FrawdError, counted
from ..tokenizer import ASSISTANT_ID, BOS_ID, EOS_ID, SYSTEM_ID, UNK_ID, USER_ID, Tokenizer, _role_and_content

TRAIN_ON = ("assistant", "last", "all")


class BadExample(FrawdError):
    """A record that is not a valid example (the message names the file and line)."""


class NothingToLearn(FrawdError):
    """A valid record that teaches nothing once tokenized and cut to the context (a pair
    whose answers become the same ids): dropped and counted, not an error of the data."""


@dataclass
class Example:
    """A tokenized SFT example: `ids[i]` is trained (a target, predicted from ids[:i]) where
    `trained[i]`."""

    ids: list[int]
    trained: list[bool]


@dataclass
class Pair:
    """A tokenized preference pair: one prompt, two completions (each ending in <|eos|>
    unless truncated: a cut answer keeps its head)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass
class LoadSummary:
    """What loading a data file gave, for the one line `frawd sft`/`dpo` print."""

    examples: int = 0
    train: int = 0
    val: int = 0
    skipped: int = 0  # bad records skipped (--skip-bad-lines)
    truncated: int = 0
    dropped: int = 0  # records with nothing to learn once cut (NothingToLearn)
    first_skipped: list[str] = field(default_factory=list)
    first_dropped: str = ""
    ignored: list = field(default_factory=list)  # files of a --data folder or glob that hold no records
    limit: str = "the context"  # what examples are cut to
    unknown: int = 0  # characters a char-level tokenizer turned into <|unk|>
    unknown_examples: int = 0

    def line(self, what: str = "examples") -> str:
        text = f"{counted(self.examples, what.removesuffix('s'))} ({self.train} train, {self.val} held out)"
        if self.truncated:
            text += f"; {self.truncated} truncated to {self.limit} (prompt tail, response head kept)"
        if self.skipped:
            records = "record" if self.skipped == 1 else "records"
            text += f"; {self.skipped} bad {records} skipped (first: {self.first_skipped[0]})"
        if self.dropped:
            text += f"; {self.dropped} dropped with nothing to learn (first: {self.first_dropped})"
        if self.unknown:
            text += (f"; {self.unknown} character(s) outside the tokenizer's vocabulary became <|unk|> "
                     f"(in {counted(self.unknown_examples, what.removesuffix('s'))}; a char tokenizer knows only its corpus' characters)")
        if self.ignored:
            files = "file" if len(self.ignored) == 1 else "files"
            shown = ", ".join(str(p) for p in self.ignored[:3]) + (", ..." if len(self.ignored) > 3 else "")
            text += f"; {len(self.ignored)} other {files} in --data ignored ({shown})"
        return text


# ---- records -> messages ---------------------------------------------------------------------

class Chat(list):
    """A conversation (a list of messages) whose first `prompt_turns` messages are prompt:
    never trained, whatever their role (but with train_on="all", which trains every token)."""

    def __init__(self, messages: list[dict], prompt_turns: int = 0) -> None:
        super().__init__(messages)
        self.prompt_turns = prompt_turns


def _messages(value: object, where: str, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadExample(f"{where}: {name!r} must be a non-empty list of messages")
    try:
        for i, message in enumerate(value):
            _role_and_content(message, i)
    except FrawdError as exc:
        raise BadExample(f"{where}: {exc}") from None
    return value


def _text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in record else type(value).__name__
        raise BadExample(f"{where}: {key!r} must be a string ({got})")
    return value


def _object(record: object, where: str, expected: str) -> dict:
    from ..data.records import BadRecord

    if isinstance(record, BadRecord):
        raise BadExample(f"{where}: {record.problem}")
    if not isinstance(record, dict):
        raise BadExample(f"{where}: expected a JSON object with {expected}")
    return record


def chat_messages(record: object, where: str) -> Chat:
    """An SFT record's conversation; what it learns must contain an assistant turn. Shapes:
    `messages`; `prompt` and `response` (or TRL's `completion`), each a string or a list of
    messages, the prompt's turns being the `Chat`'s prompt turns. A null field counts as
    absent (a table mixing the shapes gives every row every column)."""
    record = _object(record, where, '"messages" or "prompt" and "response"')
    answer_key = next((k for k in ("response", "completion") if record.get(k) is not None), None)
    other = [k for k in ("prompt", "response", "completion") if record.get(k) is not None]
    if record.get("messages") is not None and other:  # which one to learn would be a guess
        raise BadExample(f"{where}: has both \"messages\" and {', '.join(json.dumps(k) for k in other)}; "
                         "give one shape per record")
    if record.get("response") is not None and record.get("completion") is not None:  # (the same guess)
        raise BadExample(f"{where}: has both \"response\" and \"completion\" (two names for the answer); give one")
    if record.get("messages") is not None:
        messages = Chat(_messages(record["messages"], where, "messages"))
    elif record.get("prompt") is not None and answer_key is not None:
        prompt = _turns(record, "prompt", "user", where)
        messages = Chat(prompt + _turns(record, answer_key, "assistant", where), len(prompt))
    else:
        raise BadExample(f"{where}: expected \"messages\" or \"prompt\" and \"response\" "
                         f"(fields: {', '.join(repr(k) for k, v in record.items() if v is not None) or 'none'})")
    if not any(m["role"] == "assistant" for m in messages[messages.prompt_turns:]):
        learned = repr(answer_key) if messages.prompt_turns else "the conversation"
        raise BadExample(f"{where}: {learned} has no assistant turn to learn")
    return messages


def preference(record: object, where: str) -> tuple[list[dict], str, str]:
    """A DPO record's prompt (as messages), chosen and rejected answers. Shapes (TRL's):
    `prompt` a string or messages, `chosen`/`rejected` strings or a one-message assistant
    turn; or no prompt, `chosen`/`rejected` whole conversations that share all but their
    last (assistant) message, the prompt."""
    record = _object(record, where, '"prompt", "chosen" and "rejected"')
    if record.get("chosen") is None or record.get("rejected") is None:  # (was "'chosen' must be a string (missing)")
        raise BadExample(f"{where}: expected \"prompt\", \"chosen\" and \"rejected\" "
                         f"(fields: {', '.join(repr(k) for k, v in record.items() if v is not None) or 'none'})")
    prompt = record.get("prompt")
    if prompt is None and isinstance(record.get("chosen"), list) and isinstance(record.get("rejected"), list):
        chosen = _messages(record["chosen"], where, "chosen")
        rejected = _messages(record["rejected"], where, "rejected")
        if chosen[:-1] != rejected[:-1] or len(chosen) < 2:
            raise BadExample(f"{where}: without 'prompt', 'chosen' and 'rejected' must be conversations that "
                             "differ only in their last message (the prompt is what they share)")
        prompt, record = chosen[:-1], {"chosen": chosen[-1:], "rejected": rejected[-1:]}
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        messages = _messages(prompt, where, "prompt")
    else:
        raise BadExample(f"{where}: 'prompt' must be a string or a list of messages "
                         f"({'missing' if prompt is None else type(prompt).__name__})")
    chosen, rejected = _answer(record, "chosen", where), _answer(record, "rejected", where)
    if chosen == rejected:  # no preference to learn: its DPO loss is log 2 whatever the weights
        raise BadExample(f"{where}: 'chosen' and 'rejected' are the same text")
    if messages[-1]["role"] == "assistant":  # the answers follow the prompt as the assistant's turn
        raise BadExample(f"{where}: 'prompt' ends with an assistant turn; chosen and rejected are that turn")
    return messages, chosen, rejected


def _turns(record: dict, key: str, role: str, where: str) -> list[dict]:
    """A field that is a string (one turn of `role`) or a list of messages."""
    if isinstance(record[key], list):
        return _messages(record[key], where, key)
    return [{"role": role, "content": _text(record, key, where)}]


def _answer(record: dict, key: str, where: str) -> str:
    """A preference answer: a string, or a list of one assistant message (its content)."""
    value = record.get(key)
    if isinstance(value, list):
        messages = _messages(value, where, key)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise BadExample(f"{where}: {key!r} as messages must be one assistant message")
        return messages[0]["content"]
    return _text(record, key, where)


# ---- messages -> ids --------------------------------------------------------------------------

def tokenize_chat(tokenizer: Tokenizer, messages: list[dict], train_on: str = "assistant") -> Example:
    """The conversation's ids (exactly `tokenizer.render_chat(messages, False)`) and its loss
    mask; a `Chat`'s prompt turns are not trained (but with "all")."""
    if train_on not in TRAIN_ON:
        raise FrawdError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    first = messages.prompt_turns if isinstance(messages, Chat) else 0
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids, trained = [BOS_ID], [False]
    for i, (message, (role_id, content)) in enumerate(zip(messages, tokenizer.chat_turns(messages))):
        learn = train_on == "all" or (message["role"] == "assistant" and i >= first
                                      and (train_on == "assistant" or i == last))
        ids.append(role_id)
        trained.append(train_on == "all")
        ids.extend(content)
        trained.extend([learn] * len(content))
    return Example(ids, trained)


def truncate(example: Example, max_len: int) -> tuple[Example, bool]:
    """At most `max_len` tokens by the module's policy; (example, whether it was cut)."""
    n = len(example.ids)
    if n <= max_len:
        return example, False
    start = example.trained.index(True) if any(example.trained) else n
    prompt_keep, response_keep = _budget(start, n - start, max_len)
    keep = _prompt_kept(example.ids[:start], prompt_keep) + list(range(start, start + response_keep))
    return Example([example.ids[i] for i in keep], [example.trained[i] for i in keep]), True


def _prompt_kept(prompt: list[int], keep: int) -> list[int]:
    """The indices of the `keep` prompt tokens a truncated example keeps: <|bos|>, then the
    role token of the turn the tail starts inside (so the tail is still a turn of the chat
    template: "<|bos|>qqq<|eos|><|assistant|>" had lost its <|user|>), then the tail."""
    if keep <= 1:
        return list(range(keep))  # (<|bos|> alone, or nothing)
    tail = len(prompt) - keep + 1  # the first index of a tail after <|bos|> alone
    if prompt[tail] in _ROLE_IDS or keep == 2:  # (it starts a turn; or no room for a role)
        return [0] + list(range(tail, len(prompt)))
    role = next((i for i in range(tail - 1, 0, -1) if prompt[i] in _ROLE_IDS), None)
    if role is None:
        return [0] + list(range(tail, len(prompt)))
    if prompt[tail + 1] in _ROLE_IDS:  # (the role would head an empty turn: a token fewer)
        return [0] + list(range(tail + 1, len(prompt)))
    return [0, role] + list(range(tail + 1, len(prompt)))


_ROLE_IDS = frozenset((USER_ID, ASSISTANT_ID, SYSTEM_ID))


def _budget(prompt_len: int, response_len: int, max_len: int) -> tuple[int, int]:
    """(prompt tokens kept, response tokens kept) for a prompt + response over max_len."""
    prompt_keep = min(prompt_len, max(max_len - response_len, max_len // 2))
    return prompt_keep, min(response_len, max_len - prompt_keep)


def tokenize_pair(tokenizer: Tokenizer, messages: list[dict], chosen: str, rejected: str,
                  max_len: int) -> tuple[Pair, bool]:
    """A preference pair in at most `max_len` tokens per side (the same prompt for both)."""
    prompt = tokenizer.render_chat(messages, add_generation_prompt=True)
    assert prompt[-1] == ASSISTANT_ID
    answers = [tokenizer.encode(chosen) + [EOS_ID], tokenizer.encode(rejected) + [EOS_ID]]
    longest = max(map(len, answers))
    if len(prompt) + longest <= max_len:
        return Pair(prompt, *answers), False
    prompt_keep, answer_keep = _budget(len(prompt), longest, max_len)
    prompt = [prompt[i] for i in _prompt_kept(prompt, prompt_keep)]
    return Pair(prompt, answers[0][:answer_keep], answers[1][:answer_keep]), True


# ---- split ----------------------------------------------------------------------------------

def is_held_out(key: str, val_fraction: float) -> bool:
    """A deterministic train/val split by a hash of the example (or its group's key)."""
    digest = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return digest / 2**64 < val_fraction


def record_key(record: object) -> str:
    """The split key of a record: its JSON without null fields, which count as absent (a
    record of a JSONL file and the same record from Parquet or `datasets`, which fill every
    column, with nulls where it has none, fell on different sides of the split)."""
    return json.dumps(_without_nulls(record), sort_keys=True, ensure_ascii=False, default=str)


def _without_nulls(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def check_source(spec: str, kind: str, ignored: list | None = None) -> Iterator[tuple[str, object]] | None:
    """What `iter_source` refuses before reading a record (a missing file, the other kind of
    built-in corpus), checked now; the source's records, to read (None for a built-in
    corpus; hf: records are loaded, and checked, as they are read)."""
    from ..data.records import iter_records
    from . import stdlib_corpus

    if spec in stdlib_corpus.CORPORA:
        if stdlib_corpus.CORPORA[spec] != kind:
            raise FrawdError(f"--data {spec} holds {'preference pairs' if kind == 'sft' else 'instructions'}; "
                             f"use --data {stdlib_corpus.NAME_FOR[kind]} here")
        return None
    if spec.startswith("hf:"):  # (opening the data set waits for its first record)
        return _records_later(spec, stdlib_corpus.NAME_FOR[kind])
    return iter_records(spec, stdlib_corpus.NAME_FOR[kind], ignored)


def _records_later(spec: str, builtin: str) -> Iterator[tuple[str, object]]:
    from ..data.records import iter_records

    yield from iter_records(spec, builtin)


def iter_source(spec: str, kind: str, ignored: list | None = None) -> Iterator[tuple[str, object, str]]:
    """(where, record, split key) of a data source: a built-in corpus or a record file.
    `kind`: "sft" or "dpo"; a folder's files that hold no records are added to `ignored`."""
    from . import stdlib_corpus

    records = check_source(spec, kind, ignored)
    if records is None:
        yield from stdlib_corpus.records(spec)
        return
    for where, record in records:
        yield where, record, record_key(record)


def load_records(cfg: Any, convert, what: str) -> tuple[list, list, LoadSummary]:
    """`cfg.data`'s records (an SFT or DPO config) converted by `convert(record, where)` (which
    returns (example, truncated)) and split: (train, val, summary). `what` names them."""
    summary = LoadSummary(limit=f"--max-length {cfg.max_length}" if cfg.max_length else "the context")
    train, val = collect(iter_source(cfg.data, cfg.KIND, summary.ignored), convert, cfg.val_fraction,
                         cfg.skip_bad_lines, summary, source=cfg.data, what=what)
    if not train:
        raise FrawdError(f"--data {cfg.data}: every {what[:-1]} fell in the held-out split; lower --val-fraction")
    if Path(cfg.data).is_dir():  # (named from the folder: two README.md in subfolders are told apart)
        summary.ignored[:] = [Path(os.path.relpath(p, cfg.data)) for p in summary.ignored]
    return train, val, summary


def collect(items: Iterable[tuple[str, object, str]], convert, val_fraction: float, skip_bad: bool,
            summary: LoadSummary, *, source: str, what: str = "examples") -> tuple[list, list]:
    """Converted examples, split into (train, val); bad records raise or are skipped and counted.
    `convert(record, where)` returns (example, truncated); `source` (the --data) and `what`
    name them when none is usable."""
    train, val = [], []
    for where, record, key in items:
        try:
            example, cut = convert(record, where)
        except BadExample as exc:
            if not skip_bad:
                raise BadExample(f"{exc} (--skip-bad-lines skips such records)") from None
            summary.skipped += 1
            if len(summary.first_skipped) < 3:
                summary.first_skipped.append(str(exc))
            continue
        except NothingToLearn as exc:
            summary.dropped += 1
            summary.first_dropped = summary.first_dropped or str(exc)
            continue
        summary.truncated += cut
        ids = example.ids if isinstance(example, Example) else example.prompt + example.chosen + example.rejected
        unknown = ids.count(UNK_ID)
        summary.unknown += unknown
        summary.unknown_examples += unknown > 0
        (val if is_held_out(key, val_fraction) else train).append(example)
    summary.examples, summary.train, summary.val = len(train) + len(val), len(train), len(val)
    if not summary.examples:
        why = []
        first = "" if summary.skipped + summary.dropped == 1 else "first: "
        if summary.skipped:
            why.append(f"{counted(summary.skipped, 'record')} {'was' if summary.skipped == 1 else 'were'} bad and "
                       f"skipped ({first}{summary.first_skipped[0]})")
        if summary.dropped:
            why.append(f"{summary.dropped:,} had nothing to learn ({first}{summary.first_dropped})")
        all_ = "all " if len(why) == 1 and summary.skipped + summary.dropped > 1 else ""
        raise FrawdError(f"--data {source} holds no usable {what}" + (f": {all_}{'; '.join(why)}" if why else ""))
    return train, val
