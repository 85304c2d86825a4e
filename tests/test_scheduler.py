"""Continuous batching (`infer/scheduler.py`, `RowKVCache`): a request's tokens do not depend
on what else runs beside it. The reference is `Engine.generate` of that prompt alone."""

import gc
import threading
import time

import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.errors import FrawdError
from frawdllm.infer import Engine, SamplingParams
from frawdllm.infer import native as native_forward
from frawdllm.infer.cache import KVCache, RowKVCache
from frawdllm.infer.engine import decode_logits
from frawdllm.infer.scheduler import Cancelled, Closed, QueueFull, Scheduler
from frawdllm.tokenizer import SPECIAL_TOKENS, train_tokenizer
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)

TEXT = "the quick brown fox jumps over the lazy dog"


def varied_model(**overrides):
    """A random char model whose greedy output varies from token to token."""
    tok = train_tokenizer([TEXT], kind="char")
    torch.manual_seed(0)
    cfg = dict(vocab_size=tok.vocab_size, n_layer=2, n_embd=64, n_head=4, context_length=96, tie_embeddings=False)
    model = FrawdLLM(get_config("tiny", **{**cfg, **overrides}))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
        model.lm_head.weight[: len(SPECIAL_TOKENS)] = 0  # never the greedy choice
    return model, tok


PROMPTS = [TEXT[i % 7: i % 7 + 3 + (5 * i) % 31] for i in range(32)]  # lengths 3..33, all different


@pytest.fixture(scope="module")
def model_tok():
    return varied_model()


needs_native = pytest.mark.skipif(not native_forward.available(), reason="no C compiler")


def wait_idle(scheduler, seconds=5.0) -> bool:
    """Whether every row has left within `seconds`."""
    deadline = time.time() + seconds
    while scheduler.running and time.time() < deadline:
        time.sleep(0.01)
    return scheduler.running == 0


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
def test_greedy_tokens_equal_generate_alone(model_tok, native):
    model, tok = model_tok
    engine = Engine(model, tok, native=native)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    expected = [engine.generate(p, params)[0].tokens for p in PROMPTS]
    scheduler = Scheduler(engine, max_batch=32)
    try:
        handles = [scheduler.submit(p, params) for p in PROMPTS]
        got = [[c.token for c in h] for h in handles]
    finally:
        scheduler.close()
    assert got == expected
    assert len({tuple(t) for t in got}) > 16  # the prompts really lead to different outputs


def test_rows_join_and_leave_at_step_boundaries(model_tok):
    """Requests arriving while others decode join the batch; finished rows leave at once;
    a smaller max_batch makes later requests wait; results are unchanged."""
    model, tok = model_tok
    engine = Engine(model, tok)
    lengths = [5 + (7 * i) % 20 for i in range(12)]
    expected = [engine.generate(PROMPTS[i], SamplingParams(temperature=0, max_new_tokens=n))[0].tokens
                for i, n in enumerate(lengths)]
    scheduler = Scheduler(engine, max_batch=4)
    batch_sizes = []
    original = scheduler._decode

    def recording_decode():  # paced (~2 ms a step): requests arrive while others decode on any machine
        batch_sizes.append(scheduler.running)
        time.sleep(0.002)
        original()

    scheduler._decode = recording_decode
    try:
        handles = []
        for i, n in enumerate(lengths):
            handles.append(scheduler.submit(PROMPTS[i], SamplingParams(temperature=0, max_new_tokens=n)))
            time.sleep(0.002 * (i % 3))  # arrive at different steps
        got = [[c.token for c in h] for h in handles]
    finally:
        scheduler.close()
    assert got == expected
    assert max(batch_sizes) == 4 and min(batch_sizes) < 4  # full batches, and partial ones as rows left
    assert sum(batch_sizes) < sum(lengths)  # rows shared steps (one step serves several requests)


