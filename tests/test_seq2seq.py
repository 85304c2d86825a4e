"""The encoder-decoder model: exact parameter counts, padding and causality, decoding
(greedy, beam, cached), the model directory, and tiny models learning copy and reverse."""

import json
import math
import random
import re

import pytest
import torch
import torch.nn.functional as F

from frawdllm import FrawdLLM, Seq2SeqConfig, Seq2SeqTransformer, get_config
from frawdllm.errors import ConfigError, FrawdError
from frawdllm.infer.translate import beam_search, greedy_decode, pad_batch
from frawdllm.modeldir import load_model

OPTIONS = {
    "paper": dict(),
    "untied_learned": dict(tie_embeddings=False, pos_encoding="learned"),
    "pre_ln_rope_gqa": dict(norm_placement="pre", pos_encoding="rope", n_kv_head=2, activation="gelu", bias=False,
                            use_rmsnorm=True),
}


def small(**kw) -> Seq2SeqConfig:
    base = dict(vocab_size=40, n_embd=32, n_head=4, n_layer=2, n_encoder_layer=2, mlp_hidden=64, dropout=0.0,
                context_length=64)
    return get_config("aiayn-tiny", **{**base, **kw})


def model_for(name: str, seed: int = 0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(small(**OPTIONS[name])).eval()
    with torch.no_grad():  # larger weights than at init: decisive, varied next-token choices
        for p in model.parameters():
            p.mul_(3)
    return model


BAD_CALLS = r"""
import torch
from frawdllm import Seq2SeqTransformer, get_config
m = Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=40, n_embd=32, n_head=4, n_layer=1, n_encoder_layer=1)).eval()
src, tgt = torch.randint(4, 40, (2, 5)), torch.randint(4, 40, (2, 6))
print(torch.equal(m(src, tgt, tgt.int())[1], m(src, tgt, tgt)[1]))
for args in [(src[0], tgt), (src, tgt.float()), (src, tgt, tgt.T)]:
    try:
        m(*args)
        print("accepted")
    except ValueError as exc:
        print(exc)
"""


def test_forward_takes_any_integer_targets_and_names_a_bad_input_in_one_line():
    """As FrawdLLM's (a user's script, without the tests' shape checks): int32 targets failed
    inside cross_entropy, and (T, B) targets were flattened silently against (B, T) ids."""
    from cli_helpers import script_lines

    assert script_lines(BAD_CALLS) == [
        "True",
        "src must be a (batch, time) integer tensor, got a 1-D torch.int64 tensor",
        "tgt must be a (batch, time) integer tensor, got a 2-D torch.float32 tensor",
        "targets of shape (6, 2) do not match tgt of shape (2, 6)",
    ]


@pytest.mark.parametrize("name", OPTIONS)
def test_num_parameters_is_exact(name):
    cfg = small(**OPTIONS[name])
    assert cfg.num_parameters == Seq2SeqTransformer(cfg).num_parameters()


def test_aiayn_presets_parameter_counts():
    # The paper (table 3) gives 65M for base and 213M for big with a 37k joint vocabulary.
    # The layers it describes, with one shared embedding, count exactly these:
    assert get_config("aiayn-base").num_parameters == 63_082_496
    assert get_config("aiayn-big").num_parameters == 214_245_376
    with torch.device("meta"):
        assert Seq2SeqTransformer(get_config("aiayn-base")).num_parameters() == 63_082_496


def test_swiglu_is_refused():
    with pytest.raises(ConfigError, match="swiglu"):
        small(use_swiglu=True)


@pytest.mark.parametrize("name", OPTIONS)
def test_encoder_padding_never_changes_real_positions(name):
    model = model_for(name)
    src = torch.randint(4, 40, (1, 7))
    padded = torch.cat([src, torch.randint(4, 40, (1, 5))], dim=1)  # garbage where the padding is
    mask = torch.tensor([[True] * 7 + [False] * 5])
    with torch.no_grad():
        torch.testing.assert_close(model.encode(padded, mask)[:, :7], model.encode(src), atol=1e-5, rtol=1e-5)
        tgt = torch.randint(4, 40, (1, 6))
        torch.testing.assert_close(model(padded, tgt, src_mask=mask)[0], model(src, tgt)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", OPTIONS)
def test_decoder_is_causal(name):
    model = model_for(name)
    src, tgt = torch.randint(4, 40, (2, 9)), torch.randint(4, 40, (2, 10))
    changed = tgt.clone()
    changed[:, 6] = (tgt[:, 6] + 1) % 40
    with torch.no_grad():
        a, b = model(src, tgt)[0], model(src, changed)[0]
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_every_source_token_reaches_the_decoder():
    model = model_for("paper")
    src, tgt = torch.randint(4, 40, (1, 9)), torch.randint(4, 40, (1, 4))
    changed = src.clone()
    changed[0, 8] = (src[0, 8] + 1) % 40
    with torch.no_grad():
        assert not torch.allclose(model(src, tgt)[0][:, 0], model(changed, tgt)[0][:, 0])


@pytest.mark.parametrize("name", ["paper", "pre_ln_rope_gqa"])
def test_every_norm_of_a_decoder_block_takes_part(name):
    # each block's norms (its cross-attention's own, norm_cross, too): scaling one moves the output
    model = model_for(name)
    src, tgt = torch.randint(4, 40, (1, 9)), torch.randint(4, 40, (1, 4))
    with torch.no_grad():
        before = model(src, tgt)[0]
        for norm in ("norm1", "norm_cross", "norm2"):
            weight = getattr(model.decoder[0], norm).weight
            weight.mul_(1.5)
            assert not torch.allclose(model(src, tgt)[0], before), norm
            weight.div_(1.5)


def _sources(n=5, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(4, 40) for _ in range(rng.randint(2, 9))] for _ in range(n)]


@pytest.mark.parametrize("name", OPTIONS)
def test_beam_one_equals_greedy_and_cached_equals_uncached(name):
    model = model_for(name)
    src, mask = pad_batch(_sources(), 0)
    greedy = greedy_decode(model, src, mask, max_extra=6)
    assert greedy == greedy_decode(model, src, mask, max_extra=6, use_cache=False)
    assert beam_search(model, src, mask, beam_size=1, max_extra=6) == greedy
    assert any(len(g) > 1 for g in greedy)  # the comparison covers several steps
    for k, alpha in ((3, 0.6), (4, 0.0)):
        cached = beam_search(model, src, mask, beam_size=k, alpha=alpha, max_extra=6)
        assert cached == beam_search(model, src, mask, beam_size=k, alpha=alpha, max_extra=6, use_cache=False)


def test_neither_search_emits_pad_or_bos_so_beam_one_is_greedy_even_where_the_model_prefers_them():
    """A model whose favourite next tokens are PAD and BOS: greedy used to end every row at
    the PAD, beam search went on past it (beam 1 was not greedy), and both spent steps on BOS."""
    model = model_for("paper")
    cfg = model.config
    decode = model.decode

    def favour_pad_and_bos(*args, **kwargs):
        logits = decode(*args, **kwargs).clone()
        logits[..., cfg.pad_token_id] += 1e3
        logits[..., cfg.bos_token_id] += 1e3 - 1
        return logits

    model.decode = favour_pad_and_bos
    src, mask = pad_batch(_sources(), 0)
    greedy = greedy_decode(model, src, mask, max_extra=6)
    assert greedy == greedy_decode(model, src, mask, max_extra=6, use_cache=False)
    assert beam_search(model, src, mask, beam_size=1, max_extra=6) == greedy
    beams = beam_search(model, src, mask, beam_size=3, max_extra=6)
    for hyp in greedy + beams:
        assert not {cfg.pad_token_id, cfg.bos_token_id} & set(hyp)
    assert any(len(g) > 1 for g in greedy)
    del model.decode  # the unbiased model: the same choices among the other tokens
    assert greedy_decode(model, src, mask, max_extra=6) == greedy


def test_translation_of_a_sentence_does_not_depend_on_its_batch():
    model = model_for("paper")
    sources = _sources(6, seed=3)
    src, mask = pad_batch(sources, 0)
    batched = beam_search(model, src, mask, beam_size=3, max_extra=6)
    alone = [beam_search(model, *pad_batch([s], 0), beam_size=3, max_extra=6)[0] for s in sources]
    assert batched == alone


def test_beam_search_finds_a_better_scoring_translation_than_greedy_or_the_same_on_these_sentences():
    # (not a property of beam search in general: pruning can drop greedy's prefix, and on a
    # trained Multi30k model beam 4 scored below greedy on 6 of 100 sentences; the exact
    # check is against reference_beam_search below)
    model = model_for("paper")
    src, mask = pad_batch(_sources(8, seed=5), 0)
    greedy = greedy_decode(model, src, mask, max_extra=5)
    beam = beam_search(model, src, mask, beam_size=4, alpha=0.0, max_extra=5)

    def logprob(row: int, hyp: list[int]) -> float:
        cfg = model.config
        ended = len(hyp) < int(mask[row].sum()) + 5  # a hypothesis at the limit has no EOS
        labels = torch.tensor([hyp + ([cfg.eos_token_id] if ended else [])])
        tgt_in = torch.tensor([[cfg.bos_token_id] + hyp])[:, : labels.shape[1]]
        with torch.no_grad():
            logits = model(src[row: row + 1], tgt_in, src_mask=mask[row: row + 1])[0]
        return float(torch.log_softmax(logits, -1).gather(-1, labels[..., None]).sum())

    for row in range(8):
        assert logprob(row, beam[row]) >= logprob(row, greedy[row]) - 1e-4


@pytest.mark.parametrize("name", list(OPTIONS))
def test_decode_with_a_kv_cache_and_no_positions_takes_the_caches_as_the_decoder_only_model_does(name):
    # (each cached step sat at position 0: logits 0.74 away from the whole decode, as docs/model.md's
    # cache example, written for FrawdLLM, reads)
    from frawdllm.infer.cache import KVCache

    model = model_for(name)
    src, mask = pad_batch([[5, 6, 7, 8], [9, 10]], 0)
    memory_kv = model.memory_kv(model.encode(src, mask))
    tgt = torch.tensor([[1, 11, 12, 13, 14], [1, 15, 16, 17, 18]])
    with torch.no_grad():
        whole = model.decode(tgt, memory_kv, mask)
        cache = KVCache(model.config, 2, 8)
        cache.begin(2)
        steps = [model.decode(tgt[:, :2], memory_kv, mask, kv_cache=cache)]
        for t in range(2, 5):
            cache.begin(1)
            steps.append(model.decode(tgt[:, t:t + 1], memory_kv, mask, kv_cache=cache))
    assert (torch.cat(steps, 1) - whole).abs().max() < 1e-4


def test_pairs_longer_than_max_len_on_either_side_are_skipped_and_at_it_kept():
    from frawdllm.data.parallel import encode_pairs
    from frawdllm.tokenizer import byte_tokenizer

    got = encode_pairs(byte_tokenizer(), ["abcd", "ab", "abcde", "ab"], ["ab", "abcd", "a", "abcde"], 4)
    assert (got.kept, got.too_long) == ([0, 1], 2)  # 4 tokens a side kept; 5 skipped, source or target


def test_token_batches_hold_at_most_their_tokens_and_no_more_batches_than_needed():
    # rows x max(source, target + 1) <= the budget, unless a pair alone is wider; similar
    # lengths together, so a budget that holds every pair of one width takes them in one batch
    from frawdllm.train.translation import token_batches

    rng = random.Random(0)
    pairs = [([1] * rng.randint(1, 12), [1] * rng.randint(1, 12)) for _ in range(300)]
    batches = token_batches(pairs, 40, random.Random(1))
    assert sorted(i for b in batches for i in b) == list(range(300))
    width = lambda i: max(len(pairs[i][0]), len(pairs[i][1]) + 1)  # noqa: E731
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(map(width, batch)) <= 40
    narrow = [([1] * 3, [1] * 4)] * 8 + [([1] * 9, [1] * 9)]  # (width 5: eight fill 40 tokens)
    assert sorted(map(len, token_batches(narrow, 40, random.Random(2)))) == [1, 8]
    # sorted by source length, a short source with a long target (width 10) comes first: the
    # next batch starts at its own pairs' width (2), not that one's
    wide_first = [([1], [1] * 9)] + [([1] * 2, [1])] * 5
    assert sorted(map(len, token_batches(wide_first, 10, random.Random(3)))) == [1, 5]


def test_translate_texts_hands_alpha_and_batch_size_to_the_search(monkeypatch):
    from frawdllm.infer import translate as translate_module
    from frawdllm.tokenizer import byte_tokenizer
    from frawdllm.train.translation import translate_texts

    seen = {}

    def spy(model, ids, **options):
        seen.update(options)
        return [[] for _ in ids]

    monkeypatch.setattr(translate_module, "translate_ids", spy)
    translate_texts(torch.nn.Identity(), byte_tokenizer(), ["ab"], beam_size=3, alpha=1.5, batch_size=7)
    assert seen == {"beam_size": 3, "alpha": 1.5, "batch_size": 7}


def test_the_memory_check_is_of_the_widest_batch(monkeypatch):
    from frawdllm.infer import translate as translate_module

    widths = []
    check = translate_module._check_search
    monkeypatch.setattr(translate_module, "_check_search",
                        lambda model, src, *rest: (widths.append(src.shape[1]), check(model, src, *rest))[1])
    model = model_for("paper")
    translate_module.translate_ids(model, [[5], [5, 6], [5, 6, 7, 8, 9]], beam_size=1, batch_size=1)
    assert widths[0] == 5


def test_token_batches_too_small_to_deal_out_to_the_ranks_are_refused_at_the_start(monkeypatch):
    # (a 2-rank run trained 153 steps, then stopped when the shuffled epoch reached a batch of
    # one long pair; batches hold the same pairs every epoch, so the start can tell)
    from frawdllm.train import distributed
    from frawdllm.train.translation import TranslationTask

    model = model_for("paper")
    short = [([5, 6], [7, 8]) for _ in range(40)]
    long = [([5] * 30, [6] * 30)]  # 31 padded tokens: alone in a batch of 40
    monkeypatch.setattr(distributed, "_current", distributed.Dist(rank=0, world_size=2, parallel="ddp"))
    with pytest.raises(FrawdError, match=re.escape("--tokens-per-batch 40 makes batches of as few as 1 sentence "
                                                   "pair (the longest), which do not split over 2 ranks: raise "
                                                   "--tokens-per-batch or make --grad-accum a multiple of 2")):
        TranslationTask(model.config, None, short + long, None, tokens_per_batch=40)
    TranslationTask(model.config, None, short + long, None, tokens_per_batch=40, grad_accum=2)  # whole batches
    TranslationTask(model.config, None, short + long * 2, None, tokens_per_batch=62)  # the two long ones together
    monkeypatch.setattr(distributed, "_current", distributed.Dist())
    TranslationTask(model.config, None, short + long, None, tokens_per_batch=40)  # one process


def test_each_epoch_deals_the_same_batches_in_a_new_order():
    """The token batches are shuffled each epoch (module docstring): epoch 1 deals every pair
    once, in batches of epoch 0's shapes (pairs of one length trade places), in another
    order; the order is the seed's."""
    from frawdllm.train.translation import TranslationTask

    model = model_for("paper")
    rng = random.Random(0)
    pairs = [([5] * rng.randint(1, 9), [6] * rng.randint(1, 9)) for _ in range(200)]
    task = TranslationTask(model.config, None, pairs, None, tokens_per_batch=60)
    first, second = task._epoch_batches(0), task._epoch_batches(1)
    def shapes(batches):
        return sorted((len(b), max(max(len(pairs[i][0]), len(pairs[i][1]) + 1) for i in b)) for b in batches)

    assert len(first) > 10 and [shapes([b]) for b in first] != [shapes([b]) for b in second]
    assert sorted(i for b in second for i in b) == list(range(len(pairs))) and shapes(first) == shapes(second)
    again = TranslationTask(model.config, None, pairs, None, tokens_per_batch=60)
    assert again._epoch_batches(1) == second


def test_bleu_and_samples_during_training_decode_greedily(monkeypatch):
    """Training's val_bleu and samples translate with beam 1 (greedy, as `_bleu_cost` times
    it), not translate_texts' default beam of 4: slower, and other scores."""
    from frawdllm.train import translation
    from frawdllm.train.translation import TranslationTask, ValidationSet

    beams = []

    def recording(model, tokenizer, sources, **options):
        beams.append(options.get("beam_size"))
        return ["x"] * len(sources)

    monkeypatch.setattr(translation, "translate_texts", recording)
    pairs = [([5, 6, 7], [8, 9]), ([6, 7], [9])]
    task = TranslationTask(model_for("paper").config, None, pairs, ValidationSet(pairs, ["a", "b"], ["x", "y"]),
                           tokens_per_batch=1000, bleu_sentences=2, samples=2)
    task.cursor = 1  # (trained: an untrained model's evaluation skips BLEU)
    with torch.no_grad():
        assert "val_bleu" in task.evaluate(model_for("paper"), torch.device("cpu"))
        assert len(task.samples(model_for("paper"), torch.device("cpu"))) == 2
    assert beams == [1, 1]


def test_parallel_text_keeps_a_last_line_without_a_newline_and_drops_carriage_returns(tmp_path):
    from frawdllm.data.parallel import read_lines

    path = tmp_path / "t.txt"
    for raw, lines in ((b"a\nb", ["a", "b"]), (b"a\nb\n", ["a", "b"]), (b"a\r\nb\r\n", ["a", "b"])):
        path.write_bytes(raw)
        assert read_lines(path) == lines, raw


def test_validation_loss_and_tokens_count_real_target_tokens_and_bleu_is_sacrebleus_default():
    """val_loss is the plain cross-entropy per real target token (each sentence's tokens and its
    EOS; padding not counted), batch_tokens counts those tokens too, and the BLEU logged
    during training is sacreBLEU's corpus BLEU with its defaults (cased, 13a), as eval's."""
    import sacrebleu

    from frawdllm.train.translation import TranslationTask, ValidationSet, collate, corpus_bleu

    model = model_for("paper")
    cfg = model.config
    pairs = [([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11, 12, 13]), ([6, 7], [9])]  # ragged: labels padded
    task = TranslationTask(cfg, None, pairs, ValidationSet(pairs, ["x"] * 3, ["x"] * 3), tokens_per_batch=1000,
                           bleu_sentences=0)
    total, count = 0.0, 0
    with torch.no_grad():
        got = task.evaluate(model, torch.device("cpu"))["val_loss"]
        for src, tgt in pairs:  # each sentence alone: no padding anywhere
            logits = model(torch.tensor([src]), torch.tensor([[cfg.bos_token_id, *tgt]]))[0][0]
            total += float(F.cross_entropy(logits, torch.tensor([*tgt, cfg.eos_token_id]), reduction="sum"))
            count += len(tgt) + 1
    assert got == pytest.approx(total / count, rel=1e-5)
    assert task.batch_tokens(collate(pairs)) == count == 12
    hyps, refs = ["The cat sat on the mat."], ["the cat sat on the mat ."]
    assert corpus_bleu(hyps, refs).score == sacrebleu.corpus_bleu(hyps, [refs]).score < 100


def reference_beam_search(model, src: list[int], beam_size: int, alpha: float, max_extra: int) -> list[int]:
    """Beam search written plainly, for one sentence: every hypothesis's next-token
    log-probabilities from a whole forward of its prefix (no cache, no batch). Each step
    ranks every (beam, token) candidate; one ending in EOS is set aside with its score /
    lp(its tokens, the EOS counted); the best beam_size others go on. The search ends when
    beam_size have ended, or at the length limit (the live ones end there, lp(their
    tokens)); the best set-aside one is the translation. PAD and BOS are never emitted:
    their log-probabilities are -inf after the softmax (not renormalised, as transformers'
    logits processors leave them)."""
    from frawdllm.infer.translate import length_penalty, never_after_bos

    cfg = model.config
    limit = min(len(src) + max_extra, cfg.context_length - 1)
    live, ended = [(0.0, [])], []
    for step in range(limit):
        candidates = []
        for score, prefix in live:
            with torch.no_grad():
                logits = model(torch.tensor([src]), torch.tensor([[cfg.bos_token_id, *prefix]]))[0][0, -1]
            logprobs = torch.log_softmax(logits.double(), -1)
            logprobs[never_after_bos(cfg)] = -math.inf
            candidates += [(score + lp, prefix, t) for t, lp in enumerate(logprobs.tolist()) if lp > -math.inf]
        candidates.sort(key=lambda c: -c[0])
        keep = []
        for score, prefix, token in candidates:
            if token == cfg.eos_token_id:
                ended.append((score / length_penalty(len(prefix) + 1, alpha), prefix))
            else:
                keep.append((score, prefix + [token]))
            if len(keep) == beam_size:
                break
        if len(ended) >= beam_size:
            break
        if step + 1 >= limit:
            ended += [(score / length_penalty(len(prefix), alpha), prefix) for score, prefix in keep]
            break
        live = keep
    return max(ended, key=lambda e: e[0])[1]


def test_beam_search_equals_a_plain_reference_search():
    """Batched, cached beam search against `reference_beam_search`. (Taking only the top K
    candidates a step, where K end in EOS, left fewer than K beams going: no other test
    saw it.) EOS is made about as likely as the other tokens, so that ended and live
    hypotheses mix, and short limits end some at the limit."""
    model = model_for("paper")
    with torch.no_grad():
        model.embed.tok.weight[model.config.eos_token_id] *= 0.9
    sources = _sources(6, seed=0)
    src, mask = pad_batch(sources, 0)
    for beam_size, alpha, max_extra in [(3, 0.6, 4), (4, 2.0, 3), (2, 1.0, 6)]:
        got = beam_search(model, src, mask, beam_size=beam_size, alpha=alpha, max_extra=max_extra)
        assert got == [reference_beam_search(model, row, beam_size, alpha, max_extra) for row in sources], \
            (beam_size, alpha, max_extra)


def test_an_ended_hypothesis_counts_its_eos_in_the_length_penalty(monkeypatch):
    """lp = ((5 + length) / 6) ** alpha with length the tokens scored, EOS included (as a
    hypothesis ended at the limit counts all of its). Decided here by the EOS: with
    hand-set probabilities, X = [A] EOS scores -1.2 and Y = [B, C] EOS -1.385; with alpha 1,
    X / lp(2) = -1.029 beats Y / lp(3) = -1.039, but without the EOS counted Y would win
    (-1.187 against X / lp(1) = -1.2)."""
    from frawdllm.infer import translate

    model = model_for("paper")
    V, eos = model.config.vocab_size, model.config.eos_token_id
    A, B, C = 10, 11, 12
    table = {(): {A: 0.45, B: 0.40}, (A,): {eos: math.exp(-1.2) / 0.45},
             (B,): {C: math.exp(-0.4687 / 2)}, (B, C): {eos: math.exp(-0.4687 / 2)}}

    def next_logits(self, tokens):
        rows = []
        for prefix in tokens[:, 1:].tolist():
            chosen = table.get(tuple(prefix), {eos: 0.5})
            rest = (1 - sum(chosen.values())) / (V - len(chosen))
            rows.append([math.log(chosen.get(t, rest)) for t in range(V)])
        return torch.tensor(rows)

    monkeypatch.setattr(translate._Decoder, "next_logits", next_logits)
    src, mask = pad_batch([[5, 6, 7, 8, 9]], 0)
    assert beam_search(model, src, mask, beam_size=2, alpha=1.0)[0] == [A]
    assert beam_search(model, src, mask, beam_size=2, alpha=0.0)[0] == [A]  # (the better sum, unnormalised)


def test_val_bleu_scores_each_translation_against_its_own_reference(monkeypatch):
    """Translations equal to their references score 100: the n translated sentences are
    scored against the same n references, in order (a shifted list scores near 0)."""
    from frawdllm.train import translation
    from frawdllm.train.translation import TranslationTask, ValidationSet

    refs = ["the cat sat on the mat today", "a dog ran far away from home", "two birds sing in the old tree",
            "my friend reads a long book"]
    pairs = [([5 + i, 6, 7], [8, 9]) for i in range(4)]
    by_source = {tuple(src): ref for (src, _), ref in zip(pairs, refs)}
    monkeypatch.setattr(translation, "translate_texts",
                        lambda model, tokenizer, sources, **options: [by_source[tuple(s)] for s in sources])
    task = TranslationTask(model_for("paper").config, None, pairs, ValidationSet(pairs, ["s"] * 4, refs),
                           tokens_per_batch=1000, bleu_sentences=3)
    task.cursor = 1  # (trained: an untrained model's evaluation skips BLEU)
    with torch.no_grad():
        assert task.evaluate(model_for("paper"), torch.device("cpu"))["val_bleu"] == 100.0


def test_length_limit_is_source_length_plus_max_extra():
    model = model_for("paper")
    src, mask = pad_batch([[5, 6, 7]], 0)
    model.lm_head.weight.data[model.config.eos_token_id] = -100.0  # never ends by itself
    assert len(greedy_decode(model, src, mask, max_extra=4)[0]) == 3 + 4
    assert len(beam_search(model, src, mask, beam_size=2, max_extra=4)[0]) == 3 + 4
    assert len(greedy_decode(model, src, mask, max_extra=4, max_steps=2)[0]) == 2  # a timing probe's cut


def test_an_untrained_evaluation_reserves_time_for_the_bleu_it_skipped():
    """Before the first step the task skips BLEU (an untrained model writes noise to the
    length limit) but times a probe of it, so a --max-time run keeps the final one in reserve."""
    from frawdllm.tokenizer import train_tokenizer
    from frawdllm.train.translation import TranslationTask, ValidationSet

    model = model_for("paper")
    pairs = [(s, s) for s in _sources(6, seed=2)]
    valid = ValidationSet(pairs, ["a b"] * 6, ["a b"] * 6)
    bytes_ = train_tokenizer([], kind="byte")  # (ids below 40 decode to something; BLEU scores it)
    task = TranslationTask(model.config, bytes_, pairs, valid, tokens_per_batch=64, bleu_sentences=6)
    with torch.no_grad():
        untrained = task.evaluate(model, torch.device("cpu"))
        assert "val_bleu" not in untrained and task.evaluation_extra_s() > 0
        task.cursor = 1  # a step taken: BLEU runs, and its cost is now the evaluation's own
        trained = task.evaluate(model, torch.device("cpu"))
    assert "val_bleu" in trained and task.evaluation_extra_s() == 0


def test_the_bleu_estimate_counts_one_encoder_pass_per_batch_and_steps_to_the_length_limit(monkeypatch):
    """On a fake clock (encoder pass 80 ms, decode step 5 ms) the estimate is one encoder
    pass per batch plus one step per token to each batch's length limit: the probe's
    encoder time is not spread over its few steps (that made it about 4x too high)."""
    import time

    from frawdllm.infer.translate import MAX_EXTRA, length_limits
    from frawdllm.train.translation import TranslationTask, probe_times

    assert probe_times(1.0, [1.1, 1.12, 1.14]) == pytest.approx((0.08, 0.02))
    assert probe_times(1.0, [1.1]) == pytest.approx((0.0, 0.1))  # one step: all of it a step

    model = model_for("paper")
    eos = model.config.eos_token_id
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    encode, decode = model.encode, model.decode

    def slow_encode(*args, **kwargs):
        now[0] += 0.080
        return encode(*args, **kwargs)

    def slow_decode(*args, **kwargs):
        now[0] += 0.005
        logits = decode(*args, **kwargs)
        logits[..., eos] = float("-inf")  # noise to the limit, as an untrained model's
        return logits

    monkeypatch.setattr(model, "encode", slow_encode)
    monkeypatch.setattr(model, "decode", slow_decode)
    sources = _sources(150, seed=3)  # batches of 64, 64 and 22
    task = TranslationTask(model.config, None, [(s, s) for s in sources], None, tokens_per_batch=64)
    order = sorted(sources, key=len)
    steps = sum(max(length_limits(model, pad_batch(order[a: a + 64], 0)[1], MAX_EXTRA)) for a in (0, 64, 128))
    with torch.no_grad():
        assert task._bleu_cost(model, sources) == pytest.approx(3 * 0.080 + steps * 0.005)


@pytest.mark.parametrize("name", OPTIONS)
def test_model_directory_round_trip(tmp_path, name):
    model = model_for(name)
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "seq2seq"
    loaded = load_model(tmp_path / "m")
    assert isinstance(loaded, Seq2SeqTransformer) and loaded.config == model.config
    src, tgt = torch.randint(4, 40, (2, 5)), torch.randint(4, 40, (2, 4))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(src, tgt)[0], model(src, tgt)[0])


