"""Shards: header and contents equal to tokenizing each document directly, the split, the
uint32 path, reuse, atomic failure, and tiny shakespeare as char-level shards."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from frawdllm.data import prepare_shards, read_header, read_shard, write_shard
from frawdllm.data import shards as shards_module
from frawdllm.data.shard_format import HEADER_BYTES, MAGIC
from frawdllm.data.sources import iter_documents
from frawdllm.errors import FrawdError
from frawdllm.tokenizer import EOS_ID, UNK_ID, Tokenizer, byte_tokenizer, train_tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _corpus(n_docs: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n_docs):
        lines = [" ".join(rng.choice(WORDS, size=rng.integers(1, 12))) for _ in range(rng.integers(1, 4))]
        docs.append(f"doc {i}: " + "\n".join(lines))
    return docs


def _write_corpus(path, docs):
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_tokenizer(_corpus(300, seed=1) + ["ünïcödé 🙂 日本"], "bpe", vocab_size=320)


def _documents_of(tokens: np.ndarray) -> list[list[int]]:
    """Split a shard's tokens at <|eos|> (every document ends with one)."""
    tokens = np.asarray(tokens).tolist()
    assert not tokens or tokens[-1] == EOS_ID
    docs, current = [], []
    for t in tokens:
        if t == EOS_ID:
            docs.append(current)
            current = []
        else:
            current.append(t)
    return docs


def test_shards_hold_each_document_tokenized_directly_then_eos_split_by_document(tmp_path, bpe):
    docs = _corpus(400)
    src = _write_corpus(tmp_path / "c.txt", docs)
    meta = prepare_shards(str(src), bpe, tmp_path / "out", val_fraction=0.2)
    train, val = read_shard(tmp_path / "out" / "train.bin"), read_shard(tmp_path / "out" / "val.bin")
    expected = {tuple(bpe.encode(d)): i for i, d in enumerate(docs)}
    train_docs, val_docs = _documents_of(train), _documents_of(val)
    train_idx = [expected[tuple(d)] for d in train_docs]
    val_idx = [expected[tuple(d)] for d in val_docs]
    assert sorted(train_idx + val_idx) == list(range(len(docs)))  # every document exactly once
    assert train_idx == sorted(train_idx) and val_idx == sorted(val_idx)  # in source order
    assert 0.12 < len(val_idx) / len(docs) < 0.28
    assert meta["train_tokens"] == len(train) and meta["val_tokens"] == len(val)
    assert meta["train_documents"] == len(train_idx) and meta["val_documents"] == len(val_idx)
    text_bytes = sum(len(d.encode()) for d in docs)
    assert meta["train_text_bytes"] + meta["val_text_bytes"] == text_bytes
    assert meta["bytes_per_token"] == pytest.approx(text_bytes / (len(train) + len(val)), rel=1e-5)
    assert meta["dtype"] == "uint16" and train.dtype == np.uint16
    assert meta["tokenizer_hash"] == bpe.fingerprint
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["train_tokens"] == len(train)


def test_split_and_contents_do_not_depend_on_batching(tmp_path, bpe, monkeypatch):
    src = _write_corpus(tmp_path / "c.txt", _corpus(200))
    prepare_shards(str(src), bpe, tmp_path / "a", val_fraction=0.1)
    monkeypatch.setattr(shards_module, "BATCH_CHARS", 50)  # many tiny batches
    prepare_shards(str(src), bpe, tmp_path / "b", val_fraction=0.1)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("kind", ["bpe", "char", "byte"])
def test_long_documents_cut_into_pieces_encode_exactly_like_the_whole(tmp_path, bpe, kind, monkeypatch):
    tok = {"bpe": bpe, "byte": byte_tokenizer()}.get(kind) or train_tokenizer(_corpus(50), "char")
    doc = "\n".join(_corpus(60, seed=3)).replace("doc", "  doc\n\n x")  # one long document
    src = tmp_path / "long.txt"
    src.write_text(doc, encoding="utf-8")
    monkeypatch.setattr(shards_module, "PIECE_CHARS", 37)
    assert len(shards_module._piece_splitter(tok)(doc)) > 10
    prepare_shards(str(src), tok, tmp_path / "out", val_fraction=0.0, doc_split="file")
    assert read_shard(tmp_path / "out" / "train.bin").tolist() == tok.encode(doc) + [EOS_ID]


def test_an_imported_word_level_tokenizer_is_not_char_level_and_its_documents_are_not_cut(tmp_path, monkeypatch):
    # A WordLevel model is char-level only in the layout FrawdLLM writes; cut at any character,
    # another one's words were split into other (or unknown) tokens.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    backend = HFTokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(_corpus(50), trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok = Tokenizer(backend)
    assert tok.kind == "word" and train_tokenizer(_corpus(5), "char").kind == "char"
    doc = " ".join(_corpus(60, seed=3)).replace("\n", " ") + " omega"  # one long line, one unknown word
    (tmp_path / "long.txt").write_text(doc, encoding="utf-8")
    monkeypatch.setattr(shards_module, "PIECE_CHARS", 37)
    meta = prepare_shards(str(tmp_path / "long.txt"), tok, tmp_path / "out", val_fraction=0.0, doc_split="file")
    assert read_shard(tmp_path / "out" / "train.bin").tolist() == backend.encode(doc).ids + [1]  # </s>
    unknown = backend.encode(doc).ids.count(0)  # [UNK] (omega, and doc numbers past 49)
    assert meta["tokenizer_kind"] == "word" and meta["unk_tokens"] == unknown > 0
    # Named as the tokenizer names it: this one's has no <|unk|> at all.
    assert shards_module._unk_warning(meta) == f"{unknown} word(s) are not in the word tokenizer's vocabulary and " \
                                               "became [UNK]"


def test_cuts_at_whitespace_after_a_non_space_never_change_the_bpe_tokens(bpe, monkeypatch):
    # Against encoding the whole text: kinds of whitespace (\x0b, \x1c, no-break and ideographic
    # spaces besides the ones cut at), contractions, punctuation and digits around the cuts.
    monkeypatch.setattr(shards_module, "PIECE_CHARS", 5)
    alphabet = ["alp", "ha", "bet", "a", "gam", "ma", "doc", "9", "'", ".", ":", "'s", "'ll", " ", "  ", "\t", "\r", "\n",
                "\r\n", "\x0b", "\x1c", "\u00a0", "\u3000", "é"]  # (word fragments: the vocabulary merges them)
    rng = np.random.default_rng(0)
    splitter = shards_module._piece_splitter(bpe)
    for _ in range(200):
        text = "".join(rng.choice(alphabet, size=40))
        pieces = splitter(text)
        assert "".join(pieces) == text
        assert [i for p in pieces for i in bpe.encode(p)] == bpe.encode(text), repr(text)


def test_a_document_longer_than_a_batch_spreads_over_batches_and_encodes_like_the_whole(tmp_path, bpe,
                                                                                        monkeypatch):
    # One line of words and no newline (the tokenizer's encodings of a 20 MB line took 4.3 GB
    # when a document went whole into one batch): memory stays bounded by the batch.
    line = " ".join(_corpus(80, seed=5)).replace("\n", " ")
    docs = _corpus(40) + [line] + _corpus(40, seed=2)
    src = _write_corpus(tmp_path / "c.txt", docs)
    monkeypatch.setattr(shards_module, "PIECE_CHARS", 37)
    splitter = shards_module._piece_splitter(bpe)
    assert len(splitter(line)) > 100
    batches = list(shards_module._batches(iter_documents(str(src)), 0.2, splitter, 200))
    longest_piece = max(len(p) for b in batches for p in b.pieces)
    assert max(b.chars for b in batches) < 200 + longest_piece < 300
    monkeypatch.setattr(shards_module, "BATCH_CHARS", 200)
    meta = prepare_shards(str(src), bpe, tmp_path / "out", val_fraction=0.2)
    train, val = read_shard(tmp_path / "out" / "train.bin"), read_shard(tmp_path / "out" / "val.bin")
    is_val = [shards_module._is_val(d.encode(), 0.2) for d in docs]
    assert any(is_val) and not all(is_val)
    for split, tokens in ((False, train), (True, val)):
        chosen = [d for d, v in zip(docs, is_val) if v == split]
        assert _documents_of(tokens) == [bpe.encode(d) for d in chosen]
        assert meta[f"{'val' if split else 'train'}_documents"] == len(chosen)
        assert meta[f"{'val' if split else 'train'}_text_bytes"] == sum(len(d.encode()) for d in chosen)


