"""Pretraining: next-token prediction on a corpus, through the shared loop.

`run_pretraining(cfg)` does the whole job:

0. checks: everything that can be checked without work (the budget, OUT, the data source,
   the tokenizer, the model config) is checked first, so a bad start fails at once; a start
   that fails later removes the OUT it created.
1. data: a raw source (`stdlib`, files, JSONL, ...) gets a tokenizer (trained on it, or
   a given tokenizer.json) and is tokenized into OUT/data/{train,val}.bin; both are
   reused when a rerun has the same inputs. A folder of prepared shards is used as is.
2. model: the preset with its overrides, its vocabulary sized to the tokenizer's; or, with
   `init_from`, an existing model directory's config and weights (its tokenizer.json by
   default; training starts at step 0 with a fresh optimizer).
3. `PretrainTask`: random windows of the training tokens (`RandomWindowLoader`,
   resumable), cross-entropy from the hidden states without the full logits
   (`losses.linear_cross_entropy`), validation on the first `eval_batches` batches of
   `batch_size` windows of val.bin, a sample at each evaluation.
4. `Trainer(...).fit()`; OUT/model is the best model, tokenizer.json included.

--max-time covers all of it, from the call's start (from the process's start under
`frawd pretrain`). Under torchrun rank 0 prepares the run directory and the data while the
others wait, then every rank trains its share of each batch (`distributed`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..config import PRESETS, ModelConfig, get_config, is_integer
from ..data import META_FILE, RandomWindowLoader, prepare_shards, read_split, split_files
from ..data.loader import check_one_window
from ..data.shards import print_warnings, read_shard_meta, resolved_source, shard_files, split_bytes_per_token
from ..data.shard_format import TokenArray
from ..errors import ConfigError, FrawdError
from ..io import write_json_atomic
from ..memory import check_training_fits
from ..modeldir import (checked_weights, load_config, load_generation_config, load_model, require_kind,
                        save_model_dir, tables_too_large)
from ..tokenizer import (KINDS, SPECIAL_TOKENS, TOKENIZER_FILE, Tokenizer, check_bpe_vocab_size, short_bpe_note,
                         train_tokenizer)
from . import distributed
from .checkpoint import damaged_checkpoint, latest_checkpoint
from .config import PretrainConfig, field_defaults, parse_duration
from .device import pick_device, seed_everything
from .evaluate import lm_loss, lm_metrics
from .losses import linear_cross_entropy
from .loop import Trainer, TrainResult, TrainTask, content_hash
from .rundir import check_run_dir, checkpoints_gone, has_run, prepare_run_dir, save_run_config, undo_failed_start

DATA_DIR = "data"
TOKENIZER_SOURCE_FILE = "tokenizer_source.json"  # what OUT/tokenizer.json was trained on


@dataclass
class PreparedData:
    train: TokenArray  # a shard memmap, or several shards as one stream
    val: TokenArray
    tokenizer: Tokenizer
    meta: dict
    shard_dir: Path


class PretrainTask(TrainTask):
    def __init__(self, data: PreparedData, model_config: ModelConfig, cfg: PretrainConfig,
                 context_length: int | None = None) -> None:
        """Training windows are `context_length` tokens long (default: the model's context)."""
        self.data, self.cfg = data, cfg
        self.context_length = context_length or model_config.context_length
        # this rank's share of each global batch; validation reads the same windows on every rank
        place = distributed.current()
        micro, accum = distributed.batch_layout(cfg.batch_size, cfg.grad_accum, place.world_size)
        self.loader = RandomWindowLoader(data.train, micro, self.context_length, seed=cfg.seed, rank=place.rank,
                                         world_size=place.world_size, grad_accum=accum,
                                         vocab_size=model_config.vocab_size)
        self.flops_per_token = model_config.flops_per_token(self.context_length)
        self.bytes_per_token = split_bytes_per_token(data.meta, "val")
        self.can_evaluate = len(data.val) > self.context_length
        # --init-from's sampling defaults (an imported model's), kept in the models saved
        self.generation_config = load_generation_config(cfg.init_from) if cfg.init_from else {}

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

    def evaluation_key(self) -> dict:
        """The tokens `evaluate` reads: its first eval_batches x batch_size windows of val.bin
        (others with other --data, --val-fraction, --doc-split, --eval-batches...)."""
        if not self.can_evaluate:
            return {}
        windows = min((len(self.data.val) - 1) // self.context_length, self.cfg.eval_batches * self.cfg.batch_size)
        read = np.asarray(self.data.val[:windows * self.context_length + 1])
        return {"validation tokens": content_hash(read, self.context_length)}

    def samples(self, model: nn.Module, device: torch.device) -> list[str]:
        from ..infer import Engine, SamplingParams

        params = SamplingParams(max_new_tokens=self.cfg.sample_tokens, temperature=0.8, top_k=50,
                                seed=self.cfg.seed)
        # slide: a sample of more tokens than the context (shakespeare_char: 200 in 64) goes on
        completion = Engine(model, self.data.tokenizer, overflow="slide").generate(self.cfg.sample_prompt, params)[0]
        return [self.cfg.sample_prompt + completion.text]

    def prepare_samples(self, device: torch.device) -> None:
        from ..infer import native

        native.build_for(device)

    def save_model(self, model: nn.Module, directory: Path) -> None:
        save_model_dir(model, directory, tokenizer=self.data.tokenizer,
                       generation_config=self.generation_config or None)

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict(), "data": self._data_identity(), "split": self._split()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        before = state.get("data")
        if before is not None and before != self._data_identity() and distributed.current().is_main:
            split, now = state.get("split") or {}, self._split()
            moved = [f"{name} {split[name]!r} -> {value!r}" for name, value in now.items()
                     if name != "data" and name in split and split[name] != value]
            if split.get("data") not in (None, now["data"]):  # another source, given on purpose
                what = f"the run trains on other data now ({self.cfg.data})"
            elif moved:
                what = f"the training split moved ({', '.join(moved)})"
            else:
                what = f"the training data ({self.cfg.data}) changed since the checkpoint"
            print(f"warning: {what} ({before['train_tokens']:,} -> {len(self.data.train):,} training tokens): the "
                  "run goes on with the new data, from a position that was drawn in the old", file=sys.stderr)

    def _split(self) -> dict:
        """The source and the settings that split it into train and validation (a shard
        folder's split is fixed)."""
        source = {"data": resolved_source(self.cfg.data)}
        if is_shard_dir(self.cfg.data):
            return source
        return {**source, "val_fraction": self.cfg.val_fraction, "doc_split": self.cfg.doc_split,
                "text_field": self.cfg.text_field}

    def _data_identity(self) -> dict:
        """What says the training tokens are those a checkpoint's loader position was drawn
        in: their count and a hash of 4096 of them, evenly spread (a source merely touched,
        whose shards are made again the same, is the same data)."""
        n = len(self.data.train)
        sample = np.asarray(self.data.train[np.linspace(0, n - 1, num=min(n, 4096), dtype=np.int64)])
        return {"train_tokens": n, "sample_sha256": hashlib.sha256(sample.astype("<u4").tobytes()).hexdigest()}


# ---- data --------------------------------------------------------------------------------------

def is_shard_dir(path: str | Path) -> bool:
    """A folder of prepared shards: meta.json and every shard file it lists (or train.bin, val.bin).

    A folder with meta.json and some of those files but not all is an error (one missing
    split would otherwise be read as a text corpus: the bytes of the other)."""
    meta = read_shard_meta(path)
    if meta is None:  # none, or not ours (unreadable, not JSON, not an object)
        return False
    files = split_files(path, "train", meta) + split_files(path, "val", meta)  # (damaged lists: one line)
    if not any(f.is_file() for f in files):
        return False
    shard_files(path, meta)  # all there, else one line naming the missing ones
    return True


def tokenizer_path(spec: str) -> Path | None:
    """`spec` as a tokenizer.json path (a file, or a folder holding one), else None."""
    path = Path(spec)
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        return path / TOKENIZER_FILE
    return path if path.is_file() else None


def given_tokenizer(cfg: PretrainConfig) -> Tokenizer | None:
    """The tokenizer.json to use, loaded: --tokenizer PATH, else the --init-from model's, else
    the one beside prepared shards; None when a tokenizer kind is to be trained on --data."""
    spec = cfg.tokenizer
    if spec is not None and spec not in KINDS and tokenizer_path(spec) is None:
        raise FrawdError(f"tokenizer {spec!r} is neither a kind ({', '.join(KINDS)}) nor a tokenizer.json path")
    if spec is not None and spec not in KINDS:
        return Tokenizer.load(tokenizer_path(spec))
    if cfg.init_from is not None:
        path = tokenizer_path(cfg.init_from)
        if spec is not None:
            own = " (or none, for the model's)" if path is not None else ""
            raise FrawdError(f"--init-from {cfg.init_from}: the model's embeddings belong to its own tokenizer; "
                             f"give a tokenizer.json with --tokenizer{own}, not a kind to train ({spec})")
        if path is None:
            raise FrawdError(f"--init-from {cfg.init_from} has no {TOKENIZER_FILE}; give the model's tokenizer "
                             "with --tokenizer PATH")
        return Tokenizer.load(path)
    if is_shard_dir(cfg.data):
        path = tokenizer_path(cfg.data)
        if path is None:
            raise FrawdError(f"{cfg.data} holds prepared shards; give their tokenizer with --tokenizer PATH")
        return Tokenizer.load(path)
    return None


def _shard_meta(shard_dir: Path, tok: Tokenizer) -> dict:
    meta = json.loads((shard_dir / META_FILE).read_text(encoding="utf-8"))
    if meta.get("tokenizer_hash") not in (None, tok.fingerprint):
        raise FrawdError(f"this tokenizer ({tok.vocab_size} tokens) is not the tokenizer the shards in {shard_dir} "
                         "were made with")
    return meta


def prepare_data(cfg: PretrainConfig, run_dir: Path) -> PreparedData:
    tok = given_tokenizer(cfg)
    own = tokenizer_path(cfg.init_from) if cfg.init_from is not None and cfg.tokenizer is not None else None
    if own is not None and Tokenizer.load(own).fingerprint != tok.fingerprint and distributed.current().is_main:
        print(f"warning: --tokenizer {cfg.tokenizer} is not the tokenizer of --init-from {cfg.init_from}: its ids "
              "name other tokens than the ones the model's embeddings learned", file=sys.stderr)
    if is_shard_dir(cfg.data):
        shard_dir = Path(cfg.data)
        meta = _shard_meta(shard_dir, tok)
    else:
        tok = tok or _source_tokenizer(cfg, run_dir)
        shard_dir = run_dir / DATA_DIR
        meta = prepare_shards(cfg.data, tok, shard_dir, val_fraction=cfg.val_fraction, text_field=cfg.text_field,
                              doc_split=cfg.doc_split, progress=cfg.progress and sys.stderr.isatty())
        print_warnings(meta)
    return PreparedData(read_split(shard_dir, "train", meta), read_split(shard_dir, "val", meta), tok, meta,
                        shard_dir)


def _bpe_vocab_size(cfg: PretrainConfig) -> int:
    return cfg.vocab_size or cfg.model.get("vocab_size") or PRESETS[cfg.preset]["vocab_size"]


def _source_tokenizer(cfg: PretrainConfig, run_dir: Path) -> Tokenizer:
    """A tokenizer of kind --tokenizer trained on the source (reused while the source is the same)."""
    kind = cfg.tokenizer or "bpe"
    vocab_size = _bpe_vocab_size(cfg)
    source = {"data": resolved_source(cfg.data), "kind": kind, "vocab_size": vocab_size if kind == "bpe" else None,
              "text_field": cfg.text_field, "doc_split": cfg.doc_split}
    saved, record = run_dir / TOKENIZER_FILE, run_dir / DATA_DIR / TOKENIZER_SOURCE_FILE
    if saved.is_file() and cfg.resume:  # the checkpoint's model reads its ids: other --data is tokenized with it
        return Tokenizer.load(saved)  # (it was trained again on that data: the run went on in another vocabulary)
    if saved.is_file() and record.is_file() and json.loads(record.read_text(encoding="utf-8")) == source:
        return Tokenizer.load(saved)
    from ..data.sources import iter_documents

    if cfg.progress:
        print(f"training a {kind} tokenizer on {cfg.data} ...", file=sys.stderr, flush=True)
    documents = iter_documents(cfg.data, text_field=cfg.text_field, doc_split=cfg.doc_split)
    # the trainer's bars only where someone watches them (in a log they are blank lines)
    tok = train_tokenizer(documents, kind=kind, vocab_size=vocab_size,
                          show_progress=cfg.progress and sys.stderr.isatty())
    note = short_bpe_note(tok, vocab_size) if kind == "bpe" else None
    if note:  # (the model's vocabulary is the tokenizer's, unless set)
        print(note, file=sys.stderr, flush=True)
    tok.save(saved)
    write_json_atomic(record, source)
    return tok


# ---- model and run ---------------------------------------------------------------------------------

def model_config_for(cfg: PretrainConfig, vocab_size: int, tokenizer: Tokenizer | None = None) -> ModelConfig:
    """The preset with its overrides; the vocabulary fits the tokenizer (a larger one is kept).
    Special ids set by hand must be the tokenizer's where it has FrawdLLM's fixed specials
    (every tokenizer trained here: `tokenizer` None); another project's tokenizer gives its
    end-of-text token for the ids not set."""
    overrides = cfg.model  # (its values typed by PretrainConfig)
    wanted = overrides.get("vocab_size")
    if wanted is not None and wanted < vocab_size:
        raise FrawdError(f"model vocab_size {wanted} is smaller than the tokenizer's {vocab_size}")
    if tokenizer is None or tokenizer.has_frawd_specials():
        for name, token in (("pad_token_id", "<|pad|>"), ("bos_token_id", "<|bos|>"), ("eos_token_id", "<|eos|>")):
            fixed = SPECIAL_TOKENS.index(token)
            if overrides.get(name, fixed) != fixed:
                raise FrawdError(f"{name} {overrides[name]} is not the tokenizer's {token} id ({fixed}); "
                                 f"FrawdLLM's tokenizers fix their special ids: leave {name} unset")
    elif (end := tokenizer.document_end_id()) is not None:
        # another project's tokenizer (no <|eos|> at 3): its end-of-text token ends the shards'
        # documents, so the model stops generating there (as an imported model's ids: one for all three)
        overrides = {"pad_token_id": end, "bos_token_id": end, "eos_token_id": end, **overrides}
    model_cfg = get_config(cfg.preset, **{**overrides, "vocab_size": wanted or vocab_size})
    problem = tables_too_large(model_cfg, 4 * model_cfg.num_parameters)
    if problem:
        raise FrawdError(f"{problem}, so no command could load the trained model: give a shorter context_length")
    return model_cfg


def _known_vocab_size(cfg: PretrainConfig, tok: Tokenizer | None) -> int | None:
    """The tokenizer's size: given, or known before it is trained here (BPE's target, byte's
    alphabet and specials); None for char (the data's characters)."""
    if tok is not None:
        return tok.vocab_size
    return {"bpe": _bpe_vocab_size(cfg), "byte": 256 + len(SPECIAL_TOKENS)}.get(cfg.tokenizer or "bpe")


def init_model_config(cfg: PretrainConfig) -> tuple[ModelConfig, int]:
    """The --init-from model's config (dropout as overridden) and the training windows' length.

    Model settings from the config file or --set may repeat the model's values, change
    dropout, or shorten context_length (shorter training windows; the model keeps its own)."""
    base = load_config(cfg.init_from)
    require_kind(cfg.init_from, base, "decoder")
    checked_weights(cfg.init_from, base)  # a bad weights file is found now, not after tokenizing
    try:
        wanted = base.replace(**cfg.model)
    except ConfigError as exc:
        raise FrawdError(f"--init-from {cfg.init_from}: {exc}") from None
    old, new = base.settings(), wanted.settings()
    changed = {name: (old[name], new[name]) for name in new
               if old[name] != new[name] and name not in ("dropout", "context_length")}
    if changed:
        listed = ", ".join(f"{name}={new!r} (the model has {old!r})" for name, (old, new) in changed.items())
        raise FrawdError(f"--init-from {cfg.init_from} fixes the model; these model settings differ from its "
                         f"config.json: {listed}; remove them")
    if wanted.context_length > base.context_length:
        raise FrawdError(f"context_length {wanted.context_length} exceeds the --init-from model's "
                         f"{base.context_length}")
    return base.replace(dropout=wanted.dropout), wanted.context_length


def check_pretrain(cfg: PretrainConfig) -> None:
    """Every check that needs no real work: the budget, OUT, the device, the data source, the
    tokenizer and the model config. A FrawdError here means nothing was written."""
    check_run_dir(cfg)
    cfg.require_budget()
    device = pick_device(cfg.device)
    model_cfg, window = init_model_config(cfg) if cfg.init_from is not None else (None, None)
    tok = given_tokenizer(cfg)
    meta = _shard_meta(Path(cfg.data), tok) if is_shard_dir(cfg.data) else _check_source(cfg)
    if model_cfg is not None:
        if tok.vocab_size > model_cfg.vocab_size:
            raise FrawdError(f"the tokenizer has {tok.vocab_size} tokens but the --init-from model "
                             f"{cfg.init_from} has vocab_size {model_cfg.vocab_size}; use the model's tokenizer")
    else:
        if tok is None and (cfg.tokenizer or "bpe") == "bpe":
            check_bpe_vocab_size(_bpe_vocab_size(cfg))
        model_cfg = model_config_for(cfg, _known_vocab_size(cfg, tok) or len(SPECIAL_TOKENS), tok)
        window = model_cfg.context_length
    if meta is not None and is_integer(meta.get("train_tokens")):  # (prepared shards say how many)
        check_one_window(meta["train_tokens"], window)
    check_training_fits(model_cfg, cfg.batch_size, window, cfg.dtype, device)


def vocab_size_note(cfg: PretrainConfig) -> str | None:
    """A note when --vocab-size cannot apply: the tokenizer is given (or --init-from's), or is not BPE."""
    if cfg.vocab_size and cfg.init_from and not cfg.tokenizer:
        return "note: --vocab-size applies to a BPE tokenizer trained here, not to the --init-from model's"
    if not cfg.vocab_size or (cfg.tokenizer or "bpe") == "bpe":
        return None
    if cfg.tokenizer in ("char", "byte"):
        return f"note: --vocab-size applies to BPE only; a {cfg.tokenizer} tokenizer takes its size from the data"
    return "note: --vocab-size applies to a BPE tokenizer trained here, not to a given tokenizer.json"


def shard_source_note(cfg: PretrainConfig) -> str | None:
    """A note when --data is a shard folder and the raw-source settings (--val-fraction,
    --doc-split, --text-field) are not at their defaults: the folder's split applies."""
    from ..data.shards import raw_source_flags_note

    if not is_shard_dir(cfg.data):
        return None
    defaults = field_defaults(PretrainConfig)
    given = [f"--{name.replace('_', '-')}" for name in ("val_fraction", "doc_split", "text_field")
             if getattr(cfg, name) != defaults[name]]
    return raw_source_flags_note(given, cfg.data, read_shard_meta(cfg.data) or {})


def _check_source(cfg: PretrainConfig) -> None:
    """A raw source exists (its documents are read later)."""
    import importlib.util

    from ..data.sources import parse_hf_spec, source_files

    if cfg.data.startswith("hf:"):
        parse_hf_spec(cfg.data)
        if importlib.util.find_spec("datasets") is None:
            raise FrawdError("hf: sources need the datasets library: pip install 'frawdllm[hf]'")
        return
    source_files(cfg.data)


def dry_run_plan(cfg: PretrainConfig) -> list[str]:
    """`frawd pretrain --dry-run`: the settings checked (nothing trained or written) and the plan."""
    from .device import hardware_report

    check_pretrain(cfg)
    run_dir = Path(cfg.out)
    tok = given_tokenizer(cfg)
    resumed = cfg.resume and latest_checkpoint(run_dir) is not None and (run_dir / TOKENIZER_FILE).is_file()
    if tok is None and resumed:  # (as `_source_tokenizer` will: the run's own)
        tok = Tokenizer.load(run_dir / TOKENIZER_FILE)
    kind = cfg.tokenizer if cfg.tokenizer in KINDS else (cfg.tokenizer or "bpe") if tok is None else None
    if tok is not None:  # a tokenizer.json: given, the --init-from model's, the shards' or the run's
        whose = "the --init-from model's " if cfg.init_from is not None and cfg.tokenizer is None else \
            "the run's " if resumed and cfg.tokenizer in (None, *KINDS) else ""
        tokenizer = f"{whose}{tok.kind or ''} tokenizer, {tok.vocab_size:,} tokens".replace("  ", " ")
    else:
        tokenizer = f"a {kind} tokenizer trained on it"
    if cfg.init_from is not None:
        model_cfg, window = init_model_config(cfg)
        model = f"--init-from {cfg.init_from}, {model_cfg.num_parameters:,} parameters"
    else:
        vocab = _known_vocab_size(cfg, tok)
        model_cfg = model_config_for(cfg, vocab or len(SPECIAL_TOKENS), tok)
        window = model_cfg.context_length
        if vocab is not None:
            at_most = " at most: BPE stops early on a small corpus" if tok is None and kind == "bpe" and \
                "vocab_size" not in cfg.model else ""
            model = (f"{cfg.preset}, {model_cfg.num_parameters:,} parameters (vocabulary "
                     f"{model_cfg.vocab_size:,}{at_most})")
        elif "vocab_size" in cfg.model:  # char, the vocabulary given
            model = (f"{cfg.preset}, {model_cfg.num_parameters:,} parameters (vocabulary {model_cfg.vocab_size:,}: "
                     f"the data's characters and {len(SPECIAL_TOKENS)} special tokens must fit in it)")
        else:  # char: the vocabulary is the data's characters, known once the tokenizer is trained
            per_token = model_cfg.n_embd * (1 if model_cfg.tie_embeddings else 2)
            model = (f"{cfg.preset}, {model_cfg.num_parameters:,} parameters + {per_token} per character of the "
                     "data (the char vocabulary is known once trained)")
    budget = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in (("max_steps", cfg.max_steps),
                       ("max_tokens", cfg.max_tokens), ("max_time", cfg.max_time)) if v is not None)
    action = "resume" if cfg.resume else "overwrite" if has_run(run_dir) else "new run"
    if cfg.resume and latest_checkpoint(run_dir) is None:  # as `settle_run_dir` will do
        damage = damaged_checkpoint(run_dir) if not cfg.overwrite else None
        gone = checkpoints_gone(run_dir) if not cfg.overwrite else None
        action = (f"no complete checkpoint to resume from: {damage}; --resume refuses it" if damage else
                  f"nothing to resume from: the run {gone}; --resume refuses it" if gone else
                  "no complete checkpoint to resume from: --resume starts the run over")
    lines = ["dry run: nothing trained, nothing written",
             f"out:           {run_dir} ({action})",
             f"data:          {cfg.data} ({tokenizer})",
             f"model:         {model}, context {model_cfg.context_length}",
             f"batch:         {cfg.batch_size} x {cfg.grad_accum} x {window} tokens per step",
             f"budget:        {budget}" + (" (--max-time: the whole command, tokenizer, data, warm-up, "
                                               "evaluations and save included)" if cfg.max_time else "")]
    say = functools.partial(print, file=sys.stderr, flush=True)  # (a peak measured: said, bar or not)
    return lines + hardware_report(cfg.device, cfg.dtype, cfg.compile, say=say, peak_tflops=cfg.peak_tflops)


def build_model(cfg: PretrainConfig, tokenizer: Tokenizer) -> tuple[nn.Module, int]:
    """The model to train (fresh from the preset, or --init-from's weights) and the length of
    its training windows."""
    from .. import FrawdLLM

    seed_everything(cfg.seed)
    if cfg.init_from is None:
        model_cfg = model_config_for(cfg, tokenizer.vocab_size, tokenizer)
        return FrawdLLM(model_cfg), model_cfg.context_length
    model_cfg, window = init_model_config(cfg)
    return load_model(cfg.init_from, config=model_cfg), window


def run_pretraining(cfg: PretrainConfig, callbacks: list | None = None,
                    started_at: float | None = None) -> TrainResult:
    """The whole job. --max-time counts from `started_at` (a `time.perf_counter()`; default:
    now), so tokenizer training and data preparation are inside the budget."""
    started_at = time.perf_counter() if started_at is None else started_at
    place = distributed.setup(cfg.parallel, cfg.device, parse_duration(cfg.dist_timeout))
    cfg = distributed.rank_config(cfg)
    check_pretrain(cfg)
    run_dir = Path(cfg.out)
    with undo_failed_start(cfg, enabled=place.is_main, keep=(DATA_DIR, TOKENIZER_FILE)):
        if place.is_main:  # the others wait, then read what rank 0 made
            prepare_run_dir(cfg)
            data = prepare_data(cfg, run_dir)
        cfg.resume, cfg.overwrite = place.after_main((cfg.resume, cfg.overwrite),
                                                     "the run's start (tokenizer, data)")
        if not place.is_main:
            data = prepare_data(cfg, run_dir)
        model, window = build_model(cfg, data.tokenizer)
        model_cfg = model.config
        start = f"--init-from {cfg.init_from}; " if cfg.init_from else ""
        about = (f"{start}model: {model_cfg.num_parameters:,} parameters, vocab {model_cfg.vocab_size}, context "
                 f"{model_cfg.context_length}; data: {len(data.train):,} train / {len(data.val):,} val tokens")
        task = PretrainTask(data, model_cfg, cfg, context_length=window)  # data too short: refused here
        if not task.can_evaluate and place.is_main:  # (was silent: no val_loss line, nothing said why)
            print(f"warning: the validation split has {len(data.val):,} tokens, fewer than one window of "
                  f"{window + 1:,}: no val_loss, and {run_dir / 'model'} will be the last step's model (raise "
                  "--val-fraction, or use a longer corpus or a shorter context)", file=sys.stderr)
        save_run_config(cfg, "pretrain", place.world_size, about, place.is_main)
        trainer = Trainer(model, task, cfg, run_dir, callbacks=callbacks, config_for_loggers=cfg.to_dict(),
                          started_at=started_at)
    return trainer.fit()
