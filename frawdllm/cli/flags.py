"""Every field of a config dataclass as a command-line flag.

`dataclass_options(PretrainConfig)` adds `--batch-size`, `--max-time`, `--progress/--no-progress`
... one per field, with the field's help text and its default shown. A field with
auto/true/false choices (`compile`) takes a value (`--compile auto`) or none (`--compile`
= true), and `--no-compile` = false. Each flag's click
default is None, meaning "not given", so a value from a `--config` file is overridden
only by flags that were actually typed (see `train.config.build_config`).
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import MISSING, fields

import click


def _base_type(hint: object) -> object:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or \
        typing.get_origin(hint) is typing.Union else (hint,)
    concrete = [o for o in options if o is not type(None)]
    return concrete[0] if concrete else str


def dataclass_options(cls: type, skip: tuple[str, ...] = ()):
    """A decorator adding one click option per field of `cls` (dict fields excepted)."""
    hints = typing.get_type_hints(cls)

    def decorate(command):
        negatives = {}  # --no-NAME flags of auto/true/false fields: parameter -> field
        for f in fields(cls):
            if f.metadata.get("choices") and "false" in f.metadata["choices"]:
                negatives[f"no_{f.name}"] = f.name
        if negatives:
            command = _merge_negatives(command, negatives)
        for f in reversed(fields(cls)):
            kind = _base_type(hints[f.name])
            if f.name in skip or kind in (dict, list):
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else None
            help_text = f.metadata.get("help", "")
            if default is not None and kind is not bool:
                help_text += f"  [default: {default}]"
            if f.metadata.get("choices"):
                choices = f.metadata["choices"]
                if f"no_{f.name}" in negatives:
                    command = click.option(f"--no-{f.name.replace('_', '-')}", f"no_{f.name}", is_flag=True,
                                           default=False, help=f"Same as {flag} false.")(command)
                alone = {"is_flag": False, "flag_value": "true"} if "true" in choices else {}
                command = click.option(flag, f.name, type=click.Choice(choices, case_sensitive=False), default=None,
                                       help=help_text + (f"  ({flag} alone = true)" if alone else ""),
                                       **alone)(command)
            elif kind is bool:
                decl = f"{flag}/--no-{f.name.replace('_', '-')}"
                command = click.option(decl, f.name, default=None, help=help_text + (
                    "  [default: on]" if default else "  [default: off]"))(command)
            else:
                click_type = {int: click.INT, float: click.FLOAT}.get(kind, click.STRING)
                if f.metadata.get("none_clears"):
                    click_type = _OrNone(click_type)
                command = click.option(flag, f.name, type=click_type, default=None, help=help_text)(command)
        return command

    return decorate


class _OrNone(click.ParamType):
    """A value of `kind`, or `none` (kept as the word: None means "not given", and the word
    clears a config file's value, `train.config._coerce`)."""

    def __init__(self, kind: click.ParamType) -> None:
        self.kind, self.name = kind, f"{kind.name}|none"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.lower() == "none":
            return "none"
        return self.kind.convert(value, param, ctx)


def _merge_negatives(command, negatives: dict[str, str]):
    """Turn `--no-NAME` into NAME=false before the command sees its arguments."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        for flag, name in negatives.items():
            if kwargs.pop(flag, False):
                if kwargs.get(name) not in (None, "false"):
                    raise click.UsageError(f"--no-{name.replace('_', '-')} and --{name.replace('_', '-')} "
                                           f"{kwargs[name]} contradict each other")
                kwargs[name] = "false"
        return command(*args, **kwargs)

    return wrapper