def test_cancel_frees_the_row_and_others_are_undisturbed(model_tok):
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    expected = engine.generate(PROMPTS[1], params)[0].tokens
    scheduler = Scheduler(engine, max_batch=2)
    try:
        long = scheduler.submit(PROMPTS[0], params.replace(max_new_tokens=10_000 // 100))
        keep = scheduler.submit(PROMPTS[1], params)
        first = next(iter(long))
        assert first.token is not None
        long.cancel()
        third = scheduler.submit(PROMPTS[1], params)  # needs the freed row (max_batch 2)
        assert [c.token for c in keep] == expected
        assert [c.token for c in third] == expected
        assert wait_idle(scheduler)
    finally:
        scheduler.close()


def test_seeded_sampling_independent_of_the_batch(model_tok):
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20, seed=7, num_samples=3,
                            repetition_penalty=1.2)
    scheduler = Scheduler(engine, max_batch=32)
    try:
        chunks = list(scheduler.submit(PROMPTS[2], params))
        alone = [c.token for c in chunks]
        handles = [scheduler.submit(p, params) for p in PROMPTS[:8]]
        crowded = [[c.token for c in h] for h in handles][2]
        other_seed = [c.token for c in scheduler.submit(PROMPTS[2], params.replace(seed=8))]
    finally:
        scheduler.close()
    assert alone == crowded
    assert alone != other_seed
    # Engine.generate draws the same way: one sampling path for generate, chat and serve
    per_sample = [[c.token for c in chunks if c.index == i] for i in range(3)]
    assert [c.tokens for c in engine.generate(PROMPTS[2], params)] == per_sample


def test_stop_strings_and_text_match_generate(model_tok):
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=30)
    full = engine.generate(PROMPTS[3], params)[0].text
    stop = full[10:13]
    expected = engine.generate(PROMPTS[3], params.replace(stop=[stop]))[0]
    scheduler = Scheduler(engine)
    try:
        chunks = list(scheduler.submit(PROMPTS[3], params.replace(stop=[stop])))
    finally:
        scheduler.close()
    assert "".join(c.text for c in chunks) == expected.text == full[: full.index(stop)]
    assert chunks[-1].finish_reason == "stop"


def test_a_stop_token_ends_the_text_without_its_own(model_tok):
    """A stop token (stop_token_ids, here a plain character) ends a completion and is not
    text, in generate as in stream and the scheduler."""
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    free = engine.generate(PROMPTS[3], params)[0]
    stop = free.tokens[3]
    assert tok.decode([stop])  # (a character: text, were it not a stop token)
    params = params.replace(stop_token_ids=[stop])
    got = engine.generate(PROMPTS[3], params)[0]
    index = free.tokens.index(stop)
    assert got.tokens == free.tokens[:index + 1] and got.finish_reason == "stop"
    assert got.text == tok.decode(free.tokens[:index])
    assert "".join(c.text for c in engine.stream(PROMPTS[3], params)) == got.text
    scheduler = Scheduler(engine)
    try:
        assert "".join(c.text for c in scheduler.submit(PROMPTS[3], params)) == got.text
    finally:
        scheduler.close()


def paced(engine: Engine, seconds: float = 0.002) -> Engine:
    """`engine` with every forward taking at least `seconds` more: a test's next lines run
    while its requests are still decoding, however fast this machine (or however slow the
    test thread, waiting for the GIL beside other threads)."""
    forward = engine.forward

    def slow_forward(*args):
        time.sleep(seconds)
        return forward(*args)

    engine.forward = slow_forward
    return engine


def test_queue_limit(model_tok):
    model, tok = model_tok
    scheduler = Scheduler(paced(Engine(model, tok)), max_batch=1, max_queue=1)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=60)
        running = scheduler.submit(PROMPTS[0], params)
        next(iter(running))  # admitted: the queue is empty again
        scheduler.submit(PROMPTS[1], params)
        with pytest.raises(QueueFull):
            scheduler.submit(PROMPTS[2], params)
    finally:
        scheduler.close(drain=False)


def test_the_queue_limit_counts_only_requests_without_a_free_row(model_tok):
    """With --max-queue 1 and 31 rows idle, the second of two requests sent at once got a 429."""
    model, tok = model_tok
    scheduler = Scheduler(paced(Engine(model, tok)), max_batch=4, max_queue=1)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=60)
        requests = [scheduler.submit(PROMPTS[i % len(PROMPTS)], params) for i in range(5)]  # 4 rows + 1 waiting
        with pytest.raises(QueueFull, match="^1 requests are already waiting for a row"):
            scheduler.submit(PROMPTS[0], params)
        two = params.replace(num_samples=2)
        for request in requests:
            list(request)
        requests = [scheduler.submit(PROMPTS[0], two) for _ in range(2)]  # 4 rows
        requests.append(scheduler.submit(PROMPTS[1], two))  # waits
        with pytest.raises(QueueFull):
            scheduler.submit(PROMPTS[1], params)
        for request in requests:
            list(request)
    finally:
        scheduler.close(drain=False)


