"""`frawd sft` and `frawd dpo`: from a base model to a chat model, on the shared loop."""

from __future__ import annotations

import click

from ..align.dpo import DPOConfig
from ..align.sft import SFTConfig
from .flags import dataclass_options
from .launch import nproc_option, relaunch_under_torchrun, train_on_this_rank


def _run(cls: type, command: str, config_file: str | None, nproc: int | None, flags: dict) -> None:
    from ..train.config import build_config
    from ..train.device import process_started_at

    started_at = process_started_at()  # --max-time counts the whole command
    cfg = build_config(cls, config_file, flags)
    if command == "sft":
        from ..align.sft import run_sft as run
    else:
        from ..align.dpo import run_dpo as run
    if nproc is not None:
        from ..align.job import check_init

        check_init(cfg)  # bad input: one line here, not one per rank
        relaunch_under_torchrun(nproc, cfg)
    train_on_this_rank(lambda: run(cfg, started_at=started_at), command, cfg)


# TrainConfig's pretraining-only field: the samples answer held-out prompts of --data
FINETUNE_SKIPS = ("sample_prompt",)

_CONFIG = click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                       help="A YAML file of the options below (flags given here override it).")


@click.command(context_settings={"max_content_width": 110})
@_CONFIG
@nproc_option()
@dataclass_options(SFTConfig, skip=FINETUNE_SKIPS)
def sft(config_file: str | None, nproc: int | None, **flags) -> None:
    """Supervised fine-tuning: teach the --init model to answer, on conversations in --data.

    The loss is on the assistant's tokens only (--train-on), several examples are packed
    per row with attention kept inside each, and the held-out split gives val_loss and
    samples.txt. --data takes JSONL/Parquet/hf: records with "messages" or
    "prompt"/"response", or the built-in stdlib-instruct (made from Python's standard
    library, nothing downloaded). OUT is laid out as for pretraining; OUT/model is a
    model directory for frawd chat, generate and export. See docs/alignment.md.

    \b
    Examples:
      frawd sft --init runs/demo/model --data stdlib-instruct --max-time 5m --out runs/sft
      frawd sft --init runs/demo/model --data chats.jsonl --lora-rank 8 --max-steps 500 --out runs/sft-lora
      frawd sft --out runs/sft --resume --max-time 10m
      frawd sft --nproc 4 --init runs/base/model --data chats.jsonl --max-steps 2000 --out runs/sft
    """
    _run(SFTConfig, "sft", config_file, nproc, flags)


@click.command(context_settings={"max_content_width": 110})
@_CONFIG
@nproc_option()
@dataclass_options(DPOConfig, skip=FINETUNE_SKIPS)
def dpo(config_file: str | None, nproc: int | None, **flags) -> None:
    """Direct preference optimisation: prefer --data's chosen answers over its rejected ones.

    The --init model (usually an SFT run's OUT/model) is trained against a frozen copy of
    itself (the reference; --precompute-ref computes its log-probs once and frees it),
    with the sigmoid DPO loss (--beta) or IPO (--loss-type ipo). --data takes records with
    "prompt" (text or messages), "chosen" and "rejected", or the built-in stdlib-prefs.
    metrics.jsonl and loss.png show rewards/chosen, rewards/rejected, rewards/accuracies,
    rewards/margins, logps/chosen and logps/rejected. See docs/alignment.md.

    \b
    Examples:
      frawd dpo --init runs/sft/model --data stdlib-prefs --max-time 5m --out runs/dpo
      frawd dpo --init runs/sft/model --data prefs.jsonl --beta 0.2 --precompute-ref --max-steps 300 --out runs/dpo
    """
    _run(DPOConfig, "dpo", config_file, nproc, flags)
