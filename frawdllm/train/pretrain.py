"""Pretraining: next-token prediction on a corpus, through the shared loop.

`run_pretraining(cfg)` does the whole job:

1. data: a raw source (`stdlib`, files, JSONL, ...) gets a tokenizer (trained on it, or
   a given tokenizer.json) and is tokenized into OUT/data/{train,val}.bin; both are
   reused when a rerun has the same inputs. A folder of prepared shards is used as is.
2. model: the preset with its overrides, its vocabulary sized to the tokenizer's.
3. `PretrainTask`: random windows of the training tokens (`RandomWindowLoader`,
   resumable), the model's own cross-entropy, validation on the first `eval_batches`
   windows of val.bin, a sample at each evaluation.
4. `Trainer(...).fit()`; OUT/model is the best model, tokenizer.json included.

--max-time covers all of it, from the call's start (from the process's start under
`frawd pretrain`).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..config import PRESETS, ModelConfig, get_config, parse_value
from ..data import META_FILE, TRAIN_FILE, VAL_FILE, RandomWindowLoader, prepare_shards, read_shard
from ..errors import FrawdError
from ..io import write_json_atomic, write_text_atomic
from ..tokenizer import KINDS, TOKENIZER_FILE, Tokenizer, train_tokenizer
from .config import PretrainConfig, dump_yaml
from .device import seed_everything
from .evaluate import lm_loss, lm_metrics
from .losses import linear_cross_entropy
from .loop import Trainer, TrainResult, TrainTask
from .rundir import BEST_MODEL_DIR, CONFIG_FILE, METRICS_FILE, PLOT_FILE, SAMPLES_FILE
from .checkpoint import CHECKPOINTS_DIR

DATA_DIR = "data"
TOKENIZER_SOURCE_FILE = "tokenizer_source.json"  # what OUT/tokenizer.json was trained on
RUN_FILES = (CONFIG_FILE, METRICS_FILE, PLOT_FILE, SAMPLES_FILE)
RUN_DIRS = (CHECKPOINTS_DIR, BEST_MODEL_DIR, "tensorboard", "wandb")


@dataclass
class PreparedData:
    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    meta: dict
    shard_dir: Path


class PretrainTask(TrainTask):
    def __init__(self, data: PreparedData, model_config: ModelConfig, cfg: PretrainConfig) -> None:
        self.data, self.cfg = data, cfg
        self.context_length = model_config.context_length
        self.loader = RandomWindowLoader(data.train, cfg.batch_size, self.context_length, seed=cfg.seed)
        self.flops_per_token = model_config.flops_per_token(self.context_length)
        self.bytes_per_token = data.meta.get("val_bytes_per_token") or data.meta.get("bytes_per_token")
        self.can_evaluate = len(data.val) > self.context_length

    def next_batch(self) -> tuple[Tensor, Tensor]:
        return self.loader.next_batch()

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        # = model(x, y)[1], without materialising the (B, T, V) logits
        hidden = model.hidden_states(x)  # (B, T, D)
        return linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, y.flatten())

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        if not self.can_evaluate:
            return {}
        loss, _ = lm_loss(model, self.data.val, self.cfg.batch_size, self.context_length, device,
                          max_batches=self.cfg.eval_batches)
        return lm_metrics(loss, self.bytes_per_token, prefix="val_")

    def samples(self, model: nn.Module, device: torch.device) -> list[str]:
        from ..infer import Engine, SamplingParams

        params = SamplingParams(max_new_tokens=self.cfg.sample_tokens, temperature=0.8, top_k=50,
                                seed=self.cfg.seed)
        completion = Engine(model, self.data.tokenizer).generate(self.cfg.sample_prompt, params)[0]
        return [self.cfg.sample_prompt + completion.text]

    def save_model(self, model: nn.Module, directory: Path) -> None:
        model.save_pretrained(directory, tokenizer=self.data.tokenizer)

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])


# ---- data --------------------------------------------------------------------------------------

def is_shard_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and all((path / name).is_file() for name in (TRAIN_FILE, VAL_FILE, META_FILE))


def tokenizer_path(spec: str) -> Path | None:
    """`spec` as a tokenizer.json path (a file, or a folder holding one), else None."""
    path = Path(spec)
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        return path / TOKENIZER_FILE
    return path if path.is_file() else None


def prepare_data(cfg: PretrainConfig, run_dir: Path) -> PreparedData:
    if is_shard_dir(cfg.data):
        shard_dir = Path(cfg.data)
        meta = json.loads((shard_dir / META_FILE).read_text(encoding="utf-8"))
        path = tokenizer_path(cfg.tokenizer) or tokenizer_path(str(shard_dir))
        if path is None:
            raise FrawdError(f"{shard_dir} holds prepared shards; give their tokenizer with --tokenizer PATH")
        tok = Tokenizer.load(path)
        if meta.get("tokenizer_hash") not in (None, tok.fingerprint):
            raise FrawdError(f"{path} is not the tokenizer the shards in {shard_dir} were made with")
    else:
        tok = _source_tokenizer(cfg, run_dir)
        shard_dir = run_dir / DATA_DIR
        meta = prepare_shards(cfg.data, tok, shard_dir, val_fraction=cfg.val_fraction, text_field=cfg.text_field,
                              doc_split=cfg.doc_split, progress=cfg.progress)
    return PreparedData(read_shard(shard_dir / TRAIN_FILE), read_shard(shard_dir / VAL_FILE), tok, meta, shard_dir)


def _source_tokenizer(cfg: PretrainConfig, run_dir: Path) -> Tokenizer:
    """The given tokenizer.json, or one trained on the source (reused while the source is the same)."""
    path = tokenizer_path(cfg.tokenizer)
    if path is not None:
        return Tokenizer.load(path)
    if cfg.tokenizer not in KINDS:
        raise FrawdError(f"tokenizer {cfg.tokenizer!r} is neither a kind ({', '.join(KINDS)}) "
                         "nor a tokenizer.json path")
    vocab_size = cfg.vocab_size or cfg.model.get("vocab_size") or PRESETS[cfg.preset]["vocab_size"]
    source = {"data": cfg.data, "kind": cfg.tokenizer, "vocab_size": vocab_size if cfg.tokenizer == "bpe" else None,
              "text_field": cfg.text_field, "doc_split": cfg.doc_split}
    saved, record = run_dir / TOKENIZER_FILE, run_dir / DATA_DIR / TOKENIZER_SOURCE_FILE
    if saved.is_file() and record.is_file() and json.loads(record.read_text(encoding="utf-8")) == source:
        return Tokenizer.load(saved)
    from ..data.sources import iter_documents

    if cfg.progress:
        print(f"training a {cfg.tokenizer} tokenizer on {cfg.data} ...", flush=True)
    documents = iter_documents(cfg.data, text_field=cfg.text_field, doc_split=cfg.doc_split)
    tok = train_tokenizer(documents, kind=cfg.tokenizer, vocab_size=vocab_size, show_progress=cfg.progress)
    tok.save(saved)
    write_json_atomic(record, source)
    return tok


# ---- model and run ---------------------------------------------------------------------------------

def model_config_for(cfg: PretrainConfig, vocab_size: int) -> ModelConfig:
    """The preset with its overrides; the vocabulary fits the tokenizer (a larger one is kept)."""
    overrides = {k: parse_value(ModelConfig, k, v) if isinstance(v, str) else v for k, v in cfg.model.items()}
    wanted = overrides.get("vocab_size")
    if wanted is not None and wanted < vocab_size:
        raise FrawdError(f"model vocab_size {wanted} is smaller than the tokenizer's {vocab_size}")
    return get_config(cfg.preset, **{**overrides, "vocab_size": wanted or vocab_size})


def prepare_run_dir(cfg: PretrainConfig) -> Path:
    """Check OUT: a new run needs an empty one (or --overwrite), --resume a previous run."""
    run_dir = Path(cfg.out)
    has_run = any((run_dir / name).exists() for name in RUN_FILES + RUN_DIRS)
    if cfg.resume and not (run_dir / CHECKPOINTS_DIR).is_dir():
        raise FrawdError(f"{run_dir}: no run to resume (no checkpoints folder)")
    if has_run and not cfg.resume:
        if not cfg.overwrite:
            raise FrawdError(f"{run_dir} already holds a run; --resume continues it, --overwrite starts over")
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
        for name in RUN_DIRS:
            shutil.rmtree(run_dir / name, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def dry_run_plan(cfg: PretrainConfig) -> list[str]:
    """`frawd pretrain --dry-run`: the settings checked (nothing trained or written) and the plan."""
    from .device import hardware_report

    if not cfg.has_budget:
        raise FrawdError("give a budget: --max-steps, --max-tokens or --max-time")
    run_dir = Path(cfg.out)
    has_run = any((run_dir / name).exists() for name in RUN_FILES + RUN_DIRS)
    if cfg.resume and not (run_dir / CHECKPOINTS_DIR).is_dir():
        raise FrawdError(f"{run_dir}: no run to resume (no checkpoints folder)")
    if has_run and not cfg.resume and not cfg.overwrite:
        raise FrawdError(f"{run_dir} already holds a run; --resume continues it, --overwrite starts over")
    model_cfg = model_config_for(cfg, cfg.vocab_size or cfg.model.get("vocab_size")
                                 or PRESETS[cfg.preset]["vocab_size"])
    budget = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in (("max_steps", cfg.max_steps),
                       ("max_tokens", cfg.max_tokens), ("max_time", cfg.max_time)) if v is not None)
    action = "resume" if cfg.resume else "overwrite" if has_run else "new run"
    lines = [f"dry run: nothing trained, nothing written",
             f"out:           {run_dir} ({action})",
             f"data:          {cfg.data} (tokenizer {cfg.tokenizer})",
             f"model:         {cfg.preset}, ~{model_cfg.num_parameters:,} parameters "
             f"(vocabulary to fit the tokenizer), context {model_cfg.context_length}",
             f"batch:         {cfg.batch_size} x {cfg.grad_accum} x {model_cfg.context_length} tokens per step",
             f"budget:        {budget} (the whole command: tokenizer, data, warm-up, evaluations, save)"]
    say = print if cfg.progress else None
    return lines + hardware_report(cfg.device, cfg.dtype, cfg.compile, say=say)


def run_pretraining(cfg: PretrainConfig, callbacks: list | None = None,
                    started_at: float | None = None) -> TrainResult:
    """The whole job. --max-time counts from `started_at` (a `time.perf_counter()`; default:
    now), so tokenizer training and data preparation are inside the budget."""
    from .. import FrawdLLM, __version__

    started_at = time.perf_counter() if started_at is None else started_at

    run_dir = prepare_run_dir(cfg)
    data = prepare_data(cfg, run_dir)
    model_cfg = model_config_for(cfg, data.tokenizer.vocab_size)
    seed_everything(cfg.seed)
    model = FrawdLLM(model_cfg)
    header = (f"# rerun: frawd pretrain --config {run_dir / CONFIG_FILE} --out NEW_DIR\n"
              f"# frawdllm {__version__}, torch {torch.__version__}; model: {model_cfg.num_parameters:,} "
              f"parameters, vocab {model_cfg.vocab_size}, context {model_cfg.context_length}; "
              f"data: {data.meta.get('train_tokens'):,} train / {data.meta.get('val_tokens'):,} val tokens\n")
    saved = PretrainConfig.from_dict({**cfg.to_dict(), "resume": False, "overwrite": False})
    write_text_atomic(run_dir / CONFIG_FILE, dump_yaml(saved, header))
    task = PretrainTask(data, model_cfg, cfg)
    trainer = Trainer(model, task, cfg, run_dir, callbacks=callbacks, config_for_loggers=cfg.to_dict(),
                      started_at=started_at)
    return trainer.fit()
