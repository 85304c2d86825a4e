"""The engine against naive references: a loop that recomputes the full sequence each
step, the full forward's logits, each prompt run alone.

Every reference test runs in each decoding mode: PyTorch, and the native C forward
reading fp32 weights or fp16 copies (the default on CPU). In fp16 mode the reference is
the same model with its linear weights rounded to fp16, which is exactly what the C code
multiplies by (in fp32)."""

import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.errors import FrawdError
from frawdllm.infer import Engine, KVCache, SamplingParams, native
from frawdllm.infer.engine import decode_logits
from frawdllm.infer.sampling import make_generator, sample_next
from frawdllm.tokenizer import EOS_ID, train_tokenizer
from infer_helpers import HalfKV, one_thread  # noqa: F401  (autouse fixture)

VOCAB = 97

CONFIGS = {
    "learned": dict(pos_encoding="learned"),
    "sinusoidal": dict(pos_encoding="sinusoidal", scale_embeddings=True),
    "rope": dict(pos_encoding="rope"),
    "none": dict(pos_encoding="none"),
    "rope-gqa": dict(pos_encoding="rope", n_kv_head=2),
    "learned-mqa": dict(pos_encoding="learned", n_kv_head=1),
    "post-ln": dict(pos_encoding="learned", norm_placement="post"),
    "llama": dict(use_rope=True, use_rmsnorm=True, use_swiglu=True, bias=False, n_kv_head=2, tie_embeddings=False),
}


_NO_NATIVE = pytest.mark.skipif(not native.available(), reason=f"no native forward: {native.unavailable_reason()}")
MODES = {
    "torch": dict(native=False),
    "native-fp32": pytest.param(dict(native=True, weights="fp32"), marks=_NO_NATIVE),
    "native-fp16": pytest.param(dict(native=True, weights="fp16"), marks=[_NO_NATIVE, pytest.mark.skipif(
        not native.has_fp16(), reason="this CPU cannot read fp16 weights")]),
}


def reference(model, engine):
    """The model whose full forward the engine's decoding should reproduce: fp16-rounded
    weights and keys/values where the engine reads them so."""
    ref = native.fp16_rounded_copy(model) if engine.native and engine.weights == "fp16" else model
    return HalfKV(ref) if engine.kv_dtype == torch.float16 else ref


class IdTokenizer:
    """Decodes ids as text 'a b c' so tests can run on raw ids."""

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def make_model(seed=0, vocab_size=VOCAB, context_length=48, std=0.4, **overrides):
    torch.manual_seed(seed)
    cfg = get_config("tiny", vocab_size=vocab_size, n_layer=2, n_embd=32, n_head=4,
                     context_length=context_length, **overrides)
    model = FrawdLLM(cfg).eval()
    with torch.no_grad():  # larger weights than the init: outputs depend strongly on context
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
    return model


def prompt_ids(seed, length):
    return torch.randint(7, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def naive_generate(model, prompt, n_new, params=None, generator=None):
    """Full recompute of the whole sequence for every new token."""
    params = params or SamplingParams(temperature=0)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS_ID})
    seq, out = list(prompt), []
    for _ in range(n_new):
        logits = model(torch.tensor([seq]))[0][:, -1]  # (1, V)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[0, seq] = True
        token = int(sample_next(logits, params, generator, seen))
        seq.append(token)
        out.append(token)
        if token in stop_ids:
            break
    return out


@_NO_NATIVE
def test_the_default_engine_decodes_natively_with_fp16_weights_on_cpu():
    engine = Engine(make_model(), IdTokenizer())
    assert engine.native and engine.weights == ("fp16" if native.has_fp16() else "fp32")
    assert not Engine(make_model(), IdTokenizer(), native=False).native


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_engine_equals_naive_full_recompute(name, mode):
    model = make_model(**CONFIGS[name])
    engine = Engine(model, IdTokenizer(), **mode)
    ref = reference(model, engine)
    prompt = prompt_ids(1, 9)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    out = engine.generate([prompt], params)[0]
    assert out.tokens == naive_generate(ref, prompt, 20)
    # With a repetition penalty greedy output varies more: a sharper check of positions.
    penalised = params.replace(repetition_penalty=1.8)
    tokens = engine.generate([prompt], penalised)[0].tokens
    assert len(set(tokens)) > 5
    assert tokens == naive_generate(ref, prompt, 20, penalised)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("name", ["rope", "learned-mqa", "llama"])
