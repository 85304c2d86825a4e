"""`frawd chat` driven as a person would: through a terminal (pexpect), typing messages
and commands, pressing Ctrl-C in the middle of a reply and Ctrl-D to leave."""

import re
import signal
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.infer import Engine, SamplingParams
from frawdllm.errors import FrawdError
from frawdllm.infer.chat import ROLE_TOKEN_IDS
from frawdllm.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer
from cli_helpers import run_cli
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)

FRAWD = str(Path(sys.executable).parent / "frawd")
ALPHABET = "abcdefghij "
REPLY = r"[a-j ]"


def save_chat_model(directory: Path, context_length: int) -> Path:
    """A random model that only ever writes letters: it never ends a reply by itself."""
    tok = train_tokenizer([ALPHABET], kind="char")
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=2, n_embd=32, n_head=4,
                                context_length=context_length, tie_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
        model.lm_head.weight[: len(SPECIAL_TOKENS)] = 0  # logit 0: never the greedy choice
    model.save_pretrained(directory, tokenizer=tok)
    return directory


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("chat"), context_length=128)


def default_sigint() -> None:
    """Ctrl-C as a terminal delivers it: a test run started in the background without job
    control (`cmd &` in a script) ignores SIGINT, and children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(model_dir, *args):
    child = pexpect.spawn(FRAWD, ["chat", "--model", str(model_dir), "--threads", "1", *args],
                          encoding="utf-8", timeout=60, dimensions=(40, 2000), preexec_fn=default_sigint)
    child.expect(r"/help for commands")
    child.expect_exact("> ")
    return child


def expected_reply(model_dir, messages, max_new_tokens):
    engine = Engine(FrawdLLM.from_pretrained(model_dir), Tokenizer.load(model_dir))
    ids = engine.tokenizer.render_chat(messages, add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, stop_token_ids=ROLE_TOKEN_IDS)
    return engine.generate([ids], params)[0].text


def say(child, text):
    """Type a line; return what the REPL printed before its next prompt."""
    child.sendline(text)
    child.expect_exact(text + "\r\n")  # the terminal echoes what was typed
    child.expect(r"\r\n> ")
    return child.before


def test_a_conversation_with_commands(chat_model):
    child = spawn(chat_model, "--temperature", "0", "--max-new-tokens", "12")
    first = say(child, "he fed a badge")
    assert first == expected_reply(chat_model, [{"role": "user", "content": "he fed a badge"}], 12)
    assert re.fullmatch(REPLY + "{12}", first)
    second = say(child, "a bad deed")
    history = [{"role": "user", "content": "he fed a badge"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "a bad deed"}]
    assert second == expected_reply(chat_model, history, 12)  # the history is part of the prompt

    assert "top_k=5" in say(child, "/params top_k=5")
    assert "error: top_p must be in (0, 1]" in say(child, "/params top_p=3")
    assert "error: num_samples cannot be changed here: chat replies with one sample" in say(child, "/params num_samples=3")
    assert "error: stop cannot be changed here: stop strings are set when chat starts (--stop)" in \
        say(child, "/params stop=x")
    assert "error: stop_token_ids cannot be changed here: chat stops at its role tokens" in \
        say(child, "/params stop_token_ids=5")
    unknown = say(child, "/params foo=1")
    assert "error: unknown parameter 'foo'; /params takes max_new_tokens, temperature" in unknown
    assert "num_samples" not in unknown and "stop" not in unknown
    assert "(system message set)" in say(child, "/system be brief")
    assert "(conversation cleared)" in say(child, "/reset")
    assert "unknown command /bogus" in say(child, "/bogus")
    reply = say(child, "he fed a badge")  # top_k does not matter at temperature 0
    system_first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "he fed a badge"}]
    assert reply == expected_reply(chat_model, system_first, 12)
    # a message that starts with a slash: "//" sends it (it was an unknown command)
    assert say(child, "/reset") and say(child, "//a b") == \
        "(not in the tokenizer's vocabulary, seen as <|unk|>: '/')\r\n" + expected_reply(
            chat_model, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "/a b"}], 12)
    # characters a char tokenizer lacks are said, as generate says them
    assert say(child, "/reset") and say(child, "hi xyz").startswith(
        "(not in the tokenizer's vocabulary, seen as <|unk|>: 'xyz')\r\n")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_reply_and_keeps_the_repl(chat_model):
    child = spawn(chat_model, "--temperature", "0", "--max-new-tokens", "1000000", "--overflow", "slide")
    child.sendline("write forever")
    child.expect_exact("write forever\r\n")
    child.expect(REPLY + "{30}")  # the reply is streaming
    child.sendintr()
    child.expect_exact("[stopped]")
    child.expect_exact("\r\n> ")
    assert "max_new_tokens=1000000" in say(child, "/params")
    child.sendintr()  # Ctrl-C at the prompt: a fresh prompt, still running
    child.expect_exact("> ")
    assert child.isalive()
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_before_a_reply_begins_keeps_the_repl_and_its_history(chat_model, monkeypatch, capsys):
    """Ctrl-C while a long pasted message (or /system text) was being tokenized ended the
    whole session ("aborted", status 130): only a reply's own Ctrl-C was caught."""
    from frawdllm.cli.chat import _Repl

    engine = Engine(FrawdLLM.from_pretrained(chat_model), Tokenizer.load(chat_model))
    real_encode = engine.tokenizer.encode

    def encode(text):
        if text == "a long paste":
            raise KeyboardInterrupt  # what Ctrl-C does to the tokenizer's call
        return real_encode(text)

    lines = iter(["he fed a badge", "a long paste", "/system a long paste", "a bad deed"])

    def typed(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    monkeypatch.setattr("builtins.input", typed)
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=ROLE_TOKEN_IDS)
    repl = _Repl(engine, params, None, str(chat_model))
    repl.run()
    assert capsys.readouterr().out.count(" [stopped]\n") == 2
    first = expected_reply(chat_model, [{"role": "user", "content": "he fed a badge"}], 6)
    history = [{"role": "user", "content": "he fed a badge"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "a bad deed"}]
    assert repl.system is None and repl.turns == history + [
        {"role": "assistant", "content": expected_reply(chat_model, history, 6)}]


