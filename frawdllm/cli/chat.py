"""`frawd chat`: talk to a model in the terminal.

A read-eval-print loop over the chat template. Each reply streams as it is generated;
Ctrl-C stops the reply (what was printed stays in the history) and returns to the
prompt; Ctrl-D or /quit leaves; SIGTERM (kill, timeout) ends the command. History that
no longer fits the context is dropped, oldest exchange first (a message with its reply),
and the REPL says so the first time.
"""

from __future__ import annotations

import sys
from dataclasses import fields

import click

from ..errors import FrawdError, check_unicode
from . import Terminated
from .terminal import for_terminal
from .sampling_flags import (check_stop_ids, context_stop_note, engine_flags, load_engine, params_from_flags,
                             sampling_flags, warn_unmatchable_stops)

PROMPT = "> "
# What chat keeps whatever generation_config.json says: each setting's value, and why
CHAT_FIXED = {"num_samples": (1, "chat replies with one sample"),
              "logprobs": (None, "chat does not show log-probabilities"),
              "ignore_eos": (False, "a reply ends at <|eos|>")}
HELP = """commands:
  /reset            forget the conversation (the system message stays)
  /system TEXT      set the system message (/system alone removes it)
  /params           show the sampling parameters; /params key=value ... changes them
  /help             this list
  /quit, /exit      leave (or Ctrl-D); Ctrl-C stops a reply
  //TEXT            send "/TEXT" as a message (a message that starts with a slash)"""


@click.command()
@engine_flags
@sampling_flags
@click.option("--system", "system_message", default=None, metavar="TEXT", help="A system message to start with.")
def chat(model_dir: str, quantize: str, dtype: str, overflow: str, native: str, compile_model: bool,
         device: str, threads: int | None, system_message: str | None, **sampling) -> None:
    """Chat with the model in --model through the chat template.

    Any model with FrawdLLM's special tokens works; a model only pretrained here has
    never seen the template, so its replies read as continuations of the text.

    Type a message and press Enter; the reply streams back. Commands: /reset,
    /system TEXT, /params [key=value ...], /help, /quit (//TEXT sends "/TEXT"). Ctrl-C
    stops the current reply, Ctrl-D leaves. With --seed S the session repeats as a whole:
    reply k draws as sample k of `frawd generate --seed S` would (/reset counts again).

    \b
    Example:
      frawd chat --model runs/shakespeare/model --temperature 0.7 --top-p 0.9
    """
    from ..infer.chat import ROLE_TOKEN_IDS, check_system_message, reply_reserve

    if system_message is not None:
        check_unicode(system_message, "--system")
    # (generation_config.json may ask for what a conversation cannot use: several samples
    # each turn, which were streamed into one reply; log-probabilities chat never shows;
    # replies that run past <|eos|>)
    params = params_from_flags(model_dir, sampling, **{key: value for key, (value, _) in CHAT_FIXED.items()})
    params = params.replace(stop_token_ids=sorted(set(params.stop_token_ids) | set(ROLE_TOKEN_IDS)))
    engine = load_engine(model_dir, quantize, dtype, overflow, compile_model, device, threads, native)
    check_stop_ids(engine, params, model_dir)
    warn_unmatchable_stops(engine, params)
    # (known before the first message: no message could be rendered)
    engine.tokenizer.require_frawd_specials(f"{model_dir}: the tokenizer", "which the chat template needs; "
                                            "frawd generate continues plain text with it")
    if system_message:
        context = engine.config.context_length
        check_system_message(engine.tokenizer, system_message, context,
                             reply_reserve(context, params.max_new_tokens), what="--system")
    _Repl(engine, params, system_message, model_dir).run()


