"""Tokenizers: round trips, fixed special ids, the chat template, files, and BPE against a
naive pure-Python BPE encoder that reads the merges from tokenizer.json."""

import json
import random
import os
import re
import subprocess
import sys

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from frawdllm.errors import FrawdError
from frawdllm.tokenizer import (ASSISTANT_ID, BOS_ID, EOS_ID, SPECIAL_TOKENS, SYSTEM_ID, UNK_ID, USER_ID,
                                Tokenizer, byte_tokenizer, cut_at_word_starts, render_chat_text, train_tokenizer)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé – ça va? 日本語のテキスト 🙂\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n",
    "Numbers 12345 and 2024-01-01, tabs\tand  double  spaces.\r\nWindows line.\n",
] * 40


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_tokenizer(CORPUS, "bpe", vocab_size=400)


@pytest.fixture(scope="module")
def char() -> Tokenizer:
    return train_tokenizer(["hello world\n", "abc"], "char")


@pytest.fixture(scope="module")
def byte() -> Tokenizer:
    return byte_tokenizer()


@pytest.fixture(scope="module")
def all_kinds(bpe, char, byte) -> dict:
    return {"bpe": bpe, "char": char, "byte": byte}


@pytest.mark.parametrize("kind", ["bpe", "char", "byte"])
def test_special_tokens_sit_at_ids_0_to_6_in_every_kind(all_kinds, kind):
    tok = all_kinds[kind]
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(7))
    assert (BOS_ID, EOS_ID, USER_ID, ASSISTANT_ID, SYSTEM_ID, UNK_ID) == (2, 3, 4, 5, 6, 1)
    assert tok.has_frawd_specials()
    assert tok.decode(list(range(7))) == "".join(SPECIAL_TOKENS)
    assert tok.decode([BOS_ID, EOS_ID], skip_special_tokens=True) == ""