def test_decoder_only_model_directory_has_no_model_type(tmp_path):
    model = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=50, context_length=16))
    model.save_pretrained(tmp_path / "m")
    assert "model_type" not in json.loads((tmp_path / "m" / "config.json").read_text())
    assert isinstance(load_model(tmp_path / "m"), FrawdLLM)
    with pytest.raises(Exception, match="holds a FrawdLLM model, not a Seq2SeqTransformer"):
        Seq2SeqTransformer.from_pretrained(tmp_path / "m")


def test_from_pretrained_is_in_eval_mode_and_a_training_model_decodes_as_in_eval_mode(tmp_path):
    torch.manual_seed(0)
    model = Seq2SeqTransformer(small(dropout=0.5))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    model.save_pretrained(tmp_path / "m")
    loaded = Seq2SeqTransformer.from_pretrained(tmp_path / "m")
    assert not any(m.training for m in loaded.modules())
    src, mask = pad_batch(_sources(4), 0)
    def decode():
        return greedy_decode(loaded, src, mask, max_extra=6), beam_search(loaded, src, mask, 3, max_extra=6)

    expected = decode()
    loaded.train()
    loaded.decoder[0].eval()  # a mixed state comes back exactly as it was
    modes = [m.training for m in loaded.modules()]
    for _ in range(2):  # with dropout on, runs would differ from each other and from eval mode
        assert decode() == expected
    assert [m.training for m in loaded.modules()] == modes


