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


def _without_vocab_size(args: list[str]) -> list[str]:
    """TINY for a run given --tokenizer (whose vocabulary is its own: --vocab-size is refused)."""
    i = args.index("--vocab-size")
    return args[:i] + args[i + 2:]


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
    assert "1 empty source line: left empty" in err


def _stdin(data: bytes):
    """A standard input holding `data` (text over bytes, as a real one is)."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")


def test_whitespace_around_a_sentence_changes_nothing(trained, capsys):
    # (a trailing space or tab became tokens the model had almost never seen: the same sentence
    # got four translations); training reads each side the same way
    from frawdllm.data.parallel import encode_pairs
    from frawdllm.tokenizer import Tokenizer

    model = trained / "run" / "model"
    code, out, _ = run_cli(capsys, "translate", "run", "--model", model, "--beam", "2", "ein mann", "ein mann  ",
                           "ein mann\t", "  ein mann", "ein hund", " ein hund \t")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 6 and len(set(lines[:4])) == 1 and lines[4] == lines[5]
    tok = Tokenizer.load(model / "tokenizer.json")
    assert tok.encode("ein mann ") != tok.encode("ein mann")
    padded = encode_pairs(tok, [" ein mann\t", "ein hund"], ["a man ", "\ta dog"], None)
    assert padded.pairs == encode_pairs(tok, ["ein mann", "ein hund"], ["a man", "a dog"], None).pairs


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


def test_an_out_that_cannot_be_created_is_refused_before_the_tokenizer_is_trained(tmp_path, capsys):
    """The joint BPE tokenizer was trained first (seconds on Multi30k), then OUT refused."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc: no folder the OS refuses to create")
    _corpus(tmp_path, n=20)
    code, _, err = run_cli(capsys, "translate", "train", "--src", tmp_path / "train.de.gz", "--tgt",
                           tmp_path / "train.en", "--out", "/proc/frawd-translate", "--max-steps", "1", *TINY)
    assert (code, err) == (1, "frawd: error: --out /proc/frawd-translate: cannot create the folder there "
                              "(no such file or directory)\n")


def test_a_tokenizer_without_frawd_special_tokens_is_refused(tmp_path, capsys):
    from tokenizers import ByteLevelBPETokenizer

    _corpus(tmp_path, n=20)
    plain = ByteLevelBPETokenizer()  # no special tokens: ids 0.. are bytes such as "!"
    plain.train_from_iterator(["ein mann", "a man"], vocab_size=300, show_progress=False)
    plain.save(str(tmp_path / "plain.json"))
    code, _, err = run_cli(capsys, "translate", "train", "--src", tmp_path / "train.de.gz", "--tgt",
                           tmp_path / "train.en", "--tokenizer", tmp_path / "plain.json", "--out", tmp_path / "run",
                           "--max-steps", "1", *_without_vocab_size(TINY))
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


@pytest.mark.parametrize("command", ["run", "eval"])
def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(tmp_path, capsys, command):
    from frawdllm import Seq2SeqTransformer, get_config
    from frawdllm.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=100, n_embd=32, n_head=2, n_layer=1,
                                  n_encoder_layer=1)).save_pretrained(tmp_path / "mt")
    tok.save(tmp_path / "mt" / "tokenizer.json")  # (save_pretrained refuses to pair them)
    (tmp_path / "one.de").write_text("hallo welt\n")
    files = ["--src", tmp_path / "one.de", "--ref", tmp_path / "one.de"] if command == "eval" else ["hallo welt"]
    code, _, err = run_cli(capsys, "translate", command, "--model", tmp_path / "mt", *files)
    assert code == 1 and f"the tokenizer has {tok.vocab_size} ids but the model only 100" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["run", "eval"])
def test_a_model_directory_whose_tokenizer_lacks_the_special_tokens_is_refused(tmp_path, capsys, command):
    """Another tokenizer copied into the folder translated into garbage with exit 0 (BLEU 0.00 as
    if scored): decoding pads with id 0, starts with 2 and stops at 3, which it gives other meanings."""
    from tokenizers import ByteLevelBPETokenizer

    from frawdllm import Seq2SeqTransformer, get_config

    plain = ByteLevelBPETokenizer()  # no special tokens: ids 0.. are bytes such as "!"
    plain.train_from_iterator(["ein mann", "a man"], vocab_size=300, show_progress=False)
    Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=300, n_embd=32, n_head=2, n_layer=1,
                                  n_encoder_layer=1)).save_pretrained(tmp_path / "mt")
    plain.save(str(tmp_path / "mt" / "tokenizer.json"))
    (tmp_path / "one.de").write_text("hallo welt\n")
    files = ["--src", tmp_path / "one.de", "--ref", tmp_path / "one.de"] if command == "eval" else ["hallo welt"]
    code, out, err = run_cli(capsys, "translate", command, "--model", tmp_path / "mt", *files)
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert f"{tmp_path / 'mt' / 'tokenizer.json'}: lacks FrawdLLM's special tokens" in err and "<|eos|>" in err


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