def test_truncation_or_padding_saved_in_a_tokenizer_json_is_not_applied(bpe, tmp_path):
    """A hub tokenizer.json saved after a call that asked for truncation and padding keeps
    them: every text was cut to 8 ids and padded to 24, silently (data prepare wrote 25
    tokens a document). transformers applies them only when a call asks."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(bpe.backend.to_str())
    backend.enable_truncation(max_length=8)
    backend.enable_padding(length=24, pad_id=0, pad_token=SPECIAL_TOKENS[0])
    (tmp_path / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    loaded = Tokenizer.load(tmp_path / "tokenizer.json")
    long, short = CORPUS[1], "hi"
    assert loaded.encode(long) == bpe.encode(long) and len(bpe.encode(long)) > 8
    assert loaded.encode(short) == bpe.encode(short) and len(bpe.encode(short)) < 24
    assert loaded.encode_batch([long, short]) == [bpe.encode(long), bpe.encode(short)]
    assert loaded.fingerprint == bpe.fingerprint  # the same tokenization, the same tokenizer


def test_save_to_a_path_ending_in_a_slash_makes_that_folder(byte, tmp_path):
    """save("tok/new/") wrote a file named tok/new (the slash dropped by Path)."""
    byte.save(f"{tmp_path / 'new'}/")
    assert (tmp_path / "new").is_dir() and Tokenizer.load(tmp_path / "new").fingerprint == byte.fingerprint


def test_special_tokens_at_other_ids_are_not_frawds(char):
    """A tokenizer whose <|bos|> and <|eos|> swapped ids has the tokens but not at the ids the
    chat template and the sampler use (EOS_ID would end replies at every <|bos|>)."""
    data = json.loads(char.to_json())
    vocab = data["model"]["vocab"]
    vocab["<|bos|>"], vocab["<|eos|>"] = vocab["<|eos|>"], vocab["<|bos|>"]
    for token in data["added_tokens"]:
        token["id"] = {"<|bos|>": EOS_ID, "<|eos|>": BOS_ID}.get(token["content"], token["id"])
    swapped = Tokenizer.from_json(json.dumps(data))
    assert swapped.token_to_id("<|eos|>") == BOS_ID
    assert not swapped.has_frawd_specials()
    assert swapped.missing_frawd_specials() == [f"<|bos|> (id {EOS_ID}, not {BOS_ID})",
                                                f"<|eos|> (id {BOS_ID}, not {EOS_ID})"]


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_bpe_round_trips_any_unicode_string(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_byte_tokenizer_is_utf8_bytes_plus_seven_and_round_trips(byte, text):
    ids = byte.encode(text)
    assert ids == [b + 7 for b in text.encode("utf-8")]
    assert byte.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="helo wrdabc\n", max_size=100))
def test_char_tokenizer_round_trips_text_of_its_alphabet(char, text):
    ids = char.encode(text)
    assert len(ids) == len(text)
    assert char.decode(ids) == text


def test_char_vocab_is_specials_then_sorted_corpus_characters(char):
    chars = sorted(set("hello world\nabc"))
    assert char.vocab_size == 7 + len(chars)
    assert [char.id_to_token(7 + i) for i in range(len(chars))] == chars


def test_char_tokenizer_maps_unseen_characters_to_unk_and_says_which(char):
    ids = char.encode("hex!")
    assert ids[:2] == [char.token_to_id("h"), char.token_to_id("e")]
    assert ids[2:] == [UNK_ID, UNK_ID]
    assert char.decode(ids) == "he<|unk|><|unk|>"
    assert char.unknown_characters("hex!") == {"x", "!"}


def test_bpe_and_byte_have_no_unknown_characters(bpe, byte):
    assert bpe.unknown_characters("日本 x") == set() == byte.unknown_characters("日本 x")
    assert UNK_ID not in bpe.encode("never seen: ☃ ∰ 𝔘")


def test_bpe_trains_to_the_requested_vocab_size():
    tok = train_tokenizer(CORPUS, "bpe", vocab_size=300)
    assert tok.vocab_size == 300


def _naive_bpe_encode(tokenizer_json: dict, text: str) -> list[int]:
    """GPT-2 byte-level BPE written out: regex pre-tokens -> byte alphabet -> lowest-rank merge first."""
    vocab = tokenizer_json["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in tokenizer_json["model"]["merges"]]
    rank = {pair: i for i, pair in enumerate(merges)}
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_char = {b: chr(c) for b, c in zip(bs, cs)}
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    ids = []
    for word in pattern.findall(text):
        symbols = [byte_char[b] for b in word.encode("utf-8")]
        while len(symbols) > 1:
            pairs = [(rank.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            best, i = min(pairs)
            if best == float("inf"):
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        ids.extend(vocab[s] for s in symbols)
    return ids


def test_bpe_encoding_equals_a_naive_python_bpe_with_the_same_merges(bpe):
    setup = json.loads(bpe.backend.to_str())
    assert setup["model"]["merges"], "the test needs a tokenizer with merges"
    for text in CORPUS[:4] + ["  indented\n\n\ttab  x's we'll 3.14 ½ 日本語 🙂🙂"]:
        assert bpe.encode(text) == _naive_bpe_encode(setup, text)


def test_encode_keeps_special_token_strings_as_plain_text(bpe, byte):
    char = train_tokenizer(["a<|eos|>b<|user|>"], "char")  # knows the characters < | > e o s u r
    text = "a<|eos|>b<|user|>"
    for tok in (bpe, char, byte):
        ids = tok.encode(text)
        assert not set(ids) & set(range(7)), tok.kind
        assert tok.decode(ids) == text
    assert len(char.encode(text)) == len(text)


@pytest.mark.parametrize("kind", ["bpe", "char", "byte"])
def test_encode_batch_equals_encode_one_by_one(all_kinds, kind):
    tok = all_kinds[kind]
    texts = ["hello world", "", "abc abc\n", "hello"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


@pytest.mark.parametrize("kind", ["bpe", "char", "byte"])
def test_save_and_load_recover_kind_and_tokenization_from_tokenizer_json_alone(all_kinds, kind, tmp_path):
    tok = all_kinds[kind]
    tok.save(tmp_path)  # a directory: writes tokenizer.json inside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]
    loaded = Tokenizer.load(tmp_path)
    assert loaded.kind == kind
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.fingerprint == tok.fingerprint
    assert loaded.encode("hello world") == tok.encode("hello world")
    assert Tokenizer.load(tmp_path / "tokenizer.json").kind == kind


def test_load_names_the_missing_or_corrupt_file(tmp_path):
    with pytest.raises(FrawdError, match="tokenizer not found"):
        Tokenizer.load(tmp_path / "nope.json")
    with pytest.raises(FrawdError, match="tokenizer not found"):
        Tokenizer.load(tmp_path)  # a directory without tokenizer.json
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": 3')
    with pytest.raises(FrawdError, match="not a valid tokenizer.json: not valid JSON"):
        Tokenizer.load(bad)
    bad.write_text('{"a": 1}')  # JSON, but not a tokenizer: not reported as a syntax error
    with pytest.raises(FrawdError, match="not a valid tokenizer.json: JSON, but not a tokenizer"):
        Tokenizer.load(bad)



def test_an_unreadable_tokenizer_is_said_so_and_a_path_in_another_encoding_loads(tmp_path, monkeypatch):
    """An unreadable tokenizer.json was "not valid JSON (Permission denied)"; one in a folder
    named in Latin-1 was "JSON, but not a tokenizer" (the library takes no such path)."""
    import os
    import pathlib

    folder = tmp_path / os.fsdecode(b"tok\xe9")
    folder.mkdir()
    byte_tokenizer().save(folder)
    assert Tokenizer.load(folder).vocab_size == byte_tokenizer().vocab_size

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "read_bytes", denied)  # (the tests run as root: chmod 000 reads)
    with pytest.raises(FrawdError, match=r"tokenizer.json: cannot read \(Permission denied\)$"):
        Tokenizer.load(folder)


def test_training_rejects_bad_inputs():
    with pytest.raises(FrawdError, match="not one str: pass \\[text\\]"):  # (trained by character: no merges)
        train_tokenizer("one long text " * 50, "bpe", vocab_size=300)
    with pytest.raises(FrawdError, match="between 263 .* got 100$"):
        train_tokenizer(CORPUS, "bpe", vocab_size=100)
    with pytest.raises(FrawdError, match="empty corpus"):
        train_tokenizer([], "bpe")
    with pytest.raises(FrawdError, match="empty corpus"):
        train_tokenizer([], "char")
    for kind in ("bpe", "char"):  # (documents that are all "": bpe built a tokenizer of its alphabet alone)
        with pytest.raises(FrawdError, match="empty corpus"):
            train_tokenizer(["", ""], kind)
    with pytest.raises(FrawdError, match="unknown tokenizer kind"):
        train_tokenizer(CORPUS, "wordpiece")


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


def test_chat_template_text_is_bos_then_role_content_eos_then_assistant():
    assert render_chat_text(CHAT) == ("<|bos|><|system|>Be brief.<|eos|><|user|>Hi there<|eos|>"
                                      "<|assistant|>Hello!<|eos|><|user|>Bye<|eos|><|assistant|>")
    assert render_chat_text(CHAT[:2], add_generation_prompt=False) == \
        "<|bos|><|system|>Be brief.<|eos|><|user|>Hi there<|eos|>"


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_render_chat_equals_encoding_the_rendered_text_with_specials_parsed(all_kinds, kind):
    tok = all_kinds[kind]
    for gen in (True, False):
        expected = tok.backend.encode(render_chat_text(CHAT, gen), add_special_tokens=False).ids
        assert tok.render_chat(CHAT, gen) == expected
    ids = tok.render_chat(CHAT)
    assert ids[0] == BOS_ID and ids[1] == SYSTEM_ID and ids[-1] == ASSISTANT_ID
    assert ids.count(EOS_ID) == 4 and ids.count(USER_ID) == 2


def test_render_chat_keeps_special_strings_in_content_as_text(bpe):
    ids = bpe.render_chat([{"role": "user", "content": "say <|eos|> now"}], add_generation_prompt=False)
    assert ids.count(EOS_ID) == 1 and ids[-1] == EOS_ID
    assert bpe.decode(ids) == "<|bos|><|user|>say <|eos|> now<|eos|>"


def test_render_chat_rejects_bad_messages(bpe):
    with pytest.raises(FrawdError, match="role 'bot'"):
        bpe.render_chat([{"role": "bot", "content": "x"}])
    with pytest.raises(FrawdError, match="content must be a string"):
        render_chat_text([{"role": "user", "content": None}])


def test_cli_trains_each_kind_into_out_dir(tmp_path):
    from click.testing import CliRunner

    from frawdllm.cli import cli

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS), encoding="utf-8")
    for kind, size in (("bpe", ["--vocab-size", "300"]), ("char", []), ("byte", [])):
        out = tmp_path / kind
        result = CliRunner().invoke(cli, ["tokenizer", "train", "--data", str(corpus), "--kind", kind,
                                          *size, "--out", str(out)])
        assert result.exit_code == 0, result.output
        tok = Tokenizer.load(out / "tokenizer.json")
        assert tok.kind == kind
        assert tok.vocab_size == {"bpe": 300, "char": 7 + len(set("".join(CORPUS))), "byte": 263}[kind]


def test_cli_reports_a_missing_corpus_as_one_line(tmp_path, capfd):
    from cli_helpers import run_cli

    capfd.readouterr()
    code, _, stderr = run_cli(capfd, "tokenizer", "train", "--data", tmp_path / "missing.txt",
                              "--out", tmp_path / "t")  # (in this process; captured at the descriptors)
    assert code == 1
    assert stderr.strip().count("\n") == 0
    assert "data source not found" in stderr and "missing.txt" in stderr



@pytest.mark.parametrize("size", ["0", "-5", "100", "1048577", "10000000000"])
def test_cli_refuses_a_bpe_vocab_size_outside_263_to_2_pow_20_zero_included(tmp_path, capsys, size):
    from cli_helpers import run_cli

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS), encoding="utf-8")
    code, out, err = run_cli(capsys, "tokenizer", "train", "--data", corpus, "--vocab-size", size,
                             "--out", tmp_path / "t")
    assert code == 1 and not out and not (tmp_path / "t").exists()  # 0 is a size given, not the default
    # (10**10 aborted the trainer, asking for 566 GB, after reading the corpus)
    assert err == (f"frawd: error: BPE vocab_size must be between 263 (7 specials + 256 bytes) and 1,048,576, "
                   f"got {int(size):,}\n")


def test_the_ends_of_the_bpe_vocab_size_range_are_accepted():
    from frawdllm.tokenizer import check_bpe_vocab_size

    assert check_bpe_vocab_size(263) == 263 and check_bpe_vocab_size(2**20) == 2**20
    assert train_tokenizer(CORPUS, vocab_size=263).vocab_size == 263


def test_vocab_size_outside_bpe_gets_a_note_and_a_byte_tokenizer_says_it_read_nothing(tmp_path, capsys):
    from cli_helpers import run_cli

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS), encoding="utf-8")
    code, out, err = run_cli(capsys, "tokenizer", "train", "--data", corpus, "--kind", "byte", "--out", tmp_path / "b")
    assert code == 0 and "documents: none read" in out, out  # (it said "documents: 0")
    code, _, err = run_cli(capsys, "pretrain", "--data", corpus, "--tokenizer", "char", "--vocab-size", "500",
                           "--max-steps", "1", "--dry-run", "--out", tmp_path / "run")
    assert code == 0 and err.count("note: --vocab-size applies to BPE only; a char tokenizer") == 1, err
    # a config file's vocab_size, with --tokenizer char typed: the flag replaces the file's BPE (no note)
    config = tmp_path / "run.yaml"
    config.write_text("tokenizer: bpe\nvocab_size: 500\n")
    code, out, err = run_cli(capsys, "pretrain", "--config", config, "--data", corpus, "--tokenizer", "char",
                             "--max-steps", "1", "--dry-run", "--out", tmp_path / "run")
    assert code == 0 and "note:" not in err and "a char tokenizer trained on it" in out, (out, err)


def test_decode_accepts_numpy_arrays_and_tensors(bpe):
    import numpy as np
    import torch

    ids = bpe.encode("hello world")
    assert bpe.decode(np.array(ids, dtype=np.uint16)) == "hello world"
    assert bpe.decode(torch.tensor(ids)) == "hello world"


def test_decode_refuses_ids_that_are_not_non_negative_integers(bpe):
    """104.9 decoded as 104 and -1 overflowed inside tokenizers; an id past the vocabulary
    decodes to nothing (a model may be larger than its tokenizer)."""
    import torch

    ids = bpe.encode("hello world")
    for bad, shown in (([ids[0] + 0.9], repr(ids[0] + 0.9)), ([-1], "-1"), (torch.tensor([ids]), "a nested list")):
        with pytest.raises(FrawdError, match=rf"^decode takes non-negative integer token ids, got {re.escape(shown)}$"):
            bpe.decode(bad)
    assert bpe.decode(ids + [bpe.vocab_size + 5]) == "hello world"


def test_ids_past_any_vocabulary_decode_to_nothing_and_negative_ids_are_one_line(bpe):
    """2**40 overflowed inside tokenizers (an id past the vocabulary decodes to nothing), and
    token_bytes(-1) too (b"" past the vocabulary; a negative id is refused, as decode does)."""
    ids = bpe.encode("hello world")
    assert bpe.decode(ids[:1] + [2**40, 2**32] + ids[1:]) == "hello world"
    assert bpe.token_bytes(2**40) == bpe.token_bytes(bpe.vocab_size) == b""
    with pytest.raises(FrawdError, match=r"^token_bytes takes a non-negative integer token id, got -1$"):
        bpe.token_bytes(-1)


MISUSED_CALLS = r"""
from frawdllm.errors import FrawdError
from frawdllm.tokenizer import byte_tokenizer
tok = byte_tokenizer()
for call in [lambda: tok.encode(b"hi"), lambda: tok.encode(None), lambda: tok.decode(5), lambda: tok.decode("ab"),
             lambda: tok.encode_batch("ab"), lambda: tok.encode_batch(5), lambda: tok.encode_batch(["a", None]),
             lambda: tok.encode_batch(["a", "\ud800"]), lambda: tok.encode_batch(t for t in ["a"]),
             lambda: tok.token_bytes(2.0)]:
    try:
        call()
        print("accepted")
    except FrawdError as exc:
        print(exc)
