"""Corpus sources: every kind of input, document splitting (against a one-shot re.split
reference), invalid UTF-8 (against Python's own 'replace' decoding), and clear errors."""

import gzip
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frawdllm.data import sources
from frawdllm.data.sources import SourceStats, iter_documents, parse_hf_spec, stdlib_files
from frawdllm.errors import FrawdError


def _reference_split(text: str, mode: str) -> list[str]:
    separator = {"blank": r"\n(?:[^\S\n]*\n)+", "line": r"\n"}[mode]
    return [d.strip("\r\n") for d in re.split(separator, text) if d.strip("\r\n").strip()]


def test_text_file_splits_documents_at_blank_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first\nstill first\n\n\nsecond\n  \t\nthird\r\n\r\nfourth\n\n", encoding="utf-8")
    assert list(iter_documents(str(path))) == ["first\nstill first", "second", "third", "fourth"]


def test_doc_split_line_and_file(tmp_path):
    path = tmp_path / "a.txt"
    text = "one\ntwo\n\nthree\n"
    path.write_text(text, encoding="utf-8")
    assert list(iter_documents(str(path), doc_split="line")) == ["one", "two", "three"]
    assert list(iter_documents(str(path), doc_split="file")) == [text]
    with pytest.raises(FrawdError, match="doc_split"):
        iter_documents(str(path), doc_split="page")


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab \t\n\r", max_size=80), chunk=st.integers(1, 9),
       mode=st.sampled_from(["blank", "line"]))
def test_chunked_splitting_equals_splitting_the_whole_text_at_once(text, chunk, mode):
    chunks = iter([text[i:i + chunk] for i in range(0, len(text), chunk)] + [""])
    got = list(sources._split_stream(lambda: next(chunks), sources._SEPARATORS[mode]))
    assert got == _reference_split(text, mode)


def test_many_short_documents_in_one_chunk_read_in_linear_time(tmp_path):
    # Each separator once checked the rest of the 4M-character chunk: 400,000 ten-byte lines
    # took 135 s to read, 0.5 s after. Against a plain split of the same text, same process.
    text = "".join(f"w{i:08d}\n" for i in range(200_000))
    (tmp_path / "lines.txt").write_text(text, encoding="utf-8")
    plain = []
    for _ in range(3):
        start = time.perf_counter()
        expected = [line for line in text.split("\n") if line.strip()]
        plain.append(time.perf_counter() - start)
    start = time.perf_counter()
    documents = list(iter_documents(str(tmp_path / "lines.txt"), doc_split="line"))
    took = time.perf_counter() - start
    assert documents == expected
    assert took < 200 * sorted(plain)[1] + 0.5, (took, plain)


def test_gzip_file_reads_like_the_plain_file(tmp_path):
    text = "alpha\n\nbeta gamma\n\nδέλτα\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    assert list(iter_documents(str(tmp_path / "a.txt.gz"))) == list(iter_documents(str(tmp_path / "a.txt")))
    assert len(list(iter_documents(str(tmp_path / "a.txt.gz")))) == 3


def test_corrupt_gzip_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.txt.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(FrawdError, match="bad.txt.gz: cannot read"):
        list(iter_documents(str(bad)))


def test_folder_reads_files_sorted_by_path_and_skips_hidden_ones(tmp_path):
    (tmp_path / "b.txt").write_text("from b", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("from sub/a", encoding="utf-8")
    (tmp_path / "a.txt").write_text("from a", encoding="utf-8")
    (tmp_path / ".hidden.txt").write_text("secret", encoding="utf-8")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "from c"}) + "\n", encoding="utf-8")
    stats = SourceStats()
    assert list(iter_documents(str(tmp_path), stats=stats)) == ["from a", "from b", "from c", "from sub/a"]
    assert stats.files == 4 and stats.documents == 4


def test_glob_matches_sorted_files_and_a_glob_without_match_is_an_error(tmp_path):
    for name in ("x2.txt", "x1.txt", "y.md"):
        (tmp_path / name).write_text(name, encoding="utf-8")
    assert list(iter_documents(str(tmp_path / "x*.txt"))) == ["x1.txt", "x2.txt"]
    assert list(iter_documents(str(tmp_path / "**" / "*.md"))) == ["y.md"]
    with pytest.raises(FrawdError, match="no files match"):
        iter_documents(str(tmp_path / "*.csv"))