# ---- bad input to decoding: one line, before any work -------------------------------------------

def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_beam_wider_than_the_vocabulary_is_refused_before_decoding(trained, capsys):
    code, out, err = run_cli(capsys, "translate", "run", "--model", trained / "run" / "model", "--beam", "100000",
                             "ein mann")
    assert code == 1 and out == ""
    assert _one_line_error(err) == "frawd: error: --beam 100000 exceeds the model's vocabulary size (300 tokens)"


def test_beams_that_would_not_fit_in_memory_are_refused_before_decoding(trained, capsys, monkeypatch, tmp_path):
    import frawdllm.infer.translate as decoding

    monkeypatch.setattr(decoding, "free_memory", lambda device: 2**20)  # 1 MiB free
    code, _, err = run_cli(capsys, "translate", "eval", "--model", trained / "run" / "model", "--src",
                           trained / "val.de", "--ref", trained / "val.en", "--beam", "200", "--hyp-out",
                           tmp_path / "h.txt")
    line = _one_line_error(err)
    assert code == 1 and line.startswith("frawd: error: --beam 200 with --batch-size 64: decoding 10 x 200 rows")
    assert "more than the 0.0 GiB free on cpu; lower --beam or --batch-size" in line
    assert not (tmp_path / "h.txt").exists()


@pytest.mark.parametrize("alpha", ["nan", "inf", "-inf"])
def test_alpha_must_be_a_finite_number(trained, capsys, alpha):
    code, out, err = run_cli(capsys, "translate", "run", "--model", trained / "run" / "model", "--alpha", alpha, "x")
    assert code == 2 and out == "" and "Invalid value for '--alpha'" in _one_line_error(err)


# ---- --hyp-out -----------------------------------------------------------------------------------

def test_hyp_out_never_replaces_an_input_and_an_existing_file_needs_overwrite(trained, capsys, tmp_path):
    ref = tmp_path / "ref.en"
    ref.write_text((trained / "val.en").read_text())
    (tmp_path / "link.en").symlink_to(ref)
    args = ["translate", "eval", "--model", trained / "run" / "model", "--src", trained / "val.de", "--beam", "1"]
    for given_ref, hyp_out in ((ref, ref), (ref, tmp_path / "." / "ref.en"), (tmp_path / "link.en", ref)):
        code, _, err = run_cli(capsys, *args, "--ref", given_ref, "--hyp-out", hyp_out, "--overwrite")
        assert code == 1 and _one_line_error(err) == f"frawd: error: --hyp-out {hyp_out} is the --ref file; give " \
                                                     "another file name"
    code, _, err = run_cli(capsys, *args, "--ref", ref, "--hyp-out", trained / "val.de", "--overwrite")
    assert code == 1 and "is the --src file" in err
    assert ref.read_text() == (trained / "val.en").read_text()
    old = tmp_path / "old.txt"
    old.write_text("keep me\n")
    code, _, err = run_cli(capsys, *args, "--ref", ref, "--hyp-out", old)
    assert code == 1 and _one_line_error(err) == f"frawd: error: --hyp-out {old} exists; give a new file name " \
                                                 "(or --overwrite to replace it)"
    assert old.read_text() == "keep me\n"
    code, _, err = run_cli(capsys, *args, "--ref", ref, "--hyp-out", old, "--overwrite")
    assert code == 0, err
    assert old.read_text().count("\n") == 10


def test_a_refused_input_leaves_no_hyp_out_folders_behind(trained, capsys, tmp_path, monkeypatch):
    code, _, err = run_cli(capsys, "translate", "eval", "--model", trained / "run" / "model", "--src",
                           tmp_path / "nope.de", "--ref", trained / "val.en", "--hyp-out", tmp_path / "nd" / "sub" / "h.txt")
    assert code == 1 and _one_line_error(err) == f"frawd: error: file not found: {tmp_path / 'nope.de'}"
    monkeypatch.chdir(tmp_path)  # a relative path (a config's ../shared/...) says where it was looked for
    code, _, err = run_cli(capsys, "translate", "eval", "--model", trained / "run" / "model", "--src", "nope.de",
                           "--ref", trained / "val.en")
    assert code == 1 and _one_line_error(err) == \
        f"frawd: error: file not found: nope.de (looked for in the current folder, {tmp_path})"
    assert not (tmp_path / "nd").exists()