"""


def test_arguments_of_the_wrong_type_are_one_line():
    """bytes or None to encode failed inside check_unicode, decode(5) with "'int' object is
    not iterable", encode_batch("ab") with a Rust TypeError (a user's script, without the
    tests' type checks, which would refuse them first)."""
    from cli_helpers import script_lines

    assert script_lines(MISUSED_CALLS) == [
        "encode takes text (str), got bytes: decode it first, e.g. text.decode('utf-8')",
        "encode takes text (str), got NoneType",
        "decode takes a sequence of token ids, got int",
        "decode takes a sequence of token ids, got str",
        "encode_batch takes a list of texts, not one str: pass [text]",
        "encode_batch takes a list of texts, got int",
        "encode_batch takes text (str), got NoneType as text 1",
        "text 1 is not valid UTF-8 (a lone surrogate or undecodable byte at character 0)",
        "encode_batch takes a list of texts, got generator: pass list(...)",  # (the tokenizers library's TypeError)
        "token_bytes takes a non-negative integer token id, got 2.0",
    ]


def test_bpe_training_progress_never_writes_to_stdout(capfd):
    train_tokenizer(CORPUS, "bpe", vocab_size=300, show_progress=True)
    assert capfd.readouterr().out == ""  # `tokenizers` ends each progress stage with a newline on stdout