@pytest.mark.timeout(30)
def test_a_glob_reads_the_files_the_folder_form_reads_through_links_and_loops(tmp_path):
    """glob.glob's ** followed links to folders: `latest -> 2024-06` read every file twice, a
    link to a folder above read one file 41 times, and two such links made a walk that did
    not end. A glob now reads what the folder form reads (links to folders not followed,
    hidden names skipped unless the pattern spells one)."""
    (tmp_path / "2024-06").mkdir()
    (tmp_path / "2024-06" / "a.txt").write_text("one\n\ntwo\n")
    (tmp_path / "2024-06" / ".notes.txt").write_text("hidden\n")
    (tmp_path / "latest").symlink_to("2024-06")
    (tmp_path / "2024-06" / "up").symlink_to("..")
    (tmp_path / "2024-06" / "around").symlink_to("../latest")
    (tmp_path / "b.txt").symlink_to(tmp_path / "2024-06" / "a.txt")  # (a link to a file is read)
    folder = sources.resolve_files(str(tmp_path))
    assert folder == [tmp_path / "2024-06" / "a.txt", tmp_path / "b.txt"]
    assert sources.resolve_files(str(tmp_path / "**" / "*.txt")) == folder
    assert sources.resolve_files(str(tmp_path / "*" / "a.txt")) == [tmp_path / "2024-06" / "a.txt"]
    assert sources.resolve_files(str(tmp_path / "**" / ".*.txt")) == [tmp_path / "2024-06" / ".notes.txt"]
    # `DIR/**` is every file below DIR, as glob.glob and the folder form read (pathlib's: folders only)
    assert sources.resolve_files(str(tmp_path / "**")) == folder
    assert sources.resolve_files(str(tmp_path / "2024-06" / "a**")) == [tmp_path / "2024-06" / "a.txt"]  # (in a name)


def test_a_folder_that_cannot_be_read_is_an_error_not_left_out(tmp_path):
    """Files in a folder the user cannot list were silently left out (folder and ** forms)."""
    AS_OWNER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]
    if os.geteuid() == 0 and subprocess.run([*AS_OWNER, "true"], capture_output=True).returncode != 0:
        pytest.skip("setpriv cannot drop root's file-permission override here")
    (tmp_path / "src" / "locked").mkdir(parents=True)
    (tmp_path / "src" / "a.txt").write_text("readable\n")
    (tmp_path / "src" / "locked" / "c.txt").write_text("behind a closed door\n")
    (tmp_path / "src" / "locked").chmod(0o000)
    script = ("import sys\nfrom frawdllm.data.sources import resolve_files\nfrom frawdllm.errors import FrawdError\n"
              "for spec in sys.argv[1:]:\n    try:\n        print(resolve_files(spec))\n"
              "    except FrawdError as error:\n        print(error)\n")
    try:
        out = subprocess.run([*(AS_OWNER if os.geteuid() == 0 else []), sys.executable, "-c", script,
                              str(tmp_path / "src"), str(tmp_path / "src" / "**" / "*.txt")],
                             capture_output=True, text=True, timeout=60)
    finally:
        (tmp_path / "src" / "locked").chmod(0o755)
    refused = f"cannot read folder {tmp_path / 'src' / 'locked'} (permission denied): its files would be left out"
    assert out.stdout.splitlines() == [refused, refused], out.stderr


def test_missing_path_is_an_error_at_once(tmp_path):
    with pytest.raises(FrawdError, match="data source not found.*nope"):
        iter_documents(str(tmp_path / "nope"))


def test_empty_corpus_is_an_error_naming_the_source(tmp_path):
    path = tmp_path / "blank.txt"
    path.write_text("\n\n  \n\t\n", encoding="utf-8")
    with pytest.raises(FrawdError, match="no documents"):
        list(iter_documents(str(path)))


