"""Options shared by several commands, and config assembly from presets/files/--set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..config import ModelConfig, config_class, get_config, parse_overrides
from ..errors import FrawdError


def preset_option(default: str | None = "tiny"):
    return click.option("--preset", default=default, show_default=True,
                        help="Model preset: tiny, small, base, 100m, tiny-llama, small-llama; "
                             "encoder-decoder: aiayn-tiny, aiayn-base, aiayn-big.")


def set_option():
    return click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE",
                        help="Override a ModelConfig field (repeatable), e.g. --set n_layer=4.")


def model_config_from(preset: str, overrides: tuple[str, ...] | list[str] = (), **extra: Any) -> ModelConfig:
    values = parse_overrides(config_class(preset), list(overrides))
    values.update({k: v for k, v in extra.items() if v is not None})
    return get_config(preset, **values)


def existing_path(path: str | Path, what: str = "file") -> Path:
    path = Path(path)
    if not path.exists():
        raise FrawdError(f"{what} not found: {path}")
    return path
