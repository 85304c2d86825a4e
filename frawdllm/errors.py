"""User-facing errors.

A `FrawdError` is a problem with the user's input (a missing file, a bad config, a corrupt
model directory). The CLI prints its message as one line on stderr and exits non-zero;
any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any


def short_repr(value: Any) -> str:
    """`repr(value)` for an error message, bounded: a YAML alias bomb's list of 10^9 items
    (shared references, cheap to load) took a repr of all of them, and hung the command."""
    return _SHORT.repr(value)


def first_line(exc: BaseException, default: str = "", limit: int = 200) -> str:
    """An exception's first line for a message: without a leading C++ source location (gloo's
    "[/__w/pytorch/.../pair.cc:553] Connection closed by peer"), cut at a word with "..." past
    `limit` characters; `default` where it has no text."""
    text = (str(exc).strip().splitlines() or [default])[0]
    text = re.sub(r"^\[[^\]\s]+:\d+\]\s*", "", text)
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + "..."


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 5
_SHORT.maxlevel = 2


class FrawdError(Exception):
    """Bad input: shown to the user as one line, never as a traceback."""


class RankLost(FrawdError):
    """Another rank died or stopped answering: the collectives failed or timed out."""


class ConfigError(FrawdError, ValueError):
    """An invalid configuration value; a ValueError so library users can catch it as one."""


def utf8_error_at(text: str) -> int | None:
    """Where `text` stops being UTF-8 encodable (a lone surrogate), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def check_unicode(text: str, what: str) -> None:
    """Refuse text that cannot be UTF-8 encoded: a lone surrogate, which is how Python hands
    over invalid UTF-8 from the command line (`surrogateescape`) or a JSON "\\ud800" escape."""
    if (at := utf8_error_at(text)) is not None:
        raise FrawdError(f"{what} is not valid UTF-8 (a lone surrogate or undecodable byte at character {at})")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """A count and its noun for a message: "1 step", "2 steps", "1,024 source lines"."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