def test_jsonl_reads_the_text_field_and_gz(tmp_path):
    rows = [{"text": "one", "id": 1}, {"text": "two"}, {"text": ""}, {"body": "x", "text": "three"}]
    lines = "\n".join(json.dumps(r) for r in rows) + "\n\n"
    (tmp_path / "d.jsonl").write_text(lines, encoding="utf-8")
    with gzip.open(tmp_path / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines)
    assert list(iter_documents(str(tmp_path / "d.jsonl"))) == ["one", "two", "three"]
    assert list(iter_documents(str(tmp_path / "d.jsonl.gz"))) == ["one", "two", "three"]
    (tmp_path / "e.jsonl").write_text(json.dumps({"body": "b"}) + "\n", encoding="utf-8")
    assert list(iter_documents(str(tmp_path / "e.jsonl"), text_field="body")) == ["b"]
    (tmp_path / "bom.jsonl").write_text("\ufeff" + lines, encoding="utf-8")  # (was "line 1: not valid JSON")
    assert list(iter_documents(str(tmp_path / "bom.jsonl"))) == ["one", "two", "three"]
    # A lone CR is JSON whitespace inside a record, not a line end (was "cr.jsonl:1: not valid JSON")
    (tmp_path / "cr.jsonl").write_bytes(b'{"text": "a",\r"id": 1}\r\n{"text": "b\\r"}\n{"text"\r:\r"c"}')
    assert list(iter_documents(str(tmp_path / "cr.jsonl"))) == ["a", "b\r", "c"]
    (tmp_path / "cr.jsonl").write_bytes(b'{"text": "a",\r"id": 1}\n{"text": \r5}\n')
    with pytest.raises(FrawdError, match=r"cr\.jsonl:2: field 'text' is int"):  # (the line counted right)
        list(iter_documents(str(tmp_path / "cr.jsonl")))


@pytest.mark.parametrize("doc_split", ["blank", "line", "file"])
def test_a_byte_order_mark_opening_a_text_file_is_not_text(tmp_path, doc_split):
    (tmp_path / "bom.txt").write_bytes("\ufeffFirst doc\n\nSecond\n".encode())
    with gzip.open(tmp_path / "bom.txt.gz", "wb") as f:
        f.write("\ufeffFirst doc\n\nSecond\n".encode())
    for name in ("bom.txt", "bom.txt.gz"):
        documents = list(iter_documents(str(tmp_path / name), doc_split=doc_split))
        assert documents[0].startswith("First doc"), (name, documents)


def test_jsonl_bad_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "broken\n', encoding="utf-8")
    with pytest.raises(FrawdError, match=r"d\.jsonl:2: not valid JSON"):
        list(iter_documents(str(path)))
    path.write_text('{"text": "ok"}\n\n{"content": "no text"}\n', encoding="utf-8")
    with pytest.raises(FrawdError, match=r"d\.jsonl:3: no field 'text' \(fields: 'content'\)"):
        list(iter_documents(str(path)))
    path.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(FrawdError, match=r"d\.jsonl:1: field 'text' is int"):
        list(iter_documents(str(path)))
    path.write_text('{"text": null}\n', encoding="utf-8")  # (JSON's name, not Python's NoneType)
    with pytest.raises(FrawdError, match=r"d\.jsonl:1: field 'text' is null, expected a string"):
        list(iter_documents(str(path)))


def test_invalid_utf8_is_replaced_and_counted_like_pythons_replace_decoder(tmp_path):
    raw = b"ok \xff\xfe there\n\nsecond \xc3( and \xe2\x82\n\nclean \xe2\x82\xac\n"
    path = tmp_path / "bad.txt"
    path.write_bytes(raw)
    stats = SourceStats()
    docs = list(iter_documents(str(path), stats=stats))
    reference = raw.decode("utf-8", "replace")
    assert docs == _reference_split(reference, "blank")
    assert stats.replaced == reference.count("\ufffd") == 4
    assert stats.replaced_in == [str(path)]
    assert "replaced 4 invalid UTF-8" in stats.warning()


def test_invalid_utf8_in_jsonl_and_lone_surrogates_are_replaced_and_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "caf\xe9"}\n{"text": "lone \\ud800 surrogate"}\n')
    stats = SourceStats()
    assert list(iter_documents(str(path), stats=stats)) == ["caf\ufffd", "lone \ufffd surrogate"]
    assert stats.replaced == 2
    assert stats.replaced_in == [str(path)]  # (each record counts, the file is named once)
    assert stats.warning().endswith(f"in 1 file(s): {path}"), stats.warning()


def test_the_files_with_invalid_utf8_are_named_three_at_most(tmp_path):
    for count in (3, 4):
        folder = tmp_path / str(count)
        folder.mkdir()
        for name in "abcd"[:count]:
            (folder / f"{name}.txt").write_bytes(b"x\xff y")
        stats = SourceStats()
        list(iter_documents(str(folder), stats=stats))
        names = ", ".join(str(folder / f"{name}.txt") for name in "abc") + (", ..." if count > 3 else "")
        assert stats.warning().endswith(f"in {count} file(s): {names}"), stats.warning()