def test_old_turns_are_dropped_to_fit_the_context_and_said_once(tmp_path):
    model_dir = save_chat_model(tmp_path / "small", context_length=64)
    child = spawn(model_dir, "--temperature", "0", "--max-new-tokens", "10")
    outputs = [say(child, f"message number {i} here") for i in range(5)]
    notices = [o.count("no longer fit the 64-token context") for o in outputs]
    assert sum(notices) == 1 and notices[0] == 0
    for output in outputs:
        assert re.search(REPLY + "{10}$", output)
    child.sendeof()
    child.expect(pexpect.EOF)


def test_the_repl_keeps_the_newest_whole_exchanges_that_fit(tmp_path, capsys):
    """What the REPL keeps after dropping: the tail of the conversation, starting with a user
    message, and each reply drawn from exactly the history `fit_history` gives."""
    from frawdllm.cli.chat import _Repl

    model_dir = save_chat_model(tmp_path / "small", context_length=64)
    engine = Engine(FrawdLLM.from_pretrained(model_dir), Tokenizer.load(model_dir))
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=ROLE_TOKEN_IDS)
    repl = _Repl(engine, params, "ab", str(model_dir))
    everything = []
    for i in range(6):
        message = f"message number {'abcdef'[i]} here"
        system = [{"role": "system", "content": "ab"}]
        repl.reply(message)
        everything += [{"role": "user", "content": message}, repl.turns[-1]]
        assert repl.turns[0]["role"] == "user" and repl.turns == everything[-len(repl.turns):]
        assert repl.turns[-1]["content"] == expected_reply(model_dir, system + repl.turns[:-1], 6)
    assert len(repl.turns) < len(everything)  # (it did drop)
    assert capsys.readouterr().out.count("no longer fit") == 1


def test_a_system_message_is_set_without_the_spaces_after_the_command(tmp_path, capsys):
    from frawdllm.cli.chat import _Repl

    model_dir = save_chat_model(tmp_path / "small", context_length=64)
    engine = Engine(FrawdLLM.from_pretrained(model_dir), Tokenizer.load(model_dir))
    repl = _Repl(engine, SamplingParams(temperature=0, max_new_tokens=6), None, str(model_dir))
    repl.command("/system   be bad")  # (of the chat model's alphabet)
    assert repl.system == "be bad" and capsys.readouterr().out == "(system message set)\n"


