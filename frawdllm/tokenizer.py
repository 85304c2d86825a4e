"""Tokenizers: text <-> integer ids, stored as one Hugging Face `tokenizer.json`.

Three kinds, all backed by the Rust `tokenizers` library (so encoding runs on all cores):

    bpe   byte-level BPE (GPT-2 style): text -> UTF-8 bytes -> learned merges.
          Every Unicode string round-trips exactly; the vocabulary size is chosen.
    char  one token per character seen in the training text (the classic tiny-shakespeare
          setup); a character never seen maps to <|unk|>.
    byte  the 256 raw bytes, no merges: id = 7 + byte value. Round-trips everything.

Seven special tokens sit at fixed ids 0..6 in every kind, so a config's pad/bos/eos ids
line up with any tokenizer FrawdLLM trains. `encode` treats its input as plain text:
a literal "<|eos|>" inside a document is spelled out, never turned into the control
token. Only `render_chat` (the one chat template of the project) emits role tokens:

    <|bos|><|system|>...<|eos|><|user|>...<|eos|><|assistant|>...<|eos|><|assistant|>

The kind is read back from the layout of tokenizer.json alone: a WordLevel model that
splits text into single characters is `char` (another one, imported, is `word`); a BPE
model whose byte-level pre-tokenizer does not split on a regex and that has no merges is
`byte`; any other model is `bpe` (byte-level or not: an imported SentencePiece-style one too).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

from .config import is_integer
from .errors import FrawdError, check_unicode
from .io import write_text_atomic

SPECIAL_TOKENS = ["<|pad|>", "<|unk|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
PAD_ID, UNK_ID, BOS_ID, EOS_ID, USER_ID, ASSISTANT_ID, SYSTEM_ID = range(7)
ROLES = ("system", "user", "assistant")
KINDS = ("bpe", "char", "byte")
TOKENIZER_FILE = "tokenizer.json"
MIN_BPE_VOCAB = len(SPECIAL_TOKENS) + 256  # specials + the byte alphabet, before any merge
MAX_TOKEN_ID = 2**32 - 1  # what the tokenizers library reads an id into (u32): any id above is past any vocabulary
MAX_BPE_VOCAB = 2**20  # 4x the largest vocabularies in use (~256k); the trainer allocates ~56 bytes an id up front
# End-of-text tokens of other families (GPT-2, Llama 3, Llama 2 / Mistral, Gemma): what ends a
# document for a tokenizer without FrawdLLM's specials (an imported model's)
FOREIGN_DOCUMENT_ENDS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def short_bpe_note(tok: Tokenizer, asked: int) -> str | None:
    """A note when a BPE tokenizer trained for `asked` tokens came out smaller (a small corpus)."""
    if tok.vocab_size >= asked:
        return None
    return (f"note: the corpus gave {tok.vocab_size:,} tokens, not the {asked:,} asked for "
            "(BPE stops once every word of the corpus is one token; a larger corpus gives more)")


def check_bpe_vocab_size(vocab_size: int) -> int:
    """`vocab_size` if a BPE tokenizer can be trained to it (10**10 aborted the trainer: 566 GB)."""
    if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
        raise FrawdError(f"BPE vocab_size must be between {MIN_BPE_VOCAB} (7 specials + 256 bytes) and "
                         f"{MAX_BPE_VOCAB:,}, got {vocab_size:,}")
    return vocab_size


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_OF_CHAR = {char: byte for byte, char in _bytes_to_unicode().items()}  # its inverse


def render_chat_text(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template as a string: <|bos|>, then <|role|>content<|eos|> per message,
    then <|assistant|> when the model should answer next."""
    parts = ["<|bos|>"]
    for i, message in enumerate(messages):
        role, content = _role_and_content(message, i)
        parts.append(f"<|{role}|>{content}<|eos|>")
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return "".join(parts)