def test_cli_stdout_holds_only_key_value_lines(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS), encoding="utf-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n', encoding="utf-8")
    frawd = [sys.executable, "-c", "from frawdllm.cli import main; main()", "tokenizer", "train"]
    proc = subprocess.run(frawd + ["--data", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "t")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "kind: bpe" and "" not in proc.stdout.splitlines()
    proc = subprocess.run(frawd + ["--data", str(bad), "--vocab-size", "300", "--out", str(tmp_path / "u")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("frawd: error: ") and proc.stderr.count("\n") == 1


def test_cli_refuses_to_replace_a_tokenizer_unless_overwrite(tmp_path, capsys, monkeypatch):
    from cli_helpers import run_cli

    import frawdllm.tokenizer as tokenizer_module

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS), encoding="utf-8")
    out = tmp_path / "tok"
    train = ["tokenizer", "train", "--data", corpus, "--vocab-size", "300"]
    assert run_cli(capsys, *train, "--out", out)[0] == 0
    first = (out / "tokenizer.json").read_text()

    def never(*args, **kwargs):
        raise AssertionError("trained before refusing")

    with monkeypatch.context() as patched:
        patched.setattr(tokenizer_module, "train_tokenizer", never)
        for target, what in ((out, "directory"), (out / "tokenizer.json", "path")):
            code, stdout, err = run_cli(capsys, *train, "--vocab-size", "280", "--out", target)
            assert code == 1 and stdout == ""
            assert err == f"frawd: error: {out / 'tokenizer.json'} exists; choose a new {what} (or --overwrite)\n"
    assert (out / "tokenizer.json").read_text() == first
    code, stdout, _ = run_cli(capsys, *train, "--vocab-size", "280", "--out", out, "--overwrite")
    assert code == 0 and Tokenizer.load(out).vocab_size == 280


def test_cli_notes_a_vocabulary_smaller_than_asked(tmp_path, capsys):
    from cli_helpers import run_cli

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS), encoding="utf-8")
    code, out, err = run_cli(capsys, "tokenizer", "train", "--data", corpus, "--vocab-size", "1000000",
                             "--out", tmp_path / "t")
    size = Tokenizer.load(tmp_path / "t" / "tokenizer.json").vocab_size
    assert code == 0 and size < 1_000_000 and f"vocab_size: {size} " in out
    assert f"note: the corpus gave {size:,} tokens, not the 1,000,000 asked for" in err
    assert err.endswith("(BPE stops once every word of the corpus is one token; a larger corpus gives more)\n")
    code, _, err = run_cli(capsys, "tokenizer", "train", "--data", corpus, "--vocab-size", "300", "--out", tmp_path / "u")
    assert code == 0 and "note:" not in err
    code, _, err = run_cli(capsys, "tokenizer", "train", "--data", corpus, "--out", tmp_path / "v")  # (the default)
    size = Tokenizer.load(tmp_path / "v" / "tokenizer.json").vocab_size
    assert code == 0 and f"note: the corpus gave {size:,} tokens, not the 8,192 asked for" in err