@needs_native
@pytest.mark.parametrize("weights, amx", [
    ("fp32", False), ("fp16", False),
    pytest.param("fp16", True, marks=pytest.mark.skipif(not native_forward.has_amx(), reason="no AMX")),
])
def test_native_rows_do_not_depend_on_the_row_count(model_tok, weights, amx):
    """native.c sums each row of a product in the same order whatever the number of rows:
    a row of a batch of 11 (rows 6, 4 and 1 at a time) is bit for bit the row computed
    alone (the continuous batch's promise), with per-row cache lengths. On AMX tiles (from
    2 rows here) the sums are in another order: equal to fp32 rounding."""
    model, _ = model_tok
    decoder = native_forward.NativeDecoder(model, weights, amx_rows=2 if amx else 0)
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 17, 1, 30, 8, 16, 2, 33, 5, 12, 24]
    batch = RowKVCache(cfg, 12, 40)
    alone = []
    for row, n in enumerate(lengths):
        cache = KVCache(cfg, 1, n + 1)
        prompt = torch.randint(4, cfg.vocab_size, (1, n), generator=gen)
        for target in (cache, batch.row_view(row)):  # (the batch's row prefilled in place, as the scheduler does)
            target.begin(n)
            decoder.forward(prompt, torch.arange(n)[None], target)
        batch.set_length(row, n)
        token = torch.randint(4, cfg.vocab_size, (1, 1), generator=gen)
        cache.begin(1)
        alone.append((token, decoder.forward(token, torch.tensor([[n]]), cache)))
    batch.rows = len(lengths)
    batch.begin(1)
    tokens = torch.cat([t for t, _ in alone])
    logits = decoder.forward(tokens, torch.tensor(lengths)[:, None], batch)
    if amx:
        torch.testing.assert_close(logits, torch.cat([l for _, l in alone]), rtol=0, atol=1e-5)
    else:
        assert torch.equal(logits, torch.cat([l for _, l in alone]))
    assert batch.lengths[: len(lengths)].tolist() == [n + 1 for n in lengths]


def test_row_cache_torch_path_matches_alone(model_tok):
    """The PyTorch path over a RowKVCache (one mask per row, each prefilled in place through
    `row_view`) agrees with each row alone."""
    model, _ = model_tok
    cfg = model.config
    gen = torch.Generator().manual_seed(2)
    lengths = [4, 11, 1]
    batch = RowKVCache(cfg, 3, 20)
    alone = []
    with torch.inference_mode():
        for row, n in enumerate(lengths):
            prompt = torch.randint(4, cfg.vocab_size, (1, n), generator=gen)
            cache = KVCache(cfg, 1, n + 1)
            for target in (cache, batch.row_view(row)):
                target.begin(n)
                model.hidden_states(prompt, torch.arange(n)[None], target)
            batch.set_length(row, n)
            token = torch.randint(4, cfg.vocab_size, (1, 1), generator=gen)
            cache.begin(1)
            alone.append((token, decode_logits(model, token, torch.tensor([[n]]), cache)))
        batch.rows = 3
        batch.begin(1)
        logits = decode_logits(model, torch.cat([t for t, _ in alone]), torch.tensor(lengths)[:, None], batch)
    torch.testing.assert_close(logits, torch.cat([l for _, l in alone]), rtol=1e-5, atol=1e-5)


def test_submit_from_many_threads(model_tok):
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    expected = {i: engine.generate(PROMPTS[i], params)[0].text for i in range(16)}
    scheduler = Scheduler(engine, max_batch=8)
    got = {}

    def client(i):
        got[i] = "".join(c.text for c in scheduler.submit(PROMPTS[i], params))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        scheduler.close()
    assert got == expected


