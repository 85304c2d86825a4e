"""Model text on a terminal: control characters a model writes (ESC starts the sequences that
clear a screen or retitle a window) reach a terminal as `\\x1b`, and a pipe as written."""

import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pexpect
import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.cli.terminal import for_terminal
from frawdllm.infer import Engine, SamplingParams
from frawdllm.infer.chat import ROLE_TOKEN_IDS
from frawdllm.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)

FRAWD = str(Path(sys.executable).parent / "frawd")
ALPHABET = "\x1b[2J\x07\x9bab"  # ESC [ 2 J (clear the screen), BEL, CSI, letters
N = 24


class FakeStream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_control_characters_become_escapes_on_a_terminal_only():
    text = "a\x1b[2J\tb\r\n\x00\x07\x7f\x9b\x85é€🙂"
    assert for_terminal(text, FakeStream(True)) == "a\\x1b[2J\tb\r\n\\x00\\x07\\x7f\\x9b\\x85é€🙂"
    assert for_terminal(text, FakeStream(False)) == text
    assert for_terminal(text, object()) == text  # (a stream without isatty is no terminal)
    for code in range(0x300):  # every C0 and C1 control (Unicode's Cc), but the three that lay text out
        control = unicodedata.category(chr(code)) == "Cc" and chr(code) not in "\n\t\r"
        assert for_terminal(chr(code), FakeStream(True)) == (f"\\x{code:02x}" if control else chr(code)), hex(code)


@pytest.fixture(scope="module")
def escape_model(tmp_path_factory):
    """A random model over ALPHABET whose greedy text holds ESC (never a special token)."""
    tok = train_tokenizer([ALPHABET], kind="char")
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=2, n_embd=32, n_head=4,
                                context_length=64, tie_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
        model.lm_head.weight[: len(SPECIAL_TOKENS)] = 0
        model.lm_head.weight[tok.encode("\x1b")[0]] += 0.3  # ESC often enough to be seen
    directory = tmp_path_factory.mktemp("escape")
    model.save_pretrained(directory, tokenizer=tok)
    return directory


def greedy(model_dir, ids_or_text, stop=()):
    engine = Engine(FrawdLLM.from_pretrained(model_dir), Tokenizer.load(model_dir))
    if isinstance(ids_or_text, list):
        ids_or_text = engine.tokenizer.render_chat(ids_or_text, add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_new_tokens=N, stop_token_ids=list(stop), ignore_eos=not stop)
    return engine.generate([ids_or_text], params)[0].text


def escaped(text):
    return for_terminal(text, FakeStream(True))


def terminal_output(args):
    child = pexpect.spawn(FRAWD, args, encoding="utf-8", timeout=60, dimensions=(40, 2000))
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    return child.before


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_generate_escapes_control_characters_on_a_terminal_and_not_in_a_pipe(escape_model, stream):
    prompt = "\x1bab"  # (--echo-prompt: the prompt is shown as the reply is)
    expected = greedy(escape_model, prompt)
    assert "\x1b" in expected and "\x07" in expected  # (else the test shows nothing)
    args = ["generate", "--model", str(escape_model), "--prompt", prompt, "--temperature", "0", "--ignore-eos",
            "--max-new-tokens", str(N), "--threads", "1", "--echo-prompt", stream]
    seen = terminal_output(args)
    assert escaped(prompt) + escaped(expected) in seen.replace("\r\n", "\n")
    assert "\x1b" not in seen and "\x07" not in seen
    piped = subprocess.run([FRAWD, *args], capture_output=True, check=True).stdout.decode()
    assert piped == prompt + expected + "\n"  # (a file gets what the model wrote)


def test_standard_output_decides_not_standard_error(escape_model, tmp_path):
    """`frawd generate ... > out.txt` from a terminal (stderr one, stdout a file) writes the
    text as generated; `2> log` on a terminal escapes it."""
    expected = greedy(escape_model, "ab")
    args = ["generate", "--model", str(escape_model), "--prompt", "ab", "--temperature", "0", "--ignore-eos",
            "--max-new-tokens", str(N), "--threads", "1"]
    command = " ".join(map(shlex.quote, [FRAWD, *args]))
    for redirect, shown in (("> " + shlex.quote(str(tmp_path / "out.txt")), None),
                            ("2> " + shlex.quote(str(tmp_path / "err.txt")), escaped(expected))):
        child = pexpect.spawn("bash", ["-c", f"{command} {redirect}"], encoding="utf-8", timeout=60,
                              dimensions=(40, 2000))
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0, child.before
        if shown is None:
            assert (tmp_path / "out.txt").read_bytes().decode() == expected + "\n"
        else:
            assert child.before.replace("\r\n", "\n") == shown + "\n"


def test_chat_escapes_control_characters_of_the_reply(escape_model):
    expected = greedy(escape_model, [{"role": "user", "content": "ab"}], stop=ROLE_TOKEN_IDS)
    assert "\x1b" in expected
    child = pexpect.spawn(FRAWD, ["chat", "--model", str(escape_model), "--threads", "1", "--temperature", "0",
                                  "--max-new-tokens", str(N)], encoding="utf-8", timeout=60, dimensions=(40, 2000))
    child.expect_exact("> ")
    child.sendline("ab")
    child.expect_exact("ab\r\n")
    child.expect(r"\r\n> ")
    assert child.before == escaped(expected)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