def test_seeded_sampling_through_the_engine_equals_the_naive_loop(name, mode):
    model = make_model(**CONFIGS[name])
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, max_new_tokens=25, seed=7)
    prompt = prompt_ids(2, 6)
    engine = Engine(model, IdTokenizer(), **mode)
    tokens = engine.generate([prompt], params)[0].tokens
    assert len(set(tokens)) > 5
    assert tokens == naive_generate(reference(model, engine), prompt, 25, params, make_generator(7))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_cache_logits_equal_full_forward(name, static):
    model = make_model(std=0.2, **CONFIGS[name])  # logits of order 1: 1e-5 is fp32 rounding
    seq = prompt_ids(3, 30)
    cache = KVCache(model.config, 1, 40, static=static)
    cache.begin(12)
    hidden = model.hidden_states(torch.tensor([seq[:12]]), torch.arange(12)[None], cache)
    torch.testing.assert_close(model.lm_head(hidden[:, -1]), model(torch.tensor([seq[:12]]))[0][:, -1],
                               atol=1e-5, rtol=0)
    for t in range(12, 30):
        cache.begin(1)
        logits = decode_logits(model, torch.tensor([[seq[t]]]), torch.tensor([[t]]), cache)
        full = model(torch.tensor([seq[: t + 1]]))[0][:, -1]
        torch.testing.assert_close(logits, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("name", ["learned", "rope-gqa", "sinusoidal"])
def test_ragged_batch_rows_equal_each_prompt_alone(name, mode):
    model = make_model(**CONFIGS[name])
    engine = Engine(model, IdTokenizer(), **mode)
    prompts = [prompt_ids(10, 3), prompt_ids(11, 17), prompt_ids(12, 9), prompt_ids(13, 1)]
    params = SamplingParams(temperature=0, max_new_tokens=15, repetition_penalty=1.5, num_samples=2)
    batch = engine.generate(prompts, params)
    assert [(c.prompt_index, c.sample_index) for c in batch] == [(i, s) for i in range(4) for s in range(2)]
    for c in batch:
        alone = engine.generate([prompts[c.prompt_index]], params.replace(num_samples=1))[0]
        assert c.tokens == alone.tokens
        assert c.prompt_tokens == len(prompts[c.prompt_index])
    # Seeded sampling too: each row draws from a generator of its own (seed, sample index),
    # so a prompt's samples do not depend on the other prompts of the batch.
    sampled = params.replace(temperature=1.0, top_k=50, seed=3)
    batch = engine.generate(prompts, sampled)
    assert len({tuple(c.tokens) for c in batch}) == len(batch)  # every sample its own draw
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], sampled)
        assert [c.tokens for c in alone] == [c.tokens for c in batch[2 * i:2 * i + 2]]


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_rows_finish_independently_and_the_rest_continue_unchanged(mode):
    model = make_model(**CONFIGS["rope"])
    engine = Engine(model, IdTokenizer(), **mode)
    prompts = [prompt_ids(20 + i, 4 + 3 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_new_tokens=16, repetition_penalty=1.5, ignore_eos=True)
    alone = [engine.generate([p], params)[0].tokens for p in prompts]
    # A stop token that ends row 0 early while some other row never emits it.
    stop = next(t for t in alone[0][:6] if any(t not in ref for ref in alone[1:]))
    batch = engine.generate(prompts, params.replace(stop_token_ids=[stop]))
    for c, ref in zip(batch, alone):
        if stop in ref:
            assert c.tokens == ref[: ref.index(stop) + 1] and c.finish_reason == "stop"
        else:
            assert c.tokens == ref and c.finish_reason == "length"
    assert len(batch[0].tokens) <= 6


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_a_padded_row_goes_on_alone_after_the_longest_prompt_finishes_at_once(mode):
    """The longest prompt (no padding) ends on its first token: the cache keeps the short
    prompt's row, whose padding stays masked and whose new slots stay seen (a stale copy
    of the mask after the rows were selected masked each new token out of its own attention)."""
    model = make_model(**CONFIGS["learned"])
    engine = Engine(model, IdTokenizer(), **mode)
    long, short = prompt_ids(30, 7), prompt_ids(31, 2)
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    first = engine.generate([long], params.replace(max_new_tokens=1))[0].tokens[0]
    params = params.replace(stop_token_ids=[first])
    alone = engine.generate([short], params)[0]
    assert len(alone.tokens) >= 5  # (it runs on after the long one ends)
    batch = engine.generate([long, short], params)
    assert batch[0].tokens == [first] and batch[1].tokens == alone.tokens


def test_end_of_sequence_ends_a_completion_and_is_not_text():
    model = make_model(**CONFIGS["learned"])
    with torch.no_grad():  # make <|eos|> the only possible greedy choice after one token
        model.lm_head.weight[EOS_ID] = model.lm_head.weight[EOS_ID] * 0
    engine = Engine(model, IdTokenizer())
    prompt = prompt_ids(4, 5)
    ref = naive_generate(reference(model, engine), prompt, 30)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=30))[0]
    assert out.tokens == ref
    if out.tokens[-1] == EOS_ID:
        assert out.finish_reason == "stop" and out.text == IdTokenizer().decode(out.tokens[:-1])
    ignored = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))[0]
    assert len(ignored.tokens) == 30 and ignored.finish_reason == "length"


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_overflow_stop_ends_rows_at_the_context_length(mode):
    model = make_model(context_length=24, **CONFIGS["rope"])
    engine = Engine(model, IdTokenizer(), overflow="stop", **mode)
    params = SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)
    short, long = prompt_ids(5, 4), prompt_ids(6, 20)
    out = engine.generate([short, long], params)
    # The last token fed sits at position 23, so a row ends holding 24 + 1 tokens.
    assert [len(c.tokens) for c in out] == [21, 5]
    assert all(c.finish_reason == "length" for c in out)
    assert out[1].tokens == naive_generate(reference(model, engine), long, 5, params)
    with pytest.raises(FrawdError, match="prompt has 30 tokens but the model's context is 24"):
        engine.generate([prompt_ids(7, 30)], params)


