"""`frawd pretrain`: train a language model from scratch on a corpus."""

from __future__ import annotations

import click

from ..train.config import PretrainConfig
from .flags import dataclass_options
from .launch import nproc_option, relaunch_under_torchrun, train_on_this_rank
from .options import set_option


@click.command(context_settings={"max_content_width": 110})
@click.option("--config", "config_file", type=str, metavar="FILE", default=None,
              help="A YAML (or .toml) file of the options below (flags given here override it).")
@click.option("--dry-run", is_flag=True, default=False,
              help="Check the settings and print the plan (device, CPU features, dtype, compile, peaks); "
                   "train nothing, write nothing.")
@nproc_option()
@set_option()
@dataclass_options(PretrainConfig)
def pretrain(config_file: str | None, overrides: tuple[str, ...], dry_run: bool, nproc: int | None,
             **flags) -> None:
    """Pretrain a model on --data until a budget (--max-steps, --max-tokens, --max-time) is spent.

    Trains (or reuses) a tokenizer, tokenizes the corpus into OUT/data, then runs the
    training loop. --max-time bounds the whole command (tokenizer, data, compile warm-up,
    evaluations, the final save). dtype and compile default to auto: decided for this
    machine by its features and by timing the first steps (--dry-run shows the plan). OUT ends up with config.yaml, metrics.jsonl, loss.png, samples.txt,
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
      frawd pretrain --nproc 4 --parallel fsdp --preset base --data stdlib --max-time 1h --out runs/base
    """
    from ..config import parse_overrides, ModelConfig
    from ..errors import FrawdError
    from ..train.config import build_config
    from . import command_started_at
    from ..train.pretrain import dry_run_plan, run_pretraining, shard_source_note, vocab_size_note

    started_at = command_started_at()  # --max-time counts the whole command
    cfg = build_config(PretrainConfig, config_file, flags, parse_overrides(ModelConfig, list(overrides)))
    if cfg.init_from is not None and flags.get("preset") is not None:
        raise FrawdError("--preset and --init-from both choose the model; give one")
    for note in (vocab_size_note(cfg), shard_source_note(cfg)):
        if note:
            click.echo(note, err=True)
    if dry_run:
        if nproc is not None:
            from ..train.distributed import check_ranks

            check_ranks(cfg, nproc)  # (before the plan, which may measure the machine)
        lines = dry_run_plan(cfg) if nproc is None else _ranks_dry_run_plan(cfg, nproc)
        for line in lines:
            click.echo(line)
        return
    if nproc is not None:
        from ..train.pretrain import check_pretrain

        check_pretrain(cfg)  # bad input: one line here, not one per rank
        relaunch_under_torchrun(nproc, cfg)
    train_on_this_rank(lambda: run_pretraining(cfg, started_at=started_at), "pretrain", cfg)


def _ranks_dry_run_plan(cfg, nproc: int) -> list[str]:
    """The plan as each of `nproc` ranks sees it: its device line and measured peak at a
    rank's share of the threads (they were the launcher's: every thread), and a line for
    the ranks."""
    import torch

    from ..train.pretrain import dry_run_plan
    from .launch import rank_threads, ranks_plan

    threads, before = rank_threads(nproc), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lines = dry_run_plan(cfg)
    finally:
        torch.set_num_threads(before)
    at = next(i for i, line in enumerate(lines) if line.startswith("batch:")) + 1
    lines.insert(at, ranks_plan(cfg, nproc, threads))
    return lines