def test_an_undecodable_system_message_is_one_line_before_anything_runs(chat_model):
    import subprocess

    system = b"\xff".decode("utf-8", "surrogateescape")  # how Python passes invalid UTF-8 in argv
    done = subprocess.run([FRAWD, "chat", "--model", str(chat_model), "--system", system], input=b"hi\n",
                          capture_output=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.decode().strip().splitlines() == [
        "frawd: error: --system is not valid UTF-8 (a lone surrogate or undecodable byte at character 0)"]


def test_a_tokenizer_without_chat_tokens_is_refused_at_start(tmp_path, capsys):
    """It used to start, fail every message with the same error, and exit 0."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    plain = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(ALPHABET)}, unk_token="a"))
    plain.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    model = FrawdLLM(get_config("tiny", vocab_size=len(ALPHABET), n_layer=1, n_embd=16, n_head=2,
                                context_length=32))
    model.save_pretrained(tmp_path / "m", tokenizer=Tokenizer(plain))
    code, _, err = run_cli(capsys, "chat", "--model", tmp_path / "m", "--threads", "1")  # (refused before reading)
    assert code == 1
    err = err.strip().splitlines()
    assert len(err) == 1 and "lacks FrawdLLM's special tokens" in err[0] and "frawd generate" in err[0], err


def test_history_is_dropped_by_whole_exchanges_never_leaving_a_reply_without_its_question():
    """Dropping one message at a time kept "reply 1" without the message it answers."""
    from frawdllm.infer.chat import fit_history

    tok = train_tokenizer([ALPHABET], kind="char")
    system = {"role": "system", "content": "be brief" * 3}  # 26 tokens as a turn
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "bbbbbbbbbbbbbbbbbbbbbbbb"},
               {"role": "user", "content": "c"}, {"role": "assistant", "content": "dd"},
               {"role": "user", "content": "e"}]

    def kept(messages, context):
        ids, dropped = fit_history(tok, messages, context, reserve=4)
        rest = messages[len(messages) - len(history) + dropped:]
        assert ids == tok.render_chat(messages[:len(messages) - len(history)] + rest, add_generation_prompt=True)
        return [m["content"] for m in rest]

    full = len(tok.render_chat(history, add_generation_prompt=True))
    assert kept(history, full + 4) == ["a", "bbbbbbbbbbbbbbbbbbbbbbbb", "c", "dd", "e"]  # fits: untouched
    assert kept(history, full + 3) == ["c", "dd", "e"]  # not "bbbb...", "c", ...
    assert kept([system, *history], 26 + 12 + 4) == ["c", "dd", "e"]
    assert kept([system, *history], 26 + 12 + 3) == ["e"]  # the system message stays; whole exchanges go
    with pytest.raises(FrawdError, match="the system message needs"):
        fit_history(tok, [{"role": "system", "content": "be brief" * 20}, *history], 64, reserve=4)
    # a newest turn that leaves no room for the reserve may take the whole context, exactly
    need = len(tok.render_chat([history[-1]], add_generation_prompt=True))
    ids, dropped = fit_history(tok, history, need, reserve=4)
    assert (len(ids), dropped) == (need, 4)
    with pytest.raises(FrawdError):
        fit_history(tok, history, need - 1, reserve=4)


def test_history_keeps_every_system_message_wherever_it_stands():
    """Only a first system message was kept: one after some turns (which OpenAI's API
    allows) was dropped with them, and a second one at the start too."""
    from frawdllm.infer.chat import fit_history

    tok = train_tokenizer([ALPHABET], kind="char")

    def turn(role, content):
        return {"role": role, "content": content}

    old = [turn("user", "aaaa"), turn("assistant", "bbbb")]
    newest = turn("user", "cc")
    for messages, kept in [
        ([*old, turn("system", "s"), turn("user", "d"), turn("assistant", "e"), newest], [2, 5]),
        ([turn("system", "s"), turn("system", "h"), *old, newest], [0, 1, 4]),
        ([*old, turn("system", "s"), turn("system", "h"), newest], [2, 3, 4]),
    ]:
        want = [messages[i] for i in kept]
        budget = len(tok.render_chat(want))
        ids, dropped = fit_history(tok, messages, budget + 4, reserve=4)
        assert ids == tok.render_chat(want) and dropped == len(messages) - len(kept), (messages, tok.decode(ids))
        assert fit_history(tok, messages, budget + 3, reserve=4)[0] == ids  # too short for more: the same
    greeted = [turn("assistant", "bbbb"), turn("user", "d"), turn("assistant", "e"), newest]  # (opens with an answer)
    budget = len(tok.render_chat(greeted[1:]))
    assert fit_history(tok, greeted, budget + 4, reserve=4) == (tok.render_chat(greeted[1:]), 1)
    systems = [turn("system", "a" * 5), turn("system", "b" * 5)]
    need = len(tok.render_chat([*systems, turn("user", "")]))
    with pytest.raises(FrawdError, match=f"^the system messages need {need} tokens .*shorten them$"):
        fit_history(tok, [systems[0], *old, systems[1], newest], need - 1, reserve=4)


def test_fitting_a_long_history_tokenizes_each_message_a_bounded_number_of_times():
    """fit_history rendered the whole remaining chat again for each start it tried: 4000
    short messages took 18 s in the server's event loop. Now each message is tokenized once
    (a long pasted message was tokenized three times before it was refused), and the result
    is what rendering the kept messages gives."""
    from frawdllm.infer.chat import fit_history

    tok = train_tokenizer([ALPHABET], kind="char")
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(1000):
        messages += [{"role": "user", "content": f"q{i % 7}"}, {"role": "assistant", "content": "a" * (i % 5)}]
    messages.append({"role": "user", "content": "last"})
    encoded = []
    real_encode = tok.encode
    tok.encode = lambda text: encoded.append(text) or real_encode(text)
    ids, dropped = fit_history(tok, messages, 64, reserve=16)
    tok.encode = real_encode
    assert encoded == [m["content"] for m in messages]
    kept = [messages[0]] + messages[1 + dropped:]
    assert ids == tok.render_chat(kept, add_generation_prompt=True) and len(ids) <= 64 - 16
    earlier = [messages[0]] + messages[1 + dropped - 2:]  # from the user turn before: too long
    assert kept[1]["role"] == "user" and earlier[1]["role"] == "user" and len(tok.render_chat(earlier)) > 64 - 16


def test_quit_ends_the_line_and_a_system_message_too_long_is_named_at_start(chat_model, capsys):
    import subprocess

    # (piped from a file with a byte-order mark: "\ufeff/quit" was a message to the model, not /quit)
    done = subprocess.run([FRAWD, "chat", "--model", str(chat_model), "--threads", "1"],
                          input="\ufeff/quit\n".encode(), capture_output=True, timeout=120)
    assert done.returncode == 0 and done.stdout.endswith(b"> /quit\n"), done.stdout  # the shell prompt on its own line
    assert done.stdout.count(b"> ") == 1, done.stdout  # no reply: it quit at the first line
    # (refused before it reads anything: in this process, without a fresh interpreter's `import torch`)
    code, out, err = run_cli(capsys, "chat", "--model", chat_model, "--threads", "1", "--max-new-tokens", "8",
                             "--system", "abc " * 39 + "abc")
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        "frawd: error: --system needs 165 tokens with the template (an empty user message included) but the "
        "model's context leaves 120 (context 128 - 8 for the reply); shorten it"]
    child = spawn(chat_model, "--max-new-tokens", "8")
    assert "error: the system message needs 165 tokens" in say(child, "/system " + "abc " * 39 + "abc")
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_generation_config_cannot_make_chat_sample_twice_or_skip_eos(chat_model, tmp_path):
    """num_samples: 2 in generation_config.json streamed both samples' chunks, interleaved,
    into one reply (and the history); logprobs and ignore_eos came through too."""
    import json
    import shutil

    model_dir = shutil.copytree(chat_model, tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"num_samples": 2, "logprobs": 3, "ignore_eos": True, "temperature": 0, "max_new_tokens": 12}))
    child = spawn(model_dir)
    reply = say(child, "he fed a badge")
    assert reply == expected_reply(chat_model, [{"role": "user", "content": "he fed a badge"}], 12)
    shown = say(child, "/params")
    assert "max_new_tokens=12" in shown and not re.search(r"num_samples|logprobs|ignore_eos", shown)
    assert "error: logprobs cannot be changed here: chat does not show log-probabilities" in \
        say(child, "/params logprobs=2")
    assert "error: ignore_eos cannot be changed here: a reply ends at <|eos|>" in say(child, "/params ignore_eos=true")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_a_line_that_is_not_utf8_in_a_terminal_is_refused_and_the_chat_goes_on(chat_model):
    """A bad paste ended the whole session ("standard input is not UTF-8 text")."""
    child = pexpect.spawn(FRAWD, ["chat", "--model", str(chat_model), "--threads", "1", "--temperature", "0",
                                  "--max-new-tokens", "12"], encoding="utf-8", codec_errors="replace",
                          timeout=60, dimensions=(40, 2000), preexec_fn=default_sigint)
    child.expect_exact("> ")
    import os

    os.write(child.child_fd, b"ab\xff\xfecd\r")
    child.expect_exact("error: that message is not UTF-8 text; not sent\r\n> ")
    assert say(child, "he fed a badge") == expected_reply(chat_model, [{"role": "user", "content": "he fed a badge"}], 12)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_system_message_with_characters_the_tokenizer_lacks_is_noted(chat_model):
    child = pexpect.spawn(FRAWD, ["chat", "--model", str(chat_model), "--threads", "1", "--system", "be ~nice"],
                          encoding="utf-8", timeout=60, dimensions=(40, 2000), preexec_fn=default_sigint)
    child.expect_exact("Ctrl-D to leave.\r\n(not in the tokenizer's vocabulary, seen as <|unk|>: 'n~')\r\n> ")
    assert say(child, "/system be ~kind") == ("(system message set)\r\n"
                                              "(not in the tokenizer's vocabulary, seen as <|unk|>: 'kn~')")
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_sigterm_ends_chat_at_the_prompt_and_during_a_reply(chat_model):
    """SIGTERM (kill, timeout) was taken for Ctrl-C: "^C" at the prompt, "[stopped]" during
    a reply, and the chat went on. It now ends the command, with the status Ctrl-C gives
    elsewhere (130), while Ctrl-C still only stops a reply (the test above)."""
    import subprocess

    child = spawn(chat_model, "--temperature", "0", "--max-new-tokens", "1000000", "--overflow", "slide")
    child.kill(signal.SIGTERM)
    child.expect(pexpect.EOF, timeout=20)
    child.close()
    assert child.exitstatus == 130 and "^C" not in child.before
    child = spawn(chat_model, "--temperature", "0", "--max-new-tokens", "1000000", "--overflow", "slide")
    child.sendline("write forever")
    child.expect_exact("write forever\r\n")
    child.expect(REPLY + "{30}")  # the reply is streaming
    child.kill(signal.SIGTERM)
    child.expect(pexpect.EOF, timeout=20)
    child.close()
    assert child.exitstatus == 130 and "[stopped]" not in child.before
    # piped input that stays open (`(sleep 30) | timeout 10 frawd chat`): it waited for the end of stdin
    with subprocess.Popen([FRAWD, "chat", "--model", str(chat_model), "--threads", "1"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        try:
            assert process.stdout.read(len(b"frawd chat:")) == b"frawd chat:"  # started: its handler is set
            process.terminate()
            assert process.wait(timeout=20) == 130
        finally:
            process.kill()
        assert process.stderr.read().decode().strip() == "aborted"


def seeded_reply(model_dir, messages, seed, max_new_tokens):
    engine = Engine(FrawdLLM.from_pretrained(model_dir), Tokenizer.load(model_dir))
    ids = engine.tokenizer.render_chat(messages, add_generation_prompt=True)
    params = SamplingParams(temperature=1, seed=seed, max_new_tokens=max_new_tokens, stop_token_ids=ROLE_TOKEN_IDS)
    return engine.generate([ids], params)[0].text


def test_with_a_seed_each_reply_draws_fresh_numbers_and_the_session_repeats(chat_model):
    """Every reply drew from the same seed, so replies to different messages shared long
    identical tails. Reply k of a session draws as sample k of `frawd generate --seed S`
    (seed S + k x SEED_STRIDE); /reset and /params seed= start the count again."""
    from frawdllm.infer.sampling import sample_seed

    child = spawn(chat_model, "--temperature", "1", "--max-new-tokens", "40", "--seed", "7")
    first = say(child, "he fed a badge")
    assert first == seeded_reply(chat_model, [{"role": "user", "content": "he fed a badge"}], 7, 40)
    history = [{"role": "user", "content": "he fed a badge"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "a bad deed"}]
    second = say(child, "a bad deed")
    assert second == seeded_reply(chat_model, history, sample_seed(7, 1), 40)
    assert second != seeded_reply(chat_model, history, 7, 40)  # (what it drew before)
    assert "(conversation cleared)" in say(child, "/reset")
    third = say(child, "a bad deed")
    assert third == seeded_reply(chat_model, [{"role": "user", "content": "a bad deed"}], 7, 40)
    history = [{"role": "user", "content": "a bad deed"}, {"role": "assistant", "content": third},
               {"role": "user", "content": "he fed a badge"}]
    assert "seed=3" in say(child, "/params seed=3")  # (no /reset: the count starts again all the same)
    assert say(child, "he fed a badge") == seeded_reply(chat_model, history, 3, 40)
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_system_alone_removes_the_system_message(chat_model):
    child = spawn(chat_model, "--temperature", "0", "--max-new-tokens", "30", "--system", "be a bee")
    assert "(system message removed)" in say(child, "/system")
    assert say(child, "he fed a badge") == expected_reply(chat_model, [{"role": "user", "content": "he fed a badge"}],
                                                          30)
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_a_reply_cut_off_at_the_context_says_so(chat_model):
    """With --overflow stop a reply that reached the context ended without a word (generate
    prints a note naming --overflow slide)."""
    child = spawn(chat_model, "--temperature", "0", "--max-new-tokens", "200")
    reply = say(child, "he fed a badge")
    # 18 prompt tokens (<|bos|><|user|>, 14 characters, <|eos|><|assistant|>): 128 - 18 + 1 new ones
    assert reply == expected_reply(chat_model, [{"role": "user", "content": "he fed a badge"}], 200)[:111] + (
        "\r\n(the reply stopped at the model's context of 128 tokens after 111 new tokens, short of "
        "--max-new-tokens 200; --overflow slide keeps going)")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child = spawn(chat_model, "--temperature", "0", "--max-new-tokens", "200", "--overflow", "slide")
    reply = say(child, "he fed a badge")
    assert re.fullmatch(REPLY + "{200}", reply)  # the whole reply, and no note
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_a_piped_conversation_reads_as_a_transcript(chat_model):
    """Piped input is not echoed by a terminal: each message is written after its prompt, so the
    output reads "> message", then the reply (it read "> reply", the messages lost)."""
    import subprocess

    done = subprocess.run([FRAWD, "chat", "--model", str(chat_model), "--threads", "1", "--max-new-tokens", "4",
                           "--temperature", "0"], input=b"hello there\n/params\n", capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode()
    assert out.split("\n")[1] == "> hello there", out
    assert "\n> /params\nmax_new_tokens=4  temperature=0.0  " in out, out  # (after the reply's line)
    assert out.endswith("\n> \n"), out  # (the end of input: the prompt's line ended)



def test_a_history_that_fits_exactly_is_kept_whole_even_when_it_opens_with_a_reply():
    """A conversation that opens with the assistant's greeting and fills context - reserve
    exactly is kept as it is: nothing needs dropping (dropping started at the first user turn)."""
    from frawdllm.infer.chat import fit_history

    tok = train_tokenizer([ALPHABET], kind="char")
    greeted = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "abc"},
               {"role": "assistant", "content": "de"}, {"role": "user", "content": "f"}]
    full = tok.render_chat(greeted, add_generation_prompt=True)
    assert fit_history(tok, greeted, len(full) + 4, reserve=4) == (full, 0)
    assert fit_history(tok, greeted, len(full) + 3, reserve=4) == (tok.render_chat(greeted[1:], add_generation_prompt=True), 1)


def test_a_system_message_that_leaves_exactly_the_room_asked_is_accepted():
    """check_system_message refuses only a system message (with an empty user turn and the
    template) longer than context - reserve; one that fills it exactly is accepted."""
    from frawdllm.infer.chat import check_system_message

    tok = train_tokenizer([ALPHABET], kind="char")
    need = len(tok.render_chat([{"role": "system", "content": "be a bee"}, {"role": "user", "content": ""}],
                               add_generation_prompt=True))
    check_system_message(tok, "be a bee", need + 8, reserve=8)  # fits exactly: no error
    check_system_message(tok, "be a bee", need, reserve=0)
    with pytest.raises(FrawdError, match=f"needs {need} tokens .* leaves {need - 1} "):
        check_system_message(tok, "be a bee", need + 7, reserve=8)


def test_a_late_system_message_followed_by_a_reply_is_not_a_place_to_start():
    """The kept history restarts at a user turn only: restarting at a system message that
    an assistant turn follows would keep that reply without its question."""
    from frawdllm.infer.chat import fit_history

    tok = train_tokenizer([ALPHABET], kind="char")
    messages = [{"role": "user", "content": "aaaa"}, {"role": "assistant", "content": "bbbb"},
                {"role": "system", "content": "s"}, {"role": "assistant", "content": "eeee"},
                {"role": "user", "content": "cc"}]
    room = len(tok.render_chat(messages[2:], add_generation_prompt=True))  # fits, but starts at a system turn
    ids, dropped = fit_history(tok, messages, room + 4, reserve=4)
    assert (ids, dropped) == (tok.render_chat([messages[2], messages[4]], add_generation_prompt=True), 3)



def test_a_system_message_too_long_for_slash_system_keeps_the_one_before(chat_model, capsys):
    """/system with a message that leaves no room is refused and changes nothing."""
    from frawdllm.cli.chat import _Repl

    engine = Engine(FrawdLLM.from_pretrained(chat_model), Tokenizer.load(chat_model))
    repl = _Repl(engine, SamplingParams(temperature=0, max_new_tokens=8), "be a bee", str(chat_model))
    repl.command("/system " + "abc " * 39 + "abc")
    assert "error: the system message needs 165 tokens" in capsys.readouterr().out
    assert repl.system == "be a bee"


def test_chat_stops_a_reply_at_every_role_token_whatever_the_flags(chat_model, capsys, monkeypatch):
    """A role token inside a reply is the model writing the next turn: chat adds them to the
    stop ids even when --stop-token-ids / generation_config name others."""
    from frawdllm.cli import chat as chat_cli

    seen = []
    monkeypatch.setattr(chat_cli._Repl, "run", lambda self: seen.append(self.params))
    code, _, err = run_cli(capsys, "chat", "--model", chat_model, "--threads", "1")
    assert code == 0, err
    assert set(ROLE_TOKEN_IDS) <= set(seen[0].stop_token_ids)


def test_piped_input_that_is_not_utf8_ends_chat_with_one_error(chat_model):
    """Piped (not a terminal): a line that is not UTF-8 is an error that ends the command (in a
    terminal it is refused and the chat goes on)."""
    done = subprocess.run([FRAWD, "chat", "--model", str(chat_model), "--threads", "1", "--max-new-tokens", "4",
                           "--temperature", "0"], input=b"ab\xff\xfecd\nhello\n", capture_output=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.decode().strip().splitlines() == ["frawd: error: standard input is not UTF-8 text"]
    assert b"not sent" not in done.stdout


def test_the_repl_keeps_several_whole_exchanges_after_dropping(tmp_path, capsys):
    """With short messages several exchanges fit: after dropping, the REPL's history is the
    newest of them, starting at a user turn, exactly what fit_history kept (with one exchange
    fitting, as in test_the_repl_keeps_the_newest_whole_exchanges_that_fit, an off-by-one in
    the trimming went unseen)."""
    from frawdllm.cli.chat import _Repl

    model_dir = save_chat_model(tmp_path / "small", context_length=64)
    engine = Engine(FrawdLLM.from_pretrained(model_dir), Tokenizer.load(model_dir))
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=ROLE_TOKEN_IDS)
    repl = _Repl(engine, params, "ab", str(model_dir))
    everything, longest = [], 0
    for i in range(8):
        message = f"ab {'abcdefgh'[i]}"
        repl.reply(message)
        everything += [{"role": "user", "content": message}, repl.turns[-1]]
        assert repl.turns[0]["role"] == "user" and repl.turns == everything[-len(repl.turns):]
        assert repl.turns[-1]["content"] == expected_reply(model_dir, [{"role": "system", "content": "ab"}]
                                                           + repl.turns[:-1], 6)
        longest = max(longest, len(repl.turns))
    assert len(repl.turns) < len(everything) and longest >= 4  # it dropped, and kept more than one exchange