@torch.no_grad()
def naive_slide(model, prompt, n_new, keep, kept=0):
    """Recompute everything, keeping only the tokens since the last slide (after the prompt's
    first `kept` tokens)."""
    context = model.config.context_length
    seq, start, out = list(prompt), 0, []
    window = lambda: seq if start == 0 else seq[:kept] + seq[start:]  # noqa: E731
    if len(seq) > context:
        start = len(seq) - keep + kept
    for _ in range(n_new):
        logits = model(torch.tensor([window()]))[0][0, -1]
        token = int(logits.argmax())
        seq.append(token)
        out.append(token)
        if len(window()) > context:  # the new token would not fit: slide
            start = len(seq) - keep + kept
    return out


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("name", ["rope", "learned", "llama"])
def test_overflow_slide_keeps_the_cache_coherent_past_the_context(name, mode):
    model = make_model(context_length=16, **CONFIGS[name])
    engine = Engine(model, IdTokenizer(), overflow="slide", **mode)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, repetition_penalty=1.0)
    for prompt in (prompt_ids(8, 5), prompt_ids(9, 20)):  # the second is longer than the context
        out = engine.generate([prompt], params)[0]
        assert len(out.tokens) == 40
        assert out.tokens == naive_slide(reference(model, engine), prompt, 40, keep=12)
    # in one batch each row slides when it reaches the context itself, not when another does
    prompts = [prompt_ids(10, 5), prompt_ids(11, 11), prompt_ids(12, 14), prompt_ids(13, 20)]
    batched = engine.generate(prompts, params)
    assert [c.tokens for c in batched] == [naive_slide(reference(model, engine), p, 40, keep=12) for p in prompts]


class BosTokenizer(IdTokenizer):
    """An imported Llama's: its template starts every text prompt with BOS (id 1 here)."""
    prompt_prefix = [1]

    def encode_prompt(self, text):
        return self.prompt_prefix + self.encode(text)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_overflow_slide_keeps_the_prompts_bos(mode):
    """A slid window lost the BOS an imported model always saw first."""
    model = make_model(context_length=16, **CONFIGS["llama"])
    engine = Engine(model, BosTokenizer(), overflow="slide", **mode)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, repetition_penalty=1.0)
    prompts = ["5 9 7", " ".join(str(t) for t in prompt_ids(9, 20)), "4 4 8 2 2 8 3 5 6 7 9 2 3"]
    out = engine.generate(prompts, params)
    ids = [engine.encode(p) for p in prompts]
    assert all(i[0] == 1 for i in ids)
    expected = [naive_slide(reference(model, engine), i, 40, keep=12, kept=1) for i in ids]
    assert [c.tokens for c in out] == expected
    assert expected != [naive_slide(reference(model, engine), i, 40, keep=12) for i in ids]  # (the test can tell)
    assert engine.generate(prompts[1:2], params)[0].tokens == expected[1]  # alone as in a batch


COMPILE_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_engine import CONFIGS, IdTokenizer, make_model, prompt_ids
from frawdllm.infer import Engine, SamplingParams
torch.set_num_threads(1)
model = make_model(**CONFIGS["rope-gqa"])
prompts = [prompt_ids(30, 5), prompt_ids(31, 11)]
params = SamplingParams(temperature=0, max_new_tokens=12, repetition_penalty=1.5)
eager = Engine(model, IdTokenizer(), native=False).generate(prompts, params)
compiled = Engine(model, IdTokenizer(), compile=True).generate(prompts, params)
print([c.tokens for c in eager] == [c.tokens for c in compiled], len(set(eager[0].tokens)))
# The compiled step freezes the weights into its graph: a new Engine after a weight
# change must see the new weights, not reuse the first engine's graph.
with torch.no_grad():
    for param in model.parameters():
        param.mul_(-1.0)