# ---- what files hold -----------------------------------------------------------------------------

def _fifo_holding(path: Path, data: bytes):
    """A named pipe at `path` that a thread fills with `data` (as `<(...)` gives a command)."""
    import threading

    os.mkfifo(path)

    def fill():
        with open(path, "wb") as pipe:
            pipe.write(data)

    thread = threading.Thread(target=fill, daemon=True)
    thread.start()
    return thread


def _eval_output(capsys, trained, src, ref, hyp_out) -> tuple[str, str]:
    """(stdout, translations written) of a greedy `translate eval`."""
    code, out, err = run_cli(capsys, "translate", "eval", "--model", trained / "run" / "model", "--beam", "1",
                             "--src", src, "--ref", ref, "--hyp-out", hyp_out)
    assert code == 0, err
    return out, Path(hyp_out).read_text()


def test_eval_reads_a_pipe(trained, capsys, tmp_path):
    expected = _eval_output(capsys, trained, trained / "val.de", trained / "val.en", tmp_path / "plain.txt")
    thread = _fifo_holding(tmp_path / "ref.pipe", (trained / "val.en").read_bytes())  # as --ref <(cat val.en)
    assert _eval_output(capsys, trained, trained / "val.de", tmp_path / "ref.pipe", tmp_path / "piped.txt") == expected
    thread.join(timeout=10)


def test_eval_drops_a_byte_order_mark(trained, capsys, tmp_path):
    expected = _eval_output(capsys, trained, trained / "val.de", trained / "val.en", tmp_path / "plain.txt")
    for name in ("val.de", "val.en"):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + (trained / name).read_bytes())
    # the same translations and BLEU: no BOM left on the first source or reference
    assert _eval_output(capsys, trained, tmp_path / "val.de", tmp_path / "val.en", tmp_path / "bom.txt") == expected


def test_run_drops_a_byte_order_mark_on_stdin(trained, capsys, monkeypatch):
    model = trained / "run" / "model"
    code, expected, _ = run_cli(capsys, "translate", "run", "--model", model, "ein mann")
    monkeypatch.setattr("sys.stdin", _stdin(b"\xef\xbb\xbfein mann\n"))
    code, out, err = run_cli(capsys, "translate", "run", "--model", model)
    assert code == 0 and out == expected, err


# ---- translate train: flags and data checked before any work -------------------------------------

@pytest.mark.parametrize("case", ["missing", "misaligned", "not_utf8", "all_empty", "max_len", "pipe"])
def test_nproc_checks_flags_and_data_before_starting_torchrun(tmp_path, capsys, monkeypatch, case):
    _corpus(tmp_path, n=20)
    monkeypatch.setattr("torch.distributed.run.run", lambda *a, **k: pytest.fail("torchrun started despite bad input"))
    files = {"src": tmp_path / "train.de.gz", "tgt": tmp_path / "train.en"}
    extra = []
    if case == "missing":
        files["src"] = tmp_path / "nope.de"
        expected = f"file not found: {tmp_path / 'nope.de'}"
    elif case == "misaligned":
        files["tgt"] = tmp_path / "val.en"
        expected = "misaligned parallel files"
    elif case == "not_utf8":
        (tmp_path / "bad.en").write_bytes(b"a\n" * 5 + b"\xff\n" + b"b\n" * 14)
        files["tgt"] = tmp_path / "bad.en"
        expected = f"{tmp_path / 'bad.en'}: line 6 is not UTF-8 text"
    elif case == "all_empty":
        (tmp_path / "blank.en").write_text("\n" * 20)
        files["tgt"] = tmp_path / "blank.en"
        expected = "no training pairs left in --src/--tgt: all 20 skipped, 20 with an empty side"
    elif case == "max_len":
        extra = ["--max-len", "64", "--set", "context_length=64"]
        expected = "--max-len 64 exceeds the 63 tokens a sentence may have in the model's context_length 64"
    else:
        _fifo_holding(tmp_path / "train.pipe", b"")  # (never opened: the thread waits, as a daemon)
        files["tgt"] = tmp_path / "train.pipe"
        expected = f"--tgt {tmp_path / 'train.pipe'} is a pipe or device, which the --nproc ranks cannot each read"
    code, _, err = run_cli(capsys, "translate", "train", "--nproc", "2", "--src", files["src"], "--tgt", files["tgt"],
                           "--out", tmp_path / "run", "--max-steps", "1", *TINY, *extra)
    assert code == 1 and expected in _one_line_error(err)
    assert not (tmp_path / "run").exists()


