"""`frawd translate train|eval|run` end to end on a tiny parallel corpus, and its bad input."""

import gzip
import io
import json
import os
import random
import re
from pathlib import Path

import pytest
import torch

from cli_helpers import run_cli

WORDS_DE = ["ein", "mann", "frau", "hund", "läuft", "sitzt", "rot", "blau", "auf", "dem", "gras"]
WORDS_EN = ["a", "man", "woman", "dog", "runs", "sits", "red", "blue", "on", "the", "grass"]


def _corpus(tmp_path, n=200, seed=0):
    rng = random.Random(seed)
    de, en = [], []
    for _ in range(n):
        idx = [rng.randrange(len(WORDS_DE)) for _ in range(rng.randint(2, 6))]
        de.append(" ".join(WORDS_DE[i] for i in idx))
        en.append(" ".join(WORDS_EN[i] for i in idx))
    (tmp_path / "train.de.gz").write_bytes(gzip.compress(("\n".join(de) + "\n").encode()))
    (tmp_path / "train.en").write_text("\n".join(en) + "\n")
    (tmp_path / "val.de").write_text("\n".join(de[:10]) + "\n")
    (tmp_path / "val.en").write_text("\n".join(en[:10]) + "\n")
    return de, en


TINY = ["--set", "n_embd=32", "--set", "n_head=2", "--set", "n_layer=1", "--set", "n_encoder_layer=1",
        "--set", "mlp_hidden=64", "--vocab-size", "300", "--tokens-per-batch", "256", "--no-progress",
        "--dtype", "fp32", "--peak-tflops", "1", "--bleu-sentences", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("translate")
    _corpus(tmp_path)
    from frawdllm.cli import main

    main_args = ["translate", "train", "--src", tmp_path / "train.de.gz", "--tgt", tmp_path / "train.en",
                 "--valid-src", tmp_path / "val.de", "--valid-tgt", tmp_path / "val.en", "--out", tmp_path / "run",
                 "--max-steps", "6", "--eval-interval", "3", *TINY]
    try:
        main([str(a) for a in main_args])
    except SystemExit as exc:
        assert exc.code in (0, None)
    return tmp_path


def test_train_writes_a_seq2seq_model_and_logs_bleu(trained):
    run = trained / "run"
    assert json.loads((run / "model" / "config.json").read_text())["model_type"] == "seq2seq"
    assert (run / "model" / "tokenizer.json").is_file()
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [e["step"] for e in evals][-2:] == [3, 6] and all("val_bleu" in e for e in evals[-2:])
    assert "=>" in (run / "samples.txt").read_text()


def test_eval_prints_sacrebleus_line_signature_and_chrf(trained, capsys):
    code, out, err = run_cli(capsys, "translate", "eval", "--model", trained / "run" / "model",
                             "--src", trained / "val.de", "--ref", trained / "val.en", "--beam", "2")
    assert code == 0, err
    assert re.search(r"^BLEU = \d+\.\d+ ", out, re.M)
    assert "tok:13a" in out and "case:mixed" in out
    assert re.search(r"^chrF2 = \d+\.\d+", out, re.M)


def test_eval_score_is_sacrebleus_on_the_written_translations(trained, capsys, tmp_path):
    import sacrebleu

    hyp = tmp_path / "hyp.en"
    code, out, _ = run_cli(capsys, "translate", "eval", "--model", trained / "run" / "model", "--src",
                           trained / "val.de", "--ref", trained / "val.en", "--beam", "1", "--hyp-out", hyp)
    assert code == 0
    refs = (trained / "val.en").read_text().splitlines()
    expected = sacrebleu.corpus_bleu(hyp.read_text().splitlines(), [refs])
    assert out.splitlines()[0] == str(expected)


def test_run_translates_arguments_and_streams_stdin(trained, capsys, monkeypatch):
    model = trained / "run" / "model"
    code, out, _ = run_cli(capsys, "translate", "run", "--model", model, "ein mann", "ein hund")
    assert code == 0 and len(out.splitlines()) == 2
    monkeypatch.setattr("sys.stdin", _stdin(b"ein mann\n\nein hund\n"))
    code, piped, err = run_cli(capsys, "translate", "run", "--model", model)
    assert code == 0 and piped.split("\n")[:3] == [out.splitlines()[0], "", out.splitlines()[1]]
    assert "1 empty source lines" in err


def _stdin(data: bytes):
    """A standard input holding `data` (text over bytes, as a real one is)."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")


def test_run_names_a_stdin_line_that_is_not_utf8(trained, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", _stdin(b"ein mann\n\xff\xfe bad\n"))
    code, out, err = run_cli(capsys, "translate", "run", "--model", trained / "run" / "model")
    assert code == 1 and err.strip().splitlines()[-1] == "frawd: error: stdin: line 2 is not UTF-8 text"
    assert len(out.splitlines()) == 1  # the good line before it was translated
    code, _, err = run_cli(capsys, "translate", "run", "--model", trained / "run" / "model",
                           b"\xff bad".decode("utf-8", "surrogateescape"))  # how argv carries bad bytes
    assert code == 1 and "sentence 1 is not valid UTF-8" in err and "Traceback" not in err


def test_eval_checks_the_hyp_out_folder_before_translating(trained, capsys, tmp_path, monkeypatch):
    args = ["translate", "eval", "--model", trained / "run" / "model", "--src", trained / "val.de",
            "--ref", trained / "val.en", "--beam", "1", "--hyp-out"]
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, *args, tmp_path / "file" / "new" / "h.txt")
    assert code == 1 and f"--hyp-out {tmp_path / 'file' / 'new' / 'h.txt'}: {tmp_path / 'file'} is not a folder" in err
    assert "translating" not in err
    # a folder where nothing can be made, even by root (os.access said yes there): tried, refused
    code, _, err = run_cli(capsys, *args, "/proc/frawd-nowhere/h.txt")
    assert code == 1 and "--hyp-out /proc/frawd-nowhere/h.txt: cannot write there" in err, err
    assert "translating" not in err
    code, _, err = run_cli(capsys, *args, tmp_path)  # a folder, not a file: one line too
    assert code == 1 and err.strip() == f"frawd: error: --hyp-out {tmp_path} is a folder; give a file name"
    monkeypatch.undo()
    code, _, err = run_cli(capsys, *args, tmp_path / "made" / "h.txt")  # missing folders are made
    assert code == 0, err
    assert (tmp_path / "made" / "h.txt").read_text().count("\n") > 0


def test_misaligned_files_are_refused_with_both_counts(tmp_path, capsys):
    _corpus(tmp_path)
    (tmp_path / "short.en").write_text("a man\n")
    code, _, err = run_cli(capsys, "translate", "train", "--src", tmp_path / "train.de.gz", "--tgt",
                           tmp_path / "short.en", "--out", tmp_path / "run", "--max-steps", "1", *TINY)
    assert code == 1 and "misaligned" in err and "200 lines" in err and "has 1" in err
    assert not (tmp_path / "run").exists()
    code, _, err = run_cli(capsys, "translate", "train", "--src", tmp_path, "--tgt", tmp_path / "short.en",
                           "--out", tmp_path / "run", "--max-steps", "1", *TINY)
    assert code == 1 and f"{tmp_path} is a folder; give a text file" in err and err.count("\n") == 1, err


def test_empty_and_overlong_pairs_are_skipped_and_counted(tmp_path, capsys):
    de, en = _corpus(tmp_path, n=60)
    de[3], en[7] = "", "  "
    de[10] = " ".join(["gras"] * 80)
    (tmp_path / "train.de.gz").write_bytes(gzip.compress(("\n".join(de) + "\n").encode()))
    (tmp_path / "train.en").write_text("\n".join(en) + "\n")
    code, _, err = run_cli(capsys, "translate", "train", "--src", tmp_path / "train.de.gz", "--tgt",
                           tmp_path / "train.en", "--out", tmp_path / "run", "--max-steps", "1", "--max-len", "40",
                           "--bleu-sentences", "0", *TINY[:-2])
    assert code == 0, err
    assert "skipped 2 with an empty side and 1 longer than 40 tokens of 60 pairs" in err


@pytest.mark.parametrize("case", ["too_long", "empty_sources", "empty_validation", "long_validation"])
def test_no_pairs_left_is_one_line_and_leaves_no_run(tmp_path, capsys, case):
    _corpus(tmp_path, n=20)
    files = {"src": "train.de.gz", "tgt": "train.en", "valid-src": "val.de", "valid-tgt": "val.en"}
    if case == "too_long":
        (tmp_path / "long.de").write_text(" ".join(["gras"] * 60) + "\n")
        (tmp_path / "long.en").write_text("grass\n")
        files.update({"src": "long.de", "tgt": "long.en"})
    elif case == "long_validation":  # longer than the model takes (no --max-len for validation)
        (tmp_path / "long.de").write_text(" ".join(["gras"] * 100) + "\n")
        (tmp_path / "long.en").write_text("grass\n")
        files.update({"valid-src": "long.de", "valid-tgt": "long.en"})
    else:
        (tmp_path / "blank.de").write_text("\n\n \n")
        (tmp_path / "abc.en").write_text("a\nb\nc\n")
        files.update({"src" if case == "empty_sources" else "valid-src": "blank.de",
                      "tgt" if case == "empty_sources" else "valid-tgt": "abc.en"})
    args = [a for flag, name in files.items() for a in (f"--{flag}", tmp_path / name)]
    code, _, err = run_cli(capsys, "translate", "train", *args, "--out", tmp_path / "run", "--max-steps", "1",
                           "--max-len", "40", "--set", "context_length=64", *TINY)
    assert code == 1 and "Traceback" not in err
    expected = {"too_long": "no training pairs left in --src/--tgt: all 1 skipped, 1 longer than --max-len 40 tokens",
                "empty_sources": "no training pairs left in --src/--tgt: all 3 skipped, 3 with an empty side",
                "empty_validation": "no validation pairs left in --valid-src/--valid-tgt: all 3 skipped, "
                                    "3 with an empty side",
                "long_validation": "no validation pairs left in --valid-src/--valid-tgt: all 1 skipped, 1 longer "
                                   "than 63 tokens (the model's context_length less BOS/EOS)"}[case]
    assert err.strip().splitlines()[-1] == f"frawd: error: {expected}"
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_without_frawd_special_tokens_is_refused(tmp_path, capsys):
    from tokenizers import ByteLevelBPETokenizer

    _corpus(tmp_path, n=20)
    plain = ByteLevelBPETokenizer()  # no special tokens: ids 0.. are bytes such as "!"
    plain.train_from_iterator(["ein mann", "a man"], vocab_size=300, show_progress=False)
    plain.save(str(tmp_path / "plain.json"))
    code, _, err = run_cli(capsys, "translate", "train", "--src", tmp_path / "train.de.gz", "--tgt",
                           tmp_path / "train.en", "--tokenizer", tmp_path / "plain.json", "--out", tmp_path / "run",
                           "--max-steps", "1", *TINY)
    assert code == 1 and len(err.strip().splitlines()) == 1  # refused before any work
    assert "lacks FrawdLLM's special tokens" in err and "<|pad|>" in err and "<|eos|>" in err
    assert not (tmp_path / "run").exists()


def test_train_help_lists_only_what_translate_train_uses(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "translate", "train", "--help")
    assert code == 0
    assert "[default: ]" not in out and "--sample-prompt" not in out and "--batch-size" not in out
    assert "--src" in out and "--tokens-per-batch" in out
    (tmp_path / "c.yaml").write_text("sample_prompt: Ein\n")  # the same field through a config file
    code, _, err = run_cli(capsys, "translate", "train", "--config", tmp_path / "c.yaml", "--max-steps", "1")
    assert code == 1 and "sample_prompt: translate train takes no prompt" in err


def test_eval_of_a_decoder_only_model_is_refused(tmp_path, capsys):
    from frawdllm import FrawdLLM, get_config
    from frawdllm.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=tok.vocab_size,
                        context_length=16)).save_pretrained(tmp_path / "lm", tokenizer=tok)
    code, _, err = run_cli(capsys, "translate", "run", "--model", tmp_path / "lm", "hallo")
    assert code == 1 and "decoder-only language model" in err


def test_generate_with_a_translation_model_is_refused(tmp_path, capsys):
    from frawdllm import Seq2SeqTransformer, get_config
    from frawdllm.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=tok.vocab_size, n_embd=32, n_head=2, n_layer=1,
                                  n_encoder_layer=1)).save_pretrained(tmp_path / "mt", tokenizer=tok)
    code, _, err = run_cli(capsys, "generate", "--model", tmp_path / "mt", "--prompt", "hallo")
    assert code == 1 and "encoder-decoder translation model" in err


def test_resume_continues_the_uninterrupted_trajectory(tmp_path, capsys):
    # dropout 0.1 (the preset's) makes the torch RNG matter; 200 pairs in batches of 256 tokens
    # are about 7 batches, so the 10 steps cross an epoch (a reshuffle) after the split at 5.
    _corpus(tmp_path)
    common = ["--src", tmp_path / "train.de.gz", "--tgt", tmp_path / "train.en", "--valid-src", tmp_path / "val.de",
              "--valid-tgt", tmp_path / "val.en", "--eval-interval", "3", "--log-interval", "1", *TINY[:-2],
              "--bleu-sentences", "0", "--sample-tokens", "0"]  # greedy decoding draws no random numbers
    code, _, err = run_cli(capsys, "translate", "train", *common, "--max-steps", "10", "--out", tmp_path / "full")
    assert code == 0, err
    code, _, err = run_cli(capsys, "translate", "train", *common, "--max-steps", "5", "--out", tmp_path / "split")
    assert code == 0, err
    code, _, err = run_cli(capsys, "translate", "train", "--out", tmp_path / "split", "--resume",
                           "--max-steps", "10", "--no-progress")
    assert code == 0, err

    def steps(run):
        return [(r["step"], r["tokens"], r["loss"], r["nll"], r["lr"]) for r in
                map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    full = steps("full")
    assert [s[0] for s in full] == list(range(1, 11))
    assert steps("split") == full  # the same batches, dropout masks and updates: equal floats
    from frawdllm.model import Seq2SeqTransformer

    a = Seq2SeqTransformer.from_pretrained(tmp_path / "full" / "checkpoints" / "step_00000010" / "model")
    b = Seq2SeqTransformer.from_pretrained(tmp_path / "split" / "checkpoints" / "step_00000010" / "model")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