eager2 = Engine(model, IdTokenizer(), native=False).generate(prompts, params)
compiled2 = Engine(model, IdTokenizer(), compile=True).generate(prompts, params)
print([c.tokens for c in eager2] == [c.tokens for c in compiled2], eager2[0].tokens != eager[0].tokens)
"""


def test_compiled_engine_equals_eager(tmp_path):
    # In a fresh interpreter: the test session's run-time type checks cannot be traced by dynamo.
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = COMPILE_SCRIPT.format(tests=str(Path(__file__).parent))
    env = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    env["FRAWD_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    same, distinct, same_after_change, changed = result.stdout.split()
    assert same == "True" and int(distinct) > 3
    assert changed == "True" and same_after_change == "True"
    # the warm-up is said (it was silent for 23-95 s), and its kernels kept where training keeps them
    assert "torch.compile warm-up of the decode step (2 rows, " in result.stderr, result.stderr[-3000:]
    assert any((tmp_path / "cache" / "inductor").iterdir())


# ---- text: stop strings and streaming ------------------------------------------------------

@pytest.fixture(scope="module")
def char_setup():
    """A char-level model: every token is one printable character."""
    tokenizer = train_tokenizer(["abcdefghij klmnop"], kind="char")
    model = make_model(vocab_size=tokenizer.vocab_size, std=0.5, **CONFIGS["rope"])
    return model, tokenizer


def test_stop_string_spanning_several_tokens_stops_and_is_never_streamed(char_setup):
    model, tokenizer = char_setup
    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=40, ignore_eos=True)
    full = engine.generate(["abc"], params)[0].text
    stop = full[10:13]  # three characters, three tokens
    expected = full[: full.index(stop)]
    chunks = list(engine.stream("abc", params.replace(stop=[stop, "zzz"])))
    streamed = "".join(c.text for c in chunks)
    assert streamed == expected
    assert chunks[-1].finish_reason == "stop"
    # No prefix of the stop string ever showed at the end of what was printed so far.
    shown = ""
    for c in chunks:
        shown += c.text
        assert not any(shown.endswith(stop[:n]) for n in range(1, len(stop))) or shown == expected
    done = engine.generate(["abc"], params.replace(stop=[stop]))[0]
    assert done.text == expected and done.finish_reason == "stop"
    assert tokenizer.decode(done.tokens, skip_special_tokens=True) == expected + stop  # it ended right there


def test_streamed_text_equals_generated_text(char_setup):
    model, tokenizer = char_setup
    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=0.9, seed=5, max_new_tokens=30, num_samples=2)
    texts = ["", ""]
    for chunk in engine.stream(["fed"], params):
        texts[chunk.index] += chunk.text
    assert texts == [c.text for c in engine.generate(["fed"], params)]


def test_empty_prompt_starts_after_end_of_sequence():
    model = make_model(**CONFIGS["learned"])
    engine = Engine(model, IdTokenizer())
    out = engine.generate([[]], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))[0]
    expected = naive_generate(reference(model, engine), [EOS_ID], 5, SamplingParams(temperature=0, ignore_eos=True))
    assert out.tokens == expected
    with pytest.raises(FrawdError, match="outside the vocabulary"):
        engine.generate([[VOCAB + 3]], SamplingParams())


def test_prompt_logprobs_checks_its_prompt_as_generate_does_and_caps_k_as_sampling_params():
    """An id past the vocabulary failed with IndexError, [] with a message about a float
    tensor, k=-1 inside topk, and k=50 was accepted past SamplingParams' logprobs cap."""
    from frawdllm.infer.sampling import MAX_LOGPROBS

    engine = Engine(make_model(**CONFIGS["learned"]), IdTokenizer(), native=False)
    outside = rf"^prompt token id {VOCAB + 3} is outside the vocabulary \(size {VOCAB}\)$"
    with pytest.raises(FrawdError, match=outside):
        engine.prompt_logprobs([5, VOCAB + 3], 2)
    with pytest.raises(FrawdError, match=rf"^prompt token id {VOCAB} is outside"):  # (the first id past it)
        engine.prompt_logprobs([5, VOCAB], 2)
    assert engine.prompt_logprobs([5, VOCAB - 1], 0)[1] is not None  # (the last id in it)
    for k in (-1, MAX_LOGPROBS + 1):
        with pytest.raises(FrawdError, match=rf"^k \(alternatives per token\) must be an integer in "
                                             rf"\[0, {MAX_LOGPROBS}\], got {k}$"):
            engine.prompt_logprobs([5, 6], k)
    assert engine.prompt_logprobs([], 2) == engine.prompt_logprobs([EOS_ID], 2) == [None]  # (as generate reads [])
    scored = engine.prompt_logprobs("5 6 7", MAX_LOGPROBS)  # text, as generate takes it
    assert scored == engine.prompt_logprobs(torch.tensor([5, 6, 7]), MAX_LOGPROBS)
    assert scored[0] is None and [s.token for s in scored[1:]] == [6, 7] and len(scored[1].top) == MAX_LOGPROBS
    context = engine.config.context_length
    for overflow in ("stop", "slide"):  # scored in one forward: sliding is no way out, and is not offered
        engine.overflow = overflow
        with pytest.raises(FrawdError, match=rf"^the prompt has {context + 1} tokens but the model's context is "
                                             rf"{context}; shorten it$"):
            engine.prompt_logprobs([5] * (context + 1), 1)