def _role_and_content(message: Any, index: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise FrawdError(f"chat message {index} is not an object with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise FrawdError(f"chat message {index}: role {role!r} is not one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise FrawdError(f"chat message {index}: content must be a string, got {type(content).__name__}")
    return role, content


def _check_text(text: Any, taker: str, index: int | None = None) -> None:
    """A str that is valid UTF-8, else one line (bytes and None failed inside tokenizers);
    `index`: its place in a batch."""
    if not isinstance(text, str):
        at = "" if index is None else f" as text {index}"
        hint = ": decode it first, e.g. text.decode('utf-8')" if isinstance(text, (bytes, bytearray)) else ""
        raise FrawdError(f"{taker} takes text (str), got {type(text).__name__}{at}{hint}")
    check_unicode(text, "the text" if index is None else f"text {index}")


class Tokenizer:
    """A FrawdLLM tokenizer: a thin wrapper around a `tokenizers.Tokenizer` (`.backend`)."""

    def __init__(self, backend: _HFTokenizer, kind: str | None = None):
        # Truncation or padding saved in a tokenizer.json (a hub file saved after a call that
        # asked for them) cut and padded every text, silently: transformers' fast tokenizers
        # apply them only when a call asks, and here none does.
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        self.backend = backend
        self.kind = kind or _detect_kind(backend)
        # A twin that never parses special tokens out of text (see the module docstring).
        self._plain = _HFTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True

    # ---- basic properties -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def fingerprint(self) -> str:
        """sha256 of the canonical tokenizer.json text: equal fingerprints, equal tokenization."""
        return hashlib.sha256(self.backend.to_str().encode("utf-8")).hexdigest()

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry text can encode to (byte-level entries
        spell a byte a character; special tokens, never made from text, left out): a text's
        token count is at least its length over this, give or take what normalization
        changes. The server refuses a hopeless prompt by its length, without tokenizing a
        megabyte of it."""
        special = {t["content"] for t in self._setup.get("added_tokens", []) if t.get("special")}
        return max([len(token) for token in self.backend.get_vocab(with_added_tokens=True) if token not in special]
                   or [1])

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: a byte-level BPE token's bytes (possibly part of a
        character), a char token's UTF-8, a special token's own text, a byte-fallback token's
        byte ("<0xE6>"), another token's text as it reads after a token (a SentencePiece-style
        "▁the" is " the"); b"" past the vocabulary.
        An id that is not a non-negative integer is one line, as in `decode`.
        (For logprobs: a token's text alone may be half a character.)"""
        try:
            token = self.backend.id_to_token(token_id)
        except (OverflowError, TypeError):  # not a u32 (the check costs nothing on the path logprobs take)
            if not is_integer(token_id) or token_id < 0:
                raise FrawdError(f"token_bytes takes a non-negative integer token id, got {token_id!r}") from None
            token = None
        if token is None:
            return b""
        if self._byte_level and token_id not in self.special_ids and all(ch in _BYTE_OF_CHAR for ch in token):
            return bytes(_BYTE_OF_CHAR[ch] for ch in token)
        if self.kind == "char" or token_id in self.special_ids:
            return token.encode()
        if token_id in self.fallback_byte_ids:  # "<0xE6>": the byte (alone it decodes to U+FFFD)
            return bytes([int(token[3:5], 16)])
        # SentencePiece-style: decoded alone, "▁the" loses its space (a text's first token
        # does); after another token it keeps it
        anchor = self._anchor_id
        if anchor is not None:
            before = self.backend.decode([anchor], skip_special_tokens=False)
            both = self.backend.decode([anchor, token_id], skip_special_tokens=False)
            if both.startswith(before):
                return both[len(before):].encode()
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def _anchor_id(self) -> int | None:
        """A plain token that `token_bytes` decodes a token after (the first of the vocabulary
        that decodes to some text alone), or None."""
        skip = self.special_ids | self.fallback_byte_ids
        for token_id in range(min(self.vocab_size, 1024)):
            if token_id not in skip and self.backend.decode([token_id], skip_special_tokens=False):
                return token_id
        return None

    @functools.cached_property
    def _setup(self) -> dict:
        """tokenizer.json's content (the backend is not changed after construction)."""
        return json.loads(self.backend.to_str())

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether tokens spell bytes as GPT-2's byte-to-character map does (its decoder is
        ByteLevel). A SentencePiece-style token "é" is the character, not the byte 0xE9."""
        decoder = self._setup.get("decoder") or {}
        return any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in decoder.get("decoders", [decoder]))

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the added (special) tokens: FrawdLLM's seven, or an imported tokenizer's."""
        return frozenset(t["id"] for t in self._setup.get("added_tokens", []))

    @functools.cached_property
    def fallback_byte_ids(self) -> frozenset[int]:
        """The ids of a SentencePiece-style tokenizer's byte tokens ("<0x0A>"), where its
        decoder has ByteFallback: a run of them decodes as one group, and a group that is
        not valid UTF-8 becomes U+FFFD for every byte, an ASCII one before it too ("\\n"
        then half a character). Empty for the others (byte-level BPE decodes per byte)."""
        setup = self._setup
        decoder = setup.get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder]) if isinstance(d, dict)}
        if "ByteFallback" not in kinds:
            return frozenset()
        vocab = self.backend.get_vocab(with_added_tokens=False)
        return frozenset(i for name, i in vocab.items()
                         if len(name) == 6 and name.startswith("<0x") and name.endswith(">")
                         and all(c in "0123456789ABCDEFabcdef" for c in name[3:5]))

    def has_frawd_specials(self) -> bool:
        """True when the seven special tokens sit at ids 0..6 (every tokenizer trained here)."""
        return not self.missing_frawd_specials()

    def document_end_id(self) -> int | None:
        """The id that ends a document in token shards: <|eos|> (id 3), or for a tokenizer
        without FrawdLLM's specials (an imported GPT-2's, a Llama's) its own end-of-text
        token; None when it has neither."""
        if self.has_frawd_specials():
            return EOS_ID
        for name in FOREIGN_DOCUMENT_ENDS:
            found = self.backend.token_to_id(name)
            if found is not None:
                return found
        return None

    def unknown_id(self) -> int | None:
        """The id of the unknown token: <|unk|> (1) in every tokenizer FrawdLLM trains (byte-level
        ones never produce it); an imported one's own, or None (GPT-2's has none)."""
        if self.has_frawd_specials():
            return UNK_ID
        name = getattr(self.backend.model, "unk_token", None)
        return None if name is None else self.backend.token_to_id(name)

    def missing_frawd_specials(self) -> list[str]:
        """The special tokens not at their ids 0..6: `<|eos|>` when absent, `<|eos|> (id 9, not 3)`
        when elsewhere. Empty for every tokenizer trained here."""
        missing = []
        for i, tok in enumerate(SPECIAL_TOKENS):
            found = self.backend.token_to_id(tok)
            if found != i:
                missing.append(tok if found is None else f"{tok} (id {found}, not {i})")
        return missing

    # ---- encode / decode ----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Plain text -> ids. No special tokens are added or parsed."""
        try:
            return self._plain.encode(text, add_special_tokens=False).ids
        except TypeError:  # what `tokenizers` says of a lone surrogate (invalid UTF-8 via argv or JSON), or not a str
            _check_text(text, "encode")
            raise

    @functools.cached_property
    def prompt_prefix(self) -> list[int]:
        """The special tokens this tokenizer's own template (tokenizer.json's post-processor)
        puts before a text, as transformers' tokenizer adds them: an imported Llama's <s>.
        [] for every tokenizer trained here (they have no post-processor)."""
        probe = self._plain.encode("a", add_special_tokens=True)  # ("a": any content token ends the prefix)
        prefix = []
        for token_id, special in zip(probe.ids, probe.special_tokens_mask):
            if not special:
                return prefix
            prefix.append(token_id)
        return []  # no content token to tell a prefix from a suffix

    def encode_prompt(self, text: str) -> list[int]:
        """A text to generate from: `prompt_prefix` (the BOS the tokenizer's template adds,
        if any), then `encode(text)`. What transformers' tokenizer gives the model, less any
        suffix its template adds (an end token would end the prompt)."""
        return self.prompt_prefix + self.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once, in parallel on all cores (Rust threads, GIL released)."""
        if isinstance(texts, (str, bytes)):
            raise FrawdError(f"encode_batch takes a list of texts, not one {type(texts).__name__}: pass [text]")
        try:
            return [e.ids for e in self._plain.encode_batch_fast(texts, add_special_tokens=False)]
        except TypeError:  # (checked only now: numpy arrays and pandas Series of str pass above)
            if not isinstance(texts, Iterable):
                raise FrawdError(f"encode_batch takes a list of texts, got {type(texts).__name__}") from None
            for i, text in enumerate(texts):
                _check_text(text, "encode_batch", i)
            # texts all right, so the container was not one the tokenizers library takes (a generator)
            raise FrawdError(f"encode_batch takes a list of texts, got {type(texts).__name__}: pass list(...)") \
                from None

    def decode(self, ids: Iterable, skip_special_tokens: bool = False) -> str:
        """Ids (a list, numpy array or 1-D tensor) -> text. An id that is not a non-negative
        integer is refused in one line (104.9, -1); one past this tokenizer's
        vocabulary decodes to nothing (a model's vocabulary may be larger than its tokenizer's:
        an untrained model can sample such an id)."""
        given = ids
        if hasattr(ids, "tolist"):
            ids = ids.tolist()  # (a 0-d tensor or numpy integer: an int)
        elif isinstance(ids, Iterable) and not isinstance(ids, (str, bytes)):
            ids = list(ids)
        if not isinstance(ids, list):
            raise FrawdError(f"decode takes a sequence of token ids, got {type(given).__name__}")
        bad = next((i for i in ids if not is_integer(i) or i < 0), None)
        if bad is not None:
            what = "a nested list" if isinstance(bad, list) else repr(bad)
            raise FrawdError(f"decode takes non-negative integer token ids, got {what}")
        try:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        except OverflowError:  # an id past any vocabulary (tokenizers reads u32): nothing, as past this one
            return self.backend.decode([i for i in ids if i <= MAX_TOKEN_ID], skip_special_tokens=skip_special_tokens)

    def unknown_characters(self, text: str) -> set[str]:
        """Characters of `text` a char-level tokenizer maps to <|unk|> (empty for bpe/byte)."""
        if self.kind != "char":
            return set()
        vocab = self.backend.get_vocab(with_added_tokens=False)
        return {ch for ch in set(text) if ch not in vocab}

    # ---- chat -----------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The chat template as ids.

        Equal to encoding `render_chat_text(...)` with special tokens parsed, except that
        message contents are always plain text (a literal "<|eos|>" typed by a user stays text).
        """
        ids = [BOS_ID]
        for role_id, content in self.chat_turns(messages):
            ids.append(role_id)
            ids.extend(content)
        if add_generation_prompt:
            ids.append(ASSISTANT_ID)
        return ids

    def chat_turns(self, messages: list[dict]) -> list[tuple[int, list[int]]]:
        """Each message of the chat template as (its role's id, its content's ids + <|eos|>):
        `render_chat` is <|bos|> and these, in order (SFT masks them turn by turn)."""
        self.require_frawd_specials("this tokenizer", "so it cannot render chats")
        turns = []
        for i, message in enumerate(messages):
            role, content = _role_and_content(message, i)
            turns.append((SPECIAL_TOKENS.index(f"<|{role}|>"), self.encode(content) + [EOS_ID]))
        return turns

    def require_frawd_specials(self, where: str, why: str) -> "Tokenizer":
        """This tokenizer, or a FrawdError naming `where` it came from, the special tokens it
        lacks and `why` they are needed."""
        missing = self.missing_frawd_specials()
        if missing:
            raise FrawdError(f"{where}: lacks FrawdLLM's special tokens at ids 0..6 (missing: {', '.join(missing)}), "
                             f"{why}")
        return self

    # ---- files ------------------------------------------------------------------------------
    def save(self, path: str | Path, replace: bool = True) -> None:
        """Write tokenizer.json atomically (`path` is the file, or a directory to hold it);
        `replace` False: refuse a file that another process wrote there meanwhile. A path
        ending in "/" is a directory, made if missing (it was a file of that name)."""
        folder = str(path).endswith(("/", os.sep))
        path = Path(path)
        if path.is_dir() or folder:
            path = path / TOKENIZER_FILE
        write_text_atomic(path, self.to_json(), replace=replace)

    def to_json(self) -> str:
        """The tokenizer.json text (what `save` writes)."""
        return self.backend.to_str(pretty=True)

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        return cls(_HFTokenizer.from_str(text))

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """Load a tokenizer.json file, or the tokenizer.json inside a directory."""
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise FrawdError(f"tokenizer not found: {path}")
        try:  # (read here: the tokenizers library called an unreadable file "not valid JSON", and
            raw = path.read_bytes()  # takes no path that is not UTF-8)
        except OSError as exc:
            raise FrawdError(f"{path}: cannot read ({exc.strerror or exc})") from None
        try:
            backend = _HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            try:  # its message reads as a JSON syntax error even for JSON that is not a tokenizer
                json.loads(raw)
                what = f"JSON, but not a tokenizer (the tokenizers library: {first_line})"
            except ValueError:
                what = f"not valid JSON ({first_line})"
            raise FrawdError(f"{path}: not a valid tokenizer.json: {what}") from None
        return cls(backend)

    def check_fits(self, vocab_size: int, where: str | Path) -> "Tokenizer":
        """This tokenizer, if all its ids are inside a model's vocabulary of `vocab_size`."""
        if self.vocab_size > vocab_size:
            raise FrawdError(f"{where}: the tokenizer has {self.vocab_size} ids but the model only {vocab_size}")
        return self

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"