def test_bpe_training_on_a_long_document_gives_the_whole_ones_tokenizer_in_bounded_memory(tmp_path):
    """A long document goes to the trainer in pieces cut where a pre-token starts anyway:
    the same merges as training on it whole (against the `tokenizers` trainer given the
    whole document), and a 4 MB one-line file took ~400 MB where its pieces take ~100 MB
    (~90 bytes a character of the longest text given to the trainer)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    doc = "".join(rng.choice(words) + rng.choice([" ", " ", "  ", "\n", "\t", ". ", ", "]) for _ in range(60_000))
    ours = train_tokenizer([doc], vocab_size=1500)
    whole = HFTokenizer(models.BPE())
    whole.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    whole.decoder = decoders.ByteLevel()
    whole.train_from_iterator([doc], trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIAL_TOKENS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert len(doc) > 4 * 65536 and ours.backend.to_str() == whole.to_str()
    # (VmHWM, this process's peak: ru_maxrss keeps the forking parent's, pytest's, across exec)
    script = ("import re; from frawdllm.tokenizer import train_tokenizer; "
              "peak = lambda: int(re.search(r'VmHWM:\\s*(\\d+) kB', open('/proc/self/status').read())[1]) * 1024; "
              "line = ' '.join(f'w{i % 5000}' for i in range(600_000)); base = peak(); "  # (4.1 MB, one line)
              "train_tokenizer([line], vocab_size=300); print((peak() - base) / len(line))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) < 40  # bytes of peak memory a character (~90 given whole)


def test_token_bytes_put_together_are_the_texts_bytes():
    """A token's bytes (what logprobs report: a byte-level token may be part of a
    character) concatenate to the text's UTF-8, for every kind; GPT-2's byte table is
    tokenizers' ByteLevel alphabet."""
    from tokenizers import pre_tokenizers

    from frawdllm.tokenizer import _BYTE_OF_CHAR

    assert set(_BYTE_OF_CHAR) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(_BYTE_OF_CHAR.values()) == \
        list(range(256))
    text = "def f(n):\n    return n  # héllo wörld ☃ 🎉 \t\r\n naïve café <|eos|>" * 20
    for tok in (train_tokenizer([text], kind="bpe", vocab_size=400), train_tokenizer([text], kind="byte"),
                train_tokenizer([text], kind="char")):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode(), tok.kind
        assert tok.token_bytes(3) == b"<|eos|>" and tok.token_bytes(10**6) == b""