# ---- decoding arguments: one line naming the argument, before any work ----------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_size=0), "beam_size must be an integer >= 1, got 0"),
    (dict(beam_size=-1), "beam_size must be an integer >= 1, got -1"),
    (dict(beam_size=41), r"beam_size 41 exceeds the model's vocabulary size \(40 tokens\)"),
    (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    (dict(max_extra=-100), "max_extra must be an integer >= 0, got -100"),
    (dict(alpha=float("nan")), "alpha must be a finite number >= 0, got nan"),
    (dict(alpha=float("inf")), "alpha must be a finite number >= 0, got inf"),
    (dict(sources=[[5, 6], [7, 40]]), r"sources\[1\] holds token id 40, outside the model's vocabulary \(0..39\)"),
    (dict(sources=[[-3]]), r"sources\[0\] holds token id -3, outside the model's vocabulary \(0..39\)"),
    (dict(sources=[[5] * 65]), r"sources\[0\] has 65 tokens, more than the model's context_length 64"),
])
def test_translate_ids_refuses_bad_arguments_naming_them(kwargs, message):
    from frawdllm.infer.translate import translate_ids

    kwargs = {"sources": [[5, 6, 7], [8, 9]], "beam_size": 2, **kwargs}
    with pytest.raises(ValueError, match=f"^{message}$"):
        translate_ids(model_for("paper"), **kwargs)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_an_empty_source_translates_to_nothing_beside_the_others(beam_size):
    """Decoded as a row of padding alone, an empty source made up a sentence (`frawd
    translate run` leaves an empty line empty); the others are as translated alone."""
    from frawdllm.infer.translate import translate_ids

    model = model_for("paper")
    sources = [[5, 6, 7], [], [8, 9]]
    alone = [translate_ids(model, [row], beam_size=beam_size)[0] for row in sources if row]
    assert translate_ids(model, sources, beam_size=beam_size) == [alone[0], [], alone[1]]
    assert translate_ids(model, [[], []], beam_size=beam_size) == [[], []]
    with pytest.raises(ValueError, match="^beam_size must be an integer >= 1, got 0$"):
        translate_ids(model, [[]], beam_size=0)  # (checked all the same)