def test_nproc_an_error_every_rank_finds_is_said_once(tmp_path):
    """What needs the tokenizer (every pair longer than --max-len) the ranks find: it was
    printed once per rank, then torchrun's 20-line report of the failed ranks."""
    import subprocess
    import sys

    _corpus(tmp_path, n=20)
    args = ["translate", "train", "--nproc", "2", "--src", tmp_path / "train.de.gz", "--tgt", tmp_path / "train.en",
            "--out", tmp_path / "run", "--max-steps", "1", "--max-len", "1", *TINY]
    done = subprocess.run([sys.executable, "-m", "frawdllm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    code, err = done.returncode, done.stderr
    errors = [line for line in err.splitlines() if "error" in line.lower() or "failed" in line.lower()]
    assert code == 1 and errors == ["frawd: error: no training pairs left in --src/--tgt: all 20 skipped, 20 longer "
                                    "than --max-len 1 tokens"], err
    assert "Root Cause" not in err and "exitcode" not in err and "Traceback" not in err, err


def test_a_run_trained_from_pipes_says_in_its_config_to_give_them_again(tmp_path, capsys):
    """config.yaml kept `/proc/PID/fd/pipe:[N]` of `--src <(zcat ...)`, and its rerun line failed
    with "file not found" on it without a word of why."""
    de, en = _corpus(tmp_path, n=20)
    _fifo_holding(tmp_path / "src.pipe", ("\n".join(de) + "\n").encode())
    _fifo_holding(tmp_path / "tgt.pipe", ("\n".join(en) + "\n").encode())
    code, _, err = run_cli(capsys, "translate", "train", "--src", tmp_path / "src.pipe", "--tgt", tmp_path / "tgt.pipe",
                           "--out", tmp_path / "run", "--max-steps", "1", *TINY, "--vocab-size", "2000")
    assert code == 0, err
    # (20 sentences of 11 words do not have 2000 tokens' worth of pairs: said, as `frawd tokenizer train` does)
    vocab = json.loads((tmp_path / "run" / "model" / "config.json").read_text())["vocab_size"]
    assert vocab < 2000 and f"note: the corpus gave {vocab:,} tokens, not the 2,000 asked for" in err
    header = (tmp_path / "run" / "config.yaml").read_text().splitlines()[:3]
    assert header[2] == "# --src, --tgt were pipes (read once): give them again to rerun or --resume", header
    # the rerun or --resume of such a run: the path that config.yaml kept says why it is gone
    from frawdllm.data.parallel import read_lines
    from frawdllm.errors import FrawdError
    for gone in ("/proc/999999999/fd/pipe:[172464]", "/dev/fd/987"):
        with pytest.raises(FrawdError, match=re.escape(f"file not found: {gone} (the pipe of a command that has "
                                                       "ended, as `<(...)` gives: give the file again)")):
            read_lines(gone)
    code, _, err = run_cli(capsys, "translate", "train", "--src", tmp_path / "train.de.gz", "--tgt",
                           tmp_path / "train.en", "--out", tmp_path / "files", "--max-steps", "1", *TINY)
    assert code == 0 and "(read once)" not in (tmp_path / "files" / "config.yaml").read_text()


def test_a_refused_resume_gives_advice_translate_train_has(trained, capsys, tmp_path):
    import shutil

    shutil.copytree(trained / "run", tmp_path / "run")
    code, _, err = run_cli(capsys, "translate", "train", "--out", tmp_path / "run", "--resume", "--max-steps", "9",
                           "--set", "n_embd=64")
    line = _one_line_error(err)
    assert code == 1 and "these settings differ: n_embd=64 (the run has 32)" in line
    assert "--init" not in line and line.endswith("start a new run (another --out, or --overwrite to replace this one)")
    # a --tokenizer for a run that trained its own (its config.yaml holds the --vocab-size it
    # trained with): a change of the run's tokenizer, not "give --tokenizer or --vocab-size"
    code, _, err = run_cli(capsys, "translate", "train", "--out", tmp_path / "run", "--resume", "--max-steps", "9",
                           "--tokenizer", tmp_path / "run" / "tokenizer.json")
    line = _one_line_error(err)
    assert code == 1 and f"these settings differ: tokenizer='{tmp_path / 'run' / 'tokenizer.json'}' (not set in " \
        "the run)" in line, line


def test_resume_of_a_run_that_is_not_there_says_so(capsys, tmp_path):
    code, _, err = run_cli(capsys, "translate", "train", "--out", tmp_path / "nothing", "--resume", "--max-steps", "9")
    assert code == 1 and _one_line_error(err).endswith("nothing: no run to resume")


def test_vocab_size_with_a_tokenizer_is_refused(trained, capsys, tmp_path):
    code, _, err = run_cli(capsys, "translate", "train", "--src", trained / "train.de.gz", "--tgt",
                           trained / "train.en", "--tokenizer", trained / "run" / "model", "--vocab-size", "500",
                           "--out", tmp_path / "run", "--max-steps", "1")
    assert code == 1 and "vocab_size 500: the vocabulary is --tokenizer" in _one_line_error(err)
    assert not (tmp_path / "run").exists()


def test_a_vocab_size_no_bpe_can_have_is_refused_before_the_data_is_read(capsys, tmp_path):
    # (it was refused after "training a joint BPE tokenizer (5 tokens) on ... sentences")
    code, out, err = run_cli(capsys, "translate", "train", "--src", tmp_path / "missing.de", "--tgt",
                             tmp_path / "missing.en", "--vocab-size", "5", "--out", tmp_path / "run", "--max-steps", "1")
    assert code == 1 and out == "" and _one_line_error(err).endswith(
        "BPE vocab_size must be between 263 (7 specials + 256 bytes) and 1,048,576, got 5")
    assert not (tmp_path / "run").exists()


def test_batch_size_in_a_config_file_is_refused(tmp_path, capsys):
    _corpus(tmp_path, n=20)
    (tmp_path / "c.yaml").write_text("batch_size: 8\n")
    code, _, err = run_cli(capsys, "translate", "train", "--config", tmp_path / "c.yaml", "--src",
                           tmp_path / "train.de.gz", "--tgt", tmp_path / "train.en", "--out", tmp_path / "run",
                           "--max-steps", "1", *TINY)
    assert code == 1 and "batch_size: translate train cuts batches by token count" in _one_line_error(err)
    assert "tokens_per_batch" in err and not (tmp_path / "run").exists()


def test_run_help_says_stdin_is_translated_a_line_at_a_time(capsys):
    code, out, _ = run_cli(capsys, "translate", "run", "--help")
    assert code == 0 and "standard input is translated a line at a time" in " ".join(out.split())


def test_at_a_terminal_run_says_how_to_use_it_then_translates_each_line(trained):
    # (it waited silently for input)
    import sys

    import pexpect

    frawd = str(Path(sys.executable).parent / "frawd")
    child = pexpect.spawn(frawd, ["translate", "run", "--model", str(trained / "run" / "model")], encoding="utf-8",
                          timeout=60, dimensions=(40, 2000))
    child.expect_exact("type a sentence and Enter to translate it; Ctrl-D to end")
    child.sendline("ein mann")
    child.expect(r"ein mann\r\n(.*)\r\n")  # (the terminal's echo, then the translation's line)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_translation_holding_a_line_break_stays_on_one_line(trained, capsys, monkeypatch, tmp_path):
    """Byte-level BPE holds "\\n" as a token, so a model can write it: `run` and --hyp-out
    must still give one line per source line (sacrebleu pairs hypotheses and references by line)."""
    from frawdllm.tokenizer import Tokenizer

    tok = Tokenizer.load(trained / "run" / "model" / "tokenizer.json")
    broken = tok.encode("a man\nruns\r\nthe dog\u2028sits")
    monkeypatch.setattr("frawdllm.infer.translate.translate_ids", lambda model, ids, **_: [broken for _ in ids])
    monkeypatch.setattr("sys.stdin", _stdin(b"ein mann\nein hund\n"))
    code, out, _ = run_cli(capsys, "translate", "run", "--model", trained / "run" / "model")
    assert code == 0 and out.split("\n") == ["a man runs the dog sits"] * 2 + [""]
    hyp = tmp_path / "hyp.en"
    code, _, _ = run_cli(capsys, "translate", "eval", "--model", trained / "run" / "model", "--src",
                         trained / "val.de", "--ref", trained / "val.en", "--beam", "1", "--hyp-out", hyp)
    assert code == 0 and hyp.read_text().split("\n") == ["a man runs the dog sits"] * 10 + [""]
