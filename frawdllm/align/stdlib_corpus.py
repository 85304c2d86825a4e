"""`stdlib-instruct` and `stdlib-prefs`: instruction and preference data made offline, at
run time, from this interpreter's standard library (like `stdlib` for pretraining).

Every top-level function with a docstring, short enough for a small model's context
(`MAX_SOURCE_CHARS`), gives two instructions:

    user: Write a Python function `name(args)` that: <the docstring's first paragraph>
    assistant: <the function's source, its docstring removed>

    user: Summarize this Python function in one line:\\n<the source>
    assistant: <the docstring's first sentence>

and one preference pair (the first instruction's prompt; chosen = the real function;
rejected by a rule chosen by a hash of the function):

    even hash: the same source with the body's indentation removed, which does not parse
    odd hash:  the body of another function (the next one in the corpus whose body is not
               this one's), under this function's signature: code that parses but does
               something else

A pair never rejects its own answer (no preference to learn; `frawd dpo` refuses such a
record): `stat.S_ISDOOR`, `S_ISPORT` and `S_ISWHT` all have the body `return False`, so
S_ISDOOR's rejected answer is the body of `stat.filemode`, the first after it that differs.

Both requests from one function fall in the same split: train/val is decided by a hash
of the function's module and name (`is_held_out`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import sys
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..data.sources import stdlib_files

CORPUS_VERSION = 1  # bump when the extraction rules change
CORPORA = {"stdlib-instruct": "sft", "stdlib-prefs": "dpo"}
NAME_FOR = {kind: name for name, kind in CORPORA.items()}
MAX_SOURCE_CHARS = 360  # the function without its docstring
MAX_DOC_CHARS = 200  # the docstring's first paragraph
WRITE = "Write a Python function `{signature}` that: {doc}"
SUMMARIZE = "Summarize this Python function in one line:\n{source}"


@dataclass(frozen=True)
class Function:
    key: str  # module:name, the split key
    signature: str  # name(args)
    doc: str  # the docstring's first paragraph, on one line
    summary: str  # its first sentence
    source: str  # the function without its docstring
    header_lines: int  # lines of the `def ...:` header (decorators included)


def _first_paragraph(doc: str) -> str:
    return " ".join(textwrap.dedent(doc).strip().split("\n\n")[0].split())


def _first_sentence(paragraph: str) -> str:
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[:end + 1]


def _functions_in(path, root: str) -> Iterator[Function]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    lines = text.splitlines()
    module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2:
            continue
        paragraph = _first_paragraph(doc)
        if not 10 <= len(paragraph) <= MAX_DOC_CHARS:
            continue
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        doc_node = node.body[0]
        kept = lines[first - 1:doc_node.lineno - 1] + lines[doc_node.end_lineno:node.end_lineno]
        source = "\n".join(kept)
        if len(source) > MAX_SOURCE_CHARS or "\t" in source:
            continue
        try:
            ast.parse(source)
        except SyntaxError:  # e.g. a docstring sharing a line with code
            continue
        signature = f"{node.name}({ast.unparse(node.args)})"
        yield Function(f"{module}:{node.name}", signature, paragraph, _first_sentence(paragraph), source,
                       doc_node.lineno - first)


@functools.lru_cache(maxsize=1)
def functions() -> tuple[Function, ...]:
    """The corpus's functions, in the stdlib's sorted file order. Parsing the whole stdlib
    takes seconds, so the result is cached per interpreter in the user's cache folder."""
    from ..io import write_json_atomic
    from ..train.device import user_cache_dir

    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    key = hashlib.sha256(repr((CORPUS_VERSION, sys.version, root, MAX_SOURCE_CHARS, MAX_DOC_CHARS,
                               [(str(p), p.stat().st_size) for p in files])).encode()).hexdigest()[:16]
    cache = user_cache_dir() / f"stdlib_corpus_{key}.json"
    try:
        return tuple(Function(**item) for item in json.loads(cache.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        pass
    found = tuple(f for path in files for f in _functions_in(path, root))
    try:
        write_json_atomic(cache, [dataclasses.asdict(f) for f in found])
    except OSError:
        pass  # a read-only cache folder: parse again next time
    return found


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def write_request(fn: Function) -> str:
    return WRITE.format(signature=fn.signature, doc=fn.doc)


def rejected_answer(fn: Function, others: Iterable[Function]) -> str | None:
    """The documented rule: unindented (does not parse), or the body of the first of
    `others` that gives other text than `fn.source`; None if none does."""
    lines = fn.source.splitlines()
    if _hash(fn.key) % 2 == 0:
        candidates = ["\n".join(lines[:fn.header_lines] + [line.lstrip() for line in lines[fn.header_lines:]])]
    else:
        candidates = ("\n".join(lines[:fn.header_lines] + other.source.splitlines()[other.header_lines:])
                      for other in others)
    return next((text for text in candidates if text != fn.source), None)


def records(name: str) -> Iterator[tuple[str, dict, str]]:
    """(where, record, split key) of a built-in corpus."""
    found = functions()
    for i, fn in enumerate(found):
        where = f"{name}:{fn.key}"
        request = write_request(fn)
        if name == "stdlib-instruct":
            yield where, {"prompt": request, "response": fn.source}, fn.key
            yield where, {"prompt": SUMMARIZE.format(source=fn.source), "response": fn.summary}, fn.key
        else:
            following = (found[(i + k) % len(found)] for k in range(1, len(found)))  # wrapping around
            rejected = rejected_answer(fn, following)
            if rejected is not None:  # None: every body is this one's (no pair to make)
                yield where, {"prompt": request, "chosen": fn.source, "rejected": rejected}, fn.key


def defines_function(answer: str) -> bool:
    """The benchmark's test of an answer: it parses and defines a function."""
    try:
        tree = ast.parse(answer)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(tree))
