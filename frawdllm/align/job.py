"""What `frawd sft` and `frawd dpo` share: the start from an existing model directory,
LoRA, sampling held-out prompts and saving a plain model directory. Their shared config
fields, `FinetuneConfig`, are in config.py (torch-free, for the CLI's --help) and
re-exported here.

A fine-tuning run starts like a pretraining run (train/rundir.py: checks before any work,
OUT prepared, a failed start undone) and ends the same way: RUN/model/ is a model
directory with the --init model's config and tokenizer, usable by chat, generate, export.

A resumed run reads --init again. Full SFT takes only its config and tokenizer from there
(the checkpoint holds the weights), but DPO's reference and LoRA's frozen base weights are
--init's weights themselves: a run that depends on them records their sha256 in its
checkpoints (`check_init_weights`), and a --resume where --init now holds other weights is
refused, since it would continue against another reference or base.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, FrawdError
from ..memory import check_training_fits
from ..tokenizer import TOKENIZER_FILE, Tokenizer
from ..train import checkpoint as ckpt
from ..train import distributed
from ..train.config import parse_duration
from ..train.device import pick_device, seed_everything
from ..train.loop import Trainer, TrainResult, TrainTask
from ..train.rundir import check_run_dir, prepare_run_dir, save_run_config, undo_failed_start
from . import lora
from .config import FinetuneConfig
from .examples import check_source


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


INIT_WEIGHTS = "init_weights"  # the task state's sha256 of --init's weights file (`check_init_weights`)


def init_weights_use(cfg: FinetuneConfig) -> str | None:
    """What a run keeps taking from --init's weights after its start, in words (their
    checkpoints hold everything else); None where nothing (full SFT: the checkpoint's
    weights replace --init's)."""
    uses = (["DPO's reference model"] if cfg.KIND == "dpo" else []) + \
        (["the frozen base weights of LoRA"] if cfg.lora_rank else [])
    return " and ".join(uses) or None


def weights_fingerprint(directory: str | Path) -> str:
    """The sha256 of a model directory's weights file (read in 8 MiB chunks)."""
    from ..modeldir import WEIGHTS_FILE, model_file

    digest = hashlib.sha256()
    with open(model_file(directory, WEIGHTS_FILE), "rb") as file:
        for chunk in iter(lambda: file.read(1 << 23), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _task_state(checkpoint: Path) -> dict | None:
    """A checkpoint's task state, its tensors left on disk where they can be (memory-mapped:
    the AdamW moments are not read); None if unreadable (the resume itself says why)."""
    try:
        state = torch.load(checkpoint / ckpt.STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - no mmap there, or unreadable: read as the resume reads it
        try:
            state = ckpt.load_state(checkpoint)
        except FrawdError:  # (reported by the Trainer's own reading of the state)
            return None
    task = state.get("task") if isinstance(state, dict) else None
    return task if isinstance(task, dict) else None


def check_init_weights(cfg: FinetuneConfig, run_dir: Path) -> str | None:
    """The fingerprint of --init's weights where the run depends on them (`init_weights_use`),
    else None. A --resume whose --init now holds other weights than those its latest
    checkpoint recorded is refused (a checkpoint of an earlier FrawdLLM records none: a note)."""
    use = init_weights_use(cfg)
    if use is None:
        return None
    now = weights_fingerprint(cfg.init)
    latest = ckpt.latest_checkpoint(run_dir) if cfg.resume else None
    state = _task_state(latest) if latest is not None else None
    if state is None:
        return now
    recorded = state.get(INIT_WEIGHTS)
    if recorded is None:
        print(f"{run_dir}: its checkpoint records no fingerprint of --init's weights (an earlier FrawdLLM wrote it): "
              f"not checked that --init {cfg.init} still holds the model the run started from", file=sys.stderr, flush=True)
    elif recorded != now:
        raise FrawdError(f"--init {cfg.init}: its weights differ from those the run in {run_dir} started from (it "
                         f"takes {use} from them): put the original model back in {cfg.init}, or start a new run "
                         "(another --out, or --overwrite)")
    return now


def sample_texts(model: nn.Module, tokenizer: Tokenizer, prompts: list[list[int]], max_new_tokens: int,
                 ) -> list[str]:
    """Each chat prompt (ids ending in <|assistant|>) and its greedy answer, as text."""
    from ..infer import Engine, SamplingParams

    if not prompts:
        return []
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    answers = [c.text for c in Engine(lora.plain(model), tokenizer).generate(prompts, params)]
    return [tokenizer.decode(p) + a for p, a in zip(prompts, answers)]


class FinetuneTask(TrainTask):
    """Saving, LoRA-aware resume and samples, shared by the SFT and DPO tasks (each sets
    `loader`, whose position the checkpoints keep)."""

    loader: Any

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, cfg: FinetuneConfig,
                 sample_prompts: list[list[int]]) -> None:
        from ..modeldir import load_generation_config

        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg  # (LoRA wraps `model` in place)
        self.sample_prompts = sample_prompts[:cfg.sample_count]
        self.generation_config = load_generation_config(cfg.init) if cfg.init else {}  # kept: --init's defaults
        self.init_weights: str | None = None  # `check_init_weights`'s fingerprint, kept in the checkpoints

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

    def state_dict(self) -> dict:
        """The data position (`self.loader`'s), the LoRA adapters, and the fingerprint of the
        --init weights the run depends on (`check_init_weights`)."""
        state = {"loader": self.loader.state_dict()}
        if lora.has_lora(self.model):
            state["lora"] = lora.adapter_state(self.model)
        return {**state, INIT_WEIGHTS: self.init_weights} if self.init_weights else state

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        if lora.has_lora(self.model):
            if "lora" not in state:
                raise FrawdError("this run's checkpoints hold no LoRA adapters; resume without --lora-rank")
            lora.load_adapter_state(self.model, state["lora"])
        elif "lora" in state:
            raise FrawdError("this run trained LoRA adapters; resume with its --lora-rank")


def run_finetune(cfg: FinetuneConfig, command: str, load: Callable[[Any, Tokenizer, int], tuple[list, list, Any]],
                 task_class: Callable[..., FinetuneTask], what: str, callbacks: list | None = None,
                 started_at: float | None = None) -> TrainResult:
    """The whole job: checks, OUT, the --init model (LoRA-wrapped if asked), the data
    (`load(cfg, tokenizer, length)`: train, val and a summary of `what` it read), the task
    (`task_class(train, val, model, tokenizer, cfg, length)`), the loop."""
    started_at = time.perf_counter() if started_at is None else started_at
    place = distributed.setup(cfg.parallel, cfg.device, parse_duration(cfg.dist_timeout))
    cfg = distributed.rank_config(cfg)
    check_init(cfg)
    run_dir = Path(cfg.out)
    with undo_failed_start(cfg, enabled=place.is_main):
        init_weights = None
        if place.is_main:  # the others wait, then read the same --init and data
            prepare_run_dir(cfg)
            init_weights = check_init_weights(cfg, run_dir)  # (before any work: a refusal costs nothing)
        cfg.resume, cfg.overwrite, init_weights = place.after_main((cfg.resume, cfg.overwrite, init_weights),
                                                                   "the run's start")
        model, tokenizer, length = load_init(cfg)
        train, val, summary = load(cfg, tokenizer, length)
        if place.is_main:  # a result, not progress: printed with --no-progress too
            print(f"{command} data: {summary.line(what)}", file=sys.stderr, flush=True)
        task = task_class(train, val, model, tokenizer, cfg, length)
        task.init_weights = init_weights
        if cfg.lora_rank:
            lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        lora_note = f" (LoRA rank {cfg.lora_rank})" if cfg.lora_rank else ""
        save_run_config(cfg, command, place.world_size, f"--init {cfg.init}: {model.config.num_parameters:,} "
                        f"parameters, {trainable:,} trained{lora_note}; examples of {length} tokens", place.is_main)
        trainer = Trainer(model, task, cfg, run_dir, callbacks=callbacks, config_for_loggers=cfg.to_dict(),
                          started_at=started_at)
    return trainer.fit()
