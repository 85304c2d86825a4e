"""The `frawd` command.

Each subcommand lives in its own module here and is imported only when used, so
`frawd --help` stays fast and torch is loaded only by commands that need it. A
`FrawdError` (bad input) or an `OSError` (an unwritable folder, a full disk) becomes one
line on stderr and exit status 1.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import click

from ..errors import FrawdError

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
    "import": ("import_", "import_", "Import a Hugging Face transformers checkpoint."),
    "serve": ("serve", "serve", "Serve models over an OpenAI-compatible API, with a chat page."),
    "translate": ("translate", "translate", "Train, evaluate and run encoder-decoder translation models."),
}


def _available(name: str) -> bool:
    return importlib.util.find_spec(f"{__name__}.{COMMANDS[name][0]}") is not None


class LazyGroup(click.Group):
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


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout, a job scheduler). A KeyboardInterrupt, so every command tidies
    up as it does for Ctrl-C; a command where Ctrl-C only cancels (chat) tells them apart."""


def _terminated(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> None:
    import signal
    import warnings

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # (commands that drain install their own)
        signal.signal(signal.SIGTERM, _terminated)

    global _show_warning
    if warnings.showwarning is not _warning_line:
        _show_warning, warnings.showwarning = warnings.showwarning, _warning_line
    try:
        cli.main(args=argv, prog_name="frawd", standalone_mode=False)
    except FrawdError as exc:
        click.echo(f"frawd: error: {_one_line(exc)}", err=True)
        sys.exit(1)
    except BrokenPipeError:
        sys.exit(0)
    except OSError as exc:  # an unwritable --out, a file where a folder is needed, a full disk
        click.echo(f"frawd: error: {_one_line(describe_os_error(exc))}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        if os.environ.get("RANK", "0") == "0":  # (under torchrun every rank gets the Ctrl-C: one line)
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
        click.echo("interrupted", err=True)
        sys.exit(130)
    finally:
        if argv is None:  # the process is this command: it ends now
            # Python's collections at exit walk every object torch and the rest created
            # (0.5-1 s of a command's wall time, outside --max-time's reach); freezing them
            # skips that work. Files are flushed and closed by refcounting as before.
            import gc

            gc.freeze()
