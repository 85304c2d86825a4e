"""Training an encoder-decoder translation model through the shared loop (`TranslationTask`).

Data: parallel sentences, tokenized by one joint BPE tokenizer trained on both sides (or
a given tokenizer.json). Batches are built by token count, not sentence count: pairs are
sorted by length, cut into batches of about `tokens_per_batch` tokens (rows x the longer
side's width, padding included), and the batches are shuffled each epoch. Sentences of
similar length share a batch, so little of it is padding.

Each pair becomes, with BOS/EOS the tokenizer's control tokens:

    src     x1 .. xm                 (encoder input; padding masked out of attention)
    tgt_in  BOS y1 .. yn             (decoder input, "teacher forcing")
    labels  y1 .. yn EOS             (what each decoder position predicts)

The loss is cross-entropy with label smoothing (0.1 in the paper: the target distribution
puts 0.9 on the right token and spreads 0.1 over the vocabulary), averaged over real
target tokens only: padding labels are IGNORE_INDEX, and tokens/s counts real target
tokens too. Each evaluation reports the validation loss (plain cross-entropy per target
token) and sacreBLEU of greedy translations of the first `bleu_sentences` validation
pairs against their raw reference sentences (not before the first step: an untrained
model writes maximum-length noise, slow to decode and scoring 0).

The job's config, `TranslateConfig`, is in translation_config.py (torch-free, so that the
CLI's --help need not load torch) and re-exported here.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Seq2SeqConfig, get_config
from ..data.parallel import EncodedPairs, encode_pairs, read_parallel, sentences
from ..errors import ConfigError, FrawdError
from ..model import IGNORE_INDEX
from ..tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, short_bpe_note, train_tokenizer
from . import distributed
from .config import parse_duration
from .loop import TrainResult, Trainer, TrainTask, content_hash
from .losses import linear_cross_entropy_and_nll
from .translation_config import TranslateConfig


# ---- batches ---------------------------------------------------------------------------------

def token_batches(pairs: list[tuple[list[int], list[int]]], tokens_per_batch: int, rng: random.Random
                  ) -> list[list[int]]:
    """Pair indices grouped into batches of at most `tokens_per_batch` padded tokens (rows x
    max(source length, target length + 1): the target gets BOS or EOS), similar lengths
    together, in random order. A pair wider than `tokens_per_batch` is a batch of its own."""
    order = list(range(len(pairs)))
    rng.shuffle(order)  # ties in length land in a new order each epoch
    order.sort(key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))
    batches, current, width = [], [], 0
    for i in order:
        w = max(width, len(pairs[i][0]), len(pairs[i][1]) + 1)
        if current and (len(current) + 1) * w > tokens_per_batch:
            batches.append(current)
            current, w = [], max(len(pairs[i][0]), len(pairs[i][1]) + 1)
        current.append(i)
        width = w
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(pairs: list[tuple[list[int], list[int]]]) -> dict[str, Tensor]:
    """Padded tensors of a batch: src, src_mask, tgt_in (BOS + target), labels (target + EOS),
    and `normalizer`: its real target tokens, so that `TranslationTask.loss` of it is its mean
    (the task's training batches carry their step's instead: `TranslationTask.next_batch`)."""
    S = max(len(s) for s, _ in pairs)
    T = max(len(t) for _, t in pairs) + 1
    # padded Python lists, one tensor each: a tensor per row cost ~5 ms a batch of 60 rows
    src = torch.tensor([[*s, *[PAD_ID] * (S - len(s))] for s, _ in pairs], dtype=torch.long).view(len(pairs), S)
    src_mask = torch.arange(S) < torch.tensor([len(s) for s, _ in pairs])[:, None]
    tgt_in = torch.tensor([[BOS_ID, *t, *[PAD_ID] * (T - 1 - len(t))] for _, t in pairs], dtype=torch.long)
    labels = torch.tensor([[*t, EOS_ID, *[IGNORE_INDEX] * (T - 1 - len(t))] for _, t in pairs], dtype=torch.long)
    normalizer = torch.tensor(float(sum(len(t) + 1 for _, t in pairs)))
    return {"src": src, "src_mask": src_mask, "tgt_in": tgt_in, "labels": labels, "normalizer": normalizer}


def translation_loss(model: nn.Module, batch: dict[str, Tensor], label_smoothing: float = 0.0) -> Tensor:
    """Mean (label-smoothed) cross-entropy over the batch's real target tokens."""
    return model(batch["src"], batch["tgt_in"], batch["labels"], batch["src_mask"], label_smoothing)[1]


