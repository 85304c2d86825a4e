"""Decoding an encoder-decoder model: batched greedy search and beam search.

Both encode the source once and project the encoder output to every decoder layer's
cross-attention keys/values once (`Seq2SeqTransformer.memory_kv`); each step then runs
the decoder on one new token per row, its self-attention reading the earlier tokens'
keys/values from a `KVCache` (`use_cache=False` recomputes the whole prefix instead: the
same result, slower; the tests compare the two).

Greedy: each row takes its most likely next token until it emits EOS or reaches its
length limit (source length + `max_extra` tokens, as in the paper, and at most the
model's context_length).

Beam search keeps the `beam_size` best partial translations per sentence, ranked by the
sum of their tokens' log-probabilities. A hypothesis that ends (EOS) is set aside with
the score sum / lp, where lp = ((5 + length) / 6) ** alpha (GNMT's length penalty; alpha
0.6 in the paper; length: the tokens scored, its EOS included), so that longer translations are not ruled out just for having more
terms. A sentence is done when it has `beam_size` ended hypotheses (or reaches its
limit); the search stops when every sentence is done. With beam_size 1 it is greedy.

Both run the model in eval mode (no dropout) and leave it in the mode it was given in.
Arguments are checked first, each refused in one line naming it (a ValueError): a beam
wider than the vocabulary, or a batch whose decoding state (the KV caches of batch x beam
rows, `decoding_bytes`) would not fit in the device's free memory, is refused before any
of it is allocated.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..config import Seq2SeqConfig, is_integer
from ..memory import free_memory
from ..model.gpt import eval_mode, is_id_tensor
from ..model.seq2seq import MemoryKV, Seq2SeqTransformer, check_src_mask
from .cache import KVCache

MAX_EXTRA = 50  # target length limit = source length + this


def _require_int(name: str, value: object, minimum: int) -> None:
    if not is_integer(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_model(model: object) -> None:
    """An encoder-decoder model (a decoder-only one failed on its missing `memory_kv`)."""
    if not isinstance(getattr(model, "config", None), Seq2SeqConfig):
        raise ValueError(f"translation decodes an encoder-decoder Seq2SeqTransformer, got {type(model).__name__}; "
                         "a decoder-only model generates through frawdllm.infer.Engine")


def _check_search(model: Seq2SeqTransformer, src: Tensor, beam_size: int, alpha: float, max_extra: int,
                  src_mask: Tensor | None = None) -> None:
    """One line naming the argument that decoding `src` with these settings cannot take."""
    _check_model(model)
    if not is_id_tensor(src) or src.dim() != 2 or src.shape[0] == 0:
        what = f"a {src.dim()}-D {src.dtype} tensor of shape {tuple(src.shape)}" if isinstance(src, Tensor) \
            else type(src).__name__
        raise ValueError(f"src must be a 2-D integer tensor of token ids with at least one row, got {what}")
    check_src_mask(src, src_mask)
    if src_mask is not None and bool((src_mask[:, 1:] & ~src_mask[:, :-1]).any()):
        # (positions count from column 0: a left-padded sentence was encoded at shifted
        # positions, and translated otherwise, silently)
        raise ValueError("src_mask has padding (False) before a real token (True); pad each row at its end")
    _require_int("beam_size", beam_size, 1)
    _require_int("max_extra", max_extra, 0)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    vocab = model.config.vocab_size
    if src.numel() and (int(src.min()) < 0 or int(src.max()) >= vocab):
        bad = int(src.min()) if int(src.min()) < 0 else int(src.max())
        raise ValueError(f"src holds token id {bad}, outside the model's vocabulary (0..{vocab - 1})")
    if beam_size > vocab:
        raise ValueError(f"beam_size {beam_size} exceeds the model's vocabulary size ({vocab} tokens)")
    problem = decoding_memory_problem(model, src.shape[0], beam_size, src.shape[1], max_extra)
    if problem:
        raise ValueError(f"beam_size {beam_size} with {src.shape[0]} sentences at a time: {problem}; lower "
                         "beam_size or batch_size")


def decoding_bytes(model: Seq2SeqTransformer, rows: int, src_len: int, max_extra: int) -> int:
    """About the most memory decoding `rows` rows (sentences x beams) of sources of up to
    `src_len` tokens takes: every decoder layer's self-attention KV cache and cross-attention
    keys/values, twice (reordering the beams copies them), and one step's activations and
    (rows, vocab) fp32 logits, log-probabilities and candidate scores."""
    cfg = model.config
    element = next(model.parameters()).element_size()
    positions = min(src_len + max_extra, cfg.context_length - 1) + 1 + src_len  # cached target + source
    state = rows * positions * cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * element
    step = rows * ((cfg.ffn_dim + 4 * cfg.n_embd) * element + 3 * cfg.vocab_size * 4)
    return 2 * state + step


def decoding_memory_problem(model: Seq2SeqTransformer, sentences: int, beam_size: int, src_len: int,
                            max_extra: int = MAX_EXTRA) -> str | None:
    """Why `sentences` sources of up to `src_len` tokens do not fit in the model's device's
    free memory decoded together with `beam_size` beams (`decoding_bytes`), or None."""
    device = next(model.parameters()).device
    need, free = decoding_bytes(model, sentences * beam_size, src_len, max_extra), free_memory(device)
    if free is None or need <= free:
        return None
    return (f"decoding {sentences} x {beam_size} rows of up to {src_len} source tokens needs about "
            f"{need / 2**30:.1f} GiB, more than the {max(free, 0) / 2**30:.1f} GiB free on {device.type}")


class _Decoder:
    """The decoder's state for one batch of rows: memory keys/values, source mask, KV cache."""

    def __init__(self, model: Seq2SeqTransformer, memory_kv: MemoryKV, src_mask: Tensor, max_len: int,
                 use_cache: bool) -> None:
        self.model, self.memory_kv, self.src_mask = model, memory_kv, src_mask
        cfg = model.config
        self.never = never_after_bos(cfg)
        dtype = memory_kv[0][0].dtype
        self.cache = KVCache(model.config, src_mask.shape[0], max_len, dtype=dtype, device=src_mask.device) \
            if use_cache else None

    def next_logits(self, tokens: Int[Tensor, "R t"]) -> Float[Tensor, "R V"]:
        """Logits (R, V) of the token after `tokens` (each row's whole prefix so far)."""
        if self.cache is None:
            return self.model.decode(tokens, self.memory_kv, self.src_mask)[:, -1].float()
        t = tokens.shape[1] - 1
        self.cache.begin(1)
        positions = torch.full((1, 1), t, device=tokens.device)
        return self.model.decode(tokens[:, -1:], self.memory_kv, self.src_mask, positions, self.cache)[:, -1].float()

    def never_emit(self, scores: Float[Tensor, "R V"]) -> Float[Tensor, "R V"]:
        """`scores` (logits or log-probabilities) with PAD and BOS at -inf: neither can follow
        BOS in a translation. (Greedy used to end a row at a PAD while beam search went on past
        it, so beam 1 was not greedy, and an untrained model spent its whole length on BOS.)"""
        scores[:, self.never] = float("-inf")
        return scores

    def select_rows(self, rows: Int[Tensor, " R"]) -> None:
        """Keep rows `rows` (repeats allowed: beams that branch) in that order."""
        self.memory_kv = [(k[rows], v[rows]) for k, v in self.memory_kv]
        self.src_mask = self.src_mask[rows]
        if self.cache is not None:
            self.cache.select_rows(rows)


