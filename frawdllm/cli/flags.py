"""Every field of a config dataclass as a command-line flag.

`dataclass_options(PretrainConfig)` adds `--batch-size`, `--max-time`, `--compile/--no-compile`
... one per field, with the field's help text and its default shown. Each flag's click
default is None, meaning "not given", so a value from a `--config` file is overridden
only by flags that were actually typed (see `train.config.build_config`).
"""

from __future__ import annotations

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
        for f in reversed(fields(cls)):
            kind = _base_type(hints[f.name])
            if f.name in skip or kind in (dict, list):
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else None
            help_text = f.metadata.get("help", "")
            if default is not None and kind is not bool:
                help_text += f"  [default: {default}]"
            if kind is bool:
                decl = f"{flag}/--no-{f.name.replace('_', '-')}"
                command = click.option(decl, f.name, default=None, help=help_text + (
                    "  [default: on]" if default else "  [default: off]"))(command)
            else:
                click_type = {int: int, float: float}.get(kind, str)
                command = click.option(flag, f.name, type=click_type, default=None, help=help_text)(command)
        return command

    return decorate