class _Repl:
    def __init__(self, engine, params, system_message: str | None, model_dir: str) -> None:
        self.engine, self.params, self.model_dir = engine, params, model_dir
        self.system = system_message
        self.turns: list[dict] = []
        self.told_about_dropping = False
        self.replies = 0  # replies drawn since the start, /reset or /params seed=: reply k's seed comes from it

    def out(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def note_unknown(self, text: str) -> None:
        """Name the characters of a message a char-level tokenizer lacks (the model sees
        <|unk|> for them, as `frawd generate` warns)."""
        unknown = sorted(self.engine.tokenizer.unknown_characters(text))
        if unknown:
            self.out(f"(not in the tokenizer's vocabulary, seen as <|unk|>: {''.join(unknown[:20])!r})\n")

    def run(self) -> None:
        if sys.stdin.isatty():
            import readline  # noqa: F401  (line editing and history for input())
        context = self.engine.config.context_length
        self.out(f"frawd chat: {self.model_dir} (context {context} tokens). /help for commands, Ctrl-D to leave.\n")
        self.note_unknown(self.system or "")
        first = True
        while True:
            try:
                line = input(PROMPT)
                line.encode("utf-8")  # undecodable bytes come through as lone surrogates
                if first and line.startswith("\ufeff"):  # piped from a file saved with a byte-order mark
                    line = line[1:]
                first = False
                if not sys.stdin.isatty():  # (piped: a terminal echoed the message; without it the
                    self.out(f"{for_terminal(line)}\n")  # transcript read "> reply", the message lost)
            except EOFError:
                self.out("\n")
                return
            except Terminated:  # (a KeyboardInterrupt too, but SIGTERM means "end", not "cancel")
                raise
            except KeyboardInterrupt:
                self.out("^C\n")
                continue
            except UnicodeError:
                if sys.stdin.isatty():  # (a bad paste, a Latin-1 terminal: the conversation goes on)
                    self.out("error: that message is not UTF-8 text; not sent\n")
                    continue
                self.out("\n")
                raise FrawdError("standard input is not UTF-8 text") from None
            line = line.strip()
            if not line:
                continue
            try:
                if line.startswith("/") and not line.startswith("//"):
                    if self.command(line) == "quit":
                        return
                    continue
                self.reply(line[1:] if line.startswith("//") else line)
            except Terminated:
                raise
            except KeyboardInterrupt:  # before a reply began (a long paste being tokenized): not sent
                self.out(" [stopped]\n")

    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return "quit"
        if name == "/help":
            self.out(HELP + "\n")
        elif name == "/reset":
            self.turns, self.replies = [], 0  # (with --seed, replies draw as in a fresh session)
            self.out("(conversation cleared)\n")
        elif name == "/system":
            if arg:
                from ..infer.chat import check_system_message, reply_reserve

                context = self.engine.config.context_length
                try:
                    check_system_message(self.engine.tokenizer, arg, context,
                                         reply_reserve(context, self.params.max_new_tokens))
                except FrawdError as exc:
                    self.out(f"error: {exc}\n")
                    return None
            self.system = arg or None
            self.out("(system message set)\n" if arg else "(system message removed)\n")
            self.note_unknown(arg)
        elif name == "/params":
            self.set_params(arg.split())
        else:
            self.out(f"unknown command {name}; /help lists them\n")
        return None

    def set_params(self, pairs: list[str]) -> None:
        from ..config import parse_value
        from ..infer import SamplingParams

        changes = {}
        fixed = {"stop": "stop strings are set when chat starts (--stop)",
                 "stop_token_ids": "chat stops at its role tokens and <|eos|>",
                 **{key: why for key, (_, why) in CHAT_FIXED.items()}}
        settable = [f.name for f in fields(SamplingParams) if f.name not in fixed]
        try:
            for pair in pairs:
                key, sep, text = pair.partition("=")
                if not sep:
                    raise FrawdError(f"expected key=value, got {pair!r}")
                if key in fixed:
                    raise FrawdError(f"{key} cannot be changed here: {fixed[key]}")
                if key not in settable:
                    raise FrawdError(f"unknown parameter {key!r}; /params takes {', '.join(settable)}")
                changes[key] = parse_value(SamplingParams, key, text)
            self.params = self.params.replace(**changes)
            if "seed" in changes:  # the next reply draws as the first of `frawd chat --seed` would
                self.replies = 0
        except FrawdError as exc:
            self.out(f"error: {exc}\n")
            return
        shown = [f"{f.name}={getattr(self.params, f.name)}" for f in fields(self.params)
                 if f.name not in ("stop_token_ids", *CHAT_FIXED)]
        self.out("  ".join(shown) + "\n")

    def reply(self, text: str) -> None:
        from ..infer.chat import fit_history, reply_reserve
        from ..infer.sampling import sample_seed

        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.turns
        messages.append({"role": "user", "content": text})
        self.note_unknown(text)
        context = self.engine.config.context_length
        try:
            ids, dropped = fit_history(self.engine.tokenizer, messages, context,
                                       reply_reserve(context, self.params.max_new_tokens))
        except FrawdError as exc:
            self.out(f"error: {exc}\n")
            return
        if dropped:
            self.turns = self.turns[dropped:]
            if not self.told_about_dropping:
                self.out(f"(the oldest turns no longer fit the {context}-token context; dropping them as we go)\n")
                self.told_about_dropping = True
        self.turns.append({"role": "user", "content": text})
        # Reply k draws as sample k of `frawd generate --seed S` would: each reply gets fresh
        # numbers, and the session as a whole is repeatable (None stays None: fresh entropy).
        params = self.params.replace(seed=sample_seed(self.params.seed, self.replies))
        self.replies += 1
        reply, n_tokens, reason = "", 0, None
        try:
            for chunk in self.engine.stream(ids, params):
                reply += chunk.text
                n_tokens += chunk.token is not None
                reason = chunk.finish_reason or reason
                self.out(for_terminal(chunk.text))
        except Terminated:
            raise
        except KeyboardInterrupt:
            self.out(" [stopped]")
        self.out("\n")
        self.turns.append({"role": "assistant", "content": reply})
        note = context_stop_note(self.engine, params, [(reason, n_tokens)], "the reply")
        if note:  # (--overflow stop, and a reply longer than the room the history left)
            self.out(f"({note})\n")