def test_shards_inside_their_source_folder_are_refused_before_anything_is_written(tmp_path, bpe, capsys):
    # (they became corpus text for the next run: "holds prepared shards, not text")
    from cli_helpers import run_cli

    (tmp_path / "src").mkdir()
    _write_corpus(tmp_path / "src" / "a.txt", _corpus(20))
    bpe.save(tmp_path / "tok.json")
    for out in (tmp_path / "src", tmp_path / "src" / "shards", tmp_path / "src" / "." / "deep" / "er"):
        code, stdout, err = run_cli(capsys, "data", "prepare", "--data", tmp_path / "src", "--tokenizer",
                                    tmp_path / "tok.json", "--out", out)
        assert (code, stdout) == (1, "")
        assert err == (f"frawd: error: the output folder {out} is inside the source folder {tmp_path / 'src'}: the "
                       "next run would read what is written there as corpus text; write it outside "
                       f"{tmp_path / 'src'}\n")
        assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["a.txt"]
    assert run_cli(capsys, "data", "prepare", "--data", tmp_path / "src", "--tokenizer", tmp_path / "tok.json",
                   "--out", tmp_path / "srcs")[0] == 0  # (a sibling whose name starts alike is outside)


def test_shards_or_a_tokenizer_where_the_source_glob_finds_files_are_refused(tmp_path, bpe, capsys):
    """`--data 'src/**/*' --out src/tok`: the tokenizer became a document of the next run,
    and the same prepare run again failed on its own shards ("a token shard, not text")."""
    from cli_helpers import run_cli

    (tmp_path / "src").mkdir()
    _write_corpus(tmp_path / "src" / "a.txt", _corpus(20))
    bpe.save(tmp_path / "tok.json")
    pattern = str(tmp_path / "src" / "**" / "*")
    for command, out, pattern in (
            (["data", "prepare", "--tokenizer", tmp_path / "tok.json"], tmp_path / "src" / "shards", pattern),
            (["data", "prepare", "--tokenizer", tmp_path / "tok.json"], tmp_path / "src" / "shards",
             str(tmp_path / "src" / "**")),  # (** alone finds folders, and what they hold)
            (["tokenizer", "train", "--kind", "char"], tmp_path / "src" / "deep" / "tok", pattern),
            (["tokenizer", "train", "--kind", "char"], tmp_path / "src", pattern)):
        code, stdout, err = run_cli(capsys, *command, "--data", pattern, "--out", out)
        assert (code, stdout) == (1, ""), err
        assert err == (f"frawd: error: the output folder {out} is where the glob {pattern!r} finds files: the next "
                       "run would read what is written there as corpus text; write it elsewhere\n")
        assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["a.txt"]
    # a glob that cannot find what is written there (*.txt; one level only) leaves it free
    for pattern, out in ((tmp_path / "src" / "**" / "*.txt", tmp_path / "src" / "shards"),
                         (tmp_path / "src" / "*", tmp_path / "src" / "shards2")):
        code, _, err = run_cli(capsys, "data", "prepare", "--tokenizer", tmp_path / "tok.json", "--data", pattern,
                               "--out", out)
        assert code == 0, err


def test_an_output_inside_an_hf_folder_or_a_tokenizer_file_a_glob_finds_is_refused(tmp_path, bpe, capsys):
    """`--data hf:DIR --out DIR/shards` was accepted: `datasets` then read val.bin as a split and
    the next run failed; `--data 'src/my*' --out src/mytok.json` wrote the tokenizer where the
    glob reads it as text (the next tokenizer had 62 symbols instead of 18)."""
    import json

    from cli_helpers import run_cli

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "data.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(20)))
    bpe.save(tmp_path / "tok.json")
    data = f"hf:{tmp_path / 'hf'}"
    for command, out in ((["data", "prepare", "--tokenizer", tmp_path / "tok.json"], tmp_path / "hf" / "shards"),
                         (["tokenizer", "train", "--kind", "char"], tmp_path / "hf" / "tok")):
        code, stdout, err = run_cli(capsys, *command, "--data", data, "--out", out)
        assert (code, stdout) == (1, ""), err
        assert err == (f"frawd: error: the output folder {out} is inside the source folder {data}: the next run "
                       f"would read what is written there as corpus text; write it outside {tmp_path / 'hf'}\n")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["data.jsonl"]

    (tmp_path / "src").mkdir()
    _write_corpus(tmp_path / "src" / "mydata.txt", _corpus(5))
    pattern, out = str(tmp_path / "src" / "my*"), tmp_path / "src" / "mytok.json"
    code, stdout, err = run_cli(capsys, "tokenizer", "train", "--kind", "char", "--data", pattern, "--out", out)
    assert (code, stdout) == (1, ""), err
    assert err == (f"frawd: error: the output {out} is where the glob {pattern!r} finds files: the next run would "
                   "read what is written there as corpus text; write it elsewhere\n")
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["mydata.txt"]
    code, _, err = run_cli(capsys, "tokenizer", "train", "--kind", "char", "--data", pattern,
                           "--out", tmp_path / "src" / "tok.json")  # (a name the glob does not find)
    assert code == 0, err


def test_a_link_loop_or_a_name_that_is_not_utf8_is_one_line_or_read(tmp_path, bpe, capsys):
    """A loop of symbolic links as --data ended `data prepare` in a RuntimeError traceback; a
    file named in Latin-1 inside a source folder in a UnicodeEncodeError (its path hashed as
    UTF-8); such a name given as an argument is refused in one line (files written with it
    would fail later: config.yaml, meta.json)."""
    import os

    from cli_helpers import run_cli

    (tmp_path / "loopA").symlink_to("loopB")
    (tmp_path / "loopB").symlink_to("loopA")
    bpe.save(tmp_path / "tok.json")
    code, stdout, err = run_cli(capsys, "data", "prepare", "--data", tmp_path / "loopA", "--tokenizer",
                                tmp_path / "tok.json", "--out", tmp_path / "out")
    assert (code, stdout) == (1, "")
    assert err == f"frawd: error: data source {str(tmp_path / 'loopA')!r} is a loop of symbolic links\n"
    (tmp_path / "src").mkdir()
    _write_corpus(tmp_path / "src" / os.fsdecode(b"lat\xe9.txt"), _corpus(20))
    code, _, err = run_cli(capsys, "data", "prepare", "--data", tmp_path / "src", "--tokenizer",
                           tmp_path / "tok.json", "--out", tmp_path / "out")
    assert code == 0, err
    latin = os.fsdecode(os.fsencode(tmp_path) + b"/out\xe9")
    code, stdout, err = run_cli(capsys, "data", "prepare", "--data", tmp_path / "src", "--tokenizer",
                                tmp_path / "tok.json", "--out", latin)
    assert (code, stdout) == (1, "")
    assert err == (f"frawd: error: --out {ascii(latin)} is not valid UTF-8 (a name in another encoding?): "
                   "rename the file or folder\n")
    assert not os.path.exists(latin)


def test_more_local_workers_than_four_per_cpu_are_refused(tmp_path, bpe, monkeypatch):
    src = _write_corpus(tmp_path / "c.txt", _corpus(5))
    monkeypatch.setattr(shards_module, "usable_cpus", lambda: 2)
    with pytest.raises(FrawdError, match=re.escape("workers must be at most 8 here (4 per CPU, this process may use "
                                                   "2), got 9: more only wait for a core")):
        prepare_shards(str(src), bpe, tmp_path / "out", workers=9)
    assert not (tmp_path / "out").exists()
    shards_module.check_prepare_options(0.1, 9, local=False)  # (Slurm or Ray tasks run elsewhere)
    shards_module.check_prepare_options(0.1, 8)  # (the bound itself, and the ends of the ranges, before any work)
    with pytest.raises(FrawdError, match=re.escape("workers must be an integer of at least 1, got 0")):
        shards_module.check_prepare_options(0.1, 0)
    with pytest.raises(FrawdError, match=re.escape("val_fraction must be a number in [0, 1), got 1.0")):
        shards_module.check_prepare_options(1.0, None)