def test_greedy_and_beam_search_refuse_bad_arguments_naming_them():
    model = model_for("paper")
    src, mask = pad_batch(_sources(), 0)
    with pytest.raises(ValueError, match="^beam_size must be an integer >= 1, got 0$"):
        beam_search(model, src, mask, beam_size=0)
    with pytest.raises(ValueError, match="^max_extra must be an integer >= 0, got -1$"):
        greedy_decode(model, src, mask, max_extra=-1)
    with pytest.raises(ValueError, match=r"^src holds token id \d+, outside the model's vocabulary \(0..39\)$"):
        greedy_decode(model, src + 40, mask)
    for search in (greedy_decode, beam_search):
        with pytest.raises(ValueError, match=r"^src must be a 2-D integer tensor .* at least one row, got .*\(0, 5\)$"):
            search(model, torch.zeros((0, 5), dtype=torch.long))


def test_ids_past_the_vocabulary_are_one_line_in_every_forward():
    """Source or target ids outside the vocabulary were PyTorch's bare "IndexError: index out
    of range in self" (the decoder-only model already named them)."""
    model = model_for("paper")
    src, tgt = torch.randint(7, 40, (2, 6)), torch.randint(7, 40, (2, 4))
    calls = [lambda: model(torch.full((2, 6), 99), tgt), lambda: model(src, torch.full((2, 4), -1)),
             lambda: model.encode(torch.full((2, 6), 40))]
    for call, bad in zip(calls, (99, -1, 40)):
        with pytest.raises(ValueError, match=rf"^token id {bad} is outside the model's vocabulary \(vocab_size 40\)$"):
            call()