def test_clean_text_reports_nothing(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("naïve café 日本\n", encoding="utf-8")
    stats = SourceStats()
    list(iter_documents(str(path), stats=stats))
    assert stats.replaced == 0 and stats.warning() is None


def test_parquet_reads_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["uno", "", "dos"], "n": [1, 2, 3]}), path)
    assert list(iter_documents(str(path))) == ["uno", "dos"]
    with pytest.raises(FrawdError, match=r"d\.parquet: no column 'body' \(columns: text, n\)"):
        iter_documents(str(path), text_field="body").__next__()
    pq.write_table(pa.table({"text": ["a", None]}), path)
    with pytest.raises(FrawdError, match="row 2: column 'text' is null, expected a string"):
        list(iter_documents(str(path)))


def test_hf_spec_parsing():
    assert parse_hf_spec("hf:wikitext") == ("wikitext", None, "train")
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1@validation") == ("wikitext", "wikitext-2-raw-v1", "validation")
    assert parse_hf_spec("hf:/data/local@test") == ("/data/local", None, "test")
    with pytest.raises(FrawdError, match="bad dataset spec"):
        parse_hf_spec("hf:@train")
    assert parse_hf_spec("hf:/data/v@2@test") == ("/data/v@2", None, "test")  # (the split is after the last @)


def test_hf_source_reads_a_local_dataset_directory(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["alpha", "beta"], "label": [0, 1]}),
        "test": datasets.Dataset.from_dict({"text": ["gamma"], "label": [1]}),
    }).save_to_disk(str(saved))
    assert list(iter_documents(f"hf:{saved}")) == ["alpha", "beta"]
    assert list(iter_documents(f"hf:{saved}@test")) == ["gamma"]
    with pytest.raises(FrawdError, match="no split 'validation'"):
        iter_documents(f"hf:{saved}@validation")
    with pytest.raises(FrawdError, match="no column 'body'"):
        iter_documents(f"hf:{saved}", text_field="body")

    raw = tmp_path / "raw"  # a plain folder of data files, read by datasets' json builder
    raw.mkdir()
    (raw / "train.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n', encoding="utf-8")
    assert list(iter_documents(f"hf:{raw}")) == ["one", "two"]


def test_hf_source_that_cannot_load_is_one_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FrawdError, match="cannot load dataset"):
        iter_documents(f"hf:{tmp_path / 'no-such-dataset'}")


def test_an_hf_name_without_a_network_fails_at_once_saying_so(tmp_path):
    """datasets retried for ~30 s, logging each retry, before giving up; a Hub host that
    does not resolve (.invalid never does) now means the local cache alone, at once."""
    pytest.importorskip("datasets")
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper() and k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="https://hub.frawd.invalid", HF_HOME=str(tmp_path / "hf"))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "frawdllm.cli", "tokenizer", "train", "--data",
                           "hf:someone/no-such-dataset", "--vocab-size", "300", "--out", str(tmp_path / "t")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and time.monotonic() - start < 20
    assert done.stderr.startswith("frawd: error: hf:someone/no-such-dataset: cannot load dataset")
    assert "hub.frawd.invalid cannot be reached (no network?)" in done.stderr
    assert "Retry" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


def test_stdlib_corpus_is_the_standard_library_without_tests_in_path_order():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    relative = [p.relative_to(root).as_posix() for p in files]
    assert relative == sorted(relative)
    assert all(p.suffix == ".py" for p in files)
    assert not any(set(Path(r).parts[:-1]) & {"test", "tests", "idle_test", "site-packages"} for r in relative)
    assert {"os.py", "json/__init__.py", "collections/__init__.py"} <= set(relative)
    assert 5e6 < sum(p.stat().st_size for p in files) < 40e6
    docs = iter_documents("stdlib", doc_split="blank")  # stdlib is always one document per file
    first = next(docs)
    assert first == files[0].read_text(encoding="utf-8")


def test_hf_rows_the_reader_cannot_decode_are_one_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    surrogate = tmp_path / "surrogate"  # pyarrow's JSON parser refuses a lone surrogate
    surrogate.mkdir()
    (surrogate / "train.jsonl").write_text('{"text": "ok"}\n{"text": "lone \\ud800 s"}\n', encoding="utf-8")
    with pytest.raises(FrawdError, match=r"surrogate: cannot read row 1 or a later one \(JSON parse error"):
        list(iter_documents(f"hf:{surrogate}"))
    bad_utf8 = tmp_path / "bad_utf8"  # a string column holding invalid UTF-8 (pyarrow writes it unchecked)
    bad_utf8.mkdir()
    raw = pa.array([b"ok", b"bad \xff byte"], pa.binary())
    column = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    pq.write_table(pa.table({"text": column}), bad_utf8 / "train.parquet")
    for spec in (f"hf:{bad_utf8}", str(bad_utf8 / "train.parquet")):
        with pytest.raises(FrawdError, match=r"cannot read row 1 or a later one \('utf-8' codec can't decode"):
            list(iter_documents(spec))