def test_a_failing_prefill_fails_its_request_alone(model_tok, monkeypatch):
    """A request whose prefill raises has left the queue but holds no row yet: it gets the
    error (it used to wait forever) and the scheduler goes on serving the others."""
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    expected = engine.generate(PROMPTS[1], params)[0].tokens
    real_forward = engine.forward

    def forward(tokens, positions, cache, decoder=None):
        if tokens.shape[1] == len(tok.encode(PROMPTS[0])) and tokens.shape[1] > 1:
            raise RuntimeError("prefill broke")
        return real_forward(tokens, positions, cache, decoder)

    monkeypatch.setattr(engine, "forward", forward)
    scheduler = Scheduler(engine, max_batch=4)
    try:
        failing = scheduler.submit(PROMPTS[0], params)
        with pytest.raises(RuntimeError, match="prefill broke"):
            list(failing)
        assert [c.token for c in scheduler.submit(PROMPTS[1], params)] == expected
    finally:
        scheduler.close()


@pytest.mark.timeout(60)
def test_close_without_drain_ends_a_request_being_prefilled(model_tok, monkeypatch):
    """Popped from the queue and not yet a row, it was in no list close() looked at: it ran
    to its end (all its tokens, no error) and close() waited for it."""
    model, tok = model_tok
    engine = Engine(model, tok)
    inside, release = threading.Event(), threading.Event()
    real_forward = engine.forward

    def forward(tokens, positions, cache, decoder=None):
        if tokens.shape[1] > 1:  # a prefill: hold it while close() runs
            inside.set()
            release.wait(10)
        return real_forward(tokens, positions, cache, decoder)

    monkeypatch.setattr(engine, "forward", forward)
    scheduler = Scheduler(engine, max_batch=4)
    request = scheduler.submit(PROMPTS[3], SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True))
    assert inside.wait(10)
    closing = threading.Thread(target=scheduler.close, kwargs={"drain": False})
    closing.start()
    time.sleep(0.05)
    release.set()
    closing.join(10)
    assert not closing.is_alive()
    with pytest.raises(FrawdError, match="the scheduler was closed"):
        list(request)
    with pytest.raises(Closed, match="the scheduler is closed"):  # (was QueueFull: "retry later")
        scheduler.submit(PROMPTS[0])


@pytest.mark.timeout(60)  # (a second read used to wait for ever)
def test_a_request_is_read_once(model_tok):
    model, tok = model_tok
    scheduler = Scheduler(Engine(model, tok), max_batch=2)
    try:
        request = scheduler.submit(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
        assert len(list(request)) == 3
        with pytest.raises(FrawdError, match="read to its end already"):  # (it waited for ever)
            list(request)
    finally:
        scheduler.close()


def test_cancel_ends_a_reader_that_is_iterating(model_tok, monkeypatch):
    """A reader blocked waiting for the next chunk when another thread cancels gets
    `Cancelled` (it used to wait forever: the cancelled rows left without a word)."""
    model, tok = model_tok
    engine = Engine(model, tok)
    real_forward = engine.forward

    def slow_forward(*args, **kwargs):  # steps slow enough that the reader waits on each
        time.sleep(0.005)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", slow_forward)
    scheduler = Scheduler(engine)
    try:
        request = scheduler.submit(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=80, ignore_eos=True))
        first_chunk, outcome = threading.Event(), []

        def reader():
            try:
                for _ in request:
                    first_chunk.set()
            except Exception as error:
                outcome.append(error)

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        assert first_chunk.wait(10)
        request.cancel()
        thread.join(5)
        assert not thread.is_alive(), "the reader still waits after cancel()"
        assert len(outcome) == 1 and isinstance(outcome[0], Cancelled)
    finally:
        scheduler.close(drain=False, timeout=5.0)


@pytest.mark.parametrize("limit", [dict(max_batch=0), dict(max_queue=0), dict(max_queue=-1),
                                   dict(prefill_tokens=0), dict(prefill_tokens=-5)])
def test_nonsense_limits_are_refused(model_tok, limit):
    """prefill_tokens <= 0 admitted nothing ever (requests waited forever); max_queue = 0
    refused every request."""
    model, tok = model_tok
    (name, value), = limit.items()
    with pytest.raises(ValueError, match=rf"^{name} must be an integer >= 1, got {value}$"):
        Scheduler(Engine(model, tok), **limit)


