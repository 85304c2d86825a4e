"""Token ids in, printable text out, one token at a time.

Three things make streaming text harder than decoding at the end:

- A token can hold part of a character: with byte-level tokenizers "é" is two tokens,
  and the first one alone decodes to U+FFFD. Text ending in U+FFFD is held back until
  the next token completes the character (or the stream ends). A model can also emit
  bytes that never form a character: after HOLD_LIMIT ids the U+FFFD is real and goes
  out, so a run of invalid bytes neither stalls the stream nor makes each token re-decode
  the whole run.
- A SentencePiece-style tokenizer's byte tokens ("<0x0A>", ByteFallback) decode as a group,
  and a group that is not valid UTF-8 turns every byte into U+FFFD, an ASCII one before the
  broken character too: text is held while the newest token is such a byte, until the
  group closes, so what was shown never changes afterwards. A group longer than HOLD_LIMIT
  (six CJK characters are 18 bytes) goes out up to its last whole character, and the
  window starts again there (released whole at the limit, its bytes were all U+FFFD, and
  the text after it was lost).
- A prompt given as token ids can end inside a character: its last ids are read first
  (`context`), so the token that completes the character adds no U+FFFD of its own.
  Otherwise its last id is read first all the same: a SentencePiece-style decoder drops
  the space that a text's first token starts with ("▁Hello" alone is "Hello"), which
  would glue a reply's first word to the prompt.
- A stop string can span several tokens ("\\n\\nUser:" = "\\n", "\\n", "User", ":"). Text
  that could be the start of a stop string is held back until it either becomes the stop
  string (the stream ends there and the stop string is never emitted) or cannot any more.

Decoding re-reads only a short window of recent ids (`prefix`..end), so a long stream
costs O(1) per token rather than re-decoding everything. The window's start moves every
few tokens, not at each: until it moves, the text of the ids read so far is the previous
decode, so a token costs one decode (two when the window moves) instead of two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
WINDOW = 8  # ids re-decoded at most before the window's start moves up
HOLD_LIMIT = 16  # ids held back for an incomplete character at most (a character is <= 4 bytes)
CONTEXT_IDS = 4  # prompt ids read before a stream that starts inside a character


class TextStream:
    """Feed token ids with `push`; it returns the text safe to show now."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), context: Sequence[int] = ()) -> None:
        """context: the ids before the stream's (the prompt): where they end inside a
        character, the stream starts inside it too (its text shows only what follows)."""
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] were decoded already, as _read_text
        self._read = 0
        self._read_text = ""
        tail = lead_in(tokenizer, context)
        if tail:
            self.ids, self._read, self._read_text = tail, len(tail), self._decode(tail)
        self._pending = ""  # decoded, not yet emitted (a partial stop string maybe)
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found
        self._fallback_bytes = getattr(tokenizer, "fallback_byte_ids", frozenset())

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly printable text ('' when held back)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        full_text = self._decode(self.ids[self._prefix:])
        if len(full_text) <= len(self._read_text):
            return ""
        if len(self.ids) - self._read < HOLD_LIMIT and (
                full_text.endswith(REPLACEMENT_CHAR)  # an incomplete character: wait for the rest of its bytes
                or token_id in self._fallback_bytes):  # a byte group may still change ("\n" -> U+FFFD)
            return ""
        if token_id in self._fallback_bytes and REPLACEMENT_CHAR in full_text[len(self._read_text):]:
            cut = self._last_whole_character()
            if cut is not None:  # a long byte group: out up to its last whole character
                self._pending += self._decode(self.ids[self._prefix:cut])[len(self._read_text):]
                self._prefix = self._read = cut
                self._read_text = ""
                return self._release(final=False)
        self._pending += full_text[len(self._read_text):]
        end = len(self.ids)
        if end - self._prefix > WINDOW:  # the window starts again at the ids read before this push
            self._prefix = self._read
            self._read_text = self._decode(self.ids[self._prefix:end])
        else:
            self._read_text = full_text
        self._read = end
        return self._release(final=False)

    def _last_whole_character(self) -> int | None:
        """The largest end among the held ids (not the last) whose text, from the window's
        start, holds no U+FFFD past what was shown: a byte group cut there is valid UTF-8."""
        for end in range(len(self.ids) - 1, self._read, -1):
            text = self._decode(self.ids[self._prefix:end])
            if len(text) > len(self._read_text) and REPLACEMENT_CHAR not in text[len(self._read_text):]:
                return end
        return None

    def finish(self) -> str:
        """The end of the stream: flush what was held back (but never a stop string)."""
        if self.stopped:
            return ""
        self._pending += self._decode(self.ids[self._prefix:])[len(self._read_text):]
        self._prefix = self._read = len(self.ids)
        self._read_text = ""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._pending
        if not self.stop:  # (the common case: everything decoded is printable)
            self._pending = ""
            self.text += text
            return text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = text[:cut], ""
        elif final:
            out, self._pending = text, ""
        else:
            keep = _partial_stop_suffix(text, self.stop)
            out, self._pending = text[: len(text) - keep], text[len(text) - keep:]
        self.text += out
        return out


def open_character_tail(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """The last few of `ids` when their text ends inside a character (decodes to a final
    U+FFFD), else []: what a stream after them reads first."""
    tail = list(ids[-CONTEXT_IDS:])
    return tail if tail and tokenizer.decode(tail, skip_special_tokens=True).endswith(REPLACEMENT_CHAR) else []


def lead_in(tokenizer: Any, context: Sequence[int]) -> list[int]:
    """The ids of `context` a stream after it decodes first (their text is cut off): the
    open character's (`open_character_tail`), else the last id, so that a SentencePiece-style
    reply's first word keeps its space ("all" + " alpha", not "allalpha"). Not a byte token
    of a byte-fallback group, whose decoding would then change with the reply's bytes."""
    tail = open_character_tail(tokenizer, context)
    if tail or not context or context[-1] in getattr(tokenizer, "fallback_byte_ids", ()):
        return tail
    return [context[-1]]


def text_after(tokenizer: Any, context: Sequence[int], ids: Sequence[int]) -> str:
    """The text of `ids` after the prompt `context`, decoded at once: what a `TextStream`
    with that context shows in all (the prompt's `lead_in` is decoded with `ids`, and its
    text cut off)."""
    tail = lead_in(tokenizer, context)
    text = tokenizer.decode(tail + list(ids), skip_special_tokens=True)
    return text[len(tokenizer.decode(tail, skip_special_tokens=True)):] if tail else text


def _partial_stop_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


__all__ = ["TextStream", "open_character_tail", "text_after"]
