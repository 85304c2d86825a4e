"""`frawd generate`: the JSON contract, streaming, prompt files, generation_config.json
defaults and one-line errors."""

import json

import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.cli import main
from frawdllm.infer import Engine
from frawdllm.infer.native import fp16_rounded_copy, has_fp16
from frawdllm.io import write_json_atomic
from frawdllm.tokenizer import EOS_ID, byte_tokenizer, train_tokenizer
from infer_helpers import HalfKV, one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=2, n_embd=32, n_head=4,
                                context_length=64))
    directory = tmp_path_factory.mktemp("model")
    model.save_pretrained(directory, tokenizer=tok)
    return directory


def run(capsys, *args):
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def naive_greedy(model_dir, prompt, n, native="auto"):
    """Full-recompute greedy tokens of the model that `--native` computes."""
    model = FrawdLLM.from_pretrained(model_dir).eval()
    if native in ("auto", "fp16") and has_fp16():  # without a C compiler the CLI decodes with PyTorch
        # the CLI's engine, as it decides here: fp16 weights, and keys/values where its plan allows
        kv_half = Engine(model, byte_tokenizer(), weights=native).kv_dtype == torch.float16
        model = fp16_rounded_copy(model)
        if kv_half:
            model = HalfKV(model)
    seq, out = byte_tokenizer().encode(prompt), []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([seq]))[0][0, -1].argmax())
            out.append(token)
            seq.append(token)
            if token == EOS_ID:
                break
    return out


@pytest.mark.parametrize("native", [None, "fp32", "off"])
def test_json_output_is_one_object_with_the_greedy_tokens(capsys, model_dir, native):
    flags = [] if native is None else ["--native", native]  # None: the default, auto
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "Hello", "--max-new-tokens", "12",
                         "--temperature", "0", "--json", *flags)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    expected = naive_greedy(model_dir, "Hello", 12, native or "auto")
    assert record["tokens"] == expected
    text_ids = expected[:-1] if expected[-1] == EOS_ID else expected
    assert record["text"] == byte_tokenizer().decode(text_ids, skip_special_tokens=True)
    assert record["completion_tokens"] == len(expected) and record["prompt_tokens"] == 5


def test_streamed_output_equals_the_json_text(capsys, model_dir):
    common = ["generate", "--model", str(model_dir), "--prompt", "abc", "--max-new-tokens", "20",
              "--temperature", "0.8", "--seed", "4"]
    _, out, _ = run(capsys, *common, "--json")
    text = json.loads(out)["text"]
    code, streamed, _ = run(capsys, *common, "--stream")
    assert code == 0 and streamed == text + "\n"


def test_prompt_file_and_several_prompts_and_samples(capsys, model_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("from a file", encoding="utf-8")
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "one", "--prompt-file", str(prompt),
                         "--num-samples", "2", "--max-new-tokens", "4", "--seed", "1", "--json")
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert records[2]["prompt_tokens"] == len("from a file")
    other = tmp_path / "other.txt"
    other.write_text("and another file", encoding="utf-8")  # --prompt-file repeats, like --prompt
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt-file", str(prompt), "--prompt-file",
                         str(other), "--max-new-tokens", "2", "--temperature", "0", "--json")
    assert code == 0, err
    assert [json.loads(line)["prompt_tokens"] for line in out.strip().splitlines()] == [11, 16]
    # a UTF-8 byte-order mark (Notepad, PowerShell's Out-File) is no prompt text: it was 3 byte tokens
    other.write_bytes("\ufeffand another file".encode())
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt-file", str(other),
                         "--max-new-tokens", "2", "--temperature", "0", "--json")
    assert code == 0 and json.loads(out)["prompt_tokens"] == 16, (out, err)
    # --echo-prompt: each record with its own prompt
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "one", "--prompt", "two",
                         "--prompt-file", str(prompt), "--max-new-tokens", "1", "--json", "--echo-prompt")
    assert [json.loads(line)["prompt"] for line in out.strip().splitlines()] == ["one", "two", "from a file"], err
    # standard input holds one prompt: a second `-` would read it empty
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt-file", "-", "--prompt-file", "-")
    assert code == 1 and err == "frawd: error: --prompt-file - (standard input) can be given once\n", err


