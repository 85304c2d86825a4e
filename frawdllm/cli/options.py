"""Options shared by several commands, and a model config from a preset and --set overrides."""

from __future__ import annotations

import math
from typing import Any

import click

from ..config import ModelConfig, config_class, get_config, parse_overrides


class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses nan (which passes every range: its comparisons are all
    false) and inf."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        return number


def preset_option():
    return click.option("--preset", default="tiny", show_default=True,
                        help="Model preset: tiny, small, base, 100m, tiny-llama, small-llama; "
                             "encoder-decoder: aiayn-tiny, aiayn-base, aiayn-big.")


def set_option():
    return click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE",
                        help="Override a ModelConfig field (repeatable), e.g. --set n_layer=4.")


def model_config_from(preset: str, overrides: tuple[str, ...] | list[str] = (), **extra: Any) -> ModelConfig:
    values = parse_overrides(config_class(preset), list(overrides))
    values.update({k: v for k, v in extra.items() if v is not None})
    return get_config(preset, **values)