def test_header_records_magic_version_dtype_count_and_vocab(tmp_path, bpe):
    src = _write_corpus(tmp_path / "c.txt", _corpus(20))
    prepare_shards(str(src), bpe, tmp_path / "out", val_fraction=0.0)
    raw = (tmp_path / "out" / "train.bin").read_bytes()
    magic, version, itemsize, n_tokens, vocab = struct.unpack("<8sIIQQ", raw[:32])
    assert (magic, version, itemsize, vocab) == (MAGIC, 1, 2, bpe.vocab_size)
    assert len(raw) == HEADER_BYTES + 2 * n_tokens
    assert np.frombuffer(raw[HEADER_BYTES:], dtype="<u2").tolist() == read_shard(tmp_path / "out" / "train.bin").tolist()
    assert read_header(tmp_path / "out" / "val.bin")["n_tokens"] == 0
    assert read_shard(tmp_path / "out" / "val.bin").shape == (0,)


def test_ids_take_two_bytes_up_to_a_vocabulary_of_65536():
    from frawdllm.data.shard_format import token_dtype

    assert token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32  # (ids 0..65,535 fit)


def test_read_shard_rejects_bad_files(tmp_path):
    path = tmp_path / "s.bin"
    write_shard(path, np.arange(10), vocab_size=100)
    assert read_shard(path).tolist() == list(range(10))
    good = path.read_bytes()
    for damaged in (good[:-3], good + b"\0\0\0\0"):  # cut short, or more bytes than the header promises
        path.write_bytes(damaged)
        with pytest.raises(FrawdError, match="truncated or corrupt"):
            read_shard(path)
    path.write_bytes(b"NOTTOKEN" + good[8:])
    with pytest.raises(FrawdError, match="bad magic"):
        read_shard(path)
    path.write_bytes(good[:8] + struct.pack("<I", 99) + good[12:])
    with pytest.raises(FrawdError, match="format version 99"):
        read_shard(path)
    with pytest.raises(FrawdError, match="shard not found"):
        read_shard(tmp_path / "missing.bin")
    with pytest.raises(FrawdError, match=r"is a folder, not a shard file \(a prepared folder holds"):
        read_shard(tmp_path)  # (it said "not found")


@pytest.mark.parametrize("tokens, error", [
    (np.array([5, -1, 7]), "token id -1 at position 1 is outside the vocabulary [0, 1000)"),
    (np.array([0, 999, 70_000]), "token id 70000 at position 2 is outside the vocabulary [0, 1000)"),
    (np.array([1000]), "token id 1000 at position 0 is outside the vocabulary [0, 1000)"),
    (np.array([[1, 2], [3, 4]]), "token ids must be a 1-D integer array, got a 2-D int64 array"),
    (np.array([1.0, 2.5]), "token ids must be a 1-D integer array, got a 1-D float64 array"),
], ids=["negative", "above-uint16", "vocab-size", "2-D", "float"])
def test_write_shard_refuses_ids_it_would_wrap_or_reshape_and_writes_nothing(tmp_path, tokens, error):
    path = tmp_path / "s.bin"
    with pytest.raises(FrawdError, match=f"^{re.escape(f'{path}: {error}')}$"):
        write_shard(path, tokens, vocab_size=1000)
    assert list(tmp_path.iterdir()) == []
    write_shard(path, np.array([0, 999], dtype=np.int64), vocab_size=1000)  # the edges fit
    assert read_shard(path).tolist() == [0, 999]


@pytest.mark.parametrize("vocab_size", [0, True, 2**32 + 1])
def test_write_shard_refuses_a_vocab_size_the_header_cannot_mean(tmp_path, vocab_size):
    with pytest.raises(FrawdError, match=rf"vocab_size must be an integer in \[1, 2\*\*32\], got {vocab_size!r}$"):
        write_shard(tmp_path / "s.bin", np.arange(3), vocab_size=vocab_size)


def test_prepare_shards_takes_a_pathlib_path_as_the_source(tmp_path, bpe):
    src = _write_corpus(tmp_path / "c.txt", _corpus(30))
    meta = prepare_shards(src, bpe, tmp_path / "out")  # a Path, not str(src)
    assert meta["source"] == str(src)
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["source"] == str(src)
    assert prepare_shards(str(src), bpe, tmp_path / "out")["reused"]  # the same inputs as the str
    assert list(iter_documents(src)) == list(iter_documents(str(src)))


@pytest.mark.parametrize("meta, error", [
    (None, "not a folder of prepared shards (meta.json is missing)"),
    ("", "not a folder of prepared shards (meta.json is not a JSON object)"),
    ("[1, 2]", "not a folder of prepared shards (meta.json is not a JSON object)"),
    ('{"train_shards": 5}', "meta.json: the shard lists are not lists of file names"),
    # (a crafted meta.json made any file on the machine the training data)
    ('{"train_shards": ["../other/train.bin"]}', "the shard list names '../other/train.bin', not a file of the folder"),
    ('{"train_shards": ["/etc/passwd"]}', "the shard list names '/etc/passwd', not a file of the folder"),
], ids=["missing", "empty", "list", "bad-list", "outside", "absolute"])
def test_read_split_of_a_folder_without_a_usable_meta_json_is_one_line(tmp_path, meta, error):
    from frawdllm.data import read_split

    from frawdllm.train.pretrain import is_shard_dir

    if meta is not None:
        (tmp_path / "meta.json").write_text(meta)
    with pytest.raises(FrawdError, match=re.escape(error)):
        read_split(tmp_path, "train")
    if "list" in error:  # our meta.json, damaged
        with pytest.raises(FrawdError, match=re.escape(error)):
            is_shard_dir(tmp_path)
    else:  # none, or not ours: a folder of text
        assert not is_shard_dir(tmp_path)


PLAIN_PYTHON_ERRORS = textwrap.dedent("""
    import numpy as np
    from frawdllm.data import RandomWindowLoader, SequentialLoader, prepare_shards
    from frawdllm.errors import FrawdError
    tokens = np.arange(100)
    for call in (lambda: RandomWindowLoader(tokens, 2.5, 8), lambda: SequentialLoader(tokens, 2, 8.0),
                 lambda: RandomWindowLoader(tokens, 2, 8, grad_accum=1.5),
                 lambda: RandomWindowLoader(list(tokens), 2, 8),
                 lambda: prepare_shards("stdlib", "tok.json", "out", val_fraction="0.1"),
                 lambda: prepare_shards("stdlib", "tok.json", "out", workers=1.5),
                 lambda: prepare_shards(42, "tok.json", "out")):
        try:
            call()
        except FrawdError as error:
            print(error)
""")


def test_plain_python_arguments_of_a_wrong_type_are_one_line_errors(tmp_path):
    # without the test session's type checker, as users call them
    proc = subprocess.run([sys.executable, "-c", PLAIN_PYTHON_ERRORS], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "batch_size must be an integer, got 2.5",
        "context_length must be an integer, got 8.0",
        "grad_accum must be a positive integer, got 1.5",
        "tokens must be a 1-D integer array (read_shard, read_split), got list",
        "val_fraction must be a number in [0, 1), got '0.1'",
        "workers must be an integer of at least 1, got 1.5",
        "a data source is a string (stdlib, hf:NAME, a file, a folder or a glob) or a path, got 42",
    ]


def test_vocab_above_65535_is_stored_as_uint32(tmp_path):
    alphabet = "".join(chr(c) for c in range(0x20, 0x20 + 70_000) if not 0xD800 <= c <= 0xDFFF)
    tok = train_tokenizer([alphabet], "char")
    assert tok.vocab_size > 65_536
    text = alphabet[-30:] + alphabet[:30]  # ids above and below 65,535
    src = tmp_path / "c.txt"
    src.write_text(text, encoding="utf-8")
    meta = prepare_shards(str(src), tok, tmp_path / "out", val_fraction=0.0)
    tokens = read_shard(tmp_path / "out" / "train.bin")
    assert meta["dtype"] == "uint32" and tokens.dtype == np.uint32
    assert tokens.tolist() == tok.encode(text) + [EOS_ID]
    assert tokens.max() > 65_535