def test_a_reply_to_a_prompt_ending_inside_a_character_is_the_text_past_the_prompt():
    """Prompt ids "hello " + 3 of the 4 bytes of 😀: a reply whose first byte continued the
    character showed it as a U+FFFD of its own. The reply's text is what the prompt and reply
    decode to together, past the prompt's text (whose last character is the broken one)."""
    from frawdllm.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    model = make_model(vocab_size=tokenizer.vocab_size, std=0.3, **CONFIGS["learned"])
    prompt = tokenizer.encode("hello 😀")[:-1]
    prompt_text = tokenizer.decode(prompt)
    engine, continued = Engine(model, tokenizer), 0
    for seed in range(24):
        params = SamplingParams(temperature=2.0, seed=seed, max_new_tokens=4, ignore_eos=True)
        done = engine.generate([prompt], params)[0]
        assert done.text == tokenizer.decode(prompt + done.tokens, skip_special_tokens=True)[len(prompt_text):], seed
        assert "".join(c.text for c in engine.stream([prompt], params)) == done.text
        continued += 0x80 <= done.tokens[0] - 7 < 0xC0  # (byte b is token 7 + b)
    assert continued >= 2  # some replies did complete the character


def test_streamed_bytes_equal_the_one_shot_decode_of_the_tokens():
    from frawdllm.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    model = make_model(vocab_size=tokenizer.vocab_size, std=0.3, **CONFIGS["learned"])
    with torch.no_grad():  # favour the bytes of "é" and "€" so that multi-byte characters appear
        for byte in "é€".encode("utf-8"):
            model.lm_head.weight[7 + byte] *= 4
    params = SamplingParams(temperature=1.5, seed=11, max_new_tokens=40, ignore_eos=True)
    engine = Engine(model, tokenizer)
    done = engine.generate(["x"], params)[0]
    streamed = "".join(c.text for c in engine.stream("x", params))
    assert streamed == tokenizer.decode(done.tokens, skip_special_tokens=True) == done.text
    assert any(ord(ch) > 127 and ch != "\ufffd" for ch in streamed)  # a real multi-byte character came through


@torch.no_grad()
def test_a_kv_cache_forward_that_begin_did_not_announce_is_one_line():
    """Without begin(n) a fresh cache failed with "The expanded size of the tensor (0) must
    match", and a second forward after one begin overwrote the first one's slots."""
    model = make_model(**CONFIGS["rope"])
    ids = torch.tensor([prompt_ids(0, 8)])
    advice = r": call cache.begin\(n\) before each forward of n tokens$"
    unannounced = r"^KVCache got a forward of {} that no begin\(\) announced" + advice
    with pytest.raises(FrawdError, match=unannounced.format("8 new tokens")):
        model(ids, kv_cache=KVCache(model.config, 1, 32))
    cache = KVCache(model.config, 1, 32)
    cache.begin(8)
    model(ids, kv_cache=cache)
    step = (ids[:, :1], torch.full((1, 1), 8))
    with pytest.raises(FrawdError, match=unannounced.format("1 new token")):
        model(step[0], positions=step[1], kv_cache=cache)
    cache.begin(2)
    with pytest.raises(FrawdError, match=r"^KVCache got 1 new token but begin\(\) announced 2" + advice):
        model(step[0], positions=step[1], kv_cache=cache)

    cache = KVCache(model.config, 1, 32)  # built for one row, given two
    cache.begin(8)
    with pytest.raises(FrawdError, match=r"^KVCache got a batch of 2 rows; it holds 1$"):
        model(ids.repeat(2, 1), kv_cache=cache)  # ("The expanded size of the tensor (1) must match ...")