def test_generation_config_gives_defaults_and_flags_override_them(capsys, model_dir, tmp_path):
    import shutil

    directory = tmp_path / "m"
    shutil.copytree(model_dir, directory)
    write_json_atomic(directory / "generation_config.json", {"max_new_tokens": 3, "temperature": 0,
                                                              "ignore_eos": True, "num_samples": 2})
    _, out, _ = run(capsys, "generate", "--model", str(directory), "--prompt", "x", "--json")
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["completion_tokens"] for r in records] == [3, 3]  # num_samples from the file too
    _, out, _ = run(capsys, "generate", "--model", str(directory), "--prompt", "x", "--json", "--max-new-tokens", "5",
                    "--num-samples", "1", "--echo-prompt")
    assert json.loads(out)["completion_tokens"] == 5 and json.loads(out)["prompt"] == "x"
    write_json_atomic(directory / "generation_config.json", {"temperature": "hot"})
    code, _, err = run(capsys, "generate", "--model", str(directory), "--prompt", "x")
    assert code == 1 and "temperature must be a number, got 'hot'" in err, err  # (not "a number or an integer")
    # a flag that replaces the bad value: the file's value is never used, so it is not refused
    code, out, err = run(capsys, "generate", "--model", str(directory), "--prompt", "x", "--temperature", "0",
                         "--max-new-tokens", "2", "--json")
    assert code == 0 and json.loads(out)["completion_tokens"] == 2, err
    write_json_atomic(directory / "generation_config.json", {"temperature": "hot", "top_k": -1})
    code, _, err = run(capsys, "generate", "--model", str(directory), "--prompt", "x", "--temperature", "0")
    assert code == 1 and "top_k" in err and "hot" not in err, err  # (what no flag replaced is still checked)
    # a stop string JSON can hold but no text can: taken silently (a stop that never matches),
    # and frawd serve's /v1/models was a 500 serialising it
    (directory / "generation_config.json").write_text('{"stop": ["ok", "\\ud800"]}')
    code, _, err = run(capsys, "generate", "--model", str(directory), "--prompt", "x")
    assert code == 1 and err == (f"frawd: error: {directory / 'generation_config.json'}: stop string 1 is not "
                                 "valid UTF-8 (a lone surrogate at character 0)\n"), err


def test_help_gives_each_sampling_flags_fallback_as_the_sampler_has_it(capsys):
    """The sampling flags default to generation_config.json's values: --help says so, and
    the value it names without one is SamplingParams' own (it showed plain defaults, not
    those that ran for a model with the file)."""
    import re

    from frawdllm.infer import SamplingParams

    code, out, _ = run(capsys, "generate", "--help")
    text = " ".join(out.split())  # (click wraps the lines)
    for flag, field in [("--max-new-tokens", "max_new_tokens"), ("--temperature", "temperature"),
                        ("--top-k", "top_k"), ("--top-p", "top_p"), ("--min-p", "min_p"),
                        ("--repetition-penalty", "repetition_penalty")]:
        shown = re.search(re.escape(flag) + r" \w+ [^\[]*\[default: the file's, else ([0-9.]+)\]", text)
        assert code == 0 and shown, flag
        assert float(shown.group(1)) == getattr(SamplingParams(), field), flag


def test_logprobs_asked_by_generation_config_get_a_note_not_silence(capsys, model_dir, tmp_path):
    """The file may set any SamplingParams field; generate prints no log-probabilities, and
    dropped them without a word."""
    import shutil

    directory = tmp_path / "m"
    shutil.copytree(model_dir, directory)
    write_json_atomic(directory / "generation_config.json", {"logprobs": 3, "temperature": 0})
    code, out, err = run(capsys, "generate", "--model", str(directory), "--prompt", "x", "--max-new-tokens", "2",
                         "--json")
    assert code == 0 and json.loads(out)["completion_tokens"] == 2
    assert err == ("note: generation_config.json asks for logprobs; frawd generate prints text and token ids, not "
                   "log-probabilities (frawd serve and Engine.stream give them)\n")