def one_document(path, hashed_to_val: bool, val_fraction: float = 0.1) -> str:
    """Write a one-document corpus (one file, --doc-split file) whose text hashes into val,
    or into train; returns the document."""
    for i in range(1000):
        doc = "\n".join(_corpus(30)) + f"\nthe end {i}"
        if shards_module._is_val(doc.encode(), val_fraction) == hashed_to_val:
            path.write_text(doc, encoding="utf-8")
            assert list(iter_documents(str(path), doc_split="file")) == [doc]
            return doc
    raise AssertionError("no such document")


@pytest.mark.parametrize("hashed_to_val, move_tokens", [(False, None), (True, None), (True, 7)],
                         ids=["hashed-to-train", "hashed-to-val", "hashed-to-val-moved-in-pieces"])
def test_single_document_corpus_still_gets_a_validation_tail(tmp_path, bpe, hashed_to_val, move_tokens,
                                                               monkeypatch):
    """Whichever side its hash falls on: hashed to val, it was all val (train_tokens 0, and
    pretraining refused the run as too short) for 1 in 10 such corpora. (Val's tokens move
    to train 16M at a time: in pieces of 7 here, so that the pieces' offsets are tested.)"""
    if move_tokens:
        monkeypatch.setattr(shards_module, "MOVE_TOKENS", move_tokens)
    doc = one_document(tmp_path / "one.txt", hashed_to_val)
    meta = prepare_shards(str(tmp_path / "one.txt"), bpe, tmp_path / "out", val_fraction=0.1, doc_split="file")
    train, val = read_shard(tmp_path / "out" / "train.bin"), read_shard(tmp_path / "out" / "val.bin")
    everything = bpe.encode(doc) + [EOS_ID]
    assert train.tolist() + val.tolist() == everything
    assert len(val) == round(0.1 * len(everything))
    assert meta["val_split"] == "tail" and meta["val_tokens"] == len(val)
    assert (meta["train_documents"], meta["val_documents"]) == (0, 1)
    assert meta["train_text_bytes"] + meta["val_text_bytes"] == len(doc.encode())
    assert 0 < meta["val_text_bytes"] < meta["train_text_bytes"]


@pytest.mark.parametrize("kind", ["char", "byte"])
def test_a_validation_tail_counts_its_own_text_bytes_and_documents(tmp_path, kind):
    """The tail of a one-document corpus is all 3-byte characters: val's bytes per token are
    its own (they were the corpus's average), and the one document ends in val."""
    doc = "abcdefgh " * 1000 + "日本語中文字漢" * 150
    src = tmp_path / "one.txt"
    src.write_text(doc, encoding="utf-8")
    tok = train_tokenizer([doc], "char") if kind == "char" else byte_tokenizer()
    meta = prepare_shards(str(src), tok, tmp_path / "out", val_fraction=0.1, doc_split="file")
    train, val = read_shard(tmp_path / "out" / "train.bin"), read_shard(tmp_path / "out" / "val.bin")
    assert meta["val_split"] == "tail" and val[-1] == EOS_ID
    if kind == "char":
        train_bytes = len(tok.decode(train.tolist()).encode())
    else:  # a byte tokenizer's ids are 7 + the byte
        train_bytes = int(np.count_nonzero(train >= 7))
    assert meta["train_text_bytes"] == train_bytes
    assert meta["val_text_bytes"] == len(doc.encode()) - train_bytes
    assert meta["val_bytes_per_token"] == pytest.approx(meta["val_text_bytes"] / len(val), abs=1e-6)
    assert (meta["train_documents"], meta["val_documents"]) == (0, 1)


