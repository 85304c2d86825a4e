"""`frawd generate`: text from a prompt, streamed to a terminal or as JSON for scripts."""

from __future__ import annotations

import json
import sys
import time
from typing import Any
from pathlib import Path

import click

from ..errors import FrawdError, check_unicode, counted
from .terminal import for_terminal
from .sampling_flags import (check_stop_ids, context_stop_note, engine_flags, load_engine, params_from_flags,
                             sampling_flags, warn_unmatchable_stops)


@click.command()
@engine_flags
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
              help="The prompt (repeatable: several prompts run as one batch, numbered in the order given).")
@click.option("--prompt-file", "prompt_files", multiple=True, metavar="FILE",
              help="Read a prompt from a file ('-' = standard input; repeatable, like --prompt: each file is one "
                   "more prompt of the batch, after every --prompt).")
@sampling_flags
@click.option("--num-samples", type=int, default=None,
              help="Completions per prompt (all run as one batch: bounded by memory).  [default: 1, or the "
                   "model's generation_config.json]")
@click.option("--ignore-eos/--no-ignore-eos", default=None,
              help="Go on past the end-of-sequence token, or stop there (either overrides the model's "
                   "generation_config.json).  [default: the file's, else stop]")
@click.option("--stream/--no-stream", default=None,
              help="Print text as it is generated (one prompt, one sample, not --json) [default: on when "
                   "stdout is a terminal].")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object per completion (text, tokens, finish_reason, ...), one per line.")
@click.option("--echo-prompt", is_flag=True,
              help="Print the prompt before its completion (--json: a \"prompt\" field in each object).")
@click.option("--stats", is_flag=True, help="Print token counts and speed on stderr.")
def generate(model_dir: str, quantize: str, dtype: str, overflow: str, native: str, compile_model: bool,
             device: str, threads: int | None, prompts: tuple[str, ...], prompt_files: tuple[str, ...],
             num_samples: int | None, ignore_eos: bool | None, stream: bool | None, as_json: bool,
             echo_prompt: bool, stats: bool, **sampling) -> None:
    """Continue --prompt with text from the model in --model.

    Sampling defaults come from the model's generation_config.json when it has one;
    flags override them. --temperature 0 is greedy and deterministic; --seed makes
    sampling repeatable.

    \b
    Examples:
      frawd generate --model runs/shakespeare/model --prompt "ROMEO:" --max-new-tokens 200 --overflow slide
      frawd generate --model DIR --prompt "def " --temperature 0 --json
      frawd generate --model DIR --prompt-file story.txt --top-p 0.9 --stop "THE END"
    """
    if prompt_files.count("-") > 1:
        raise FrawdError("--prompt-file - (standard input) can be given once")
    texts = list(prompts) + [_read_prompt_file(path) for path in prompt_files]
    if not texts:
        raise FrawdError("give a prompt with --prompt TEXT or --prompt-file FILE")
    for i, text in enumerate(prompts):  # (invalid UTF-8 on the command line; files are decoded strictly)
        check_unicode(text, "--prompt" if len(prompts) == 1 else f"--prompt {i + 1}")
    given = {name: value for name, value in (("num_samples", num_samples), ("ignore_eos", ignore_eos))
             if value is not None}  # (else generation_config.json's, like every sampling setting)
    params = params_from_flags(model_dir, sampling, **given)
    if params.logprobs is not None:  # (only generation_config.json can ask: generate has no such flag)
        click.echo("note: generation_config.json asks for logprobs; frawd generate prints text and token ids, "
                   "not log-probabilities (frawd serve and Engine.stream give them)", err=True)
        params = params.replace(logprobs=None)
    engine = load_engine(model_dir, quantize, dtype, overflow, compile_model, device, threads, native)
    check_stop_ids(engine, params, model_dir)
    engine.check_rows_fit([engine.encode(text) for text in texts], params, "--num-samples")
    warn_unmatchable_stops(engine, params)
    unknown = sorted(set().union(*(engine.tokenizer.unknown_characters(text) for text in texts)))
    if unknown:  # (a char tokenizer: the model sees <|unk|> for them, as data prepare and eval warn)
        shown = "".join(unknown[:20]) + (f" and {len(unknown) - 20} more" if len(unknown) > 20 else "")
        click.echo(f"warning: {len(unknown)} character(s) of the prompt are not in the tokenizer's vocabulary "
                   f"and become <|unk|>: {shown!r}", err=True)
    single = len(texts) == 1 and params.num_samples == 1
    if stream and not (single and not as_json):  # (asked for: say why it does not apply)
        why = "--json" if as_json else "several completions"
        click.echo(f"note: --stream prints one completion of one prompt as plain text; with {why} the output "
                   "comes when generation is done", err=True)
    if stream is None:
        stream = sys.stdout.isatty() and not as_json
    start = time.perf_counter()
    if stream and single and not as_json:
        if echo_prompt:
            click.echo(for_terminal(texts[0]), nl=False)
        n_tokens, reason = 0, None
        for chunk in engine.stream(texts[0], params):
            n_tokens += chunk.token is not None
            reason = chunk.finish_reason or reason
            click.echo(for_terminal(chunk.text), nl=False)
            sys.stdout.flush()
        click.echo()
        _note_context_stop(engine, params, [(reason, n_tokens)])
        _report(stats, n_tokens, time.perf_counter() - start, engine)
        return
    completions = engine.generate(texts, params)
    seconds = time.perf_counter() - start
    _note_context_stop(engine, params, [(c.finish_reason, len(c.tokens)) for c in completions])
    for c in completions:
        if as_json:
            record = {"text": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason,
                      "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.tokens),
                      "prompt_index": c.prompt_index, "sample_index": c.sample_index}
            if echo_prompt:
                record["prompt"] = texts[c.prompt_index]
            click.echo(json.dumps(record, ensure_ascii=False))
        else:
            if not single:
                click.echo(f"--- prompt {c.prompt_index + 1}, sample {c.sample_index + 1} ---")
            click.echo(for_terminal((texts[c.prompt_index] if echo_prompt else "") + c.text))
    _report(stats, sum(len(c.tokens) for c in completions), seconds, engine)


