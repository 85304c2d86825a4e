"""The `frawd` command.

Each subcommand lives in its own module here and is imported only when used, so
`frawd --help` stays fast and torch is loaded only by commands that need it. A
`FrawdError` (bad input), an `OSError` (an unwritable folder, a full disk) or running out
of memory becomes one line on stderr and exit status 1.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import signal
import sys
from collections.abc import Iterator
from typing import Any

import click

from ..errors import FrawdError, RankLost

# command name -> (module in frawdllm.cli, attribute, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "info": ("info", "info", "Parameters, FLOPs per token and memory of a model config."),
    "tokenizer": ("tokenizer", "tokenizer", "Train tokenizers (BPE, char, byte)."),
    "data": ("data", "data", "Prepare corpora into memory-mapped token shards."),
    "pretrain": ("pretrain", "pretrain", "Pretrain a language model, or train an existing one further."),
    "sft": ("sft", "sft", "Fine-tune a model on conversations (supervised), LoRA optional."),
    "dpo": ("sft", "dpo", "Align a model with preference pairs (DPO / IPO)."),
    "eval": ("evaluate", "evaluate", "Loss, perplexity and bits per byte of a model on held-out data."),
    "generate": ("generate", "generate", "Generate text from a prompt."),
    "chat": ("chat", "chat", "Chat with a model in the terminal."),
    "export": ("export", "export", "Export a model to Hugging Face transformers or GGUF."),
    "import": ("import_", "import_", "Import a Hugging Face transformers checkpoint or a GGUF file."),
    "serve": ("serve", "serve", "Serve models over an OpenAI-compatible API, with a chat page."),
    "translate": ("translate", "translate", "Train, evaluate and run encoder-decoder translation models."),
}


def _available(name: str) -> bool:
    return importlib.util.find_spec(f"{__name__}.{COMMANDS[name][0]}") is not None


class ReaderLeft(Exception):
    """stdout's reader has gone (`frawd ... | head`). Not an OSError, so that it gets past
    click, which would turn the BrokenPipeError into a silent exit 1."""


class LazyGroup(click.Group):
    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:  # (--help, --version print here)
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:
            raise ReaderLeft from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # piped output is buffered: a reader that left shows up here, not at exit
            return result
        except BrokenPipeError:
            raise ReaderLeft from None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if _available(name)]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not _available(name):
            return None
        module_name, attr, _ = COMMANDS[name]
        module = importlib.import_module(f"{__name__}.{module_name}")
        return getattr(module, attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="frawdllm")
def cli() -> None:
    """FrawdLLM: build, pretrain, evaluate, generate with, chat with, export and import small
    transformer language models."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def describe_os_error(exc: OSError) -> str:
    """An OSError as one line that names the file: "permission denied: out/model"."""
    from ..io import disk_full_error, is_disk_full

    name = exc.filename
    if is_disk_full(exc) and name is not None:
        return str(disk_full_error(name, exc))
    reason = (exc.strerror or str(exc) or type(exc).__name__).lower()
    if name is None:
        return reason
    if exc.filename2 is not None:
        return f"{reason}: {name} -> {exc.filename2}"
    return f"{reason}: {name}"


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """The project's own warnings as one `warning: ...` line (not Python's file:line: source
    form, which reads as a crash); other libraries' keep theirs."""
    if category is UserWarning and "frawdllm" in str(filename):
        print(f"warning: {message}", file=file or sys.stderr, flush=True)
    else:
        _show_warning(message, category, filename, lineno, file, line)