def never_after_bos(cfg: Seq2SeqConfig) -> list[int]:
    """Tokens a translation never emits: PAD and BOS (unless one is EOS; in Marian PAD is the
    start token)."""
    return sorted(i for i in {cfg.pad_token_id, cfg.bos_token_id} if i != cfg.eos_token_id)


def length_limits(model: Seq2SeqTransformer, src_mask: Bool[Tensor, "B S"], max_extra: int) -> list[int]:
    """Per row: how many tokens (EOS included) it may generate."""
    cap = model.config.context_length - 1  # position 0 holds BOS
    return [min(int(n) + max_extra, cap) for n in src_mask.sum(dim=1)]


@torch.no_grad()
def greedy_decode(
    model: Seq2SeqTransformer, src: Int[Tensor, "B S"], src_mask: Bool[Tensor, "B S"] | None = None,
    max_extra: int = MAX_EXTRA, use_cache: bool = True, max_steps: int | None = None,
    step_ends: list[float] | None = None,
) -> list[list[int]]:
    """The greedy translation of each row (token ids, without BOS and EOS); `max_steps` cuts
    every row short after that many tokens, and `step_ends` receives `time.perf_counter()`
    at the end of each step (after its wait for the device): a timing probe."""
    _check_search(model, src, 1, 0.0, max_extra, src_mask)
    if max_steps is not None:
        _require_int("max_steps", max_steps, 1)
    with eval_mode(model):  # no dropout; the caller's mode comes back after
        cfg = model.config
        src_mask = torch.ones_like(src, dtype=torch.bool) if src_mask is None else src_mask
        limits = length_limits(model, src_mask, max_extra)
        if max_steps is not None:
            limits = [min(n, max_steps) for n in limits]
        decoder = _Decoder(model, model.memory_kv(model.encode(src, src_mask)), src_mask, max(limits) + 1, use_cache)
        B = src.shape[0]
        tokens = torch.full((B, 1), cfg.bos_token_id, dtype=torch.long, device=src.device)
        limit = torch.tensor(limits, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        for step in range(max(limits)):
            next_token = decoder.never_emit(decoder.next_logits(tokens)).argmax(dim=-1)  # (B,)
            next_token = torch.where(done, cfg.pad_token_id, next_token)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            done |= (next_token == cfg.eos_token_id) | (step + 1 >= limit)
            finished = bool(done.all())
            if step_ends is not None:
                step_ends.append(time.perf_counter())
            if finished:
                break
        return [_strip(row, cfg.eos_token_id, cfg.pad_token_id) for row in tokens[:, 1:].tolist()]


def _strip(ids: list[int], eos: int, pad: int) -> list[int]:
    out = []
    for i in ids:
        if i == eos or i == pad:
            break
        out.append(i)
    return out


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's ((5 + length) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(
    model: Seq2SeqTransformer, src: Int[Tensor, "B S"], src_mask: Bool[Tensor, "B S"] | None = None,
    beam_size: int = 4, alpha: float = 0.6, max_extra: int = MAX_EXTRA, use_cache: bool = True,
) -> list[list[int]]:
    """The best beam-search translation of each row (token ids, without BOS and EOS)."""
    _check_search(model, src, beam_size, alpha, max_extra, src_mask)
    with eval_mode(model):  # no dropout; the caller's mode comes back after
        cfg = model.config
        K = beam_size
        src_mask = torch.ones_like(src, dtype=torch.bool) if src_mask is None else src_mask
        B, device = src.shape[0], src.device
        limits = length_limits(model, src_mask, max_extra)
        memory_kv = model.memory_kv(model.encode(src, src_mask))
        decoder = _Decoder(model, memory_kv, src_mask, max(limits) + 1, use_cache)
        decoder.select_rows(torch.arange(B, device=device).repeat_interleave(K))  # row b * K + i: beam i of b
        tokens = torch.full((B * K, 1), cfg.bos_token_id, dtype=torch.long, device=device)
        scores = torch.full((B, K), float("-inf"), device=device)
        scores[:, 0] = 0.0  # all beams start equal: keep one, or the first step would pick K copies
        ended: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
        done = [False] * B
        for step in range(max(limits)):
            logprobs = decoder.never_emit(torch.log_softmax(decoder.next_logits(tokens), dim=-1))  # (B*K, V)
            V = logprobs.shape[-1]
            candidates = (scores.view(B * K, 1) + logprobs).view(B, K * V)
            top_scores, top_index = candidates.topk(2 * K, dim=1)  # enough to fill K beams after K end
            top_scores, top_index = top_scores.tolist(), top_index.tolist()
            rows, next_tokens, next_scores = [], [], []
            for b in range(B):
                keep: list[tuple[int, int, float]] = []  # (beam, token, score)
                if not done[b]:
                    for score, index in zip(top_scores[b], top_index[b]):
                        beam, token = divmod(index, V)
                        if score == float("-inf"):
                            break
                        if token == cfg.eos_token_id:
                            prefix = tokens[b * K + beam, 1:].tolist()
                            ended[b].append((score / length_penalty(len(prefix) + 1, alpha), prefix))
                        else:
                            keep.append((beam, token, score))
                        if len(keep) == K:
                            break
                    if len(ended[b]) >= K:
                        done[b] = True
                    elif step + 1 >= limits[b]:  # out of length: the live beams end here
                        for beam, token, score in keep:
                            prefix = tokens[b * K + beam, 1:].tolist() + [token]
                            ended[b].append((score / length_penalty(len(prefix), alpha), prefix))
                        done[b] = True
                if done[b] or not keep:
                    keep = [(0, cfg.pad_token_id, float("-inf"))]
                keep += [keep[0][:2] + (float("-inf"),)] * (K - len(keep))  # fill with dead beams
                for beam, token, score in keep:
                    rows.append(b * K + beam)
                    next_tokens.append(token)
                    next_scores.append(score)
            if all(done):
                break
            rows_t = torch.tensor(rows, device=device)
            decoder.select_rows(rows_t)
            tokens = torch.cat([tokens[rows_t], torch.tensor(next_tokens, device=device)[:, None]], dim=1)
            scores = torch.tensor(next_scores, device=device).view(B, K)
        return [max(hyps, key=lambda h: h[0])[1] if hyps else [] for hyps in ended]