def test_int8_flag_generates(capsys, model_dir):
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "Hi", "--quantize", "int8",
                         "--max-new-tokens", "5", "--temperature", "0", "--json", "--ignore-eos")
    assert code == 0, err
    assert len(json.loads(out)["tokens"]) == 5


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x", "--temperature", "-1"], "temperature must be 0 \\(greedy\\) or"),
    (["--prompt", "x", "--top-p", "0"], r"top_p must be in \(0, 1\]"),
    (["--prompt", "x", "--temperature", "nan"], "temperature must be a number, not NaN"),
    ([], "give a prompt with --prompt TEXT or --prompt-file FILE"),
    (["--prompt-file", "/nonexistent/p.txt"], "prompt file not found"),
    (["--prompt-file", "/tmp"], "--prompt-file /tmp is a folder, not a file"),
    (["--prompt", "x" * 100], "prompt has 100 tokens but the model's context is 64"),
    (["--prompt", "ab" + b"\xff".decode("utf-8", "surrogateescape")],  # invalid UTF-8 in argv
     "--prompt is not valid UTF-8 \\(a lone surrogate or undecodable byte at character 2\\)"),
    (["--prompt", "x", "--prompt", "ab" + b"\xff".decode("utf-8", "surrogateescape")],
     "--prompt 2 is not valid UTF-8 \\(a lone surrogate or undecodable byte at character 2\\)"),
    (["--prompt", "x", "--stop", b"\xff".decode("utf-8", "surrogateescape")],  # (it could never match)
     "--stop is not valid UTF-8 \\(a lone surrogate or undecodable byte at character 0\\)"),
])
def test_bad_input_is_one_line_error(capsys, model_dir, args, message):
    import re

    code, out, err = run(capsys, "generate", "--model", str(model_dir), *args)
    assert code == 1
    assert re.search(message, err) and err.count("\n") == 1 and "Traceback" not in err


def test_missing_model_directory_is_one_line_error(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert code == 1 and "model directory not found" in err and err.count("\n") == 1
    (tmp_path / "corpus.txt").write_text("text")
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "corpus.txt"), "--prompt", "x")
    assert code == 1 and "corpus.txt is a file, not a model directory" in err and err.count("\n") == 1


def test_stats_say_how_fast_and_which_forward_ran(capsys, model_dir):
    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "Hi", "--max-new-tokens", "4",
                       "--temperature", "0", "--ignore-eos", "--no-stream", "--stats", "--native", "off")
    assert code == 0, err
    assert "[4 tokens in " in err and "forward: PyTorch eager; KV cache fp32]" in err
    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "Hi", "--max-new-tokens", "4",
                       "--temperature", "0", "--ignore-eos", "--no-stream", "--stats", "--dtype", "bf16")
    assert code == 0 and "forward: PyTorch eager; KV cache bf16]" in err, err  # (the native forward is fp16/fp32)
    if has_fp16():  # the default: native fp16 weights, and (in C everywhere) an fp16 cache
        code, _, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "Hi", "--max-new-tokens", "4",
                           "--temperature", "0", "--ignore-eos", "--no-stream", "--stats", "--native", "fp16")
        assert code == 0, err
        assert "forward: native fp16" in err and ("KV cache fp16]" in err or "PyTorch eager" in err)