def test_a_failing_listener_fails_its_request_alone(model_tok):
    """A listener that raises mid-decode gets its error and nothing more, its rows leave, and
    the request decoding beside it is undisturbed (it used to fail every request in flight)."""
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    expected = engine.generate(PROMPTS[2], params)[0].tokens
    received = []

    def failing_listener(item):
        received.append(item)
        if len(received) == 3:  # the third chunk comes from a decode step
            raise RuntimeError("listener broke")

    scheduler = Scheduler(engine, max_batch=4)
    try:
        scheduler.submit(PROMPTS[1], params, listener=failing_listener)
        other = scheduler.submit(PROMPTS[2], params)
        assert [c.token for c in other] == expected
        assert wait_idle(scheduler)
    finally:
        scheduler.close()
    assert len(received) == 4 and isinstance(received[3], RuntimeError)  # 3 chunks, then its error


def test_a_request_cancelled_by_its_listener_mid_step_hears_nothing_more(model_tok):
    """Two samples share a step: the first one's chunk makes the listener cancel (its client
    went away), and the second sample's chunk of that same step is not delivered."""
    model, tok = model_tok
    scheduler = Scheduler(Engine(model, tok))
    received, request = [], None

    def listener(item):
        received.append(item)
        request.cancel()

    params = SamplingParams(temperature=0, max_new_tokens=20, num_samples=2, ignore_eos=True)
    try:
        with scheduler._cond:  # (re-entrant: the loop cannot admit the request before `request` is set)
            request = scheduler.submit(PROMPTS[2], params, listener=listener)
        assert wait_idle(scheduler)
    finally:
        scheduler.close()
    assert len(received) == 1, received


def test_greedy_rows_with_a_repetition_penalty_are_penalised(model_tok):
    """A greedy request with a repetition penalty is not a plain argmax row: the scheduler gives
    Engine.generate's tokens (it served them without the penalty when such rows shared the
    plain argmax)."""
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=20, repetition_penalty=3.0, ignore_eos=True)
    expected = engine.generate(PROMPTS[2], params)[0].tokens
    assert expected != engine.generate(PROMPTS[2], params.replace(repetition_penalty=1.0))[0].tokens
    scheduler = Scheduler(engine, max_batch=4)
    try:
        plain = scheduler.submit(PROMPTS[3], params.replace(repetition_penalty=1.0))  # (a plain row beside it)
        penalised = [c.token for c in scheduler.submit(PROMPTS[2], params)]
        list(plain)
    finally:
        scheduler.close()
    assert penalised == expected


def test_greedy_rows_beside_sampled_ones_take_their_own_logits(model_tok):
    """Plain greedy rows share one argmax over their rows of the batch's logits; beside a
    sampled row (a server's usual batch) they must still be their own rows, the tokens
    Engine.generate gives alone."""
    model, tok = model_tok
    engine = Engine(model, tok)
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    expected = engine.generate(PROMPTS[5], greedy)[0].tokens
    scheduler = Scheduler(engine, max_batch=4)
    try:
        with scheduler._cond:  # (both in the first step's batch: the sampled row first)
            sampled = scheduler.submit(PROMPTS[4], SamplingParams(temperature=1.0, seed=3, max_new_tokens=12,
                                                                  ignore_eos=True))
            plain = scheduler.submit(PROMPTS[5], greedy)
        list(sampled)
        assert [c.token for c in plain] == expected
    finally:
        scheduler.close()


def test_prefill_admits_prompts_up_to_its_token_budget_a_step(model_tok):
    """`prefill_tokens`: the prompt tokens a step admits before the rows already decoding get
    their next token (a burst of long prompts stalled them). Past the budget, the next prompt
    waits for the following step."""
    model, tok = model_tok
    engine = Engine(model, tok)
    forward, calls = engine.forward, []

    def recorded(tokens, *args):
        calls.append(f"P{tokens.shape[1]}" if tokens.shape[1] > 1 else f"D{tokens.shape[0]}")
        return forward(tokens, *args)

    engine.forward = recorded
    scheduler = Scheduler(engine, max_batch=8, prefill_tokens=10)
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    try:
        with scheduler._cond:
            requests = [scheduler.submit("the quick", params) for _ in range(3)]  # 9 tokens each
        for request in requests:
            list(request)
    finally:
        scheduler.close()
    # a step: prompts while the budget (10) lasts, the last one may pass it; then one decode
    assert calls == ["P9", "P9", "D2", "P9", "D3", "D1"], calls