def _foreign_tokenizer(kind, text):
    """A tokenizer made elsewhere: SentencePiece-style (Metaspace, as Llama's) or word-level."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    if kind == "metaspace":
        hf = HF(models.BPE(unk_token="<unk>", byte_fallback=True))
        hf.pre_tokenizer, hf.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    else:
        hf = HF(models.WordLevel(unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    hf.train_from_iterator([text], trainer)
    return Tokenizer(hf)


@pytest.mark.parametrize("kind", ["metaspace", "wordlevel"])
def test_a_validation_tail_counts_the_spaces_of_tokens_that_do_not_spell_them(tmp_path, kind):
    """A token's bytes decoded alone lose its space ("▁the" -> "the"; a word-level token has
    none): an imported Llama tokenizer's tail split gave val 92,936 bytes where it holds
    109,205, and bits per byte 17% too high. Words split by single spaces: the train side's
    decoding is the source text before the cut, so val holds the rest, its space included."""
    words = [f"w{i % 37}x{i % 11}" for i in range(3000)]
    doc = " ".join(words)
    src = tmp_path / "one.txt"
    src.write_text(doc, encoding="utf-8")
    tok = _foreign_tokenizer(kind, doc)
    meta = prepare_shards(str(src), tok, tmp_path / "out", val_fraction=0.1, doc_split="file")
    train = read_shard(tmp_path / "out" / "train.bin")
    assert meta["val_split"] == "tail" and meta["val_tokens"] > 100
    head = tok.decode(train.tolist())
    assert doc.startswith(head) and doc[len(head)] == " "  # (independent of the offsets the count uses)
    assert (meta["train_text_bytes"], meta["val_text_bytes"]) == (len(head), len(doc) - len(head))


def test_a_validation_tail_cut_at_a_document_boundary_counts_each_side(tmp_path):
    """Two documents of 9 words (10 tokens with their end) hashed to train, half for val: the
    tail starts exactly where the second document does."""
    docs, i = [], 0
    while len(docs) < 2:
        doc = " ".join(f"w{(i + j) % 7}" for j in range(9))
        i += 1
        if not shards_module._is_val(doc.encode(), 0.5) and doc not in docs:
            docs.append(doc)
    src = tmp_path / "two.txt"
    src.write_text("\n".join(docs) + "\n", encoding="utf-8")
    tok = _foreign_tokenizer("wordlevel", " ".join(docs))
    meta = prepare_shards(str(src), tok, tmp_path / "out", val_fraction=0.5, doc_split="line")
    assert meta["val_split"] == "tail" and (meta["train_tokens"], meta["val_tokens"]) == (10, 10)
    assert (meta["train_text_bytes"], meta["val_text_bytes"]) == (len(docs[0]), len(docs[1]))
    assert (meta["train_documents"], meta["val_documents"]) == (1, 1)


def test_a_rebuild_that_fails_writing_its_meta_json_leaves_none(tmp_path, bpe, monkeypatch):
    """The new shards are in place once meta.json is written: until then the folder has none,
    never the old one beside new shards."""
    src = _write_corpus(tmp_path / "c.txt", _corpus(30))
    out = tmp_path / "out"
    prepare_shards(str(src), bpe, out, val_fraction=0.1)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards_module, "write_json_atomic", full_disk)
    with pytest.raises((FrawdError, OSError)):
        prepare_shards(str(src), bpe, out, val_fraction=0.3)
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "val.bin"]


def test_rerun_reuses_matching_shards_and_rebuilds_on_change_or_force(tmp_path, bpe):
    src = _write_corpus(tmp_path / "c.txt", _corpus(30))
    out = tmp_path / "out"
    first = prepare_shards(str(src), bpe, out)
    stamp = (out / "train.bin").stat().st_mtime_ns
    again = prepare_shards(str(src), bpe, out)
    assert again.get("reused") and again["train_tokens"] == first["train_tokens"]
    assert (out / "train.bin").stat().st_mtime_ns == stamp
    assert not prepare_shards(str(src), bpe, out, force=True).get("reused")
    assert not prepare_shards(str(src), bpe, out, val_fraction=0.3).get("reused")
    _write_corpus(src, _corpus(31))
    changed = prepare_shards(str(src), bpe, out, val_fraction=0.3)
    assert not changed.get("reused")
    assert changed["train_documents"] + changed["val_documents"] == 31
    # each input counts: the document split alone, an edit that keeps the size, a damaged val.bin
    assert not prepare_shards(str(src), bpe, out, val_fraction=0.3, doc_split="line").get("reused")
    assert prepare_shards(str(src), bpe, out, val_fraction=0.3, doc_split="line").get("reused")
    text = src.read_text(encoding="utf-8")
    src.write_text(text.replace("a", "b", 1), encoding="utf-8")
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))
    assert not prepare_shards(str(src), bpe, out, val_fraction=0.3, doc_split="line").get("reused")
    write_shard(out / "val.bin", np.array([5]), vocab_size=bpe.vocab_size)
    assert not prepare_shards(str(src), bpe, out, val_fraction=0.3, doc_split="line").get("reused")


def test_the_same_source_written_another_way_reuses_the_shards(tmp_path, bpe, monkeypatch):
    src = _write_corpus(tmp_path / "c.txt", _corpus(30))
    (tmp_path / "link.txt").symlink_to(src)
    out = tmp_path / "out"
    prepare_shards(str(src), bpe, out)
    monkeypatch.chdir(tmp_path)
    for spelling in ("c.txt", "./c.txt", "link.txt"):
        assert prepare_shards(spelling, bpe, out).get("reused"), spelling


def test_a_failure_midway_leaves_no_shard_behind(tmp_path, bpe):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": d}) for d in _corpus(50)] + ['{"oops": 1}']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(FrawdError, match=r"d\.jsonl:51: no field 'text'"):
        prepare_shards(str(path), bpe, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # the folder it created is gone too


def test_char_tokenizer_counts_unknown_characters(tmp_path):
    tok = train_tokenizer(["abc "], "char")
    src = tmp_path / "c.txt"
    src.write_text("abc xyz cab\n\nzz", encoding="utf-8")
    meta = prepare_shards(str(src), tok, tmp_path / "out", val_fraction=0.0)
    tokens = read_shard(tmp_path / "out" / "train.bin")
    assert meta["unk_tokens"] == 5 == int((tokens == UNK_ID).sum())
    assert any("5 character(s)" in w and "<|unk|>" in w for w in meta["warnings"])


def test_tiny_shakespeare_becomes_char_level_shards_with_65_characters(tmp_path, shared_data):
    path = shared_data / "tinyshakespeare.txt"
    text = path.read_text(encoding="utf-8")
    tok = train_tokenizer(iter_documents(str(path)), "char")
    assert tok.vocab_size == 65 + 7
    assert len(set(text)) == 65
    meta = prepare_shards(str(path), tok, tmp_path / "out", val_fraction=0.1)
    train, val = read_shard(tmp_path / "out" / "train.bin"), read_shard(tmp_path / "out" / "val.bin")
    docs = list(iter_documents(str(path)))
    n_chars = sum(len(d) for d in docs)
    assert len(train) + len(val) == n_chars + len(docs)  # one token per character, one <|eos|> per speech
    assert 0.07 < len(val) / (len(train) + len(val)) < 0.13
    assert meta["unk_tokens"] == 0 and meta["vocab_size"] == 72
    decoded = tok.decode(read_shard(tmp_path / "out" / "train.bin")[:2000])
    assert decoded.split("<|eos|>")[0] in docs


def test_cli_prepare_writes_train_val_and_meta(tmp_path, bpe):
    from click.testing import CliRunner

    from frawdllm.cli import cli

    src = _write_corpus(tmp_path / "c.txt", _corpus(100))
    bpe.save(tmp_path / "tok.json")
    out = tmp_path / "shards"
    args = ["data", "prepare", "--data", str(src), "--tokenizer", str(tmp_path / "tok.json"), "--out", str(out),
            "--val-fraction", "0.1", "--workers", "2"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}/train.bin" in result.output and "reusing" not in result.output
    meta = json.loads((out / "meta.json").read_text())
    assert {"train_tokens", "val_tokens", "dtype", "bytes_per_token", "tokenizer_hash"} <= set(meta)
    assert len(read_shard(out / "train.bin")) == meta["train_tokens"] > 0
    assert len(read_shard(out / "val.bin")) == meta["val_tokens"] > 0
    again = CliRunner().invoke(cli, args).output
    assert "reusing" in again and "wrote" not in again  # the second run wrote nothing


def test_cli_prepare_refuses_to_replace_another_sources_shards_unless_overwrite(tmp_path, bpe, capsys,
                                                                               monkeypatch):
    from cli_helpers import run_cli

    first = _write_corpus(tmp_path / "a.txt", _corpus(40, seed=2))
    second = _write_corpus(tmp_path / "b.txt", _corpus(40, seed=3))
    bpe.save(tmp_path / "tok.json")
    out = tmp_path / "shards"

    def prepare(src, *flags):
        return run_cli(capsys, "data", "prepare", "--data", src, "--tokenizer", tmp_path / "tok.json",
                       "--out", out, *flags)

    assert prepare(first)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for flags in ((), ("--force",)):  # --force rebuilds the same source; it replaces no other
        code, stdout, err = prepare(second, *flags)
        assert code == 1 and stdout == ""
        assert err == (f"frawd: error: {out} holds the shards of {first.resolve()}, not of {second}; "
                       "give another --out, or --overwrite to replace them\n")
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # checked again once the folder is held: two prepares of different sources started together
    # into one new folder both passed the first check, and the second replaced the first's shards
    from frawdllm.data.shards import prepare_shards

    with pytest.raises(FrawdError, match=f"^{re.escape(str(out))} holds the shards of "):
        prepare_shards(second, tmp_path / "tok.json", out, force=True, refuse_other=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # the same source is reused, named any way, and rebuilt when an option changed
    assert "reusing" in prepare(first)[2]  # (a notice: stderr)
    monkeypatch.chdir(tmp_path)
    assert "reusing" in prepare("a.txt")[2]
    code, stdout, _ = prepare(first, "--val-fraction", "0.3")
    assert code == 0 and "wrote" in stdout
    code, stdout, _ = prepare(second, "--overwrite")
    assert code == 0 and "wrote" in stdout
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"] == str(second) and meta["resolved_source"] == str(second.resolve())
    # shard files whose source nothing records are not replaced either
    (out / "meta.json").unlink()
    code, _, err = prepare(second)
    assert code == 1 and err.startswith(f"frawd: error: {out} holds train.bin and val.bin but no meta.json")


@pytest.mark.parametrize("damaged", ["[1]", '"x"', "{"])
def test_overwrite_replaces_a_meta_json_that_is_not_an_object(tmp_path, bpe, capsys, damaged):
    """What the refusal advises works: `--overwrite` over a meta.json of valid JSON that is no
    object ended in an AttributeError traceback (the reuse check read it as one)."""
    from cli_helpers import run_cli

    src = _write_corpus(tmp_path / "c.txt", _corpus(40, seed=2))
    bpe.save(tmp_path / "tok.json")
    out = tmp_path / "shards"
    args = ["data", "prepare", "--data", src, "--tokenizer", tmp_path / "tok.json", "--out", out]
    assert run_cli(capsys, *args)[0] == 0
    (out / "meta.json").write_text(damaged)
    code, _, err = run_cli(capsys, *args)
    assert code == 1 and "give another --out, or --overwrite to replace it" in err, err
    code, stdout, err = run_cli(capsys, *args, "--overwrite")
    assert code == 0 and "wrote" in stdout, err
    assert json.loads((out / "meta.json").read_text())["train_tokens"] == len(read_shard(out / "train.bin")) > 0


def test_overwrite_leaves_only_the_new_shards_once_they_are_complete(tmp_path, bpe, capsys, monkeypatch):
    from cli_helpers import run_cli

    from frawdllm.data import read_split

    first = _write_corpus(tmp_path / "a.txt", _corpus(60, seed=2))
    second = _write_corpus(tmp_path / "b.txt", _corpus(20, seed=3))
    bpe.save(tmp_path / "tok.json")
    out = tmp_path / "shards"
    # what a 5-task datatrove run of the first source leaves: its shards, meta.json and logs
    meta = prepare_shards(str(first), bpe, out)
    shards = {"train": [f"train-{r:05d}.bin" for r in range(5)], "val": [f"val-{r:05d}.bin" for r in range(5)]}
    for split in ("train", "val"):
        tokens = np.asarray(read_shard(out / f"{split}.bin"))
        for name, part in zip(shards[split], np.array_split(tokens, 5)):
            write_shard(out / name, part, bpe.vocab_size)
        (out / f"{split}.bin").unlink()
    (out / "meta.json").write_text(json.dumps({**meta, "train_shards": shards["train"], "val_shards": shards["val"]}))
    (out / ".datatrove" / f"{'0' * 16}-w5" / "completions").mkdir(parents=True)
    # files of the user's that only look like shards by name, or not at all
    user_files = {"notes.txt": b"mine\n", "val-00007.bin": b"not a shard", "train-notes.bin": MAGIC}
    for name, content in user_files.items():
        (out / name).write_bytes(content)
    old_train = np.asarray(read_split(out, "train"))

    def prepare(*flags):
        return run_cli(capsys, "data", "prepare", "--data", second, "--tokenizer", tmp_path / "tok.json",
                       "--out", out, "--overwrite", *flags)

    def failed(self):
        raise FrawdError("failed")

    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with monkeypatch.context() as patch:  # a run that fails once every new token is written deletes nothing
        patch.setattr(shards_module.ShardWriter, "finish", failed)
        assert prepare()[0] == 1
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    np.testing.assert_array_equal(np.asarray(read_split(out, "train")), old_train)

    code, stdout, _ = prepare()
    assert code == 0 and f"wrote {out}/train.bin" in stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(["meta.json", "train.bin", "val.bin", *user_files])
    assert all((out / name).read_bytes() == content for name, content in user_files.items())
    new = json.loads((out / "meta.json").read_text())
    assert len(read_shard(out / "train.bin")) == new["train_tokens"] and new["resolved_source"] == str(second.resolve())


def test_cli_prepare_reports_a_bad_tokenizer_as_one_line(tmp_path, capfd):
    from cli_helpers import run_cli

    src = _write_corpus(tmp_path / "c.txt", _corpus(3))
    capfd.readouterr()
    code, _, stderr = run_cli(capfd, "data", "prepare", "--data", src, "--tokenizer", tmp_path / "none.json",
                              "--out", tmp_path / "o")  # (in this process; captured at the descriptors)
    assert code == 1
    assert stderr.strip() == f"frawd: error: tokenizer not found: {tmp_path / 'none.json'}"


@pytest.mark.parametrize("lost", ["val.bin", "train.bin"])
def test_shards_missing_a_split_are_an_error_not_a_text_corpus(tmp_path, bpe, lost):
    from click.testing import CliRunner

    from frawdllm.cli import cli
    from frawdllm.train.pretrain import is_shard_dir

    out = tmp_path / "shards"
    prepare_shards(str(_write_corpus(tmp_path / "c.txt", _corpus(30))), bpe, out)
    assert is_shard_dir(out)
    (out / lost).unlink()  # pretrain and eval read the other split's bytes as text before
    with pytest.raises(FrawdError, match=f"holds prepared shards but {lost} is missing"):
        is_shard_dir(out)
    result = CliRunner().invoke(cli, ["pretrain", "--data", str(out), "--preset", "tiny", "--max-steps", "1",
                                      "--out", str(tmp_path / "run")])
    assert isinstance(result.exception, FrawdError) and f"{lost} is missing" in str(result.exception)
    assert not (tmp_path / "run").exists()
    # a folder of text that happens to hold a meta.json of its own is still a corpus
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "meta.json").write_text('["not ours"]')
    assert not is_shard_dir(tmp_path / "texts")



def test_a_shard_folder_is_never_read_as_text(tmp_path, bpe, capfd):
    from cli_helpers import run_cli

    from click.testing import CliRunner

    from frawdllm.cli import cli

    out = tmp_path / "shards"
    prepare_shards(str(_write_corpus(tmp_path / "c.txt", _corpus(30))), bpe, out)
    bpe.save(tmp_path / "tok.json")
    refused = f"{out} holds prepared shards (meta.json), not text; give it to frawd pretrain --data {out} or " \
              f"frawd eval --data {out}"
    with pytest.raises(FrawdError, match=re.escape(refused)):
        iter_documents(str(out))
    with pytest.raises(FrawdError, match=re.escape(refused)):
        prepare_shards(str(out), bpe, tmp_path / "again")
    for args in (["data", "prepare", "--data", out, "--tokenizer", tmp_path / "tok.json", "--out", tmp_path / "again"],
                 ["tokenizer", "train", "--data", out, "--vocab-size", "300", "--out", tmp_path / "tok2"]):
        capfd.readouterr()
        code, stdout, stderr = run_cli(capfd, *args)  # (in this process; captured at the descriptors)
        assert code == 1 and stderr == f"frawd: error: {refused}\n" and not stdout
    assert not (tmp_path / "again").exists() and not (tmp_path / "tok2").exists()
    # meta.json without any of the shard files it names: an error everywhere, not a text corpus
    (out / "train.bin").unlink()
    (out / "val.bin").unlink()
    (out / "notes.txt").write_text("some text\n")
    missing = "holds prepared shards but train.bin, val.bin are missing"
    with pytest.raises(FrawdError, match=missing):
        iter_documents(str(out))
    with pytest.raises(FrawdError, match=missing):
        prepare_shards(str(out), bpe, tmp_path / "again")
    result = CliRunner().invoke(cli, ["pretrain", "--data", str(out), "--preset", "tiny", "--max-steps", "1",
                                      "--out", str(tmp_path / "run")])
    assert isinstance(result.exception, FrawdError) and missing in str(result.exception)
    assert not (tmp_path / "run").exists() and not (tmp_path / "again").exists()
    # a folder of text with a meta.json of its own (not a JSON object) is still read
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "meta.json").write_text('["not ours"]')
    (tmp_path / "texts" / "a.txt").write_text("hello\n")
    assert list(iter_documents(str(tmp_path / "texts"))) == ["hello", '["not ours"]']  # sorted by path

def _plain_bpe(tmp_path, special_tokens=(), name="plain.json"):
    """A byte-level BPE tokenizer.json made with `tokenizers` alone: no FrawdLLM special tokens
    (GPT-2's kind of tokenizer when `special_tokens` is ["<|endoftext|>"])."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=list(special_tokens))
    backend.train_from_iterator(_corpus(50), trainer)
    backend.save(str(tmp_path / name))
    return tmp_path / name


@pytest.mark.parametrize("stop", [KeyboardInterrupt, FrawdError])
def test_an_interrupted_or_failed_rebuild_leaves_the_old_shards_usable(tmp_path, bpe, monkeypatch, stop):
    from frawdllm.train.pretrain import is_shard_dir

    out = tmp_path / "out"
    first = prepare_shards(str(_write_corpus(tmp_path / "c.txt", _corpus(30))), bpe, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bigger = _write_corpus(tmp_path / "big.txt", _corpus(200))

    def stopped(*args, **kwargs):  # Ctrl-C (or an error) once every new token is written
        raise stop("stopped")

    monkeypatch.setattr(shards_module.ShardWriter, "finish", stopped)
    with pytest.raises(stop):
        prepare_shards(str(bigger), bpe, out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temporary file left either
    assert is_shard_dir(out)
    monkeypatch.undo()
    again = prepare_shards(str(tmp_path / "c.txt"), bpe, out)
    assert again.get("reused") and again["train_tokens"] == first["train_tokens"]


def test_a_rebuild_removes_the_temporary_files_of_a_killed_run(tmp_path, bpe):
    out = tmp_path / "out"
    src = _write_corpus(tmp_path / "c.txt", _corpus(30))
    prepare_shards(str(src), bpe, out)
    for name in (".train.bin.k1ll3d_a.tmp", ".val.bin.k1ll3d_b.tmp", ".meta.json.k1ll3d_c.tmp"):
        (out / name).write_bytes(b"half")  # what a SIGKILL in the middle of a rebuild leaves
    assert prepare_shards(str(src), bpe, out).get("reused")
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_a_tokenizer_with_no_token_to_end_documents_is_refused_in_one_line(tmp_path, capsys):
    from cli_helpers import run_cli

    plain = _plain_bpe(tmp_path)
    assert Tokenizer.load(plain).token_to_id("<|eos|>") is None  # id 3 would be an ordinary byte
    src = _write_corpus(tmp_path / "c.txt", _corpus(30))
    with pytest.raises(FrawdError, match=r"has no token to end documents with: .*<\|eos\|>"):
        prepare_shards(str(src), plain, tmp_path / "out")
    code, out, err = run_cli(capsys, "data", "prepare", "--data", src, "--tokenizer", plain, "--out", tmp_path / "o")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"frawd: error: tokenizer {plain} has no token to end")
    assert "missing: <|pad|>, <|unk|>, <|bos|>, <|eos|>" in err and "<|endoftext|>" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_an_imported_tokenizer_ends_documents_with_its_own_end_of_text(tmp_path):
    gpt2_like = Tokenizer.load(_plain_bpe(tmp_path, ["<|endoftext|>"], "gpt2.json"))  # an imported GPT-2's kind
    end = gpt2_like.token_to_id("<|endoftext|>")
    assert end is not None and end != 3 and gpt2_like.unknown_id() is None  # byte-level: nothing is unknown
    docs = ["first document", "second one", "third"]
    src = _write_corpus(tmp_path / "c.txt", docs)
    meta = prepare_shards(str(src), gpt2_like, tmp_path / "out", val_fraction=0.0)
    tokens = read_shard(tmp_path / "out" / "train.bin").tolist()
    expected = []
    for doc in docs:
        expected += gpt2_like.encode(doc) + [end]
    assert tokens == expected and meta["unk_tokens"] == 0


def test_prepare_and_eval_draw_progress_bars_only_on_a_terminal(tmp_path, bpe, capfd):
    import pexpect

    from align_helpers import model_dir
    from frawdllm.cli import main

    corpus = _write_corpus(tmp_path / "c.txt", _corpus(200))
    bpe.save(tmp_path / "tok.json")
    frawd = [sys.executable, "-c", "from frawdllm.cli import main; main()"]
    prepare = ["data", "prepare", "--data", str(corpus), "--tokenizer", str(tmp_path / "tok.json")]
    evaluate = ["eval", "--model", str(model_dir(tmp_path)), "--data", str(corpus), "--val-fraction", "0.3",
                "--device", "cpu"]
    for args, result in ((prepare + ["--out", str(tmp_path / "log")], "train_tokens: "), (evaluate, "loss: ")):
        capfd.readouterr()
        try:  # in this process, stdout and stderr captured at the descriptors: not a terminal (a pipe, a log)
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
        stdout, stderr = capfd.readouterr()
        assert code == 0 and stderr == "", stderr
        assert result in stdout  # the result lines stay
    for args, bar in ((prepare + ["--out", str(tmp_path / "tty")], "tokenizing"), (evaluate, "evaluating")):
        child = pexpect.spawn(frawd[0], frawd[1:] + args, encoding="utf-8", timeout=300)
        child.expect_exact(bar)  # on a terminal the bar is drawn
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0


# ---- ids outside the vocabulary; a damaged meta.json at --out ------------------------------------

def _patch_id(path, position, value):
    raw = bytearray(path.read_bytes())
    itemsize = read_header(path)["dtype"].itemsize
    raw[HEADER_BYTES + itemsize * position:HEADER_BYTES + itemsize * (position + 1)] = \
        int(value).to_bytes(itemsize, "little")
    path.write_bytes(bytes(raw))


def test_read_split_bounds_ids_by_the_smaller_of_the_headers_and_meta_json_vocabularies(tmp_path):
    from frawdllm.data import SequentialLoader, read_split

    write_shard(tmp_path / "train.bin", np.arange(200) % 40, vocab_size=100)
    write_shard(tmp_path / "val.bin", np.arange(200) % 40, vocab_size=100)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 40}))
    assert len(list(SequentialLoader(read_split(tmp_path, "val"), 4, 16))) > 0
    _patch_id(tmp_path / "val.bin", 50, 70)  # inside the header's 100, outside meta.json's 40
    with pytest.raises(FrawdError, match=re.escape(f"{tmp_path / 'val.bin'}: token id 70 at position 50 (byte 164) "
                                                   "is outside the vocabulary [0, 40)")):
        list(SequentialLoader(read_split(tmp_path, "val"), 4, 16))