@pytest.mark.parametrize("stream", ["--stream", "--json"])
def test_a_completion_cut_by_the_context_says_so(capsys, model_dir, stream):
    """Asking for more tokens than the context holds (64 here) ends at the context with a
    note naming it and --overflow slide (3 prompt tokens + 62: the last is never fed back);
    --overflow slide generates all of them, no note."""
    common = ["generate", "--model", str(model_dir), "--prompt", "abc", "--max-new-tokens", "100",
              "--temperature", "0.8", "--seed", "1", "--ignore-eos", stream]
    code, out, err = run(capsys, *common)
    assert code == 0 and "context of 64 tokens after 62 new tokens" in err and "--overflow slide" in err, err
    if stream == "--json":
        assert json.loads(out)["completion_tokens"] == 62
    code, out, err = run(capsys, *common, "--overflow", "slide")
    assert code == 0 and "note" not in err, err
    if stream == "--json":
        assert json.loads(out)["completion_tokens"] == 100
        # of two prompts, the longer ends first: the note gives the fewest new tokens
        code, out, err = run(capsys, *common, "--prompt", "abcdefgh")
        assert code == 0 and [r["completion_tokens"] for r in map(json.loads, out.splitlines())] == [62, 57], out
        assert "context of 64 tokens after 57 new tokens" in err, err


def test_prompt_characters_a_char_tokenizer_does_not_know_are_named(capsys, tmp_path):
    tok = train_tokenizer(["abc abc"], kind="char")
    torch.manual_seed(0)
    FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=16, n_head=2,
                        context_length=32)).save_pretrained(tmp_path, tokenizer=tok)
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "ab€z", "--max-new-tokens", "2",
                       "--json")
    assert code == 0 and "2 character(s) of the prompt are not in the tokenizer's vocabulary" in err, err
    assert "'z€'" in err
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "2",
                       "--json")
    assert code == 0 and "warning" not in err
    # a stop string it can never write (it was taken without a word, and generation ran to the limit)
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "2",
                       "--stop", "é!", "--stop", "ca", "--json")
    assert code == 0 and err.splitlines() == ["warning: stop string 'é!' can never match: the tokenizer has no '!é'"], err
    for more, said in [(1, "1 more stop string"), (2, "2 more stop strings")]:  # (the first three, then a count)
        stops = [arg for i in range(3 + more) for arg in ("--stop", f"x{i}")]
        code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "2",
                           *stops, "--stop", "ca", "--json")
        assert code == 0 and err.splitlines() == [
            *(f"warning: stop string 'x{i}' can never match: the tokenizer has no '{i}x'" for i in range(3)),
            f"warning: {said} can never match"], err


def test_stream_asked_for_where_it_cannot_apply_says_so(capsys, model_dir):
    """--stream with several prompts, samples or --json was ignored without a word."""
    for extra, why in [(["--prompt", "b"], "several completions"), (["--num-samples", "2"], "several completions"),
                       (["--json"], "--json")]:
        code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "a", "--stream",
                             "--max-new-tokens", "2", *extra)
        assert code == 0 and out, err
        assert f"note: --stream prints one completion of one prompt as plain text; with {why}" in err, err
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "a", "--stream",
                         "--max-new-tokens", "2")
    assert code == 0 and "--stream" not in err, err


def stdin_of(monkeypatch, data: bytes) -> None:
    """Standard input holding `data`, as Python opens it (undecodable bytes as surrogates)."""
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape"))


def test_a_prompt_that_is_not_utf8_is_one_line_naming_its_source_and_byte(capsys, model_dir, tmp_path, monkeypatch):
    """From stdin it said "the text is not valid UTF-8 (... at character 6)" without naming
    stdin (after a warning about an <|unk|> '\\udcff' with a char model); a file said
    "bad.txt: not UTF-8 text" with no position."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes("é ROMEO:".encode() + b"\xff")  # 8 characters, 9 bytes (é is 2) before the bad one
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt-file", str(bad),
                         "--max-new-tokens", "2")
    assert (code, out) == (1, "")
    assert err == f"frawd: error: --prompt-file {bad} is not UTF-8 text (byte 0xff at byte offset 9)\n"
    stdin_of(monkeypatch, b"ROMEO:\xff")
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt-file", "-", "--max-new-tokens", "2")
    assert (code, out) == (1, "")
    assert err == "frawd: error: --prompt-file - (stdin) is not UTF-8 text (byte 0xff at byte offset 6)\n"


def test_a_prompt_file_reaches_the_model_byte_for_byte(capsys, model_dir, tmp_path, monkeypatch):
    """Text mode turned each CRLF into LF: the model saw another prompt than the file's."""
    prompt = tmp_path / "crlf.txt"
    prompt.write_bytes(b"ab\r\ncd\r\n")
    for source in (str(prompt), "-"):
        stdin_of(monkeypatch, b"ab\r\ncd\r\n")
        code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt-file", source,
                             "--max-new-tokens", "2", "--temperature", "0", "--json", "--echo-prompt")
        assert code == 0, err
        record = json.loads(out)
        assert record["prompt_tokens"] == 8 and record["prompt"] == "ab\r\ncd\r\n", (source, record)