def test_a_finished_requests_row_is_free_when_its_caller_hears_the_end(model_tok):
    """The last chunk was handed out before the row left: a caller that sent its next
    requests on hearing the end found the row still taken (QueueFull at --max-queue 1)."""
    model, tok = model_tok
    scheduler = Scheduler(Engine(model, tok), max_batch=1, max_queue=1)
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    heard, done = {}, threading.Event()

    def listener(chunk):
        if getattr(chunk, "finish_reason", None) is not None:
            heard["running"] = scheduler.running
            try:
                heard["next"] = [scheduler.submit(p, params) for p in ("brown", "fox")]  # one runs, one waits
            except QueueFull as exc:
                heard["next"] = exc
            done.set()

    try:
        scheduler.submit("the quick", params, listener)
        assert done.wait(30)
        assert heard["running"] == 0 and isinstance(heard["next"], list), heard
        for request in heard["next"]:
            assert len(list(request)) == 3
    finally:
        scheduler.close(drain=False)


def test_a_dropped_scheduler_ends_its_thread(model_tok):
    """A scheduler nobody holds still finishes what it accepted, then is collected and its
    thread ends (the thread used to hold it, so both lived forever)."""
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    expected = engine.generate(PROMPTS[1], params)[0].tokens
    scheduler = Scheduler(engine)
    request, thread = scheduler.submit(PROMPTS[1], params), scheduler._thread
    del scheduler
    gc.collect()
    assert [c.token for c in request] == expected
    thread.join(5)
    assert not thread.is_alive()

    idle_thread = Scheduler(engine)._thread  # dropped at once, never used
    idle_thread.join(5)
    assert not idle_thread.is_alive()


MISUSE = r"""
from frawdllm import FrawdLLM, get_config
from frawdllm.errors import FrawdError
from frawdllm.infer import Engine
from frawdllm.infer.scheduler import Scheduler
from frawdllm.tokenizer import byte_tokenizer
m = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=300, context_length=32))
t = byte_tokenizer()
for make in (lambda: Engine(m, t, native="no"), lambda: Engine(object(), t), lambda: Scheduler(m),
             lambda: Scheduler(Engine(m, t), max_batch=2.5), lambda: Scheduler(Engine(m, t), max_queue="4"),
             lambda: Scheduler(Engine(m, t)).submit("a", None, 5)):
    try:
        make()
        print("accepted")
    except FrawdError as exc:
        print(exc)
"""