def one_line_warnings() -> None:
    """Show the project's own warnings as `_warning_line` does, from now on (once is enough)."""
    import warnings

    global _show_warning
    if warnings.showwarning is not _warning_line:
        _show_warning, warnings.showwarning = warnings.showwarning, _warning_line


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout, a job scheduler). A KeyboardInterrupt, so every command tidies
    up as it does for Ctrl-C; a command where Ctrl-C only cancels (chat) tells them apart."""


def _terminated(signum, frame) -> None:
    raise Terminated


_terminal_fds: list[int] = []  # stdout and stderr, where they were a terminal at the start


def _hung_up(signum, frame) -> None:
    """SIGHUP (the terminal closed, ssh dropped): do what SIGTERM does now (tidy up and end,
    or a trainer's checkpoint first, a server's drain). The terminal is gone, and writing to
    it would fail and cut that short: what is still printed goes to /dev/null instead."""
    for fd in _terminal_fds:
        _to_devnull(fd)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
        raise Terminated
    signal.raise_signal(signal.SIGTERM)


def _to_devnull(fd: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _reader_left() -> None:
    """stdout's reader has gone (`frawd ... | head`): exit quietly, as a program killed by
    SIGPIPE does (`yes | head -1` gives 141), so a pipeline knows the output was cut short.
    What Python still holds for stdout goes to /dev/null, so its flush at exit cannot fail
    again with "Exception ignored ... BrokenPipeError"."""
    try:
        _to_devnull(sys.stdout.fileno())
    except (AttributeError, ValueError, OSError):  # (a stdout that is not a file: nothing to redirect)
        pass
    sys.exit(128 + signal.SIGPIPE)


_OUT_OF_MEMORY = ("can't allocate memory", "not enough memory", "out of memory")


def _out_of_memory(exc: BaseException) -> str | None:
    """The one-line message for an allocation that failed (Python's MemoryError, torch's
    allocators' RuntimeError), or None for any other error."""
    if isinstance(exc, MemoryError):
        said = str(exc)
    elif isinstance(exc, RuntimeError) and any(text in str(exc) for text in _OUT_OF_MEMORY):
        said = str(exc).strip().splitlines()[0]
        said = re.sub(r"^\[enforce fail at [^\]]*\] \S*\. ", "", said)  # torch's source line: not the user's concern
    else:
        return None
    said = f": {_one_line(said)}" if said.strip() else ""
    return f"out of memory{said}; try a smaller --batch-size or model, or a machine with more memory"


_called_at: float | None = None  # main(ARGS) called from a running program: when (perf_counter)


def command_started_at() -> float:
    """When this command started, for --max-time: the process's start (its `import torch`
    included) when the process is the command, else when main() was called (a program, a
    test or a notebook calling main(ARGS) long after its own start)."""
    if _called_at is not None:
        return _called_at
    from ..train.device import process_started_at

    return process_started_at()


# Options that name a file or folder. Given empty (`--data "$UNSET"`), each meant the current
# folder, silently: `data prepare --data ''` tokenized whatever the working folder held.
PATH_OPTIONS = frozenset({"--data", "--out", "--model", "--tokenizer", "--src", "--tgt", "--ref", "--valid-src",
                          "--valid-tgt", "--init", "--init-from", "--config", "--hyp-out", "--prompt-file",
                          "--from-hf"})


_UNDECODED = re.compile("[\udc80-\udcff]")  # the bytes of an argument that were not UTF-8 (surrogateescape)


def _path_option_values(args: list[str], missing: str) -> Iterator[tuple[str, str]]:
    """(option, value) of each of PATH_OPTIONS in `args` (`--opt=V` or `--opt V`; `missing`
    where the value is absent), up to `--`."""
    for i, arg in enumerate(args):
        if arg == "--":
            return
        name, eq, value = arg.partition("=")
        if name in PATH_OPTIONS:
            yield name, value if eq else args[i + 1] if i + 1 < len(args) else missing


def undecoded_path_option(args: list[str]) -> tuple[str, str] | None:
    """(option, value) of the first of PATH_OPTIONS whose value is not valid UTF-8, if any."""
    return next(((name, value) for name, value in _path_option_values(args, "") if _UNDECODED.search(value)), None)


def home_expanded(args: list[str]) -> list[str]:
    """`--out=~/x` with ~ expanded, as the shell expands `--out ~/x` (it leaves a `~` after
    `=` alone: a folder named `~` in the working directory)."""
    out = []
    for arg in args:
        if arg == "--":
            return out + args[len(out):]
        name, eq, value = arg.partition("=")
        out.append(f"{name}={os.path.expanduser(value)}" if eq and name in PATH_OPTIONS and value.startswith("~")
                   else arg)
    return out


def empty_path_option(args: list[str]) -> str | None:
    """The first of PATH_OPTIONS given an empty value in `args`, if any."""
    return next((name for name, value in _path_option_values(args, "x") if not value.strip()), None)


_THREAD_COUNT = re.compile(r"\s*[1-9][0-9]*\s*(,\s*[1-9][0-9]*\s*)*")  # what OpenMP reads: 4, or 4,2 (nested levels)


def check_thread_count_env() -> None:
    """OMP_NUM_THREADS as OpenMP will read it when torch loads. Set empty (`OMP_NUM_THREADS=$UNSET`)
    it means unset; set to what is not a count (0, -1, abc) it is refused here in one line:
    OpenMP would print its own "Invalid value" warning into the command's output and ignore it."""
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None or "torch" in sys.modules:  # (OpenMP has read it already)
        return
    if not value.strip():
        del os.environ["OMP_NUM_THREADS"]
    elif not _THREAD_COUNT.fullmatch(value):
        raise FrawdError(f"OMP_NUM_THREADS={value!r} is not a thread count: give a number from 1 "
                         "(or a list such as 2,1), or unset it")


def say_error(message: str, lost: bool = False) -> None:
    """`frawd: error: MESSAGE` on stderr; on a rank that `--nproc` started, in a file for the
    launcher instead, which says each different error once (N ranks refusing the same data
    printed it N times, then torchrun's report of the failed ranks). `lost`: the error is
    another rank's leaving (`RankLost`), said only when no rank said why it left."""
    from .launch import leave_for_launcher

    if leave_for_launcher("lost" if lost else "rank", message):
        return
    click.echo(f"frawd: error: {message}", err=True)


def main(argv: list[str] | None = None) -> None:
    import time

    global _called_at
    _called_at = None if argv is None else time.perf_counter()

    # A closed descriptor (`frawd info >&-`, `frawd chat <&-`) is None in sys: tracebacks in
    # every command that prints or reads. It reads as empty and writes go nowhere instead.
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, mode, encoding="utf-8"))  # noqa: SIM115 (for the process)
    # Output that the terminal's encoding cannot show (PYTHONIOENCODING=latin-1, a C locale)
    # is written as \u65e5 escapes instead of crashing the command.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # (commands that drain install their own)
        signal.signal(signal.SIGTERM, _terminated)
    # `nohup frawd ...` ignores SIGHUP, and so must we; else a hangup ends the command as SIGTERM
    # does (under torchrun the trainer takes it over during training: its launcher died).
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        _terminal_fds[:] = [fd for fd in (1, 2) if os.isatty(fd)]
        signal.signal(signal.SIGHUP, _hung_up)

    one_line_warnings()
    try:
        args = home_expanded(sys.argv[1:] if argv is None else list(argv))
        check_thread_count_env()
        empty = empty_path_option(args)
        if empty is not None:
            raise click.UsageError(f"{empty} is empty: give a path (an unset shell variable?)")
        undecoded = undecoded_path_option(args)
        if undecoded is not None:  # (Python keeps such bytes as lone surrogates: files written with them fail)
            raise FrawdError(f"{undecoded[0]} {ascii(undecoded[1])} is not valid UTF-8 (a name in another "
                             "encoding?): rename the file or folder")
        cli.main(args=args, prog_name="frawd", standalone_mode=False)
    except FrawdError as exc:
        say_error(_one_line(exc), lost=isinstance(exc, RankLost))
        sys.exit(1)
    except ReaderLeft:
        _reader_left()
    except OSError as exc:  # an unwritable --out, a file where a folder is needed, a full disk
        say_error(_one_line(describe_os_error(exc)))
        sys.exit(1)
    except click.exceptions.Abort:
        from .launch import rank_stopped

        # (under --nproc the launcher says it, after any rank's error; under torchrun every rank
        # gets the Ctrl-C: one line)
        if not rank_stopped("aborted") and os.environ.get("RANK", "0") == "0":
            click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:  # a bad flag or value: one line, like every other error
        if type(exc).__name__ == "NoArgsIsHelpError":  # `frawd` alone, or a group alone: its help
            exc.show()
            sys.exit(exc.exit_code)
        where = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
        click.echo(f"frawd: error: {_one_line(exc.format_message())}{where}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        from .launch import rank_stopped

        if not rank_stopped("interrupted"):
            click.echo("interrupted", err=True)
        sys.exit(130)
    except RecursionError:  # (a RuntimeError: before the bug-traceback rule below)
        say_error("an input file nests too deeply to read (JSON or YAML of thousands of levels: "
                  "Python's recursion limit); no FrawdLLM file does")
        sys.exit(1)
    except (MemoryError, RuntimeError) as exc:
        message = _out_of_memory(exc)
        if message is None:  # any other RuntimeError is a bug: its traceback
            raise
        say_error(message)
        sys.exit(1)
    finally:
        if argv is None:  # the process is this command: it ends now
            # Python's collections at exit walk every object torch and the rest created
            # (0.5-1 s of a command's wall time, outside --max-time's reach); freezing them
            # skips that work. Files are flushed and closed by refcounting as before.
            import gc

            gc.freeze()
