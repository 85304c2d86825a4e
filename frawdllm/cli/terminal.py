"""Model text bound for a terminal.

A model can write any character, and a terminal obeys some of them: ESC (0x1b) starts
sequences that move the cursor, clear the screen, retitle the window or, on some terminals,
write files. `frawd generate`, `chat` and `translate run` show such characters as escapes
(`\\x1b`) when they write to a terminal; a pipe or a file gets the text as generated.
"""

from __future__ import annotations

import sys

KEPT = "\n\t\r"  # (line breaks and tabs lay text out; they start no sequence)
# C0 controls, DEL and the C1 controls (U+0080-U+009F: U+009B is a one-character ESC [).
CONTROLS = [*range(0x20), 0x7F, *range(0x80, 0xA0)]
ESCAPES = {code: f"\\x{code:02x}" for code in CONTROLS if chr(code) not in KEPT}


def is_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def for_terminal(text: str, stream: object = None) -> str:
    """`text` as it may be written to `stream` (default: standard output): control
    characters other than newline, tab and carriage return as `\\xNN` where `stream` is a
    terminal, unchanged otherwise."""
    return text.translate(ESCAPES) if is_terminal(sys.stdout if stream is None else stream) else text