# ---- prepared shards inside a text source; a folder of hidden files ------------------------------

def _shard_folder(folder: Path) -> Path:
    """What frawd data prepare writes: train.bin, val.bin and meta.json."""
    from frawdllm.data import write_shard

    folder.mkdir(parents=True)
    for name in ("train.bin", "val.bin"):
        write_shard(folder / name, np.arange(200) % 40, vocab_size=300)
    (folder / "meta.json").write_text(json.dumps({"source": "x.txt", "vocab_size": 300}), encoding="utf-8")
    return folder


def test_a_folder_holding_a_folder_of_prepared_shards_is_refused_not_read_as_text(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("some text", encoding="utf-8")
    shards = _shard_folder(tmp_path / "d" / "bpe")
    with pytest.raises(FrawdError, match=re.escape(f"{shards} holds prepared shards (meta.json), not text: "
                                                   f"move it out of {tmp_path / 'd'}")):
        sources.source_files(str(tmp_path / "d"))  # checked when the source is resolved, before any reading
    (shards / "val.bin").unlink()  # a split lost: still a folder of shards, and named as one
    with pytest.raises(FrawdError, match=re.escape(f"{shards} holds prepared shards (meta.json), not text: ")):
        sources.source_files(str(tmp_path / "d"))


@pytest.mark.parametrize("name", ["train-00003.bin", "tokens.dat"])
def test_a_token_shard_file_in_a_text_source_is_refused(tmp_path, name):
    from frawdllm.data import write_shard

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("some text", encoding="utf-8")
    shard = tmp_path / "d" / name
    write_shard(shard, np.array([5, 6, 7]), vocab_size=300)
    refused = re.escape(f"{shard} is a FrawdLLM token shard (binary token ids), not text, and {tmp_path / 'd'} has "
                        "no meta.json: a folder of prepared shards needs its meta.json (prepare it again); a text "
                        "source must leave shards out")
    for spec in (tmp_path / "d", tmp_path / "d" / "*", shard):  # a folder, a glob, the file itself
        with pytest.raises(FrawdError, match=refused):
            list(iter_documents(str(spec)))
    with pytest.raises(FrawdError, match=refused):
        sources.source_files(str(tmp_path / "d" / "*.bin" if name.endswith(".bin") else shard))  # before any reading
    (tmp_path / "d" / "meta.json").write_text("{}", encoding="utf-8")  # beside a meta.json: only leave it out
    with pytest.raises(FrawdError, match=re.escape(f"{shard} is a FrawdLLM token shard (binary token ids), not "
                                                   "text; leave it out of the data source")):
        list(iter_documents(str(shard)))


def test_a_folder_of_hidden_files_only_says_so(tmp_path):
    (tmp_path / "hid").mkdir()
    (tmp_path / "hid" / ".x").write_text("hi", encoding="utf-8")
    (tmp_path / "hid" / ".git").mkdir()
    (tmp_path / "hid" / ".git" / "config").write_text("hi", encoding="utf-8")
    with pytest.raises(FrawdError, match=re.escape(f"folder {tmp_path / 'hid'} holds only hidden files "
                                                   "(names starting with '.'), which are skipped")):
        list(iter_documents(str(tmp_path / "hid")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FrawdError, match=re.escape(f"folder {tmp_path / 'empty'} holds no files")):
        list(iter_documents(str(tmp_path / "empty")))


# ---- names that look like globs; compressed and UTF-16 files; a saved Dataset's split -----------

def test_an_existing_path_holding_glob_characters_is_that_path_not_a_pattern(tmp_path, monkeypatch):
    # (data[1].txt was refused "no files match", or read data1.txt instead when that existed)
    from frawdllm.data.shards import resolved_source

    monkeypatch.chdir(tmp_path)
    Path("data[1].txt").write_text("from data[1]", encoding="utf-8")
    Path("data1.txt").write_text("from data1", encoding="utf-8")
    Path("corpus [v2]").mkdir()
    Path("corpus [v2]", "a.txt").write_text("from the folder", encoding="utf-8")
    assert list(iter_documents("data[1].txt")) == ["from data[1]"]
    assert list(iter_documents("corpus [v2]")) == ["from the folder"]
    assert list(iter_documents("data[0-9].txt")) == ["from data1"]  # no such path: a pattern
    Path("link[1].txt").symlink_to("data[1].txt")
    assert resolved_source("link[1].txt") == str(tmp_path / "data[1].txt")  # a path: its link resolved


@pytest.mark.parametrize("suffix, opener", [(".bz2", "bz2"), (".xz", "lzma"), ("", "gzip")],
                         ids=["bz2", "xz", "gzip-without-suffix"])
def test_bzip2_and_xz_files_read_like_the_plain_file(tmp_path, suffix, opener):
    import importlib

    text = "alpha\n\nbeta gamma\n\nδέλτα\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    packed = tmp_path / f"packed{suffix}"  # known by its suffix, or by its first bytes
    packed.write_bytes(importlib.import_module(opener).compress(text.encode()))
    assert list(iter_documents(str(packed))) == list(iter_documents(str(tmp_path / "a.txt")))
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n", encoding="utf-8")
    jsonl = tmp_path / f"b.jsonl{suffix or '.gz'}"
    jsonl.write_bytes(importlib.import_module(opener).compress((tmp_path / "b.jsonl").read_bytes()))
    assert list(iter_documents(str(jsonl))) == ["one"]


@pytest.mark.parametrize("magic, kind, command", [(b"\x28\xb5\x2f\xfd", "zstd", "zstd -d"),
                                                  (b"PK\x03\x04", "zip", "unzip")])
def test_a_file_compressed_in_a_format_not_read_is_one_line_naming_it(tmp_path, magic, kind, command):
    # (a .zst file was tokenized as binary garbage, with only a warning of replaced bytes)
    (tmp_path / "a.txt").write_text("fine text", encoding="utf-8")
    packed = tmp_path / "b.txt"  # known by its first bytes
    packed.write_bytes(magic + bytes(range(200)))
    said = f"{packed} is compressed with {kind}, which is not read here (gzip, bzip2 and xz are): decompress it " \
           f"first ({command} {packed})"
    with pytest.raises(FrawdError, match=re.escape(said)):
        list(iter_documents(str(tmp_path)))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_file_opening_with_a_utf16_or_utf32_byte_order_mark_is_decoded_as_such(tmp_path, encoding):
    # (Windows "Unicode" text was read as F\0i\0r\0s\0t\0...)
    text = "First Citizen:\nBefore we proceed\n\nδέλτα 🙂\n"
    path = tmp_path / "win.txt"
    path.write_bytes(("\ufeff" if encoding == "utf-16-be" else "").encode(encoding) + text.encode(encoding))
    stats = SourceStats()
    assert list(iter_documents(str(path), stats=stats)) == ["First Citizen:\nBefore we proceed", "δέλτα 🙂"]
    assert stats.replaced == 0


@pytest.mark.parametrize("packing", ["gz", "bz2", "xz"])
@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_compressed_utf16_or_utf32_text_is_decoded_as_the_plain_file_is(tmp_path, encoding, packing):
    # (a gzipped UTF-16 file was read as UTF-8: "h\0e\0l\0l\0o", only its BOM counted as bad bytes)
    import importlib

    text = "First Citizen:\nBefore we proceed\n\nδέλτα 🙂\n"
    plain, packed = tmp_path / "win.txt", tmp_path / f"win.txt.{packing}"
    plain.write_bytes(text.encode(encoding))
    packed.write_bytes(importlib.import_module({"xz": "lzma", "gz": "gzip"}.get(packing, packing)).compress(plain.read_bytes()))
    stats = SourceStats()
    assert list(iter_documents(str(packed), stats=stats)) == ["First Citizen:\nBefore we proceed", "δέλτα 🙂"]
    assert stats.replaced == 0
    (tmp_path / "w.jsonl").write_bytes(json.dumps({"text": "δέλτα"}, ensure_ascii=False).encode(encoding))
    (tmp_path / "w.jsonl.gz").write_bytes(gzip.compress((tmp_path / "w.jsonl").read_bytes()))
    assert list(iter_documents(str(tmp_path / "w.jsonl.gz"))) == ["δέλτα"]


@pytest.mark.parametrize("packing", ["", ".gz"])
def test_a_tar_archive_is_one_line_saying_to_unpack_it(tmp_path, packing):
    # (a .tar or .tar.gz of text files was read as text: headers, NULs and modes in the vocabulary)
    import tarfile

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text\n" * 50, encoding="utf-8")
    archive = tmp_path / f"corpus.tar{packing}"
    with tarfile.open(archive, "w:gz" if packing else "w") as tar:
        tar.add(tmp_path / "src", arcname="src")
    said = f"{archive} is a tar archive, which is not read here: unpack it (tar xf {archive}) and give the folder"
    with pytest.raises(FrawdError, match=re.escape(said)):
        list(iter_documents(str(archive)))
    assert list(iter_documents(str(tmp_path / "src"))) == ["some text\n" * 49 + "some text"]  # (a text file is not)


def test_ndjson_and_json_lines_named_json_are_records(tmp_path):
    # (both were read as text: one document of braces and quotes, while hf:FOLDER read the records)
    lines = "".join(json.dumps({"text": f"line {i}", "id": i}) + "\n" for i in range(3))
    for name in ("a.ndjson", "b.json"):
        (tmp_path / name).write_text(lines, encoding="utf-8")
    (tmp_path / "c.json.gz").write_bytes(gzip.compress(lines.encode()))
    for name in ("a.ndjson", "b.json", "c.json.gz"):
        assert list(iter_documents(str(tmp_path / name))) == ["line 0", "line 1", "line 2"], name
    # a JSON document that is not such records (a config among code, an array, another field) is text
    config = '{\n  "name": "pkg",\n  "text": "x"\n}\n'
    (tmp_path / "package.json").write_text(config, encoding="utf-8")
    (tmp_path / "array.json").write_text('[{"text": "a"}]\n', encoding="utf-8")
    (tmp_path / "other.json").write_text(json.dumps({"body": "a"}) + "\n", encoding="utf-8")
    assert list(iter_documents(str(tmp_path / "package.json"))) == [config.strip("\n")]
    assert list(iter_documents(str(tmp_path / "array.json"))) == ['[{"text": "a"}]']
    assert list(iter_documents(str(tmp_path / "other.json"))) == ['{"body": "a"}']
    assert list(iter_documents(str(tmp_path / "other.json"), text_field="body")) == ["a"]


def test_a_split_given_for_a_saved_dataset_without_splits_is_refused(tmp_path, monkeypatch):
    # (hf:DIR@no_such_split read the rows of the one saved Dataset)
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    bare, named = tmp_path / "bare", tmp_path / "named"
    datasets.Dataset.from_dict({"text": ["alpha", "beta"]}).save_to_disk(str(bare))
    datasets.Dataset.from_dict({"text": ["gamma"]}, split="test").save_to_disk(str(named))
    assert list(iter_documents(f"hf:{bare}")) == ["alpha", "beta"]
    with pytest.raises(FrawdError, match=re.escape(f"hf:{bare}@nope: {bare} holds one saved dataset, not a dictionary "
                                                   "of splits, so @nope cannot apply; leave it out")):
        iter_documents(f"hf:{bare}@nope")
    assert list(iter_documents(f"hf:{named}@test")) == ["gamma"]  # its own split
    with pytest.raises(FrawdError, match=re.escape(f"{named} holds one saved dataset (the test split)")):
        iter_documents(f"hf:{named}@train")


def test_a_folder_of_an_unfinished_prepare_says_so_not_hidden_files(tmp_path):
    """A prepare running, or killed, leaves only .train.bin.*.tmp: "holds only hidden files"
    hid that a prepare is writing the folder, or was stopped."""
    from frawdllm.train.rundir import claim_run_dir, release_run_dir

    out = tmp_path / "cc"
    out.mkdir()
    (out / ".train.bin.a1b2c3d4.tmp").write_bytes(b"\0" * 64)
    (out / ".val.bin.e5f6g7h8.tmp").write_bytes(b"\0" * 64)
    with pytest.raises(FrawdError, match=re.escape(f"{out} holds an unfinished `frawd data prepare` (temporary "
                                                   f"shard files, no meta.json): run frawd data prepare --out {out} "
                                                   "again")):
        list(iter_documents(str(out)))
    assert claim_run_dir(out)  # (as a prepare holds its --out)
    try:
        with pytest.raises(FrawdError, match=re.escape(f"{out} is being prepared by `frawd data prepare` (process "
                                                       f"{os.getpid()}); wait for it to end")):
            list(iter_documents(str(out)))
    finally:
        release_run_dir(out)


def test_binary_files_in_a_folder_or_glob_are_skipped_and_named(tmp_path):
    """An executable and a .pyc in a data folder were read as text: ~15k tokens of U+FFFD and
    control bytes went into train.bin (a file of NULs without even a warning). Text stays:
    UTF-16 with its byte-order mark (NULs between ASCII letters), gzip'd text; a file named
    alone is read as given."""
    import gzip
    import warnings

    from frawdllm.data import sources

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text\n", encoding="utf-8")
    (folder / "b.txt").write_text("utf sixteen\n", encoding="utf-16")  # (a BOM, then NULs)
    (folder / "c.txt.gz").write_bytes(gzip.compress(b"packed text\n"))
    (folder / "mod.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0" + b"x" * 100)
    (folder / "nuls.dat").write_bytes(b"text\0\0\0\x01\x02more\0")
    (folder / "late.bin.txt").write_bytes(b"t" * 9000 + b"\0")  # (a NUL past the first 8,000 bytes: text)
    for spec, where in ((folder, f"folder {folder}"), (f"{folder}/*", f"files matching '{folder}/*'")):
        sources._SAID.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            files = sources.resolve_files(str(spec))
            sources.resolve_files(str(spec))  # (listed again: said once)
        assert [p.name for p in files] == ["a.txt", "b.txt", "c.txt.gz", "late.bin.txt"]
        assert [str(w.message) for w in caught] == [
            f"skipped 2 binary file(s) in {where} (a NUL byte near the start, not text): {folder / 'mod.pyc'}, "
            f"{folder / 'nuls.dat'}"]
    assert sources.resolve_files(str(folder / "nuls.dat")) == [folder / "nuls.dat"]
    only = tmp_path / "only"
    only.mkdir()
    (only / "x.bin2").write_bytes(b"\0" * 10)
    with pytest.raises(FrawdError, match=r"^folder \S+only: no text files, only binary ones \(a NUL byte near the "
                                         r"start\): \S+x\.bin2$"):
        sources.resolve_files(str(only))


@pytest.mark.parametrize("name", ["notes.txt", "notes.bin"])
def test_a_text_that_starts_with_the_shard_magics_letters_is_text_however_it_is_named(tmp_path, name):
    """Named alone (or a .bin in a folder) it was refused as "a FrawdLLM token shard (binary
    token ids)": only the magic's 8 bytes were compared, not the version's NULs after them."""
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / name
    path.write_text("FRAWDTOK is my word\n\nsecond\n", encoding="utf-8")
    for spec in (path, tmp_path / "d", tmp_path / "d" / "*"):
        assert list(iter_documents(str(spec))) == ["FRAWDTOK is my word", "second"], spec


def test_a_folder_reads_parquet_beside_text_and_skips_links_to_nothing_and_pipes(tmp_path):
    """Parquet holds NULs near its start yet is no binary file to skip; a broken link and a
    FIFO are not files (opening the FIFO would wait for a writer forever)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "d"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["row one", "row two"]}), folder / "a.parquet")
    (folder / "b.txt").write_text("plain\n", encoding="utf-8")
    (folder / "c.txt").symlink_to(tmp_path / "nowhere")
    os.mkfifo(folder / "d.txt")
    import warnings

    for spec in (folder, folder / "*"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert list(iter_documents(str(spec))) == ["row one", "row two", "plain"], spec


@pytest.mark.parametrize("doc_split, expected", [
    ("file", ["  indented\r\nline2\r\n\r\nnext\rsame line\r\n"]),
    ("blank", ["  indented\r\nline2", "next\rsame line"]), ("line", ["  indented", "line2", "next\rsame line"])])
def test_line_ends_are_kept_as_stored(tmp_path, doc_split, expected):
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"  indented\r\nline2\r\n\r\nnext\rsame line\r\n")
    assert list(iter_documents(str(path), doc_split=doc_split)) == expected


def test_a_json_file_opening_with_a_byte_order_mark_is_still_records(tmp_path):
    path = tmp_path / "b.json"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "hi"}\n{"text": "there"}\n')
    assert list(iter_documents(str(path))) == ["hi", "there"]


def test_json_lines_records_of_whitespace_only_are_skipped(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"text": "a"}\n{"text": "  \\n\\t"}\n{"text": ""}\n{"text": "b"}\n', encoding="utf-8")
    assert list(iter_documents(str(path))) == ["a", "b"]