def pad_batch(rows: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
              ) -> tuple[Int[Tensor, "B S"], Bool[Tensor, "B S"]]:
    """Right-padded ids and the mask of real tokens."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return ids.to(device), mask.to(device)


def _check_source(i: int, row: object) -> None:
    """sources[i] is a list of token ids (a flat list of ids, or text, failed with a bare TypeError)."""
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        hint = ": sources is a list of sentences, each a list of ids" if is_integer(row) else ""
        raise ValueError(f"sources[{i}] must be a list of token ids, got {type(row).__name__}{hint}")
    bad = next((t for t in row if not is_integer(t)), None)
    if bad is not None:
        raise ValueError(f"sources[{i}] must be a list of token ids, holds {bad!r}")


def translate_ids(
    model: Seq2SeqTransformer, sources: list[list[int]], beam_size: int = 4, alpha: float = 0.6,
    max_extra: int = MAX_EXTRA, batch_size: int = 64,
) -> list[list[int]]:
    """Translations of token-id sources, batched by length (similar lengths together: less padding).
    Every argument is checked, and the widest batch's memory, before the first is decoded. An
    empty source translates to nothing (as `frawd translate run` leaves an empty line empty:
    decoded, a source of padding alone made up a sentence)."""
    _require_int("batch_size", batch_size, 1)
    _check_model(model)
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
        raise ValueError(f"sources must be a list of sentences, each a list of token ids; got {type(sources).__name__}")
    vocab, context = model.config.vocab_size, model.config.context_length
    for i, row in enumerate(sources):
        _check_source(i, row)
        if len(row) > context:
            raise ValueError(f"sources[{i}] has {len(row)} tokens, more than the model's context_length {context}")
        if row and (min(row) < 0 or max(row) >= vocab):
            bad = min(row) if min(row) < 0 else max(row)
            raise ValueError(f"sources[{i}] holds token id {bad}, outside the model's vocabulary (0..{vocab - 1})")
    out: list[list[int]] = [[] for _ in sources]
    order = sorted((i for i, row in enumerate(sources) if len(row)), key=lambda i: len(sources[i]))
    if not order:
        _check_search(model, pad_batch([[model.config.pad_token_id]], model.config.pad_token_id)[0], beam_size,
                      alpha, max_extra)  # (the arguments are checked all the same)
        return out
    widest = pad_batch([sources[i] for i in order[-batch_size:]], model.config.pad_token_id)[0]  # the last batch
    _check_search(model, widest, beam_size, alpha, max_extra)
    device = next(model.parameters()).device
    for a in range(0, len(order), batch_size):
        chunk = order[a: a + batch_size]
        src, mask = pad_batch([sources[i] for i in chunk], model.config.pad_token_id, device)
        if beam_size == 1:
            hyps = greedy_decode(model, src, mask, max_extra)
        else:
            hyps = beam_search(model, src, mask, beam_size, alpha, max_extra)
        for i, hyp in zip(chunk, hyps):
            out[i] = hyp
    return out