def _detect_kind(backend: _HFTokenizer) -> str:
    setup = json.loads(backend.to_str())
    pre = setup.get("pre_tokenizer") or {}
    model = setup.get("model") or {}
    if isinstance(backend.model, models.WordLevel):
        # Only the layout `_build_char` writes is char-level: another word-level model's
        # tokens are words, and a cut inside a document would split one.
        return "char" if pre.get("type") == "Split" and pre.get("pattern") == {"Regex": r"[\s\S]"} else "word"
    if (model.get("type") == "BPE" and not model.get("merges")
            and pre.get("type") == "ByteLevel" and pre.get("use_regex") is False):
        return "byte"
    return "bpe"


# ---- training -------------------------------------------------------------------------------

def train_tokenizer(texts: Iterable[str], kind: str = "bpe", vocab_size: int = 8192,
                    show_progress: bool = False) -> Tokenizer:
    """Build a tokenizer from an iterable of documents.

    `vocab_size` (specials included) applies to `bpe` only: `char` takes the characters of
    the text, `byte` is always 256 + 7.
    """
    if isinstance(texts, (str, bytes)):  # (a str iterates by character: a tokenizer without merges)
        raise FrawdError(f"texts must be an iterable of documents, not one {type(texts).__name__}: pass [text]")
    if kind == "bpe":
        return _train_bpe(texts, vocab_size, show_progress)
    if kind == "char":
        return _build_char(texts)
    if kind == "byte":
        return byte_tokenizer()
    raise FrawdError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(KINDS)}")