def test_a_loss_with_every_target_ignored_is_zero_as_in_training():
    """F.cross_entropy's mean over no targets is NaN; the fused training loss gives 0 (and the
    mean over the others when some remain)."""
    from frawdllm.train.losses import linear_cross_entropy

    torch.manual_seed(0)
    decoder = FrawdLLM(get_config("tiny", vocab_size=64, n_layer=1, n_embd=32, n_head=4, context_length=16))
    ids, ignored = torch.randint(0, 64, (2, 8)), torch.full((2, 8), -100)
    for model, args in ((decoder, (ids,)), (model_for("paper"), (torch.randint(7, 40, (2, 6)), ids % 40))):
        assert model(*args, ignored)[1].item() == 0.0
        some = ignored.clone()
        some[0, :3] = args[-1][0, :3]
        logits, loss = model(*args, some)
        assert torch.allclose(loss, F.cross_entropy(logits.view(-1, logits.size(-1)), some.view(-1)), atol=1e-6)
    h, w = torch.randn(16, 32), torch.randn(64, 32)
    assert linear_cross_entropy(h, w, torch.full((16,), -100)).item() == 0.0


MISMATCHED_CALLS = r"""
import torch
from frawdllm import FrawdLLM, Seq2SeqTransformer, get_config
from frawdllm.infer.translate import beam_search, greedy_decode, translate_ids
m = Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=40, n_embd=32, n_head=4, n_layer=1, n_encoder_layer=1))
gpt = FrawdLLM(get_config("tiny", vocab_size=40, n_layer=1, n_embd=32, n_head=4))
src = torch.randint(4, 40, (2, 5))
for call in [lambda: m(src, src[:1]), lambda: m.hidden_states(src, src[:1]),
             lambda: m(src, src, src_mask=torch.ones(2, 3, dtype=torch.bool)),
             lambda: greedy_decode(m, src, torch.ones(2, 5, dtype=torch.long), max_extra=2),
             lambda: beam_search(m, src, torch.ones(2, 5), beam_size=2, max_extra=2),
             lambda: greedy_decode(m, src, torch.tensor([[True] * 5, [False, False, True, True, True]])),
             lambda: beam_search(m, src, torch.tensor([[True] * 5, [True, False, True, True, False]]), beam_size=2),
             lambda: greedy_decode(gpt, src), lambda: translate_ids(gpt, [[5, 6]]),
             lambda: translate_ids(m, [10, 11]), lambda: translate_ids(m, ["hello"]),
             lambda: translate_ids(m, [[5, 6.0]]), lambda: translate_ids(m, "hello")]:
    try:
        call()
        print("accepted")
    except ValueError as exc:
        print(exc)
"""