def test_cli_eval_of_shards_holding_an_id_outside_the_vocabulary_is_one_line(tmp_path, capsys):
    import torch

    from cli_helpers import run_cli
    from frawdllm import FrawdLLM, get_config

    tok = byte_tokenizer()
    torch.manual_seed(0)
    FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=16, n_head=2, context_length=16)
             ).save_pretrained(tmp_path / "model", tokenizer=tok)
    src = _write_corpus(tmp_path / "c.txt", _corpus(60))
    out = tmp_path / "shards"
    prepare_shards(str(src), tok, out, val_fraction=0.3)
    _patch_id(out / "val.bin", 20, 60000)
    code, stdout, err = run_cli(capsys, "eval", "--model", tmp_path / "model", "--data", out,
                                "--context-length", "16")
    assert code == 1 and stdout == ""
    assert err == (f"frawd: error: {out / 'val.bin'}: token id 60000 at position 20 (byte 104) is outside the "
                   f"vocabulary [0, {tok.vocab_size}); the shard is damaged: prepare it again with "
                   "frawd data prepare\n")


@pytest.mark.parametrize("beside", [("train.bin", "val.bin"), ()])
def test_cli_prepare_says_an_invalid_meta_json_at_out_is_not_valid_json(tmp_path, bpe, capsys, beside):
    from cli_helpers import run_cli

    src = _write_corpus(tmp_path / "a.txt", _corpus(40, seed=2))
    bpe.save(tmp_path / "tok.json")
    out = tmp_path / "d5"
    out.mkdir()
    for name in beside:
        write_shard(out / name, np.arange(50) % 10, vocab_size=bpe.vocab_size)
    (out / "meta.json").write_text("{not json")
    code, stdout, err = run_cli(capsys, "data", "prepare", "--data", src, "--tokenizer", tmp_path / "tok.json",
                                "--out", out)
    assert code == 1 and stdout == ""
    assert err == (f"frawd: error: {out / 'meta.json'} is not valid JSON; give another --out, "
                   "or --overwrite to replace it\n")
    assert sorted(p.name for p in out.iterdir()) == sorted([*beside, "meta.json"])