def translation_loss_and_nll(model: nn.Module, batch: dict[str, Tensor], label_smoothing: float
                             ) -> tuple[Tensor, dict[str, Tensor]]:
    """The training loss (label-smoothed) and, as a named metric, the plain cross-entropy
    (`nll`, comparable with val_loss) from the same logits: `translation_loss`'s value,
    computed by `linear_cross_entropy_and_nll` without the (B, T, V) logits, on the real
    target tokens only (padding rows never reach the output projection)."""
    hidden = model.hidden_states(batch["src"], batch["tgt_in"], batch["src_mask"])  # (B, T, D)
    labels = batch["labels"]
    real = labels != IGNORE_INDEX
    if not torch.compiler.is_compiling():  # a data-dependent shape: only outside a compiled graph
        hidden, labels = hidden[real], labels[real]  # (N, D), (N,)
    loss, nll = linear_cross_entropy_and_nll(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                             labels.reshape(-1), label_smoothing)
    return loss, {"nll": nll}


# ---- the task ----------------------------------------------------------------------------------

@dataclass
class ValidationSet:
    pairs: list[tuple[list[int], list[int]]]
    sources: list[str]  # raw sentences of the pairs
    references: list[str]


class TranslationTask(TrainTask):
    bar_metrics = ("nll",)
    token_batches = True  # any number of ranks: a batch's sentence pairs are dealt out (next_batch)

    def __init__(self, model_config: Seq2SeqConfig, tokenizer: Tokenizer | None,
                 train_pairs: list[tuple[list[int], list[int]]], valid: ValidationSet | None,
                 tokens_per_batch: int, seed: int = 1337, label_smoothing: float = 0.1,
                 bleu_sentences: int = 500, eval_batches: int = 20, samples: int = 3, grad_accum: int = 1) -> None:
        if not train_pairs:
            raise FrawdError("no training pairs left to train on")
        self.tokenizer, self.pairs, self.valid = tokenizer, train_pairs, valid
        self.tokens_per_batch, self.seed, self.label_smoothing = tokens_per_batch, seed, label_smoothing
        self.bleu_sentences, self.eval_batches, self.n_samples = bleu_sentences, eval_batches, samples
        self.epoch, self.cursor = 0, 0
        self.batches = self._epoch_batches(0)
        place = distributed.current()
        self.rank, self.world_size, self.grad_accum = place.rank, place.world_size, grad_accum
        # under torchrun: whole token batches per rank when they divide, else each batch's rows
        self.whole = grad_accum % place.world_size == 0
        # a batch's rows dealt out need a row for each rank; batches hold the same pairs every
        # epoch (sorted by length; only their order changes), so epoch 0 tells, now, not hours in
        fewest = min(len(batch) for batch in self.batches)
        if not self.whole and fewest < place.world_size:
            raise FrawdError(f"--tokens-per-batch {tokens_per_batch} makes batches of as few as {fewest} sentence "
                             f"pair{'s' if fewest > 1 else ''} (the longest), which do not split over "
                             f"{place.world_size} ranks: raise --tokens-per-batch or make --grad-accum a multiple "
                             f"of {place.world_size}")
        self._step: list[list[int]] = []  # the token batches of the current optimizer step
        self._step_targets = 0  # their target tokens (each target sentence and its <|eos|>)
        self._micro = 0
        mean_len = sum(len(s) + len(t) for s, t in train_pairs) / (2 * len(train_pairs))
        self.flops_per_token = model_config.flops_per_token(max(1, round(mean_len)))

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        return token_batches(self.pairs, self.tokens_per_batch, random.Random(self.seed * 1_000_003 + epoch))

    def _next_token_batch(self) -> list[int]:
        if self.cursor >= len(self.batches):
            self.epoch, self.cursor = self.epoch + 1, 0
            self.batches = self._epoch_batches(self.epoch)
        self.cursor += 1
        return self.batches[self.cursor - 1]

    def next_batch(self) -> dict[str, Tensor]:
        """This rank's part of the step's `grad_accum` token batches (one process: all of
        them in turn): batch `m x world_size + rank` when the ranks divide `grad_accum`,
        else rows `rank::world_size` of each batch. `normalizer`: the step's target tokens
        per token batch (their mean count), over the number of parts a batch is cut into, so
        that the step's loss is the mean over all its target tokens (as fairseq's)."""
        if self._micro == 0:
            self._step = [self._next_token_batch() for _ in range(self.grad_accum)]
            self._step_targets = sum(len(self.pairs[i][1]) + 1 for batch_ids in self._step for i in batch_ids)
        if self.whole:
            mine = self._step[self._micro * self.world_size + self.rank]
            parts = 1
            self._micro = (self._micro + 1) % (self.grad_accum // self.world_size)
        else:
            unit = self._step[self._micro]
            mine, parts = unit[self.rank::self.world_size], self.world_size  # (never empty: see __init__)
            self._micro = (self._micro + 1) % self.grad_accum
        batch = collate([self.pairs[i] for i in mine])
        batch["normalizer"] = torch.tensor(self._step_targets / self.grad_accum / parts)
        return batch

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The batch's mean loss (and `nll`) over its target tokens, as this rank's share of
        its one-process batch's mean (the mean itself in one process)."""
        loss, metrics = translation_loss_and_nll(model, batch, self.label_smoothing)
        share = (batch["labels"] != IGNORE_INDEX).sum() / batch["normalizer"]
        return loss * share, {"nll": metrics["nll"] * share}

    def batch_tokens(self, batch: dict[str, Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())  # real target tokens: padding not counted

    def _valid_batches(self) -> list[list[int]]:
        """The validation token batches `evaluate` reads: the first eval_batches."""
        return token_batches(self.valid.pairs, self.tokens_per_batch, random.Random(0))[: self.eval_batches]

    def evaluation_key(self) -> dict:
        """The validation pairs `evaluate` reads (other --valid-src/--valid-tgt, --eval-batches,
        --tokens-per-batch... may read others), in any order: val_loss is a mean over their
        tokens, whichever batches hold them."""
        if self.valid is None or not self.valid.pairs:
            return {}
        read = [self.valid.pairs[i] for i in sorted(i for batch in self._valid_batches() for i in batch)]
        return {"validation pairs": content_hash(read)}

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        if self.valid is None or not self.valid.pairs:
            return {}
        total, count = 0.0, 0
        for batch in self._valid_batches():
            data = {k: v.to(device) for k, v in collate([self.valid.pairs[i] for i in batch]).items()}
            logits, _ = model(data["src"], data["tgt_in"], src_mask=data["src_mask"])
            total += float(F.cross_entropy(logits.float().flatten(0, 1), data["labels"].flatten(),
                                           ignore_index=IGNORE_INDEX, reduction="sum"))
            count += int((data["labels"] != IGNORE_INDEX).sum())
        out = {"val_loss": total / max(count, 1)}
        trained = self.epoch > 0 or self.cursor > 0
        self._bleu_s = 0.0
        if self.bleu_sentences and trained:
            n = self.bleu_sentences
            hyps = translate_texts(model, self.tokenizer, [s for s, _ in self.valid.pairs[:n]], beam_size=1)
            out["val_bleu"] = round(corpus_bleu(hyps, self.valid.references[:n]).score, 2)
        elif self.bleu_sentences:  # an untrained model writes maximum-length noise: skip, but time it
            self._bleu_s = self._bleu_cost(model, [s for s, _ in self.valid.pairs[: self.bleu_sentences]])
        return out

    def _bleu_cost(self, model: nn.Module, sources: list[list[int]], probe_steps: int = 8) -> float:
        """Seconds greedy translation of `sources` takes if no sentence ends before its
        length limit (as an untrained model's noise): for each batch `translate_texts` makes,
        one encoder pass and a decode step per token to the batch's limit, both timed on the
        widest batch. A trained model ends its sentences sooner."""
        from ..infer.translate import MAX_EXTRA, greedy_decode, length_limits, pad_batch

        batch, device, pad = 64, next(model.parameters()).device, model.config.pad_token_id
        order = sorted(sources, key=len)  # as translate_ids batches them
        chunks = [order[a: a + batch] for a in range(0, len(order), batch)]
        src, mask = pad_batch(chunks[-1], pad, device)
        ends: list[float] = []
        start = time.perf_counter()
        greedy_decode(model, src, mask, max_steps=probe_steps, step_ends=ends)
        encode_s, step_s = probe_times(start, ends)
        steps = sum(max(length_limits(model, pad_batch(chunk, pad, device)[1], MAX_EXTRA)) for chunk in chunks)
        return len(chunks) * encode_s + steps * step_s

    def evaluation_extra_s(self) -> float:
        return getattr(self, "_bleu_s", 0.0)

    def samples(self, model: nn.Module, device: torch.device) -> list[str]:
        if self.valid is None or not self.n_samples or (self.epoch == 0 and self.cursor == 0):
            return []
        sources = self.valid.pairs[: self.n_samples]
        hyps = translate_texts(model, self.tokenizer, [s for s, _ in sources], beam_size=1)
        return [f"{src} => {hyp}" for src, hyp in zip(self.valid.sources, hyps)]

    def save_model(self, model: nn.Module, directory: Path) -> None:
        model.save_pretrained(directory, tokenizer=self.tokenizer)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.batches = self._epoch_batches(self.epoch)
        self._micro = 0


def probe_times(start: float, step_ends: list[float]) -> tuple[float, float]:
    """(encoder pass, decode step) seconds of a `greedy_decode` probe started at `start`,
    from its `step_ends`: the steps after the first are the decoder's alone; the first one
    also waited for the encoder (and the cache's allocation). One step: all of it a step."""
    if len(step_ends) < 2:
        return 0.0, step_ends[-1] - start
    step_s = (step_ends[-1] - step_ends[0]) / (len(step_ends) - 1)
    return max(step_ends[0] - start - step_s, 0.0), step_s


def translate_texts(model: nn.Module, tokenizer: Tokenizer, sources: list[list[int]] | list[str],
                    beam_size: int = 4, alpha: float = 0.6, batch_size: int = 64) -> list[str]:
    """Detokenized translations of sentences (text or token ids), each on one line: a line
    break the model wrote (byte-level BPE holds the newline as a token) becomes a space, so that
    outputs and hypothesis files keep one line per source line."""
    from ..infer.translate import translate_ids

    ids = [tokenizer.encode(s.strip()) if isinstance(s, str) else s for s in sources]  # (see parallel.sentences)
    out = translate_ids(model, ids, beam_size=beam_size, alpha=alpha, batch_size=batch_size)
    return [" ".join(tokenizer.decode(h, skip_special_tokens=True).strip().splitlines()) for h in out]


def corpus_bleu(hypotheses: list[str], references: list[str]):
    """sacreBLEU's corpus BLEU (cased, 13a tokenization: its defaults) against raw references."""
    import sacrebleu

    return sacrebleu.corpus_bleu(hypotheses, [references])


# ---- the job -----------------------------------------------------------------------------------

def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def given_tokenizer(spec: str) -> Tokenizer:
    """--tokenizer SPEC, loaded and checked: translation pads, starts and ends sentences
    with FrawdLLM's special tokens, so they must sit at their ids (0..6)."""
    from .pretrain import tokenizer_path

    path = tokenizer_path(spec)
    if path is None:
        raise FrawdError(f"--tokenizer {spec}: no tokenizer.json there")
    return Tokenizer.load(path).require_frawd_specials(
        f"--tokenizer {spec}", "which translation uses for padding, BOS and EOS; leave out --tokenizer to train "
                               "one on the data, or give one from `frawd tokenizer train`")


def _tokenizer_for(cfg: TranslateConfig, src: list[str], tgt: list[str]) -> Tokenizer:
    if cfg.tokenizer is not None:
        return given_tokenizer(cfg.tokenizer)
    vocab = cfg.vocab_size or get_config(cfg.preset, **cfg.model).vocab_size
    _say(f"training a joint BPE tokenizer ({vocab} tokens) on {len(src):,} + {len(tgt):,} sentences...")
    tokenizer = train_tokenizer((line for side in (src, tgt) for line in sentences(side) if line), "bpe", vocab)
    note = short_bpe_note(tokenizer, vocab)
    if note is not None:
        _say(note)
    return tokenizer


@dataclass
class ParallelText:
    train: tuple[list[str], list[str]]  # (source sentences, target sentences)
    valid: tuple[list[str], list[str]] | None


def check_translation(cfg: TranslateConfig) -> ParallelText:
    """Everything about the job that can be checked without a tokenizer, before any work (a
    FrawdError here means nothing was written): flags, OUT, --tokenizer, --max-len against
    the model's context, and the parallel text, read and returned (files that exist, decode
    and align, with a pair that has two sides). `frawd translate train --nproc N` calls it
    before torchrun starts: bad input is one line, not one per rank."""
    from .rundir import check_run_dir

    check_run_dir(cfg)  # first: `--resume` of a run that is not there is that, not missing --src
    # (after it: a resume's vocab_size comes from the run's config.yaml, and a --tokenizer
    # given then is refused there as a change of the run's tokenizer)
    if cfg.tokenizer is not None and cfg.vocab_size is not None:
        raise ConfigError(f"vocab_size {cfg.vocab_size}: the vocabulary is --tokenizer {cfg.tokenizer}'s own; "
                          "--vocab-size sizes a tokenizer trained on the data: give one of them, not both")
    if not cfg.src or not cfg.tgt:
        raise FrawdError("give the training text: --src FILE --tgt FILE")
    cfg.require_budget()
    context = get_config(cfg.preset, **cfg.model).context_length
    if cfg.max_len > context - 1:  # a target side and its BOS (or EOS) fill the decoder's positions
        raise FrawdError(f"--max-len {cfg.max_len} exceeds the {context - 1} tokens a sentence may have in the "
                         f"model's context_length {context} (with BOS/EOS); lower --max-len or --set "
                         "context_length=N")
    if cfg.tokenizer is not None and not cfg.resume:  # a resumed run uses the tokenizer in its folder
        given_tokenizer(cfg.tokenizer)
    train = read_parallel(cfg.src, cfg.tgt)
    _require_two_sides(*train, "training", "--src/--tgt")
    valid = read_parallel(cfg.valid_src, cfg.valid_tgt) if cfg.valid_src else None
    if valid is not None:
        _require_two_sides(*valid, "validation", "--valid-src/--valid-tgt")
    return ParallelText(train, valid)


def _require_two_sides(src: list[str], tgt: list[str], what: str, flags: str) -> None:
    """Refuse text of which every pair has an empty side (the skip a tokenizer is not needed for)."""
    if all(not s.strip() or not t.strip() for s, t in zip(src, tgt)):
        raise FrawdError(f"no {what} pairs left in {flags}: all {len(src):,} skipped, {len(src):,} with an "
                         "empty side")


def run_translation_training(cfg: TranslateConfig, started_at: float | None = None) -> TrainResult:
    """The whole job: read and check the data, tokenizer, model, then the shared loop."""
    from ..model import Seq2SeqTransformer
    from .device import seed_everything
    from .rundir import prepare_run_dir, save_run_config, undo_failed_start

    started_at = time.perf_counter() if started_at is None else started_at
    place = distributed.setup(cfg.parallel, cfg.device, parse_duration(cfg.dist_timeout))
    cfg = distributed.rank_config(cfg)
    data = check_translation(cfg)
    (src, tgt), valid_text = data.train, data.valid
    run_dir = Path(cfg.out)
    tokenizer_file = run_dir / "tokenizer.json"
    with undo_failed_start(cfg, enabled=place.is_main):
        if place.is_main:  # OUT first: one it cannot write is said before the tokenizer's training
            prepare_run_dir(cfg)
            tokenizer = Tokenizer.load(tokenizer_file) if cfg.resume and tokenizer_file.is_file() \
                else _tokenizer_for(cfg, src, tgt)
        if place.active:  # every rank takes rank 0's tokenizer (one BPE training, not N)
            text = place.after_main(tokenizer.to_json() if place.is_main else None, "the tokenizer")
            tokenizer = Tokenizer.from_json(text)
        train = encode_pairs(tokenizer, src, tgt, cfg.max_len)
        _require_pairs(train, "training", f"--max-len {cfg.max_len} tokens", "--src/--tgt")
        say = _report_skipped if place.is_main else (lambda *args: None)
        say(train, "training data", cfg.max_len)
        overrides = {**cfg.model, "vocab_size": tokenizer.vocab_size, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID,
                     "eos_token_id": EOS_ID}
        model_cfg = get_config(cfg.preset, **overrides)
        valid = None
        if valid_text is not None:  # any length the model takes (a side and its BOS/EOS)
            limit = model_cfg.context_length - 1
            encoded = encode_pairs(tokenizer, *valid_text, limit)
            _require_pairs(encoded, "validation", f"{limit} tokens (the model's context_length less BOS/EOS)",
                           "--valid-src/--valid-tgt")
            say(encoded, "validation data", limit)
            valid = ValidationSet(encoded.pairs, [valid_text[0][i] for i in encoded.kept],
                                  [valid_text[1][i] for i in encoded.kept])
        if place.is_main:
            tokenizer.save(tokenizer_file)
        cfg.resume, cfg.overwrite = place.from_main((cfg.resume, cfg.overwrite))
        seed_everything(cfg.seed)
        model = Seq2SeqTransformer(model_cfg)
        save_run_config(cfg, "translate train", place.world_size, f"model: {model_cfg.num_parameters:,} parameters, "
                        f"vocab {model_cfg.vocab_size}; data: {len(train.pairs):,} training pairs", place.is_main)
        task = TranslationTask(model_cfg, tokenizer, train.pairs, valid, cfg.tokens_per_batch, cfg.seed,
                               cfg.label_smoothing, cfg.bleu_sentences, cfg.eval_batches,
                               grad_accum=cfg.grad_accum)
        trainer = Trainer(model, task, cfg, run_dir, config_for_loggers=cfg.to_dict(), started_at=started_at)
    return trainer.fit()


def _require_pairs(encoded: EncodedPairs, what: str, limit: str, flags: str) -> None:
    """Refuse data of which every pair was skipped, saying why (before anything is written)."""
    if not encoded.pairs:
        raise FrawdError(f"no {what} pairs left in {flags}: all {encoded.empty + encoded.too_long:,} skipped, "
                         f"{encoded.skip_reasons(limit)}")


def _report_skipped(encoded: EncodedPairs, what: str, max_len: int) -> None:
    message = encoded.skipped_message(what, max_len)
    if message:
        _say(message)
