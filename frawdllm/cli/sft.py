"""`frawd sft` and `frawd dpo`: from a base model to a chat model, on the shared loop."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import click

from ..align.config import DPOConfig, SFTConfig  # (torch-free: the jobs themselves are imported by _run)
from ..errors import ConfigError
from .flags import dataclass_options
from .launch import nproc_option, relaunch_under_torchrun, train_on_this_rank


def _run(cls: type, command: str, config_file: str | None, nproc: int | None, flags: dict) -> None:
    from ..train.config import build_config
    from . import command_started_at

    started_at = command_started_at()  # --max-time counts the whole command
    _refuse_another_commands_config(cls, command, config_file, flags)
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


_RERUN = re.compile(r"# rerun: frawd (.+?)(?: --nproc \d+)? --config ")


def _command_of(path: Path, data: dict, cls: type, command: str) -> str | None:
    """The command a config file is for, when it is not `command`: the one its rerun line
    names (a run's config.yaml), else one that knows every field it holds, some of which
    `cls` lacks (a file of this command with a stray key is this command's: its error names
    the key)."""
    from ..train.config import PretrainConfig

    with open(path, "rb") as f:
        match = _RERUN.match(f.readline().decode("utf-8", "replace"))
    if match:
        return match.group(1)
    unknown = set(data) - {f.name for f in fields(cls)}
    for other, other_cls in (("sft", SFTConfig), ("dpo", DPOConfig), ("pretrain", PretrainConfig)):
        if unknown and other != command and set(data) <= {f.name for f in fields(other_cls)}:
            return other
    return None


def _refuse_another_commands_config(cls: type, command: str, config_file: str | None, flags: dict) -> None:
    """One line when --config, or the run --resume continues, belongs to another command
    (`frawd dpo --out SFT_RUN --resume`), rather than a list of fields it does not know."""
    from ..train.config import field_defaults, load_config_file
    from ..train.rundir import CONFIG_FILE

    given = {k: v for k, v in flags.items() if v is not None}
    from_file = load_config_file(config_file) if config_file else {}
    held = _command_of(Path(config_file), from_file, cls, command) if config_file else None
    if held and held != command:
        raise ConfigError(f"--config {config_file} is a config of frawd {held}, not of frawd {command}; "
                          f"give it to frawd {held}")
    out = given.get("out", from_file.get("out", field_defaults(cls)["out"]))
    saved = Path(out) / CONFIG_FILE
    if given.get("resume", from_file.get("resume", False)) and saved.is_file():
        held = _command_of(saved, load_config_file(saved), cls, command)
        if held and held != command:
            raise ConfigError(f"--out {out} holds a frawd {held} run, not a frawd {command} run; continue it with "
                              f"frawd {held} --out {out} --resume, or give frawd {command} another --out")


# TrainConfig's pretraining-only field: the samples answer held-out prompts of --data
FINETUNE_SKIPS = ("sample_prompt",)

_CONFIG = click.option("--config", "config_file", type=str, metavar="FILE", default=None,
                       help="A YAML (or .toml) file of the options below (flags given here override it).")


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