def test_inputs_that_do_not_fit_together_are_refused_in_one_line():
    """Batch sizes that differ, a src_mask of the wrong shape or dtype or padded on the left,
    a decoder-only model,
    sources that are not lists of ids: each failed deep in attention or with a bare TypeError
    (a user's script, without the tests' shape checks, which would refuse them first)."""
    from cli_helpers import script_lines

    decoder_only = ("translation decodes an encoder-decoder Seq2SeqTransformer, got FrawdLLM; a decoder-only "
                    "model generates through frawdllm.infer.Engine")
    assert script_lines(MISMATCHED_CALLS) == [
        "src has 2 rows but tgt has 1: each target row needs its source row",
        "src has 2 rows but tgt has 1: each target row needs its source row",
        "src_mask must be a bool tensor of src's shape (2, 5), got a torch.bool tensor of shape (2, 3)",
        "src_mask must be a bool tensor of src's shape (2, 5), got a torch.int64 tensor of shape (2, 5)",
        "src_mask must be a bool tensor of src's shape (2, 5), got a torch.float32 tensor of shape (2, 5)",
        # (left padding: positions count from column 0, so it translated otherwise, silently)
        "src_mask has padding (False) before a real token (True); pad each row at its end",
        "src_mask has padding (False) before a real token (True); pad each row at its end",
        decoder_only,
        decoder_only,
        "sources[0] must be a list of token ids, got int: sources is a list of sentences, each a list of ids",
        "sources[0] must be a list of token ids, got str",
        "sources[0] must be a list of token ids, holds 6.0",
        "sources must be a list of sentences, each a list of token ids; got str",
    ]


