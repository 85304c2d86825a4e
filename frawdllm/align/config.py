"""The configs of `frawd sft` and `frawd dpo` (`FinetuneConfig`, `SFTConfig`, `DPOConfig`):
their fields, defaults, help texts and checks, and nothing else.

They live apart from the jobs (job.py, sft.py, dpo.py, which import torch and re-export
them) because the CLI builds its flags from them: `frawd sft --help` and `frawd dpo --help`,
and a bad flag's one-line error, must not wait for torch to load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError, FrawdError
from ..train.config import EVAL_INTERVAL_HELP, WARMUP_HELP, TrainConfig, _require, option
from .examples import TRAIN_ON

LOSSES = ("sigmoid", "ipo")  # DPOConfig.loss_type's choices (dpo.py: `dpo_loss`)


@dataclass
class FinetuneConfig(TrainConfig):
    """Fields both post-training commands add to the loop's."""

    ROWS_PER_EXAMPLE = 1  # rows a micro-batch example takes (DPO: 2), for the memory check
    KIND = "sft"  # what its --data holds: "sft" examples or "dpo" preference pairs

    init: str | None = option(None, "The model directory to start from (e.g. a pretraining run's model/); "
                                    "its config and tokenizer are kept.")
    # each command names its own built-in corpus (SFTConfig, DPOConfig)
    data: str = option("stdlib-instruct", "Examples: .jsonl[.gz], .parquet, a folder or glob of them, hf:NAME, "
                                          "or a built-in corpus.")
    val_fraction: float = option(0.05, "Share of the examples held out for evaluation (a hash split).")
    max_length: int | None = option(None, "Tokens per example (default: the model's context); longer ones are "
                                          "truncated: the prompt's tail and the response's head are kept.")
    skip_bad_lines: bool = option(False, "Skip malformed records (counted in the summary) instead of stopping.")
    lora_rank: int = option(0, "Train rank-R LoRA adapters on the attention and MLP projections instead of "
                               "every weight (0 = full fine-tuning; at most n_embd); merged into RUN/model on save.")
    lora_alpha: float | None = option(None, "LoRA scale numerator: the update is (alpha / rank) B A "
                                            "(default 2 x rank; only with --lora-rank).")
    sample_count: int = option(2, "Held-out prompts answered (greedy) in samples.txt at each evaluation.")
    # defaults suited to fine-tuning (the loop's suit pretraining)
    out: str = option("runs/finetune", "Run directory: config, metrics, checkpoints, the best model.")
    lr: float = option(1e-4, "Peak learning rate.")
    warmup_steps: int = option(10, WARMUP_HELP)
    weight_decay: float = option(0.0, "AdamW weight decay, applied to matrices only.")
    eval_interval: int = option(100, EVAL_INTERVAL_HELP)
    eval_batches: int = option(10, "Validation batches per evaluation.")
    batch_size: int = option(8, "Rows (SFT: packed rows of examples; DPO: pairs) per micro-batch.")
    sample_tokens: int = option(96, "Tokens to sample per held-out prompt at each evaluation (0 = none).")
    seed: int = option(1337, "Seed of the data order, dropout and LoRA's initialisation (the weights "
                             "come from --init).")

    @staticmethod
    def effective(values: dict) -> dict:
        """A config's values (a saved config.yaml's too) as the run uses them: LoRA's alpha
        unset is 2 x rank (a resume typing the default is no change)."""
        if values.get("lora_rank") and values.get("lora_alpha") is None:
            return {**values, "lora_alpha": 2 * values["lora_rank"]}
        return values

    def __post_init__(self) -> None:
        super().__post_init__()
        _require("val_fraction", self.val_fraction, lambda v: 0 <= v < 1, "in [0, 1)")
        if self.sample_prompt:  # a pretrain option (TrainConfig's); not a flag of sft or dpo
            raise ConfigError("sample_prompt: sft and dpo take no prompt; their samples answer held-out "
                              "prompts of the data (sample_count of them)")
        _require("max_length", self.max_length, lambda v: v is None or v >= 8, "an integer >= 8")
        _require("lora_rank", self.lora_rank, lambda v: v >= 0, "an integer >= 0")
        _require("lora_alpha", self.lora_alpha, lambda v: v is None or 0 < v < math.inf,
                 "a finite positive number")  # (inf: every step NaN)
        if self.lora_alpha is not None and not self.lora_rank:
            raise ConfigError("lora_alpha scales LoRA adapters: give --lora-rank R too (or leave --lora-alpha out)")
        if self.lora_rank and self.parallel == "fsdp":  # (a sharded merge saved wrong weights: refused)
            raise ConfigError("--lora-rank trains adapters in one process or under --parallel ddp; with "
                              "--parallel fsdp the merged model came out wrong, so the pair is refused")
        _require("sample_count", self.sample_count, lambda v: v >= 0, "an integer >= 0")


@dataclass
class SFTConfig(FinetuneConfig):
    """`frawd sft`: fine-tune a model directory on conversations."""

    train_on: str = option("assistant", "Tokens that carry the loss: assistant (every assistant turn), last "
                                        "(the last assistant turn), all (every token: no masking).", choices=TRAIN_ON)
    pack: bool = option(True, "Pack several examples per row (attention kept inside each example).")
    data: str = option("stdlib-instruct", "Examples: .jsonl[.gz], .parquet, a folder or glob of them, hf:NAME, "
                                          "or the built-in stdlib-instruct.")
    out: str = option("runs/sft", "Run directory: config, metrics, checkpoints, the best model.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.train_on not in TRAIN_ON:
            raise FrawdError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}")


@dataclass
class DPOConfig(FinetuneConfig):
    """`frawd dpo`: align a model directory with preference pairs."""

    ROWS_PER_EXAMPLE = 2  # a pair's chosen and rejected answers
    KIND = "dpo"

    beta: float = option(0.1, "How far the policy may move from the reference (the KL penalty's weight).")
    loss_type: str = option("sigmoid", "sigmoid (DPO) or ipo.", choices=LOSSES)
    precompute_ref: bool = option(False, "Compute the reference's log-probs once before training and free the "
                                         "reference (less memory and time per step; a forward of every pair "
                                         "first, inside the time budget).")
    data: str = option("stdlib-prefs", "Preference pairs: .jsonl[.gz], .parquet, a folder or glob of them, "
                                       "hf:NAME, or the built-in stdlib-prefs.")
    out: str = option("runs/dpo", "Run directory: config, metrics, checkpoints, the best model.")
    lr: float = option(5e-6, "Peak learning rate.")
    batch_size: int = option(8, "Preference pairs per micro-batch.")

    def __post_init__(self) -> None:
        super().__post_init__()
        _require("beta", self.beta, lambda v: 0 < v < math.inf, "a finite positive number")  # (inf: NaN losses)
        if self.loss_type not in LOSSES:
            raise FrawdError(f"loss_type must be one of {', '.join(LOSSES)}, got {self.loss_type!r}")
