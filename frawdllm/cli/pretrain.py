"""`frawd pretrain`: train a language model from scratch on a corpus."""

from __future__ import annotations

import click

from ..train.config import PretrainConfig
from .flags import dataclass_options
from .options import set_option


@click.command(context_settings={"max_content_width": 110})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="A YAML file of the options below (flags given here override it).")
@set_option()
@dataclass_options(PretrainConfig)
def pretrain(config_file: str | None, overrides: tuple[str, ...], **flags) -> None:
    """Pretrain a model on --data until a budget (--max-steps, --max-tokens, --max-time) is spent.

    Trains (or reuses) a tokenizer, tokenizes the corpus into OUT/data, then runs the
    training loop. OUT ends up with config.yaml, metrics.jsonl, loss.png, samples.txt,
    checkpoints/ (the last few and the best) and model/ (the best model directory,
    tokenizer.json included, usable by every other command). Ctrl-C saves a checkpoint;
    --resume continues from it. --init-from DIR trains an existing model directory further
    (its config and tokenizer, a fresh optimizer). Settings are checked before any work:
    a bad start fails at once and leaves nothing behind.

    \b
    Examples:
      frawd pretrain --preset tiny --data stdlib --max-time 5m --out runs/stdlib
      frawd pretrain --config configs/shakespeare_char.yaml --max-time 100s --out runs/shakespeare
      frawd pretrain --out runs/shakespeare --resume --max-time 200s
      frawd pretrain --init-from runs/shakespeare/model --data more.txt --max-steps 500 --out runs/more
    """
    from ..config import parse_overrides, ModelConfig
    from ..errors import FrawdError
    from ..train.config import build_config
    from ..train.pretrain import run_pretraining

    cfg = build_config(PretrainConfig, config_file, flags, parse_overrides(ModelConfig, list(overrides)))
    if cfg.init_from is not None and flags.get("preset") is not None:
        raise FrawdError("--preset and --init-from both choose the model; give one")
    result = run_pretraining(cfg)
    click.echo(result.summary())
    if result.stop_reason == "interrupted":
        click.echo(f"interrupted: checkpoint {result.checkpoint}; continue with "
                   f"frawd pretrain --out {cfg.out} --resume", err=True)
        raise SystemExit(130)
