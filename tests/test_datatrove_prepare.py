"""Distributed data preparation on datatrove (local executor, 2 workers) against the
single-process `prepare_shards`: the same tokens in the same order, read back as one
stream from several shard files by the loaders, `frawd eval` and `frawd pretrain`."""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("datatrove")

from frawdllm.cli import main  # noqa: E402
from frawdllm.data import (RandomWindowLoader, SequentialLoader, ShardStream, prepare_shards,  # noqa: E402
                           read_shard, read_split, split_files)
from frawdllm.data import datatrove_shards  # noqa: E402
from frawdllm.data.datatrove_shards import TokenizeFiles, prepare_shards_datatrove, rank_files  # noqa: E402
from frawdllm.errors import FrawdError  # noqa: E402
from frawdllm.tokenizer import train_tokenizer  # noqa: E402
from frawdllm.train import PretrainConfig, run_pretraining  # noqa: E402
from frawdllm.train.pretrain import is_shard_dir  # noqa: E402
from frawdllm.train.rundir import read_metrics  # noqa: E402

FRAWD = [sys.executable, "-c", "from frawdllm.cli import main; main()"]
WORDS = "the king shall speak of war and peace to his people while rain falls on old stone".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Five text files of blank-line separated documents, and a jsonl file, of uneven sizes."""
    rng = random.Random(0)
    folder = tmp_path_factory.mktemp("corpus")

    def doc() -> str:
        return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))).capitalize() + "."
                         for _ in range(rng.randint(1, 3)))

    for i, n_docs in enumerate([40, 3, 120, 25, 60]):
        (folder / f"part{i}.txt").write_text("\n\n".join(doc() for _ in range(n_docs)) + "\n", encoding="utf-8")
    (folder / "z.jsonl").write_text("".join(json.dumps({"text": doc()}) + "\n" for _ in range(30)), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.iterdir())]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(texts, "bpe", vocab_size=300).save(path)
    return path


@pytest.fixture(scope="module")
def prepared(corpus, tokenizer, tmp_path_factory):
    """(single-process shard folder, its meta, datatrove 2-worker shard folder, its meta)."""
    root = tmp_path_factory.mktemp("prepared")
    single = prepare_shards(str(corpus), tokenizer, root / "single", val_fraction=0.1)
    multi = prepare_shards_datatrove(str(corpus), tokenizer, root / "multi", workers=2, val_fraction=0.1)
    return root / "single", single, root / "multi", multi


COUNTS = ("train_tokens", "val_tokens", "train_documents", "val_documents", "train_text_bytes", "val_text_bytes",
          "bytes_per_token", "unk_tokens", "replaced_utf8_sequences", "inputs_hash", "tokenizer_hash", "dtype")


@pytest.mark.timeout(120)
def test_both_engines_warn_of_replaced_bytes_and_unknown_characters_alike(tmp_path):
    """The datatrove engine recorded the counts but said nothing (no `warnings`)."""
    for i in range(4):
        (tmp_path / "src").mkdir(exist_ok=True)
        (tmp_path / "src" / f"d{i}.txt").write_bytes(b"\n\n".join(b"doc %d of file %d" % (j, i) for j in range(30))
                                                    + (b"\n\nbad \xff byte and \xe2\x82 here\n" if i == 2 else b"\n")
                                                    + ("\n\nunknown \u2603 snowman\n".encode() if i == 3 else b""))
    tok = train_tokenizer(["doc of file 0123456789 bad byte and here unknown snowman"], "char")
    tok.save(tmp_path / "tok.json")
    single = prepare_shards(str(tmp_path / "src"), tmp_path / "tok.json", tmp_path / "single", val_fraction=0.2)
    multi = prepare_shards_datatrove(str(tmp_path / "src"), tmp_path / "tok.json", tmp_path / "multi", workers=2,
                                     val_fraction=0.2)
    assert single["warnings"] == multi["warnings"] and len(multi["warnings"]) == 2, (single, multi)
    assert multi["warnings"][0].startswith("replaced 2 invalid UTF-8 sequence(s) with U+FFFD in 1 file(s): ")


@pytest.mark.timeout(120)
def test_two_datatrove_workers_write_exactly_the_single_process_tokens_in_order(prepared):
    single_dir, single, multi_dir, multi = prepared
    assert single["val_split"] == "documents" and single["val_tokens"] > 0
    assert multi["train_shards"] == ["train-00000.bin", "train-00001.bin"]
    assert multi["val_shards"] == ["val-00000.bin", "val-00001.bin"]
    for split in ("train", "val"):
        shards = [read_shard(f) for f in split_files(multi_dir, split)]
        assert all(len(s) > 0 for s in shards), "each worker must have tokenized a share of this split"
        expected = np.asarray(read_shard(single_dir / f"{split}.bin"))
        np.testing.assert_array_equal(np.concatenate(shards), expected)
        np.testing.assert_array_equal(np.asarray(read_split(multi_dir, split)), expected)
    assert {k: multi[k] for k in COUNTS} == {k: single[k] for k in COUNTS}
    # meta.json is what was returned, less the warnings (said, not stored)
    assert json.loads((multi_dir / "meta.json").read_text()) == {k: v for k, v in multi.items() if k != "warnings"}
    assert not list(multi_dir.glob("part-*.json"))  # the merge step folded the ranks' counts into meta.json


@pytest.mark.timeout(120)
def test_tasks_take_the_file_list_made_at_the_start(corpus, tokenizer, tmp_path):
    """Each task listed the source again when it started (hours apart under Slurm): a file
    that came meanwhile shifted the blocks, one file tokenized by two tasks, another by none."""
    import shutil

    from frawdllm.data.sources import source_files

    src = tmp_path / "src"
    shutil.copytree(corpus, src)
    options = {"val_fraction": 0.3, "text_field": "text", "doc_split": "blank"}
    step = TokenizeFiles(str(src), str(tokenizer), str(tmp_path / "out"),
                         files=[str(p) for p in source_files(str(src))], **options)
    (tmp_path / "out").mkdir()
    step.run(rank=0, world_size=2)
    (src / "0-late.txt").write_text("A file that came after the start.\n")  # sorts first
    step.run(rank=1, world_size=2)
    (src / "0-late.txt").unlink()
    whole = prepare_shards(str(src), tokenizer, tmp_path / "single", **options)
    parts = [json.loads((tmp_path / "out" / f"part-{r:05d}.json").read_text()) for r in (0, 1)]
    assert sum(p["train_tokens"] for p in parts) == whole["train_tokens"]
    assert sum(p["val_tokens"] for p in parts) == whole["val_tokens"]
    assert sum(p["files"] for p in parts) == len(source_files(str(src)))


def test_rank_r_of_n_takes_the_rth_contiguous_block_of_files():
    files = list(range(7))
    blocks = [rank_files(files, r, 3) for r in range(3)]
    assert blocks == [[0, 1], [2, 3], [4, 5, 6]]
    assert [rank_files([0], r, 2) for r in range(2)] == [[], [0]]
    for n, world in ((5, 3), (10, 4), (3, 5)):  # blocks that do not divide evenly still cover each file once
        assert [f for r in range(world) for f in rank_files(list(range(n)), r, world)] == list(range(n)), (n, world)


def test_a_second_run_reuses_the_shards_and_the_cli_reports_them(prepared, corpus, tokenizer, capsys):
    _, _, multi_dir, _ = prepared
    again = prepare_shards_datatrove(str(corpus), tokenizer, multi_dir, workers=2, val_fraction=0.1)
    assert again.get("reused") is True
    main(["data", "prepare", "--data", str(corpus), "--tokenizer", str(tokenizer), "--out", str(multi_dir),
          "--val-fraction", "0.1", "--engine", "datatrove", "--workers", "2"])  # returns: success
    assert "reusing them" in capsys.readouterr().err


def test_loaders_read_the_multi_shard_split_as_the_single_file_one(prepared):
    single_dir, _, multi_dir, _ = prepared
    assert is_shard_dir(multi_dir) and is_shard_dir(single_dir)
    one, many = read_shard(single_dir / "train.bin"), read_split(multi_dir, "train")
    assert isinstance(many, ShardStream)
    a, b = RandomWindowLoader(one, 4, 16, seed=3), RandomWindowLoader(many, 4, 16, seed=3)
    for _ in range(5):
        for x, y in zip(a.next_batch(), b.next_batch()):
            assert x.equal(y)
    val_one, val_many = read_shard(single_dir / "val.bin"), read_split(multi_dir, "val")
    for (x1, y1), (x2, y2) in zip(SequentialLoader(val_one, 3, 8), SequentialLoader(val_many, 3, 8), strict=True):
        assert x1.equal(x2) and y1.equal(y2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=5), st.data())
def test_a_shard_stream_indexes_like_the_concatenated_array(lengths, data):
    whole = np.arange(sum(lengths), dtype=np.uint16)
    parts = np.split(whole, np.cumsum(lengths)[:-1])
    stream = ShardStream(parts)
    assert len(stream) == len(whole)
    np.testing.assert_array_equal(np.asarray(stream), whole)
    if len(whole):
        index = np.array(data.draw(st.lists(st.integers(-len(whole), len(whole) - 1), max_size=8)), dtype=np.int64)
        np.testing.assert_array_equal(stream[index], whole[index])
        start, stop = data.draw(st.integers(-len(whole), len(whole))), data.draw(st.integers(-len(whole), len(whole)))
        np.testing.assert_array_equal(stream[start:stop], whole[start:stop])
    with pytest.raises(IndexError):
        stream[np.array([len(whole)])]


@pytest.mark.timeout(120)
def test_pretrain_on_the_multi_shard_folder_trains_exactly_as_on_the_single_file_one(prepared, tokenizer, tmp_path):
    single_dir, _, multi_dir, _ = prepared
    losses = []
    for name, data in (("one", single_dir), ("many", multi_dir)):
        cfg = PretrainConfig(data=str(data), out=str(tmp_path / name), tokenizer=str(tokenizer),
                             model={"n_layer": 1, "n_head": 2, "n_embd": 32, "context_length": 16}, batch_size=4,
                             lr=1e-2, warmup_steps=1, max_steps=4, dtype="fp32", compile=False, device="cpu",
                             eval_interval=2, eval_batches=2, log_interval=1, sample_tokens=0, peak_tflops=1.0,
                             progress=False)
        run_pretraining(cfg)
        losses.append([(r["step"], r["loss"]) for r in read_metrics(tmp_path / name) if "loss" in r])
        losses[-1] += [(r["step"], r["val_loss"]) for r in read_metrics(tmp_path / name) if "val_loss" in r]
    assert len(losses[0]) >= 4 and losses[0] == losses[1]


@pytest.mark.timeout(180)
def test_a_rebuild_by_either_engine_leaves_only_its_own_shards_and_logs(corpus, tokenizer, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for name in ("part2.txt", "part4.txt"):
        (other / name).write_text((corpus / name).read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "out"

    def contents() -> list[str]:
        return sorted(p.name for p in out.iterdir()) + sorted(p.name for p in (out / ".datatrove").glob("*"))

    prepare_shards_datatrove(str(corpus), tokenizer, out, workers=3, val_fraction=0.1)
    meta = prepare_shards_datatrove(str(other), tokenizer, out, workers=2, val_fraction=0.1)
    shards = ["train-00000.bin", "train-00001.bin", "val-00000.bin", "val-00001.bin"]
    assert contents() == [".datatrove", "meta.json", *shards, f"{meta['inputs_hash'][:16]}-w2"]
    prepare_shards(str(corpus), tokenizer, out, val_fraction=0.1)
    assert contents() == ["meta.json", "train.bin", "val.bin"]
    # the logs of the 2-task run went with its shards, so running it again redoes every task
    again = prepare_shards_datatrove(str(other), tokenizer, out, workers=2, val_fraction=0.1)
    assert not again.get("reused") and again["train_tokens"] == meta["train_tokens"]
    assert sorted(p.name for p in out.iterdir()) == [".datatrove", "meta.json", *shards]


def test_hf_sources_have_no_files_to_split_and_are_refused(tokenizer, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["data", "prepare", "--data", "hf:x", "--tokenizer", str(tokenizer), "--out", str(tmp_path / "h"),
              "--engine", "datatrove"])
    assert info.value.code != 0 and "hf: datasets" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("flags, message", [
    (["--engine", "datatrove", "--workers", "0"], "workers must be an integer of at least 1, got 0"),  # (became 2)
    (["--slurm-time", "1:00:00"], "--slurm-time: for --engine datatrove only"),  # (ignored without a word)
    (["--executor", "slurm", "--slurm-cpus", "4"], "--executor, --slurm-cpus: for --engine datatrove only"),
])
def test_datatrove_options_are_checked_not_replaced_or_ignored(corpus, tokenizer, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as info:
        main(["data", "prepare", "--data", str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
              *flags])
    assert info.value.code != 0 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def one_val_document(val_fraction: float) -> str:
    """A one-line document that hashes into the val split."""
    return next(text for text in (f"one small document {i}" for i in range(1000))
                if datatrove_shards._is_val(text.encode(), val_fraction))


def test_too_few_documents_for_a_hashed_val_split_is_a_clear_error_before_any_task_runs(tmp_path, tokenizer,
                                                                                       monkeypatch):
    """The merge found it, after every tokenize task had run (on Slurm, hours of work lost)."""
    from datatrove.executor import LocalPipelineExecutor

    monkeypatch.setattr(LocalPipelineExecutor, "run", lambda self: pytest.fail("the tasks were launched"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("one small document\n", encoding="utf-8")
    with pytest.raises(FrawdError, match="no document of .* hashed into the val split"):
        prepare_shards_datatrove(str(tmp_path / "c"), tokenizer, tmp_path / "out", workers=2, val_fraction=0.01)
    (tmp_path / "c" / "a.txt").write_text(one_val_document(0.5), encoding="utf-8")  # (it left train empty)
    with pytest.raises(FrawdError, match="every document of .* hashed into the val split .* smaller --val-fraction"):
        prepare_shards_datatrove(str(tmp_path / "c"), tokenizer, tmp_path / "out", workers=2, val_fraction=0.5)
    (tmp_path / "c" / "a.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(FrawdError, match="holds no documents"):
        prepare_shards_datatrove(str(tmp_path / "c"), tokenizer, tmp_path / "out", workers=2, val_fraction=0.01)
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_bad_input_in_a_task_is_one_line_on_the_terminal_not_a_traceback(tmp_path, tokenizer):
    """datatrove logged the task's FrawdError with ~120 lines of annotated traceback first."""
    src = tmp_path / "src"
    src.mkdir()
    # a.jsonl has val documents early, so the check before launching stops there; task 1's b.jsonl
    # lacks the field at line 51
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(100)))
    (src / "b.jsonl").write_text("".join(json.dumps({"text": f"other {i}"}) + "\n" for i in range(50))
                                 + json.dumps({"body": "x"}) + "\n")
    proc = subprocess.run([*FRAWD, "data", "prepare", "--data", str(src), "--tokenizer", str(tokenizer),
                           "--out", str(tmp_path / "out"), "--engine", "datatrove", "--workers", "2",
                           "--val-fraction", "0.3"], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1
    assert "datatrove.executor" in proc.stderr, "the error must come from a datatrove task: " + proc.stderr
    assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "no field" in line]
    assert said == [f"frawd: error: {src}/b.jsonl:51: no field 'text' (fields: 'body'); choose one with --text-field"]
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_the_merge_still_checks_a_source_too_long_to_check_first_in_one_line(tmp_path, tokenizer, monkeypatch,
                                                                             capsys):
    monkeypatch.setattr(datatrove_shards, "PROBE_BYTES", 1)  # the check before launching reads one document
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("one small document\n\nand another\n", encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        main(["data", "prepare", "--data", str(tmp_path / "c"), "--tokenizer", str(tokenizer), "--out",
              str(tmp_path / "out"), "--engine", "datatrove", "--workers", "1", "--val-fraction", "0.01"])
    err = capsys.readouterr().err  # (the merge, and here the 1 tokenize task, ran in this process)
    assert info.value.code == 1 and "Launching pipeline for rank=0" in err
    assert "Traceback" not in err and [line for line in err.splitlines() if "val split" in line] == [
        f"frawd: error: no document of {str(tmp_path / 'c')!r} hashed into the val split (too few documents for "
        "--val-fraction 0.01); use a larger --val-fraction or the single-process prepare, which then holds out "
        "the tail of train"]


@pytest.mark.timeout(120)
def test_the_merge_refuses_an_empty_train_split(tmp_path, tokenizer, monkeypatch):
    """Every document hashed into val: the merge wrote a meta.json with train_tokens 0."""
    monkeypatch.setattr(datatrove_shards, "PROBE_BYTES", 1)  # the check before launching reads one document
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text(one_val_document(0.5) + "\n", encoding="utf-8")
    with pytest.raises(FrawdError, match=f"^every document of {str(tmp_path / 'c')!r} hashed into the val split"):
        prepare_shards_datatrove(str(tmp_path / "c"), tokenizer, tmp_path / "out", workers=1, val_fraction=0.5)
    assert not (tmp_path / "out" / "meta.json").exists()


@pytest.mark.timeout(120)
def test_a_source_file_a_task_cannot_read_is_one_line(corpus, tokenizer, tmp_path, monkeypatch, capsys):
    """An unreadable (or vanished) source file was a 117-line traceback from the task, where
    the single-process prepare says "permission denied: FILE"."""
    def unreadable(self, data=None, rank=0, world_size=1):
        raise PermissionError(13, "Permission denied", str(corpus))

    monkeypatch.setattr(TokenizeFiles, "run", unreadable)  # (1 worker: the task runs in this process)
    with pytest.raises(FrawdError, match=f"^permission denied: {re.escape(str(corpus))}$"):
        prepare_shards_datatrove(str(corpus), tokenizer, tmp_path / "out", workers=1, val_fraction=0.1)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_an_unexpected_error_in_a_task_keeps_its_traceback(corpus, tokenizer, tmp_path, monkeypatch, capsys):
    """A bug is not bad input: only a FrawdError is cut down to one line."""
    def broken(self, data=None, rank=0, world_size=1):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(TokenizeFiles, "run", broken)  # (1 worker: the task runs in this process)
    with pytest.raises(ZeroDivisionError):
        prepare_shards_datatrove(str(corpus), tokenizer, tmp_path / "out", workers=1, val_fraction=0.1)
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: a bug" in err


@pytest.mark.timeout(120)
def test_meta_seconds_is_the_wall_time_of_the_whole_prepare(corpus, tokenizer, tmp_path, capsys):
    """It was the slowest task's tokenizing alone (0.155 s of a 9.5 s run), so mb_per_s looked 3x too fast.
    (Also: --workers defaults to 2, as --help says, and --val-fraction 0 is no empty-split error.)"""
    start = time.perf_counter()
    main(["data", "prepare", "--data", str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"),
          "--val-fraction", "0", "--engine", "datatrove"])
    wall = time.perf_counter() - start
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["engine"] == {"name": "datatrove", "workers": 2} and meta["val_tokens"] == 0
    assert wall - 0.5 <= meta["seconds"] <= wall + 0.01, (meta["seconds"], wall)
    text_mb = (meta["train_text_bytes"] + meta["val_text_bytes"]) / 1e6
    assert meta["mb_per_s"] == pytest.approx(text_mb / meta["seconds"], rel=0.01, abs=0.002)
    assert f"mb_per_s: {meta['mb_per_s']}" in capsys.readouterr().out


def test_a_tokenizer_without_frawd_special_tokens_is_refused(corpus, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    plain = HFTokenizer(models.BPE())  # no <|eos|>: its id 3 is an ordinary byte token
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator(["some text to learn from"], trainers.BpeTrainer(
        vocab_size=260, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(FrawdError, match=r"has no token to end documents with: .*<\|eos\|>"):
        prepare_shards_datatrove(str(corpus), tmp_path / "plain.json", tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(120)
def test_a_prepare_killed_with_sigkill_leaves_no_process_holding_its_folder(tmp_path, tokenizer):
    """datatrove's manager process, forked from the prepare, outlived a `kill -9` of it and
    kept OUT's lock: the next prepare into OUT was refused as "in use" until someone found
    and stopped that orphan."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a", "b"):  # (~8 MB each: the run lasts seconds)
        (src / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"document {i}: " + "some words, " * 80})
                                                   + "\n" for i in range(8000)))
    out = tmp_path / "out"
    proc = subprocess.Popen([*FRAWD, "data", "prepare", "--data", str(src), "--tokenizer", str(tokenizer),
                             "--out", str(out), "--engine", "datatrove", "--workers", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not children and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            children = [c for c in _children(proc.pid)
                        if "frawdllm.cli" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]
        assert children, "the prepare forked no child (it ended first?)"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while any(Path(f"/proc/{c}").exists() for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [c for c in children if Path(f"/proc/{c}").exists()
                and Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        assert not left, f"processes {left} outlived the killed prepare"
    finally:
        proc.kill()
        for child in children:  # (what a failure leaves)
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
    (tmp_path / "small.txt").write_text("a small corpus\n\nof two documents\n")
    again = subprocess.run([*FRAWD, "data", "prepare", "--data", str(tmp_path / "small.txt"), "--tokenizer",
                            str(tokenizer), "--out", str(out), "--overwrite"], capture_output=True, text=True,
                           timeout=110)
    assert again.returncode == 0 and "in use" not in again.stderr, again.stderr