def test_engine_and_scheduler_arguments_of_the_wrong_kind_are_one_line():
    """Outside the tests' type checks (a user's script): native="no" silently forced the
    native forward; the others failed with AttributeError or TypeError deep inside."""
    from cli_helpers import script_lines

    assert script_lines(MISUSE) == [
        "native must be None (chosen per phase), True or False; got 'no'",
        "Engine generates with a FrawdLLM model; got object",
        "Scheduler batches the requests of an Engine; got FrawdLLM",
        "max_batch must be an integer >= 1, got 2.5",
        "max_queue must be an integer >= 1, got '4'",
        "listener must be callable (it gets each chunk), got int",  # (was accepted, then silent)
    ]


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_logprobs_are_the_same_alone_in_a_batch_and_served(model_tok, native):
    """Engine.generate, Engine.stream and the Scheduler (beside other requests) report the
    same per-token log-probabilities, the model's own log_softmax at each token (sampled
    rows too: taken before temperature and filters), none for a final end-of-sequence."""
    if native and not native_forward.available():
        pytest.skip("no C compiler")
    model, tok = model_tok
    engine = Engine(model, tok, native=native)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=5, seed=3, logprobs=2)
    alone = engine.generate(PROMPTS[4], params)[0]
    streamed = [c.logprob for c in engine.stream(PROMPTS[4], params) if c.logprob is not None]
    scheduler = Scheduler(engine)
    try:
        others = [scheduler.submit(PROMPTS[i], params.replace(seed=i, logprobs=None)) for i in range(3)]
        served = [c.logprob for c in scheduler.submit(PROMPTS[4], params) if c.logprob is not None]
        for request in others:
            assert all(c.logprob is None for c in request)  # (not asked for)
    finally:
        scheduler.close()
    with torch.no_grad():
        prompt = tok.encode(PROMPTS[4])
        logits = model(torch.tensor([prompt + alone.tokens]))[0][0, len(prompt) - 1:-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    assert [e.token for e in served] == [e.token for e in streamed] == alone.tokens
    tolerance = 5e-3 if native else 1e-5  # (native: fp16 weights)
    for i, entry in enumerate(served):
        assert entry.logprob == pytest.approx(float(logp[i, entry.token]), abs=tolerance)
        assert [t for t, _ in entry.top] == logp[i].topk(2).indices.tolist()
        assert entry.logprob == pytest.approx(streamed[i].logprob, abs=1e-5)  # (torch: batched rows round apart)
    greedy = SamplingParams(max_new_tokens=8, temperature=0, logprobs=0)
    third = engine.generate(PROMPTS[4], greedy)[0].tokens[2]
    stopped = list(engine.stream(PROMPTS[4], greedy.replace(stop_token_ids=[third])))
    assert stopped[-1].token == third and stopped[-1].finish_reason == "stop"
    assert stopped[-1].logprob is None  # the stop token is no text
    assert all(c.logprob is not None for c in stopped[:-1])


LEFT_OPEN = r"""
import sys, torch
from frawdllm import FrawdLLM, get_config
from frawdllm.infer import Engine, SamplingParams
from frawdllm.infer.scheduler import Scheduler
from frawdllm.tokenizer import train_tokenizer

tok = train_tokenizer(["the quick brown fox"], kind="char")
model = FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=2, context_length=512))
scheduler = Scheduler(Engine(model, tok), max_batch=4)
for chunk in scheduler.submit("the", SamplingParams(max_new_tokens=5)):
    pass
if sys.argv[1] == "running":  # a long request still decoding when the script ends
    running = scheduler.submit("fox", SamplingParams(max_new_tokens=500, ignore_eos=True))
    next(iter(running))
print("done", flush=True)
"""


@pytest.mark.parametrize("left", ["idle", "running"])
def test_a_scheduler_left_open_at_exit_is_closed_not_aborted(left):
    """docs/serving.md's example without its `scheduler.close()`: the interpreter aborted as it
    exited ("terminate called without an active exception", status 134), its scheduler's
    thread still alive. Exit closes what is left open, cancelling a request still running."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LEFT_OPEN, left], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert (done.returncode, done.stdout) == (0, "done\n"), done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_two_rows_cancelled_in_one_step_both_leave_the_batch(model_tok):
    """Rows A, B, C; B and C (the last row) are cancelled between two steps: both leave at the
    next step. (Removing front to back, C moved into B's place and was skipped: a cancelled
    row went on decoding, holding a row of the batch.)"""
    model, tok = model_tok
    engine = Engine(model, tok)
    forward, decode_sizes, state = engine.forward, [], {"cancelled_at": None}

    def recorded(tokens, *args):
        if tokens.shape[1] == 1:
            decode_sizes.append(tokens.shape[0])
        return forward(tokens, *args)

    engine.forward = recorded
    scheduler = Scheduler(engine, max_batch=3)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    others = {}

    def listener(chunk):  # runs at the end of a step: both flags are set before the next one
        if isinstance(chunk, BaseException):
            return
        if chunk.finish_reason is not None:
            state["a_done"] = True
        if chunk.token is not None and state["cancelled_at"] is None and len(decode_sizes) >= 2:
            others["b"].cancel()
            others["c"].cancel()
            state["cancelled_at"] = len(decode_sizes)

    try:
        with scheduler._cond:  # (admitted in one step, in this order: rows 0, 1, 2)
            scheduler.submit(PROMPTS[0], params, listener)
            others["b"] = scheduler.submit(PROMPTS[1], params.replace(max_new_tokens=60))
            others["c"] = scheduler.submit(PROMPTS[2], params.replace(max_new_tokens=60))
        deadline = time.time() + 30
        while not (state.get("a_done") and scheduler.running == 0) and time.time() < deadline:
            time.sleep(0.01)
        assert scheduler.running == 0
    finally:
        scheduler.close(drain=False)
    at = state["cancelled_at"]
    assert at is not None and decode_sizes[:at] == [3] * at
    assert set(decode_sizes[at:]) == {1}, decode_sizes  # only A decodes once B and C are cancelled


def test_a_cancelled_waiting_request_no_longer_counts_against_the_queue(model_tok):
    """max_batch 1, max_queue 1: A runs, B waits; B is cancelled (its client went away). At the
    next step B leaves the queue, so a new request is accepted (not a 429 for a ghost)."""
    model, tok = model_tok
    scheduler = Scheduler(paced(Engine(model, tok)), max_batch=1, max_queue=1)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=80, ignore_eos=True)
        running = scheduler.submit(PROMPTS[0], params)
        next(iter(running))  # admitted
        waiting = scheduler.submit(PROMPTS[1], params)
        with pytest.raises(QueueFull):
            scheduler.submit(PROMPTS[2], params)
        waiting.cancel()
        deadline = time.time() + 10
        while scheduler.queue_depth and time.time() < deadline:
            time.sleep(0.005)
        assert scheduler.queue_depth == 0 and scheduler.running == 1  # A still runs
        scheduler.submit(PROMPTS[2], params)  # accepted
    finally:
        scheduler.close(drain=False)


def _decode_counter(engine):
    forward, decodes = engine.forward, []

    def recorded(tokens, *args):
        if tokens.shape[1] == 1:
            decodes.append(tokens.shape[0])
        return forward(tokens, *args)

    engine.forward = recorded
    return decodes


def test_a_failing_listeners_row_leaves_at_the_next_step(model_tok):
    """The docstring: a listener that raises fails its request alone, *its rows leave*. (Not
    cancelled, the row decoded all its max_new_tokens for nobody, holding a row.)"""
    model, tok = model_tok
    engine = Engine(model, tok)
    decodes = _decode_counter(engine)
    state = {}

    def failing(item):
        if not isinstance(item, BaseException) and len(decodes) >= 2 and "failed_at" not in state:
            state["failed_at"] = len(decodes)
            raise RuntimeError("listener broke")

    scheduler = Scheduler(engine, max_batch=2)
    try:
        scheduler.submit(PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=80, ignore_eos=True), failing)
        deadline = time.time() + 30
        while "failed_at" not in state and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)
        assert scheduler.running == 0
    finally:
        scheduler.close(drain=False)
    assert len(decodes) == state["failed_at"], decodes  # no decode step after the failure


def test_close_without_drain_ends_waiting_requests_with_an_error(model_tok):
    """close(drain=False): 'ends every open request with an error' - a request still waiting
    for a row too (it was admitted after close and ran to its end)."""
    model, tok = model_tok
    scheduler = Scheduler(paced(Engine(model, tok)), max_batch=1)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    running = scheduler.submit(PROMPTS[0], params)
    next(iter(running))  # admitted: holds the only row
    waiting = scheduler.submit(PROMPTS[1], params)
    scheduler.close(drain=False, timeout=30.0)
    with pytest.raises(FrawdError, match="the scheduler was closed"):
        list(waiting)


def test_a_request_whose_first_token_fails_leaves_its_rows(model_tok):
    """A request failing inside its prefill step after its rows were taken (here: sampling its
    first token) gets its error and its rows leave; the request beside it is undisturbed (the
    rows left behind failed the next decode step, and with it every request in flight)."""
    model, tok = model_tok
    engine = Engine(model, tok)
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    expected = engine.generate(PROMPTS[2], params)[0].tokens
    scheduler = Scheduler(engine, max_batch=4)
    sample, bad = scheduler._sample, {}

    def failing_sample(rows, logits):
        if any(r.request is bad.get("r") and r.generated == 0 for r in rows):
            raise RuntimeError("first token broke")
        return sample(rows, logits)

    scheduler._sample = failing_sample
    try:
        with scheduler._cond:
            other = scheduler.submit(PROMPTS[2], params)
            bad["r"] = scheduler.submit(PROMPTS[3], params.replace(num_samples=2))
        with pytest.raises(RuntimeError, match="first token broke"):
            list(bad["r"])
        assert [c.token for c in other] == expected
    finally:
        scheduler.close(drain=False)