def test_decoding_bytes_covers_the_caches_a_beam_search_allocates():
    """The estimate behind the memory refusal, against the tensors a search really holds:
    the decoder's KV cache and cross-attention keys/values of batch x beam rows, twice
    (reordering the beams copies them), plus a step's activations and logits."""
    from frawdllm.infer.translate import _Decoder, decoding_bytes

    model = model_for("paper")
    src, mask = pad_batch(_sources(), 0)
    B, S, K, extra = src.shape[0], src.shape[1], 3, 6
    decoder = _Decoder(model, model.memory_kv(model.encode(src, mask)), mask, S + extra + 1, use_cache=True)
    decoder.select_rows(torch.arange(B).repeat_interleave(K))
    held = sum(t.nbytes for t in decoder.cache.k + decoder.cache.v)
    held += sum(k.nbytes + v.nbytes for k, v in decoder.memory_kv)
    assert 2 * held <= decoding_bytes(model, B * K, S, extra) <= 3 * held


def test_a_batch_whose_beams_do_not_fit_in_memory_is_refused_before_decoding(monkeypatch):
    import frawdllm.infer.translate as decoding

    model = model_for("paper")
    monkeypatch.setattr(decoding, "free_memory", lambda device: 2**20)
    monkeypatch.setattr(decoding, "_Decoder", lambda *a, **k: pytest.fail("decoding started"))
    with pytest.raises(ValueError, match=r"^beam_size 40 with 6 sentences at a time: decoding 6 x 40 rows of up to "
                                         r"\d+ source tokens needs about [\d.]+ GiB, more than the 0\.0 GiB free on "
                                         r"cpu; lower beam_size or batch_size$"):
        decoding.translate_ids(model, _sources(6), beam_size=40)


