"""What `frawd sft` and `frawd dpo` share: the config fields, the start from an existing
model directory, LoRA, sampling held-out prompts and saving a plain model directory.

A fine-tuning run starts like a pretraining run (train/rundir.py: checks before any work,
OUT prepared, a failed start undone) and ends the same way: RUN/model/ is a model
directory with the --init model's config and tokenizer, usable by chat, generate, export.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError, FrawdError
from ..memory import check_training_fits
from ..tokenizer import TOKENIZER_FILE, Tokenizer
from ..train import distributed
from ..train.config import EVAL_INTERVAL_HELP, WARMUP_HELP, TrainConfig, _require, option, parse_duration
from ..train.device import pick_device, seed_everything
from ..train.loop import Trainer, TrainResult, TrainTask
from ..train.rundir import check_run_dir, prepare_run_dir, save_run_config, undo_failed_start
from . import lora
from .examples import check_source


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


def check_init(cfg: FinetuneConfig) -> None:
    """Every check that needs no real work (a FrawdError here means nothing was written)."""
    from ..modeldir import load_config, model_file, require_kind

    check_run_dir(cfg)
    cfg.require_budget()
    if cfg.init is None:
        raise ConfigError("--init MODEL_DIR is required: the model to fine-tune")
    check_source(cfg.data, cfg.KIND)
    device = pick_device(cfg.device)
    model_config = load_config(cfg.init)
    require_kind(cfg.init, model_config, "decoder")
    tokenizer = Tokenizer.load(model_file(cfg.init, TOKENIZER_FILE)).check_fits(model_config.vocab_size, cfg.init)
    tokenizer.require_frawd_specials(f"{cfg.init}/{TOKENIZER_FILE}", "which the chat template is made of")
    check_training_fits(model_config, cfg.batch_size, min(cfg.max_length or model_config.context_length,
                                                          model_config.context_length), cfg.dtype, device,
                        cfg.ROWS_PER_EXAMPLE, frozen=cfg.lora_rank > 0)
    if cfg.lora_rank > model_config.n_embd:  # every adapted projection has n_embd inputs or outputs
        raise ConfigError(f"--lora-rank {cfg.lora_rank} exceeds the model's n_embd {model_config.n_embd}: rank "
                          f"{model_config.n_embd} already allows any update of the projections (for every weight, "
                          "--lora-rank 0)")


def load_init(cfg: FinetuneConfig) -> tuple[nn.Module, Tokenizer, int]:
    """The --init model (in eval mode until the loop trains it; its dropout setting kept), its
    tokenizer and the example length."""
    from ..modeldir import load_model, model_file

    seed_everything(cfg.seed)
    model = load_model(cfg.init, kind="decoder")
    tokenizer = Tokenizer.load(model_file(cfg.init, TOKENIZER_FILE))
    context = model.config.context_length
    if cfg.max_length is not None and cfg.max_length > context:
        raise FrawdError(f"--max-length {cfg.max_length} exceeds the model's context_length {context}")
    return model, tokenizer, cfg.max_length or context


def answer_prompts(model: nn.Module, tokenizer: Tokenizer, prompts: list[list[int]], max_new_tokens: int,
                   ) -> list[str]:
    """Greedy answers to chat prompts (ids ending in <|assistant|>)."""
    from ..infer import Engine, SamplingParams

    if not prompts:
        return []
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    return [c.text for c in Engine(lora.plain(model), tokenizer).generate(prompts, params)]


def sample_texts(model: nn.Module, tokenizer: Tokenizer, prompts: list[list[int]], max_new_tokens: int,
                 ) -> list[str]:
    answers = answer_prompts(model, tokenizer, prompts, max_new_tokens)
    return [tokenizer.decode(p) + a for p, a in zip(prompts, answers)]


class FinetuneTask(TrainTask):
    """Saving, LoRA-aware resume and samples, shared by the SFT and DPO tasks."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, cfg: FinetuneConfig,
                 sample_prompts: list[list[int]]) -> None:
        from ..modeldir import load_generation_config

        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg  # (LoRA wraps `model` in place)
        self.sample_prompts = sample_prompts[:cfg.sample_count]
        self.generation_config = load_generation_config(cfg.init) if cfg.init else {}  # kept: --init's defaults

    def samples(self, model: nn.Module, device: torch.device) -> list[str]:
        return sample_texts(model, self.tokenizer, self.sample_prompts, self.cfg.sample_tokens)

    def prepare_samples(self, device: torch.device) -> None:
        from ..infer import native

        if self.sample_prompts:
            native.build_for(device)

    def save_model(self, model: nn.Module, directory: Path) -> None:
        from ..modeldir import save_model_dir

        save_model_dir(model, directory, tokenizer=self.tokenizer,  # (LoRA: merged on save)
                       generation_config=self.generation_config or None)

    def load_model(self, model: nn.Module, directory: Path) -> None:
        if not lora.has_lora(model):
            super().load_model(model, directory)
        # with LoRA the base weights are --init's (frozen); the adapters come back in load_state_dict

    def lora_state(self) -> dict:
        return {"lora": lora.adapter_state(self.model)} if lora.has_lora(self.model) else {}

    def load_lora_state(self, state: dict) -> None:
        if lora.has_lora(self.model):
            if "lora" not in state:
                raise FrawdError("this run's checkpoints hold no LoRA adapters; resume without --lora-rank")
            lora.load_adapter_state(self.model, state["lora"])
        elif "lora" in state:
            raise FrawdError("this run trained LoRA adapters; resume with its --lora-rank")


def run_finetune(cfg: FinetuneConfig, command: str, make_task: Callable[[nn.Module, Tokenizer, int], FinetuneTask],
                 callbacks: list | None = None, started_at: float | None = None,
                 check: Callable[[], None] | None = None) -> TrainResult:
    """The whole job: checks, OUT, the --init model (LoRA-wrapped if asked), the task
    (`make_task(model, tokenizer, length)` loads the data), the loop."""
    started_at = time.perf_counter() if started_at is None else started_at
    place = distributed.setup(cfg.parallel, cfg.device, parse_duration(cfg.dist_timeout))
    cfg = distributed.rank_config(cfg)
    check_init(cfg)
    if check is not None:
        check()
    run_dir = Path(cfg.out)
    with undo_failed_start(cfg, enabled=place.is_main):
        if place.is_main:  # the others wait, then read the same --init and data
            prepare_run_dir(cfg)
        cfg.resume, cfg.overwrite = place.after_main((cfg.resume, cfg.overwrite), "the run's start")
        model, tokenizer, length = load_init(cfg)
        task = make_task(model, tokenizer, length)
        if cfg.lora_rank:
            lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        lora_note = f" (LoRA rank {cfg.lora_rank})" if cfg.lora_rank else ""
        save_run_config(cfg, command, place.world_size, f"--init {cfg.init}: {model.config.num_parameters:,} "
                        f"parameters, {trainable:,} trained{lora_note}; examples of {length} tokens", place.is_main)
        trainer = Trainer(model, task, cfg, run_dir, callbacks=callbacks, config_for_loggers=cfg.to_dict(),
                          started_at=started_at)
    return trainer.fit()