def _note_context_stop(engine: Any, params: Any, ends: list[tuple[str | None, int]]) -> None:
    """A note on stderr when a completion ended at the model's context, short of --max-new-tokens."""
    note = context_stop_note(engine, params, ends, "a completion" if len(ends) > 1 else "the completion")
    if note:
        click.echo(f"note: {note}", err=True)


def _read_prompt_file(path: str) -> str:
    """A prompt file's text ('-': standard input), byte for byte: read as bytes, so a CRLF
    stays CRLF (text mode would turn it into LF) and a byte that is not UTF-8 is named."""
    from ..data.sources import BOM

    if path == "-":
        raw, where = sys.stdin.buffer.read(), "--prompt-file - (stdin)"
    else:
        file = Path(path)
        if file.is_dir():
            raise FrawdError(f"--prompt-file {file} is a folder, not a file")
        if not file.exists():
            raise FrawdError(f"prompt file not found: {file}")
        where = f"--prompt-file {file}"
        try:  # (a pipe, /dev/stdin, <(command) read as a file is)
            raw = file.read_bytes()
        except OSError as exc:
            raise FrawdError(f"{where}: cannot read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrawdError(f"{where} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte offset "
                         f"{exc.start})") from None
    return text.removeprefix(BOM)  # (a byte-order mark is no prompt text)


def _report(stats: bool, n_tokens: int, seconds: float, engine: Any) -> None:
    if stats:
        forward = engine.describe()
        from ..train.device import DTYPES  # (torch, so not at import: `frawd --help` stays quick)

        kv = {dtype: name for name, dtype in DTYPES.items()}.get(engine.kv_dtype, str(engine.kv_dtype))
        click.echo(f"[{counted(n_tokens, 'token')} in {seconds:.2f} s, {n_tokens / max(seconds, 1e-9):.1f} tokens/s; "
                   f"forward: {forward}; KV cache {kv}]", err=True)