def test_a_steps_loss_is_the_mean_over_all_its_target_tokens():
    """With --grad-accum 2 each token batch's loss was its own mean and the two means were
    averaged: a step is now one mean over the target tokens of all its batches (as fairseq
    normalizes accumulated batches), whatever their sizes."""
    from frawdllm.train.translation import TranslationTask

    model = model_for("paper").eval()
    sources = _sources(150, seed=3)
    pairs = [(s, s[: 1 + i % 7]) for i, s in enumerate(sources)]  # targets of 1-7 tokens: batches differ
    task = TranslationTask(model.config, None, pairs, None, tokens_per_batch=64, label_smoothing=0.0,
                           grad_accum=2)
    with torch.no_grad():
        for _ in range(3):  # steps
            batches = [task.next_batch() for _ in range(2)]
            counts = [int((b["labels"] != -100).sum()) for b in batches]
            assert counts[0] != counts[1]
            step = sum(task.loss(model, b)[0] for b in batches) / 2  # what the loop logs and differentiates
            sums = [F.cross_entropy(model(b["src"], b["tgt_in"], src_mask=b["src_mask"])[0].flatten(0, 1),
                                    b["labels"].flatten(), ignore_index=-100, reduction="sum") for b in batches]
            assert float(step) == pytest.approx(float(sum(sums)) / sum(counts), rel=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_scaled_embeddings_start_at_unit_scale_unless_tied_to_the_output_layer(tied):
    """Untied, scaled token tables start at std d^-1/2 (unit scale in the stream); a table
    tied to the output layer (every aiayn-* preset) is drawn as an output layer, at 0.02,
    which trained the multi30k recipe better (docs/seq2seq.md: same seed and batches, step
    2,400: validation loss 1.717 against 1.800 at d^-1/2, test BLEU 39.49 against 38.83)."""
    torch.manual_seed(0)
    cfg = get_config("aiayn-tiny", n_embd=256, n_layer=1, n_encoder_layer=1, tie_embeddings=tied)
    model = Seq2SeqTransformer(cfg)
    tables = [model.embed.tok.weight] + ([] if tied else [model.src_embed.tok.weight])
    for table in tables:
        assert float(table.detach().std()) == pytest.approx(0.02 if tied else 256 ** -0.5, rel=0.02)
    assert (model.lm_head.weight is model.embed.tok.weight) == tied
    if tied:  # an untrained model's loss starts near ln V (13.7 against ln V = 9.0 at d^-1/2)
        with torch.no_grad():
            src, tgt, targets = torch.randint(7, cfg.vocab_size, (3, 2, 12))
            loss = float(model(src, tgt, targets=targets)[1])
        assert abs(loss - math.log(cfg.vocab_size)) < 0.5, loss


def test_decode_refuses_positions_outside_the_context_as_the_decoder_only_model_does():
    """Position -1 with RoPE gave position 7's output (the tables read from the end), 8 a raw
    IndexError."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=40, n_embd=32, n_head=4, n_layer=1,
                                          n_encoder_layer=1, context_length=8, pos_encoding="rope")).eval()
    src = torch.randint(4, 40, (1, 5))
    memory_kv = model.memory_kv(model.encode(src))
    tgt = torch.tensor([[1]])
    for position, message in [(-1, "position -1 is negative"), (8, "position 8 is past the model's context_length 8")]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            model.decode(tgt, memory_kv, positions=torch.tensor([[position]]))
    model.decode(tgt, memory_kv, positions=torch.tensor([[7]]))