def test_token_bytes_of_a_sentencepiece_style_token_are_its_characters_utf8():
    """An imported BPE that is not byte-level (Llama-2/Mistral style): its token "é" is the
    character, whose UTF-8 is two bytes, not GPT-2's byte 0xE9 that the same character spells."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    backend.train_from_iterator(["café résumé naïve é ü"] * 20, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    tok = Tokenizer(backend)
    for char in "éü":
        assert tok.token_bytes(backend.token_to_id(char)) == char.encode()


def test_token_bytes_after_a_vocabulary_that_opens_with_hundreds_of_byte_tokens():
    """Llama-2's layout: specials, then <0x00>..<0xFF>, then the pieces. A token decoded alone
    loses its leading space (the decoder strips the text's first); after a plain token
    found past the byte tokens, it keeps it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", "t", "h", "e", "\u2581t", "\u2581th", "\u2581the"]:
        vocab[piece] = len(vocab)
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e")]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok = Tokenizer(backend)
    the = backend.token_to_id("\u2581the")
    assert backend.decode([the]) == "the" and tok.token_bytes(the) == b" the"
    assert b"".join(tok.token_bytes(i) for i in tok.encode("the the")) == b" the the"  # (the text Metaspace encodes)


def test_a_bpe_with_merges_whose_byte_level_has_no_regex_is_bpe_not_byte(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["ab ab abc"] * 20, trainers.BpeTrainer(vocab_size=270, special_tokens=SPECIAL_TOKENS,
                                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    Tokenizer(backend).save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.kind == "bpe" and byte_tokenizer().kind == "byte"


GPT2_PRE_TOKENS = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@given(st.text(alphabet="ab1.' \t\n", max_size=80), st.integers(1, 12))
@settings(max_examples=300, deadline=None)
def test_cutting_at_word_starts_keeps_gpt2s_pre_tokens(text, chars):
    """Training reads a long document in pieces: each piece must split into the pre-tokens
    the whole does (a cut inside a run of spaces, "aaaa " + "   bbbb", changes them)."""
    pieces = cut_at_word_starts(text, chars)
    assert "".join(pieces) == text and all(len(piece) >= chars for piece in pieces[:-1])
    assert [t for piece in pieces for t in GPT2_PRE_TOKENS.findall(piece)] == GPT2_PRE_TOKENS.findall(text)
    assert cut_at_word_starts("aaaa    bbbb", 5) == ["aaaa    bbbb"]


def test_cli_refuses_to_write_the_tokenizer_inside_its_source_folder(tmp_path, capsys):
    # (corp/tokenizer.json was then read by the next run as corpus text)
    from cli_helpers import run_cli

    corp = tmp_path / "corp"
    corp.mkdir()
    (corp / "a.txt").write_text("\n\n".join(CORPUS), encoding="utf-8")
    for out, folder in ((corp, corp), (corp / "tok", corp / "tok"), (corp / "t.json", corp)):
        code, stdout, err = run_cli(capsys, "tokenizer", "train", "--data", corp, "--kind", "byte", "--out", out)
        assert (code, stdout) == (1, "")
        assert err == (f"frawd: error: the output folder {folder} is inside the source folder {corp}: the next run "
                       f"would read what is written there as corpus text; write it outside {corp}\n")
    assert sorted(p.name for p in corp.iterdir()) == ["a.txt"]


_MERGING = """
import random, signal, sys
from frawdllm.tokenizer import train_tokenizer

signal.signal(signal.SIGINT, signal.default_int_handler)  # (a terminal's Ctrl-C, whatever this process inherited)

def documents():  # ~300k distinct words: the merge stage (Rust, after the last document) takes seconds
    rng = random.Random(0)
    for _ in range(1500):
        yield " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(200))
    print("read", flush=True)

try:
    train_tokenizer(documents(), "bpe", 80000)
except KeyboardInterrupt:
    sys.exit(130)
print("trained", flush=True)
"""


def test_ctrl_c_during_bpe_merges_ends_training_at_once():
    """Python sees Ctrl-C only in the main thread between bytecodes: in the trainer's Rust
    merge stage it waited for training to end (12 s on a 33 MB corpus)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", _MERGING], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline() == "read\n"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        start = time.perf_counter()
        assert proc.wait(timeout=60) == 130
        waited = time.perf_counter() - start
    finally:
        proc.kill()
    assert proc.stdout.read() == "" and waited < 1.5, waited  # (the merges alone take ~5 s)


def test_longest_token_chars_leaves_out_the_special_tokens_text_never_makes():
    """It was 13 (<|assistant|>) for every FrawdLLM tokenizer, so the server's refusal of a
    hopeless prompt by its length was 13 times looser than meant for char and byte ones."""
    text = "ROMEO: But soft, what light through yonder window breaks?\n" * 20
    bpe = train_tokenizer([text], kind="bpe", vocab_size=300)
    assert train_tokenizer([text], kind="char").longest_token_chars == 1
    assert byte_tokenizer().longest_token_chars == 1
    ordinary = [t for t, i in bpe.backend.get_vocab().items() if i not in bpe.special_ids]
    assert bpe.longest_token_chars == max(map(len, ordinary)) > 1
    assert len(text) / bpe.longest_token_chars <= len(bpe.encode(text))  # (the bound it is for)