@torch.no_grad()
def test_every_cache_refuses_an_unannounced_forward_and_gives_positions_to_one_without():
    """A static cache's one-token step and a RowKVCache took an unannounced forward (it
    overwrote the last slot: logits ~0.02 off), and a forward given no positions put every new
    token at position 0. Checked against the full forward without a cache."""
    from frawdllm.infer.cache import RowKVCache

    model = make_model(**CONFIGS["rope"])
    ids = torch.tensor([prompt_ids(0, 10)])
    full = model(ids)[0]
    for static in (False, True):
        cache = KVCache(model.config, 1, 16, static=static)
        cache.begin(8)
        model(ids[:, :8], kv_cache=cache)
        for t in (8, 9):
            cache.begin(1)
            torch.testing.assert_close(model(ids[:, t:t + 1], kv_cache=cache)[0][:, -1], full[:, t])
        with pytest.raises(FrawdError, match=r"^KVCache got a forward of 1 new token that no begin\(\) announced"):
            model(ids[:, 9:10], kv_cache=cache)
    padded = KVCache(model.config, 2, 16)  # row 0 left-padded by 3: its positions start at 0 all the same
    row0 = torch.tensor([[0, 0, 0, *prompt_ids(0, 5)]])
    padded.begin(8, valid=torch.tensor([[False] * 3 + [True] * 5, [True] * 8]))
    logits = model(torch.cat([row0, ids[:, :8]]), kv_cache=padded)[0]
    torch.testing.assert_close(logits[1], full[0, :8])
    torch.testing.assert_close(logits[0, 3:], full[0, :5])
    rows = RowKVCache(model.config, 1, 16)
    view = rows.row_view(0)  # (the row prefilled in place, as the scheduler does)
    view.begin(8)
    model(ids[:, :8], kv_cache=view)
    rows.set_length(0, 8)
    rows.rows = 1
    with pytest.raises(FrawdError, match=r"^RowKVCache got a forward that no begin\(\) announced"):
        model(ids[:, 8:9], kv_cache=rows)
    rows.begin(1)
    torch.testing.assert_close(model(ids[:, 8:9], kv_cache=rows)[0][:, -1], full[:, 8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_caches_start_as_zeros_of_their_own_and_hold_what_is_written(dtype):
    from frawdllm.infer.cache import RowKVCache

    cfg = get_config("tiny", n_layer=2, n_embd=32, n_head=4, vocab_size=300, context_length=16)
    for cache in (KVCache(cfg, 2, 16, dtype=dtype), RowKVCache(cfg, 3, 16, dtype=dtype)):
        tensors = [*cache.k, *cache.v]
        assert all(t.dtype == dtype and t.shape[1:] == (4, 16, 8) and t.is_contiguous() for t in tensors)
        assert all(torch.count_nonzero(t) == 0 for t in tensors)
        assert len({t.data_ptr() for t in tensors}) == len(tensors)  # no two layers share storage
        cache.k[0][0, 1, 5] = 2.5
        assert cache.k[0][0, 1, 5].eq(2.5).all() and torch.count_nonzero(cache.v[0]) == 0


def test_kv_cache_masks_and_counts_through_padding_reuse_row_selection_and_a_full_cache():
    """The mask `update` returns, at each turn a batch takes: a padded start keeps masking
    its padding through later all-real forwards; `reset` forgets every slot (a static
    decode attended the last batch's keys); selected rows get a mask of their own; the
    last slot can be filled, one past it cannot, and `free` counts what is left."""
    from frawdllm.infer.cache import RowKVCache

    cfg = get_config("tiny", n_layer=1, n_embd=32, n_head=4, vocab_size=300, context_length=16)

    def forward(cache, rows, n):  # (one layer: its update is the forward's write)
        kv = torch.zeros(rows, 4, n, 8)
        return cache.update(0, kv, kv)[2]

    cache = KVCache(cfg, 2, 8)
    cache.begin(3, valid=torch.tensor([[False, True, True], [True, True, True]]))
    forward(cache, 2, 3)
    cache.begin(2, valid=torch.ones(2, 2, dtype=torch.bool))
    forward(cache, 2, 2)
    cache.begin(1)
    assert forward(cache, 2, 1)[:, 0, 0].tolist() == [[False] + [True] * 5, [True] * 6]
    assert cache.free == 2
    cache.begin(2)  # the last two slots
    forward(cache, 2, 2)
    assert cache.free == 0
    with pytest.raises(ValueError, match="KV cache full"):
        cache.begin(1)
    static = KVCache(cfg, 2, 6, static=True)
    for n in (3, 1):  # a batch, then the cache reused for a shorter one
        static.reset()
        static.begin(n)
        forward(static, 2, n)
        static.begin(1)
        assert forward(static, 2, 1)[:, 0, 0].tolist() == [[True] * (n + 1) + [False] * (5 - n)] * 2
    static.select_rows(torch.tensor([1]))
    static.begin(1)
    assert forward(static, 1, 1)[:, 0, 0].tolist() == [[True] * 3 + [False] * 3]
    rows = RowKVCache(cfg, 1, 4)
    rows.set_length(0, 3)
    rows.rows = 1
    rows.begin(1)  # (its last slot)
    with pytest.raises(ValueError, match="KV cache full: a row would pass max_len 4"):
        rows.begin(1)


def test_a_model_in_train_mode_decodes_as_in_eval_mode_and_keeps_its_modes():
    model = make_model(dropout=0.5, **CONFIGS["learned"])
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_new_tokens=12, ignore_eos=True)
    prompts = [prompt_ids(1, 5), prompt_ids(2, 3)]
    engine = Engine(model, IdTokenizer(), native=False)
    expected = [[c.tokens for c in engine.generate(prompts, p)] for p in (greedy, seeded)]
    model.train()
    model.blocks[0].eval()  # a mixed state comes back exactly as it was
    modes = [m.training for m in model.modules()]
    engine = Engine(model, IdTokenizer(), native=False)  # construction changes nothing either
    assert [m.training for m in model.modules()] == modes
    for _ in range(2):  # with dropout on, two runs would differ from each other and from eval mode
        assert [[c.tokens for c in engine.generate(prompts, p)] for p in (greedy, seeded)] == expected
        assert "".join(c.text for c in engine.stream(prompts[0], greedy)) == engine.generate(prompts[0], greedy)[0].text
    assert [m.training for m in model.modules()] == modes


def test_a_tokenizer_with_more_ids_than_the_model_is_one_clear_error():
    from frawdllm.tokenizer import byte_tokenizer

    with pytest.raises(FrawdError, match="the tokenizer has 263 ids but the model only 97") as info:
        Engine(make_model(), byte_tokenizer())
    assert "\n" not in str(info.value)


def test_the_tokenizer_may_be_a_path_and_none_is_refused_at_construction(tmp_path):
    from frawdllm.tokenizer import train_tokenizer

    model = make_model()
    with pytest.raises(TypeError, match=r"the tokenizer is NoneType, without decode; give the model's"):
        Engine(model, None)

    class DecodeOnly:  # enough for token-id prompts
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    engine = Engine(model, DecodeOnly())
    assert len(engine.generate([[5, 6]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].tokens) == 3
    with pytest.raises(FrawdError, match=r"a text prompt needs a tokenizer with encode \(DecodeOnly has none\)"):
        engine.generate("text", SamplingParams(max_new_tokens=3))
    tok = train_tokenizer(["".join(chr(97 + i % 26) for i in range(200))], "char")  # 26 + 7 ids: fits 97
    tok.save(tmp_path / "tokenizer.json")
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    want = Engine(model, tok).generate("abc", params)[0].text
    for path in (tmp_path / "tokenizer.json", str(tmp_path)):  # the file, or the folder holding it
        assert Engine(model, path).generate("abc", params)[0].text == want


def test_an_encoder_decoder_model_is_refused_with_a_pointer_to_translate():
    from frawdllm import Seq2SeqTransformer

    cfg = get_config("aiayn-tiny", vocab_size=VOCAB, n_layer=1, n_encoder_layer=1, n_embd=32, n_head=4)
    with pytest.raises(FrawdError, match="decoder-only.*frawdllm.infer.translate"):
        Engine(Seq2SeqTransformer(cfg), IdTokenizer())


def test_prompt_ids_as_tensors_arrays_and_numpy_integers_equal_a_list_of_ints():
    import numpy as np

    engine = Engine(make_model(**CONFIGS["learned"]), IdTokenizer(), native=False)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    ids, other = prompt_ids(3, 5), prompt_ids(4, 5)
    expected = engine.generate(ids, params)[0].tokens
    for prompt in (tuple(ids), torch.tensor(ids), np.array(ids), np.array(ids, dtype=np.int32),
                   [np.int64(i) for i in ids], list(torch.tensor(ids))):
        out = engine.generate(prompt, params)
        assert len(out) == 1 and out[0].tokens == expected, type(prompt)
    assert engine.encode(np.array(ids)) == ids and all(type(i) is int for i in engine.encode(torch.tensor(ids)))
    both = [c.tokens for c in engine.generate([ids, other], params)]
    for batch in (torch.tensor([ids, other]), np.array([ids, other]), [torch.tensor(ids), np.array(other)]):
        assert [c.tokens for c in engine.generate(batch, params)] == both, type(batch)


@pytest.mark.parametrize("prompts, message", [
    (b"hello", "not bytes: decode it first"),
    ([b"hello", "x"], "not bytes: decode it first"),
    (bytearray(b"hi"), "not bytes: decode it first"),
    ([5.0, 6.0], "prompt token ids must be integers; got 5.0"),
    ([5, True], "prompt token ids must be integers; got True"),
    (torch.tensor([5.0, 6.0]), "1-D integer token ids; got shape \\(2,\\), dtype torch.float32"),
    (torch.tensor(5), "1-D integer token ids; got shape \\(\\)"),
    ([torch.zeros(2, 2, dtype=torch.long)], "1-D integer token ids; got shape \\(2, 2\\)"),
    ([{"text": "x"}], "a prompt is text \\(str\\) or a sequence of token ids; got dict"),
    (7, "prompts must be a prompt \\(str or token ids\\) or a list of prompts; got int"),
    (None, "got NoneType"),
])
def test_prompts_of_other_types_are_one_clear_error(prompts, message):
    engine = Engine(make_model(), IdTokenizer(), native=False)
    with pytest.raises(FrawdError, match=message) as info:
        engine.generate(prompts, SamplingParams(max_new_tokens=2))
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not (native.available() and native.has_fp16()), reason="needs the native forward with fp16")
def test_keys_past_fp16_range_in_a_half_cache_are_refused_not_decoded_as_nan():
    model = make_model(**CONFIGS["learned"])
    with torch.no_grad():  # weights inside fp16's range whose keys are not: |k| ~ 30000 * sqrt(32)
        qkv = model.blocks[0].attn.qkv.weight
        qkv.copy_(torch.sign(torch.randn_like(qkv)) * 30000)
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    half = Engine(model, IdTokenizer(), native=True, weights="fp16")
    assert half.kv_dtype == torch.float16
    for prompts in ([prompt_ids(5, 4)], [prompt_ids(5, 4), prompt_ids(6, 2)], [[9]]):  # alone, padded, one token
        with pytest.raises(FrawdError, match=r"exceed fp16's range.*fp32 cache: --native fp32 \(weights='fp32'\)"):
            half.generate(prompts, params)
    exact = Engine(model, IdTokenizer(), native=True, weights="fp32")
    assert exact.generate([prompt_ids(5, 4)], params)[0].tokens == \
        Engine(model, IdTokenizer(), native=False).generate([prompt_ids(5, 4)], params)[0].tokens


@pytest.mark.skipif(not (native.available() and native.has_fp16()), reason="needs the native forward with fp16")
def test_weights_past_fp16_range_make_auto_read_fp32_copies():
    """A diverged training run's weights: "auto" chose fp16 copies and the engine refused
    them ("a weight ... is too large for fp16"), so the run's end-of-run sample failed."""
    model = make_model(**CONFIGS["learned"])
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    assert Engine(model, IdTokenizer(), native=True).weights == "fp16"
    with torch.no_grad():
        model.blocks[0].mlp.up.weight[0, 0] = 70000.0
    auto = Engine(model, IdTokenizer(), native=True)
    assert auto.weights == "fp32"
    assert auto.generate([prompt_ids(5, 4)], params)[0].tokens == \
        Engine(model, IdTokenizer(), native=True, weights="fp32").generate([prompt_ids(5, 4)], params)[0].tokens
    with pytest.raises(FrawdError, match="too large for fp16; use fp32 weights"):  # (asked for by name)
        Engine(model, IdTokenizer(), native=True, weights="fp16").generate([prompt_ids(5, 4)], params)


def test_a_stop_string_found_in_the_flushed_tail_finishes_as_stop():
    """The last token starts a character that never completes: finish() flushes it as U+FFFD,
    and a stop string there cuts the text: the reason is "stop", not the "length" that
    ended the row."""
    from frawdllm.infer.textstream import TextStream
    from frawdllm.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    engine = Engine(make_model(vocab_size=tokenizer.vocab_size), tokenizer)
    params = SamplingParams(max_new_tokens=2, stop=["\ufffd"])
    stream = TextStream(tokenizer, params.stop)
    assert engine.push_text(stream, 7 + ord("a"), None, params) == ("a", None)
    assert engine.push_text(stream, 7 + 0xE2, "length", params) == ("", "stop")  # 0xE2: the head of "€"


def test_params_that_are_not_sampling_params_are_one_line():
    """A dict failed with `AttributeError: 'dict' object has no attribute 'num_samples'`
    (Engine.generate/stream and Scheduler.submit take params through `checked_params`;
    here the tests' own type checks would refuse the dict first)."""
    from frawdllm.infer.sampling import checked_params

    message = r"^params must be a SamplingParams \(SamplingParams.from_dict reads a dict\), got dict$"
    with pytest.raises(FrawdError, match=message):
        checked_params({"temperature": 0})
    assert checked_params(None) == SamplingParams()


def test_stop_token_ids_outside_the_vocabulary_are_one_line():
    """A stop id the model can never produce was accepted and never stopped anything."""
    from frawdllm.infer.scheduler import Scheduler
    from frawdllm.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    engine = Engine(make_model(vocab_size=tokenizer.vocab_size), tokenizer)
    params = SamplingParams(max_new_tokens=2, temperature=0, stop_token_ids=[5, tokenizer.vocab_size])
    message = rf"^stop token id {tokenizer.vocab_size} is outside the vocabulary \(size {tokenizer.vocab_size}\)$"
    with pytest.raises(FrawdError, match=message):
        engine.generate("a", params)
    with pytest.raises(FrawdError, match=message):
        next(engine.stream("a", params))
    scheduler = Scheduler(engine)
    try:
        with pytest.raises(FrawdError, match=message):
            scheduler.submit("a", params)
    finally:
        scheduler.close()
    assert len(engine.generate("a", params.replace(stop_token_ids=[tokenizer.vocab_size - 1]))[0].tokens) <= 2


def test_from_pretrained_names_a_bad_device_before_reading_anything(tmp_path):
    FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(tmp_path / "m")
    with pytest.raises(FrawdError, match="unknown device 'gpu'"):  # (blamed the weights file before)
        FrawdLLM.from_pretrained(tmp_path / "m", device="gpu")


def test_a_stop_token_that_is_a_character_is_not_streamed_as_generate_leaves_it_out(char_setup):
    """A stop token id (stop_token_ids) ends the row and is no text: generate leaves it out
    of the text; the stream must not print it either."""
    model, tokenizer = char_setup
    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=40, ignore_eos=True)
    full = engine.generate(["abc"], params)[0]
    stop_id = full.tokens[8]
    first = full.tokens.index(stop_id)
    expected = tokenizer.decode(full.tokens[:first], skip_special_tokens=True)
    stopping = params.replace(stop_token_ids=[stop_id])
    done = engine.generate(["abc"], stopping)[0]
    assert done.tokens == full.tokens[:first + 1] and done.finish_reason == "stop"
    assert done.text == expected
    chunks = list(engine.stream("abc", stopping))
    assert "".join(c.text for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop" and chunks[-1].token == stop_id