def _byte_level(backend: _HFTokenizer, use_regex: bool) -> None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    backend.decoder = decoders.ByteLevel()


_WORD_START = re.compile(r"(?<=\S)[ \t\r\n]")
_TRAIN_PIECE_CHARS = 1 << 16


def cut_at_word_starts(text: str, chars: int) -> list[str]:
    """`text` cut into pieces of about `chars` characters (or more) where byte-level BPE's
    GPT-2 regex starts a pre-token anyway: at a space, tab or newline right after a
    non-space character (no pattern spans a non-space and a following whitespace character,
    and none looks behind). Each piece then splits into the pre-tokens the whole would, so
    training counts the same words and encoding gives the same ids; a text with no such
    place after `chars` is one piece."""
    pieces, start = [], 0
    while len(text) - start > chars:
        match = _WORD_START.search(text, start + chars)
        if match is None:
            break
        pieces.append(text[start:match.start()])
        start = match.start()
    pieces.append(text[start:])
    return pieces


def _train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool) -> Tokenizer:
    check_bpe_vocab_size(vocab_size)
    backend = _HFTokenizer(models.BPE())
    _byte_level(backend, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # placed first: ids 0..6
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    seen = _CountingIterator(texts)
    # A long document goes in pieces: the trainer's pre-tokenizer holds ~90 bytes a character
    # of the text it is given (a 40 MB one-line file took 3.7 GB; in pieces, 0.46 GB).
    pieces = (piece for text in seen for piece in cut_at_word_starts(text, _TRAIN_PIECE_CHARS))
    with _stdout_to_stderr() if show_progress else nullcontext():
        _interruptible(lambda: backend.train_from_iterator(pieces, trainer))
    if seen.count == 0:
        raise FrawdError("cannot train a tokenizer on an empty corpus")
    return Tokenizer(backend, "bpe")


def _interruptible(work: Callable[[], Any]) -> None:
    """Run `work` in a thread the main thread waits on a tenth of a second at a time. Python
    handles Ctrl-C (and the CLI's SIGTERM) only in the main thread between bytecodes, so in
    `tokenizers`' Rust merge stage (which releases the GIL) an interrupt waited until training
    ended (12 s on a 33 MB corpus). The abandoned thread dies with the process."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # (re-raised in the caller's thread)
            failed.append(exc)

    thread = threading.Thread(target=run, name="frawd-bpe-trainer", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if failed:
        raise failed[0]


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at 2 for the block. The `tokenizers` trainer draws its
    progress bars on stderr but ends each stage with an empty line on stdout, which would
    lead a command's output."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (AttributeError, OSError, ValueError):  # no stdout to guard
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _build_char(texts: Iterable[str]) -> Tokenizer:
    chars: set[str] = set()
    for text in texts:
        chars.update(text)
    if not chars:
        raise FrawdError("cannot build a char tokenizer from an empty corpus")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(chars):
        vocab[ch] = len(vocab)
    backend = _HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per char
    backend.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    backend.add_special_tokens(SPECIAL_TOKENS)
    return Tokenizer(backend, "char")


def byte_tokenizer() -> Tokenizer:
    """The raw-byte tokenizer: id = 7 + byte value, 263 ids in all. Needs no training."""
    byte_to_char = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[byte_to_char[b]] = len(SPECIAL_TOKENS) + b
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    _byte_level(backend, use_regex=False)
    backend.add_special_tokens(SPECIAL_TOKENS)
    return Tokenizer(backend, "byte")


class _CountingIterator:
    """Pass texts through while counting those with any text in them (to tell an empty
    corpus apart: documents that are all "" are one too, as for a char tokenizer)."""

    def __init__(self, texts: Iterable[str]):
        self._it = iter(texts)
        self.count = 0

    def __iter__(self) -> "_CountingIterator":
        return self

    def __next__(self) -> str:
        text = next(self._it)
        self.count += bool(text)
        return text