def test_ctrl_c_says_aborted_once_under_torchrun_on_rank_0_only(tmp_path, bpe, monkeypatch, capsys):
    # (every rank gets the Ctrl-C: "aborted" was printed once per rank)
    from cli_helpers import run_cli

    src = _write_corpus(tmp_path / "c.txt", _corpus(5))
    bpe.save(tmp_path / "tok.json")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards_module.ShardWriter, "finish", interrupted)
    for rank, said in ((None, "aborted"), ("0", "aborted"), ("1", "")):
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        code, _, err = run_cli(capsys, "data", "prepare", "--data", src, "--tokenizer", tmp_path / "tok.json",
                               "--out", tmp_path / "out")
        assert code == 130 and err.strip("\n") == said, (rank, err)  # (click writes a newline first)


def test_a_full_disk_names_the_shard_that_did_not_fit(tmp_path, bpe, monkeypatch):
    """train.bin filled the disk, and the message named val.bin: Python's failed write names
    no file, and the error that reached the user came from the shard opened last."""
    import builtins
    import errno

    class Full:  # a file on a disk that takes the header and nothing more
        def __init__(self, f):
            self.f, self.name = f, f.name

        def write(self, data):
            if self.f.tell() >= HEADER_BYTES:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opened(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return Full(f) if "w" in mode and ".train.bin" in str(path) else f

    monkeypatch.setattr(shards_module, "open", opened, raising=False)
    src = _write_corpus(tmp_path / "c.txt", _corpus(50))
    with pytest.raises(FrawdError, match=r"no space left on .* while writing .*train\.bin"):
        prepare_shards(str(src), bpe, tmp_path / "out")


# ---- one writer per folder; hf: folders; the tail's bytes; extreme val fractions ------------------

HOLD = """
import sys, time
from frawdllm.train.rundir import claim_run_dir
claim_run_dir(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def test_a_prepare_into_a_folder_another_process_writes_is_refused_and_touches_nothing(tmp_path, bpe, capsys,
                                                                                       monkeypatch):
    # (a second prepare deleted the first's temporary shards, which then failed: "no such file or directory")
    from cli_helpers import run_cli
    from frawdllm.train.rundir import lock_holder

    src = _write_corpus(tmp_path / "c.txt", _corpus(30))
    bpe.save(tmp_path / "tok.json")
    out = tmp_path / "out"
    holders = []
    real = shards_module.tokenize_documents

    def watched(*args, **kwargs):  # a prepare holds its folder while it writes
        holders.append(lock_holder(out))
        return real(*args, **kwargs)

    monkeypatch.setattr(shards_module, "tokenize_documents", watched)
    prepare_shards(str(src), bpe, out)
    assert holders == [os.getpid()]
    live = out / ".train.bin.l1ve0000.tmp"
    live.write_bytes(b"being written by the other process")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    prepare = ["data", "prepare", "--data", src, "--tokenizer", tmp_path / "tok.json", "--out", out]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        code, stdout, err = run_cli(capsys, *prepare, "--force")
        assert (code, stdout) == (1, "")
        assert err == (f"frawd: error: {out} is in use by another run (process {holder.pid}): wait for it to end or "
                       "stop it, or give another --out\n")
        code, _, err = run_cli(capsys, *prepare)  # reusing needs no lock (the ranks of a training run do it at once)
        assert code == 0 and "reusing" in err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the other's files untouched
    finally:
        holder.kill()
        holder.wait()
    assert prepare_shards(str(src), bpe, out).get("reused")  # now a killed run's file: removed
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_an_hf_source_in_a_local_folder_is_known_by_its_absolute_path_and_its_files(tmp_path, bpe, monkeypatch):
    # (its shards were reused after the dataset changed, and a folder of the same name elsewhere passed as it)
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def save(folder, docs):
        shutil.rmtree(folder, ignore_errors=True)
        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder))

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    save(tmp_path / "ds", _corpus(20))
    first = prepare_shards("hf:ds", bpe, out, val_fraction=0.3)
    assert first["resolved_source"] == f"hf:{tmp_path / 'ds'}"
    assert prepare_shards(f"hf:{tmp_path / 'ds'}", bpe, out, val_fraction=0.3).get("reused")
    save(tmp_path / "ds", _corpus(25, seed=4))
    changed = prepare_shards("hf:ds", bpe, out, val_fraction=0.3)
    assert not changed.get("reused") and changed["train_documents"] + changed["val_documents"] == 25
    (tmp_path / "elsewhere").mkdir()
    save(tmp_path / "elsewhere" / "ds", _corpus(5))
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(FrawdError, match=re.escape(f"{out} holds the shards of hf:{tmp_path / 'ds'}, not of hf:ds")):
        shards_module.refuse_other_shards(out, "hf:ds")
    assert shards_module.resolved_source("hf:someone/corpus@test") == "hf:someone/corpus@test"  # a Hub name


def test_a_validation_tail_counts_the_real_bytes_of_characters_a_char_tokenizer_does_not_know(tmp_path):
    # (each <|unk|> counted 1 byte: val_text_bytes 3999 for 4878, and bits per byte 22% off)
    tok = train_tokenizer(["abc "], "char")
    for i in range(100):  # three documents, none hashed into val: the tail is cut from the middle one
        docs = [f"abc é{i} " * 40, f"cab 日本{i} " * 50, f"a😀{i} " * 30]
        if not any(shards_module._is_val(d.encode(), 0.5) for d in docs):
            break
    (tmp_path / "c.txt").write_text("\n\n".join(docs), encoding="utf-8")
    meta = prepare_shards(str(tmp_path / "c.txt"), tok, tmp_path / "out", val_fraction=0.5)
    stream = [ch for doc in docs for ch in [*doc, ""]]  # what the tokens stand for: a character each, "" for <|eos|>
    keep = meta["train_tokens"]
    assert meta["val_split"] == "tail" and meta["unk_tokens"] > 0
    assert len(docs[0]) + 1 < keep < len(docs[0]) + len(docs[1]) + 2  # (cut inside the second document)
    assert meta["train_text_bytes"] == len("".join(stream[:keep]).encode())
    assert meta["val_text_bytes"] == len("".join(stream[keep:]).encode())


def test_a_val_fraction_leaving_train_empty_is_refused_and_one_below_a_token_leaves_val_empty(tmp_path, bpe):
    # (0.999999 wrote train_tokens 0 without a word; 1e-9 a val split of one <|eos|>, "0 bytes a token")
    src = tmp_path / "c.txt"
    _write_corpus(src, _corpus(20))
    with pytest.raises(FrawdError, match=r"val_fraction 0\.999999 of the [0-9,]+ tokens of .*c\.txt leaves none to "
                                         "train on; use a smaller one"):
        prepare_shards(str(src), bpe, tmp_path / "out", val_fraction=0.999999)
    assert not (tmp_path / "out").exists()
    meta = prepare_shards(str(src), bpe, tmp_path / "out", val_fraction=1e-9)
    assert (meta["val_split"], meta["val_tokens"], meta["val_bytes_per_token"]) == ("tail", 0, None)
    assert f"val_fraction 1e-09 of the {meta['train_tokens']:,} tokens is less than one token: the val split is " \
           "empty" in meta["warnings"]


def test_eval_of_a_train_split_too_short_for_a_window_advises_a_smaller_val_fraction(tmp_path, capsys):
    import torch

    from cli_helpers import run_cli
    from frawdllm import FrawdLLM, get_config

    tok = byte_tokenizer()
    torch.manual_seed(0)
    FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=16, n_head=2, context_length=16)
             ).save_pretrained(tmp_path / "model", tokenizer=tok)
    (tmp_path / "c.txt").write_text("a short document of a hundred bytes or so, " * 3, encoding="utf-8")
    args = ["eval", "--model", tmp_path / "model", "--data", tmp_path / "c.txt", "--doc-split", "file"]
    code, _, err = run_cli(capsys, *args, "--val-fraction", "0.95", "--split", "train")
    assert code == 1 and err.startswith("frawd: error: the train split has ")
    assert err.endswith("use more data, a smaller --val-fraction or a shorter --context-length\n")
    code, _, err = run_cli(capsys, *args, "--val-fraction", "0.05")
    assert code == 1 and err.endswith("use more data, a larger --val-fraction or a shorter --context-length\n")


def test_the_bar_has_a_total_only_where_it_counts_the_whole_file(tmp_path):
    """The bar counts document text: for a JSONL file (or Parquet, or compressed) that is a
    part of its bytes, and a bar out of the file's size crawled to 9% and jumped to 100%."""
    from frawdllm.data.shards import _source_bytes

    (tmp_path / "a.txt").write_text("some text\n\nmore\n")
    (tmp_path / "b.jsonl").write_text('{"text": "x", "meta": "' + "y" * 800 + '"}\n')
    assert _source_bytes(str(tmp_path / "a.txt")) == 16
    assert _source_bytes(str(tmp_path / "b.jsonl")) is None
    assert _source_bytes(str(tmp_path)) is None  # (a folder holding one)
    # gzip known by its first bytes (the bar passed 100%: 7.9 MB of text out of 3.5 MB), UTF-16
    # (twice its UTF-8: the bar jumped from 46% to 100%), and JSON Lines named .ndjson or .json
    import gzip

    for name, data in (("c.txt", gzip.compress(b"some text\n" * 50)), ("d.txt", "some text\n".encode("utf-16")),
                       ("e.ndjson", b'{"text": "x"}\n'), ("f.json", b'{"text": "x"}\n')):
        (tmp_path / name).write_bytes(data)
        assert _source_bytes(str(tmp_path / name)) is None, name