def test_a_prompt_file_that_is_a_pipe_or_a_device_is_read(capsys, model_dir, tmp_path):
    """`--prompt-file <(cmd)`, a named pipe or /dev/null: "prompt file not found" (they are
    no regular files, but they exist and read as files do)."""
    import os
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_bytes, args=(b"ab\r\ncd",))
    writer.start()
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt-file", str(fifo),
                         "--max-new-tokens", "2", "--json", "--echo-prompt")
    writer.join()
    assert code == 0 and json.loads(out)["prompt"] == "ab\r\ncd", err
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt-file", "/dev/null",
                         "--max-new-tokens", "2", "--json", "--echo-prompt")
    assert code == 0 and json.loads(out)["prompt"] == "", err
    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--prompt-file", str(tmp_path / "none.txt"))
    assert code == 1 and err == f"frawd: error: prompt file not found: {tmp_path / 'none.txt'}\n"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_stop_id_outside_the_vocabulary_names_generation_config(capsys, model_dir, tmp_path, command):
    """It said only "stop token id 99999 is outside the vocabulary", as if a flag had given it."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(model_dir, model)
    (model / "generation_config.json").write_text('{"stop_token_ids": [99999]}')
    code, out, err = run(capsys, command, "--model", str(model), *(["--prompt", "hi"] if command == "generate" else []))
    assert (code, out) == (1, "")
    assert err == (f"frawd: error: {model / 'generation_config.json'}: stop token id 99999 is outside the "
                   "vocabulary (size 263)\n")


def test_the_memory_check_sizes_the_cache_as_the_engine_does(capsys, model_dir, monkeypatch):
    """The check sized every row's cache for the whole context in fp32: 2,000 rows of one
    new token after a 1-token prompt were refused for 67 MB they never needed (1 slot a row)."""
    import frawdllm.memory

    monkeypatch.setattr(frawdllm.memory, "free_memory", lambda device: 16 * 2**20)
    common = ["generate", "--model", str(model_dir), "--prompt", "a", "--num-samples", "2000", "--json"]
    code, out, err = run(capsys, *common, "--max-new-tokens", "1")
    assert code == 0 and len(out.splitlines()) == 2000, err
    # 63 slots a row (the whole context): about 33 MB in fp32, 17 MB in fp16; still refused
    for native in ("fp32", "auto"):
        code, out, err = run(capsys, *common, "--max-new-tokens", "63", "--native", native)
        assert code == 1 and "2,000 sequences at once (prompts x --num-samples) need about" in err, err


@pytest.mark.parametrize("n_kv_head", [4, 1], ids=["mha", "gqa"])  # (a GQA cache holds n_kv_head heads)
def test_the_memory_check_counts_the_cache_dtype_and_the_prompts(monkeypatch, n_kv_head):
    from types import SimpleNamespace

    import frawdllm.memory
    from frawdllm.errors import FrawdError
    from frawdllm.infer import Engine, SamplingParams

    cfg = get_config("tiny", vocab_size=256, n_layer=2, n_embd=32, n_head=4, n_kv_head=n_kv_head, context_length=64)

    def engine(kv_dtype):
        return SimpleNamespace(config=cfg, kv_dtype=kv_dtype, compile=False, device=torch.device("cpu"))

    def check_rows_fit(engine, texts, params):
        Engine.check_rows_fit(engine, [[0] * len(text) for text in texts], params)

    slot = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim  # elements of one token's keys and values
    # 2 prompts of 10 and 30 tokens, 20 new: 30 + 20 - 1 = 49 slots (under 64 + 30 - 10)
    fp32 = 2 * (slot * 49 * 4 + 4 * 256)
    params = SamplingParams(max_new_tokens=20)
    monkeypatch.setattr(frawdllm.memory, "free_memory", lambda device: fp32)
    check_rows_fit(engine(torch.float32), ["x" * 10, "x" * 30], params)
    monkeypatch.setattr(frawdllm.memory, "free_memory", lambda device: fp32 - 1)
    with pytest.raises(FrawdError, match="2 sequences at once"):
        check_rows_fit(engine(torch.float32), ["x" * 10, "x" * 30], params)
    check_rows_fit(engine(torch.float16), ["x" * 10, "x" * 30], params)  # half the cache
    monkeypatch.setattr(frawdllm.memory, "free_memory", lambda device: 2 * (slot * 49 * 2 + 4 * 256) - 1)
    with pytest.raises(FrawdError, match="2 sequences at once"):
        check_rows_fit(engine(torch.float16), ["x" * 10, "x" * 30], params)


def test_the_engine_refuses_rows_that_cannot_fit_before_allocating_them(model_dir):
    """The check was the CLI's: Engine.generate(num_samples=10**9) from Python was a
    MemoryError, or the OOM killer ending the process without a word."""
    from frawdllm.errors import FrawdError
    from frawdllm.infer import Engine, SamplingParams

    engine = Engine(FrawdLLM.from_pretrained(model_dir), model_dir, native=False)
    params = SamplingParams(temperature=0, max_new_tokens=2, num_samples=10**9)
    for call in (engine.generate, lambda *a: list(engine.stream(*a))):
        with pytest.raises(FrawdError, match=r"^1,000,000,000 sequences at once \(prompts x num_samples\) need about"):
            call("a", params)


def test_threads_up_to_eight_a_cpu_are_taken(model_dir, monkeypatch):
    import frawdllm.cbuild
    import frawdllm.cli.sampling_flags as flags
    from frawdllm.errors import FrawdError

    monkeypatch.setattr(frawdllm.cbuild, "usable_cpus", lambda: 1)
    before = torch.get_num_threads()
    try:
        flags.load_engine(str(model_dir), threads=8)  # the most: 8x the CPUs
        assert torch.get_num_threads() == 8
        with pytest.raises(FrawdError, match="--threads 9 is more than 8x the 1 CPUs"):
            flags.load_engine(str(model_dir), threads=9)
    finally:
        torch.set_num_threads(before)


def test_flags_can_undo_what_generation_config_sets(capsys, model_dir, tmp_path):
    """With ignore_eos, a seed or stop strings in generation_config.json there was no
    --no-ignore-eos, `--seed none` was refused, and the stop strings could not be cleared."""
    import shutil

    directory = tmp_path / "m"
    shutil.copytree(model_dir, directory)
    common = ["generate", "--model", str(directory), "--prompt", "x", "--json"]

    def finish_reasons(*args):
        code, out, err = run(capsys, *common, *args)
        assert code == 0, err
        return [json.loads(line)["finish_reason"] for line in out.splitlines()]

    # near-uniform draws over the 262 tokens: some of 30 samples of 62 tokens draw <|eos|>
    write_json_atomic(directory / "generation_config.json", {"ignore_eos": True, "temperature": 100, "seed": 1,
                                                              "num_samples": 30, "max_new_tokens": 62})
    assert set(finish_reasons()) == {"length"}
    assert "stop" in finish_reasons("--no-ignore-eos")
    assert set(finish_reasons("--ignore-eos")) == {"length"}

    write_json_atomic(directory / "generation_config.json", {"seed": 5, "max_new_tokens": 20})
    texts = [json.loads(run(capsys, *common, *args)[1])["text"] for args in [(), (), ("--seed", "none"),
                                                                             ("--seed", "NONE")]]
    assert texts[0] == texts[1] and len({texts[1], texts[2], texts[3]}) == 3  # none: fresh entropy each run

    code, out, err = run(capsys, *common, "--temperature", "0", "--max-new-tokens", "20", "--no-stop")
    greedy = json.loads(out)["text"]
    stop = greedy[4:6]
    assert code == 0 and len(greedy) > 6 and stop not in greedy[:5], (greedy, err)
    write_json_atomic(directory / "generation_config.json", {"stop": [stop], "temperature": 0, "max_new_tokens": 20})
    assert json.loads(run(capsys, *common)[1])["text"] == greedy[:4]
    assert json.loads(run(capsys, *common, "--no-stop")[1])["text"] == greedy
    code, _, err = run(capsys, *common, "--no-stop", "--stop", "q")
    assert code == 1 and err == "frawd: error: --stop and --no-stop contradict each other: give one\n"

    code, out, _ = run(capsys, "generate", "--help")
    help_text = " ".join(out.split())
    assert "--ignore-eos / --no-ignore-eos" in help_text and "--no-stop" in help_text and "'none'" in help_text


def _json_text(capsys, model_dir, prompt):
    _, out, _ = run(capsys, "generate", "--model", str(model_dir), "--prompt", prompt, "--max-new-tokens", "6",
                    "--temperature", "0", "--json")
    return json.loads(out)["text"]


def test_several_plain_text_completions_each_get_a_header_and_one_does_not(capsys, model_dir):
    common = ["generate", "--model", str(model_dir), "--max-new-tokens", "3", "--temperature", "0", "--no-stream"]
    code, out, err = run(capsys, *common, "--prompt", "a", "--prompt", "b", "--num-samples", "2")
    assert code == 0, err
    headers = [line for line in out.splitlines() if line.startswith("--- prompt")]
    assert headers == ["--- prompt 1, sample 1 ---", "--- prompt 1, sample 2 ---",
                       "--- prompt 2, sample 1 ---", "--- prompt 2, sample 2 ---"], out
    code, out, err = run(capsys, *common, "--prompt", "a")
    assert code == 0 and "--- prompt" not in out, out


def test_echo_prompt_puts_the_prompt_before_the_plain_text_completion(capsys, model_dir):
    text = _json_text(capsys, model_dir, "abc")
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "abc", "--max-new-tokens", "6",
                         "--temperature", "0", "--no-stream", "--echo-prompt")
    assert code == 0 and out == "abc" + text + "\n", (out, err)


def test_echo_prompt_puts_the_prompt_before_the_streamed_completion(capsys, model_dir):
    text = _json_text(capsys, model_dir, "abc")
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "abc", "--max-new-tokens", "6",
                         "--temperature", "0", "--stream", "--echo-prompt")
    assert code == 0 and out == "abc" + text + "\n", (out, err)


def test_the_unknown_character_warning_names_up_to_twenty_then_counts_the_rest(capsys, tmp_path):
    tok = train_tokenizer(["abc abc"], kind="char")
    torch.manual_seed(0)
    FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=16, n_head=2,
                        context_length=64)).save_pretrained(tmp_path, tokenizer=tok)
    unknown = "ABCDEFGHIJKLMNOPQRSTU"  # 21, sorted
    for n in (20, 21):
        code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "ab" + unknown[:n],
                           "--max-new-tokens", "1", "--json")
        assert code == 0, err
        shown = repr(unknown[:20] + (" and 1 more" if n == 21 else ""))
        assert f"warning: {n} character(s) of the prompt are not in the tokenizer's vocabulary and become " \
               f"<|unk|>: {shown}" in err, err


def test_plain_output_with_echo_prompt_prints_each_completions_own_prompt(capsys, model_dir):
    """--echo-prompt without --json, several prompts: each completion follows its own prompt."""
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "one", "--prompt", "two",
                         "--max-new-tokens", "1", "--temperature", "0", "--no-stream", "--echo-prompt")
    assert code == 0, err
    blocks = out.split("--- prompt ")[1:]
    assert [b.splitlines()[0] for b in blocks] == ["1, sample 1 ---", "2, sample 1 ---"], out
    assert blocks[0].split("---\n", 1)[1].startswith("one"), out
    assert blocks[1].split("---\n", 1)[1].startswith("two"), out
