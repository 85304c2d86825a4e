"""`frawd serve` through the official `openai` client against a live server: results equal
`Engine.generate`, errors are OpenAI's, 32 concurrent streams stay unmixed when some
clients leave, schema fuzzing finds no 5xx, SIGTERM drains."""

import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from frawdllm.infer import SamplingParams
from frawdllm.infer.chat import ROLE_TOKEN_IDS
from frawdllm.serve import ServeOptions
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)
from serve_helpers import AccessLog, asgi_post, free_port, live_server, test_engine
from test_scheduler import PROMPTS, varied_model

KEY = "test-key-123"
MAX_TOKENS = 1000
CONTEXT = 1024


@pytest.fixture(scope="module")
def server():
    model, tok = varied_model(context_length=CONTEXT)  # room for long replies: leavers leave mid-reply
    engine = test_engine(model, tok)
    other_model, other_tok = varied_model(n_layer=1)
    small = test_engine(other_model, other_tok)
    engines = {"varied": engine, "small": small, "org/small": small}  # (a name with a slash, as on the Hub)
    log = AccessLog()
    logger = logging.getLogger("frawdllm.serve.access")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    options = ServeOptions(api_key=KEY, max_tokens=MAX_TOKENS, default_max_tokens=16, max_n=4, max_batch=32,
                           max_body_bytes=64 * 1024)
    try:
        with live_server(engines, options) as url:
            yield {"url": url, "engine": engine, "small": engines["small"], "log": log}
    finally:
        logger.removeHandler(log)


def client(server, key=KEY):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=key, max_retries=0, timeout=60)


def expected_completion(engine, prompt, **params):
    return engine.generate(prompt, SamplingParams(temperature=0, **params))[0]


def expected_chat(engine, messages, **params):
    ids = engine.tokenizer.render_chat(messages, add_generation_prompt=True)
    return engine.generate([ids], SamplingParams(temperature=0, stop_token_ids=ROLE_TOKEN_IDS, **params))[0]


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["varied", "small", "org/small"]
    card = client(server).models.retrieve("org/small")
    assert card.id == "org/small"
    assert card.model_extra == {"context_length": server["small"].config.context_length, "max_tokens": MAX_TOKENS,
                                "sampling": {}}  # (no generation_config.json defaults)
    label = 'frawd_requests_total{path="/v1/models/{model}",status="200"}'  # (one label for every model's page)
    deadline = time.time() + 5  # (counted just after the reply is sent)
    while label not in httpx.get(server["url"] + "/metrics").text and time.time() < deadline:
        time.sleep(0.01)
    assert label in httpx.get(server["url"] + "/metrics").text
    assert httpx.head(server["url"] + "/health").status_code == 200  # (load balancers' probes)
    for path in ("/", "/metrics", "/v1/models", "/v1/models/org/small"):  # (HEAD wherever GET is: were 405s)
        auth = {"Authorization": f"Bearer {KEY}"}
        head, get = httpx.head(server["url"] + path, headers=auth), httpx.get(server["url"] + path, headers=auth)
        assert (head.status_code, head.content) == (200, b"") and get.status_code == 200, path
        assert head.headers["content-type"] == get.headers["content-type"], path
    health = httpx.get(server["url"] + "/health").json()
    assert health["status"] == "ok"
    page = httpx.get(server["url"] + "/")
    assert page.status_code == 200 and "<textarea" in page.text and "http" not in page.text.split("<script>")[1]


def test_completion_greedy_equals_engine(server):
    want = expected_completion(server["engine"], PROMPTS[5], max_new_tokens=20)
    got = client(server).completions.create(model="varied", prompt=PROMPTS[5], max_tokens=20, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == want.prompt_tokens
    assert got.usage.completion_tokens == len(want.tokens) == 20
    assert got.usage.total_tokens == want.prompt_tokens + 20
    assert got.id.startswith("cmpl-") and got.object == "text_completion"


def test_chat_stream_and_not(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[7]}]
    want = expected_chat(server["engine"], messages, max_new_tokens=24)
    c = client(server)
    whole = c.chat.completions.create(model="varied", messages=messages, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == len(want.tokens)
    prompt_tokens = len(server["engine"].tokenizer.render_chat(messages))
    assert whole.usage.prompt_tokens == prompt_tokens and whole.usage.total_tokens == prompt_tokens + len(want.tokens)
    pieces, reasons, usage = [], [], None
    stream = c.chat.completions.create(model="varied", messages=messages, max_completion_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == want.text
    assert len(pieces) > 10  # token by token, not one block
    assert reasons[-1] == "length" and usage.completion_tokens == 24
    assert usage.prompt_tokens == prompt_tokens and usage.total_tokens == prompt_tokens + 24


def reference_logprobs(engine, prompt_ids, tokens):
    """log_softmax of the model's own full forward (PyTorch, fp32) at each generated token."""
    import torch

    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt_ids + tokens]))[0][0, len(prompt_ids) - 1:-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(tokens)], logp


def test_logprobs_chat_and_completions_streamed_and_not(server):
    """logprobs (OpenAI's forms) are the model's own log-probabilities of the tokens it
    wrote, with the likeliest alternatives; streamed, the same entries in pieces."""
    engine, c = server["engine"], client(server)
    messages = [{"role": "user", "content": PROMPTS[7]}]
    want = expected_chat(engine, messages, max_new_tokens=12)
    got = c.chat.completions.create(model="varied", messages=messages, max_tokens=12, temperature=0,
                                    logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == want.text and len(content) == len(want.tokens) == 12
    prompt_ids = engine.tokenizer.render_chat(messages, add_generation_prompt=True)
    expected, logp = reference_logprobs(engine, prompt_ids, want.tokens)
    assert [e.logprob for e in content] == pytest.approx(expected, abs=5e-3)  # (native fp16 weights: ~1e-3 here)
    assert b"".join(bytes(e.bytes) for e in content) == want.text.encode()
    for i, entry in enumerate(content):  # greedy: the chosen token is the likeliest
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].bytes == entry.bytes
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[1].logprob == pytest.approx(float(logp[i].topk(2).values[1]), abs=5e-3)
    streamed = []
    for event in c.chat.completions.create(model="varied", messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3, stream=True):
        for choice in event.choices:
            streamed += choice.logprobs.content if choice.logprobs else []
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = c.chat.completions.create(model="varied", messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None  # (not asked for)

    want = expected_completion(engine, PROMPTS[5], max_new_tokens=10)
    got = c.completions.create(model="varied", prompt=PROMPTS[5], max_tokens=10, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert "".join(lp.tokens) == got.choices[0].text == want.text
    expected, _ = reference_logprobs(engine, engine.tokenizer.encode(PROMPTS[5]), want.tokens)
    assert lp.token_logprobs == pytest.approx(expected, abs=5e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and top[token] == value for top, token, value in
               zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    streamed = []
    for event in c.completions.create(model="varied", prompt=PROMPTS[5], max_tokens=10, temperature=0,
                                      logprobs=0, stream=True):
        for choice in event.choices:
            streamed += choice.logprobs.token_logprobs if choice.logprobs else []
    assert streamed == lp.token_logprobs
    # echo: the prompt's tokens come first, each scored given those before it (as evaluation
    # harnesses score texts); the first has nothing to be predicted from
    echoed = c.completions.create(model="varied", prompt=PROMPTS[5], max_tokens=10, temperature=0, logprobs=2,
                                  echo=True).choices[0]
    prompt_ids = engine.tokenizer.encode(PROMPTS[5])
    n = len(prompt_ids)
    assert echoed.text == PROMPTS[5] + want.text and "".join(echoed.logprobs.tokens[:n]) == PROMPTS[5]
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    scored, _ = reference_logprobs(engine, prompt_ids[:1], prompt_ids[1:])
    assert echoed.logprobs.token_logprobs[1:n] == pytest.approx(scored, abs=1e-5)  # (a PyTorch forward)
    assert echoed.logprobs.token_logprobs[n:] == lp.token_logprobs
    assert echoed.logprobs.text_offset == list(range(len(echoed.text)))  # (a char tokenizer: a token a character)
    streamed = []
    for event in c.completions.create(model="varied", prompt=PROMPTS[5], max_tokens=10, temperature=0, logprobs=2,
                                      echo=True, stream=True):
        for choice in event.choices:
            streamed += choice.logprobs.token_logprobs if choice.logprobs else []
    assert streamed == echoed.logprobs.token_logprobs
    # max_tokens 0 with echo scores the prompt alone (what scoring clients send)
    only = c.completions.create(model="varied", prompt=PROMPTS[5], max_tokens=0, logprobs=2, echo=True)
    assert only.choices[0].text == PROMPTS[5] and only.usage.completion_tokens == 0
    assert only.usage.prompt_tokens == n and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == echoed.logprobs.token_logprobs[:n]
    assert only.choices[0].logprobs.tokens == echoed.logprobs.tokens[:n]
    for bad in (dict(echo=True, stream=True), dict(echo=False)):
        with pytest.raises(openai.BadRequestError, match="max_tokens 0 .scoring a prompt. needs echo: true"):
            c.completions.create(model="varied", prompt=PROMPTS[5], max_tokens=0, logprobs=2, **bad)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        c.chat.completions.create(model="varied", messages=messages, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        c.chat.completions.create(model="varied", messages=messages, max_tokens=2, top_logprobs=2)


def test_openai_request_forms_beyond_the_basics(server):
    c = client(server)
    assert c.models.retrieve("small").id == "small"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    # completions take max_completion_tokens too (the client's newer name), and logprobs as a count
    got = c.completions.create(model="varied", prompt=PROMPTS[3], temperature=0,
                               extra_body={"max_completion_tokens": 3})
    assert got.usage.completion_tokens == 3
    assert len(c.completions.create(model="varied", prompt=PROMPTS[3], max_tokens=3,
                                    logprobs=2).choices[0].logprobs.token_logprobs) == 3
    # a developer message is the system prompt; text parts are joined
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[7]}]
    want = expected_chat(server["engine"], plain, max_new_tokens=12).text
    newer = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": PROMPTS[7][:5]},
                                          {"type": "text", "text": PROMPTS[7][5:]}]}]
    got = c.chat.completions.create(model="varied", messages=newer, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want
    # with include_usage, every chunk carries "usage" (null until the last), as OpenAI's do
    body = {"model": "varied", "prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert all("usage" in e for e in events) and [e["usage"] is None for e in events[:-1]] == [True] * (len(events) - 1)
    assert events[-1]["usage"]["completion_tokens"] == 4
    assert events[-1]["usage"]["total_tokens"] == events[-1]["usage"]["prompt_tokens"] + 4


def test_a_list_of_prompts(server):
    """OpenAI's batch form: n completions per prompt, choice prompt_index * n + sample_index,
    each what the prompt gets alone; token-id lists too; echo per prompt; streaming interleaved."""
    c, engine = client(server), server["engine"]
    texts = [PROMPTS[1], PROMPTS[6], PROMPTS[2]]
    want = [expected_completion(engine, p, max_new_tokens=8).text for p in texts]
    got = c.completions.create(model="varied", prompt=texts, max_tokens=8, temperature=0, n=2)
    assert [ch.index for ch in got.choices] == list(range(6))
    assert [ch.text for ch in got.choices] == [w for w in want for _ in range(2)]
    assert got.usage.prompt_tokens == sum(len(engine.encode(p)) for p in texts)
    assert got.usage.completion_tokens == 6 * 8
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    ids = [engine.encode(p) for p in texts[:2]]
    got = c.completions.create(model="varied", prompt=ids, max_tokens=8, temperature=0)
    assert [ch.text for ch in got.choices] == want[:2]
    echoed = c.completions.create(model="varied", prompt=texts[:2], max_tokens=8, temperature=0, echo=True)
    assert [ch.text for ch in echoed.choices] == [p + w for p, w in zip(texts[:2], want)]
    # with n > 1 each choice echoes its own prompt (choice i: prompt i // n), its log-probabilities too
    echoed = c.completions.create(model="varied", prompt=texts[:2], max_tokens=8, temperature=0, echo=True, n=2,
                                  logprobs=0)
    assert [ch.text for ch in echoed.choices] == [p + w for p, w in zip(texts[:2], want) for _ in range(2)]
    assert ["".join(ch.logprobs.tokens) for ch in echoed.choices] == [ch.text for ch in echoed.choices]
    pieces = ["", "", ""]
    for chunk in c.completions.create(model="varied", prompt=texts, max_tokens=8, temperature=0, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert pieces == want
    with pytest.raises(openai.BadRequestError, match="prompt\\[1\\] has 2000 tokens"):
        c.completions.create(model="varied", prompt=[[5], [5] * 2000], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most 32 in one request"):
        c.completions.create(model="varied", prompt=["a"] * 33, max_tokens=2)


def test_the_second_model(server):
    want = expected_completion(server["small"], PROMPTS[2], max_new_tokens=10)
    got = client(server).completions.create(model="small", prompt=PROMPTS[2], max_tokens=10, temperature=0)
    assert got.choices[0].text == want.text and got.model == "small"


def test_n_seed_and_stop(server):
    c = client(server)
    a = c.completions.create(model="varied", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, n=3, seed=11)
    b = c.completions.create(model="varied", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, n=3, seed=11)
    other = c.completions.create(model="varied", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, n=3, seed=12)
    texts = [ch.text for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts == [ch.text for ch in b.choices]
    assert texts != [ch.text for ch in other.choices]
    assert len(set(texts)) > 1  # the n samples differ from each other
    capped = c.completions.create(model="varied", prompt=PROMPTS[1], max_tokens=4, n=4, seed=11)  # n at the cap
    assert [ch.index for ch in capped.choices] == [0, 1, 2, 3]
    full = expected_completion(server["engine"], PROMPTS[4], max_new_tokens=30).text
    stop = full[12:15]
    got = c.completions.create(model="varied", prompt=PROMPTS[4], max_tokens=30, temperature=0, stop=[stop, "zzzz"])
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_errors_are_openai_errors(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    for key in (KEY[:-1], KEY[:1], KEY + "4", KEY.upper()):  # (the whole key, no prefix of it, nothing more)
        with pytest.raises(openai.AuthenticationError):
            client(server, key=key).models.list()
    assert httpx.get(server["url"] + "/v1/models", headers={"Authorization": "Bearer"}).status_code == 401
    assert httpx.get(server["url"] + "/v1/models").status_code == 401
    c = client(server)
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="nope", prompt="a", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    bad = [dict(temperature=3), dict(n=5), dict(max_tokens=MAX_TOKENS + 1), dict(top_p=-0.1), dict(logprobs=True),
           dict(presence_penalty=1.0), dict(stop=["a", "b", "c", "d", "e"]), dict(seed=2**63), dict(max_tokens=0)]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="varied", prompt="abc", **extra)
        assert info.value.status_code == 400 and info.value.body["type"] == "invalid_request_error", extra
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="varied", messages=[])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="varied", messages=[{"role": "robot", "content": "hi"}])
    too_long = "a" * (CONTEXT + 100)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="varied", prompt=too_long, max_tokens=2)
    assert "context" in info.value.message
    ok = c.completions.create(model="varied", prompt=too_long, max_tokens=2, extra_body={"truncate": True})
    assert ok.usage.prompt_tokens == CONTEXT - 2  # room for the 2 tokens asked for
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = httpx.post(server["url"] + "/v1/completions", headers=headers,
                     content=json.dumps({"model": "varied", "prompt": "a" * 100_000}))
    assert big.status_code == 413 and big.json()["error"]["message"]
    broken = httpx.post(server["url"] + "/v1/completions", headers=headers, content=b"{not json")
    assert broken.status_code == 400 and "error" in broken.json()
    # without the key, nothing is said about the body
    keyless = httpx.post(server["url"] + "/v1/completions", content=b"{not json",
                         headers={"Content-Type": "application/json"})
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"
    assert keyless.headers["www-authenticate"] == "Bearer"  # (HTTP requires a challenge with a 401)
    for header in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"):  # (the scheme is case-blind, RFC 7235)
        assert httpx.get(server["url"] + "/v1/models", headers={"Authorization": header}).status_code == 200, header
    assert httpx.get(server["url"] + "/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401


def test_a_chat_reply_ends_at_a_role_token_the_model_writes():
    """A chat model that goes on to write the next turn (`<|user|>`) ends its reply there, as
    `frawd chat` does (infer/chat.py's ROLE_TOKEN_IDS), not at max_tokens with the next turn in it."""
    from frawdllm.tokenizer import USER_ID

    model, tok = varied_model()
    engine = test_engine(model, tok)
    forward, calls = engine.forward, [0]

    def writes_a_turn(tokens, *args):  # the third forward (the third reply token) is <|user|>
        logits = forward(tokens, *args)
        calls[0] += 1
        if calls[0] == 3:
            logits = logits.clone()
            logits[..., USER_ID] = 1e4
        return logits

    engine.forward = writes_a_turn
    with live_server({"m": engine}, ServeOptions()) as url:
        got = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "the quick"}], "max_tokens": 12,
            "temperature": 0}).json()
    choice = got["choices"][0]
    assert (choice["finish_reason"], got["usage"]["completion_tokens"]) == ("stop", 3), got
    assert len(choice["message"]["content"]) == 2  # two characters; the role token is not text


def test_too_many_requests():
    model, tok = varied_model()
    engine = test_engine(model, tok)
    forward = engine.forward

    def slow_forward(tokens, *args):  # decode steps of 20 ms: the open stream below outlasts the next request
        if tokens.shape[1] == 1:
            time.sleep(0.02)
        return forward(tokens, *args)

    engine.forward = slow_forward
    with live_server({"m": engine}, ServeOptions(max_in_flight=1, max_tokens=64, max_queue=2)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        # a list of prompts the queue could never take at once is a 400, not a 429 forever
        with pytest.raises(openai.BadRequestError, match="at most 2 in one request"):
            c.completions.create(model="m", prompt=["a", "b", "c"], max_tokens=2)
        assert len(c.completions.create(model="m", prompt=["a", "b"], max_tokens=2).choices) == 2
        stream = c.completions.create(model="m", prompt="abc", max_tokens=64, stream=True)
        next(iter(stream))  # the first request is open
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model="m", prompt="abc", max_tokens=2)
        stream.close()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.timeout(240)
def test_32_concurrent_streams_with_5_disconnecting(server):
    engine = server["engine"]
    greedy = {i: expected_completion(engine, PROMPTS[i], max_new_tokens=32).text for i in range(32)}
    assert len(set(greedy.values())) > 16  # outputs are distinguishable: a mix-up would show
    leavers = {3, 9, 14, 22, 30}

    shared = client(server)  # (one connection pool: 32 clients' own pools would blur the memory check)

    def burst():
        got, errors = {}, []

        def run(i):
            try:
                # A leaver asks for a long reply, so it is still generating when it leaves.
                stream = shared.completions.create(model="varied", prompt=PROMPTS[i], temperature=0, stream=True,
                                                   max_tokens=MAX_TOKENS if i in leavers else 32)
                text = ""
                for n, chunk in enumerate(stream):
                    text += chunk.choices[0].text
                    if i in leavers and n == 3:
                        stream.close()  # the client goes away mid-stream
                        break
                got[i] = text
            except Exception as error:  # noqa: BLE001 (reported below)
                errors.append((i, repr(error)))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        for i in range(32):
            if i in leavers:
                assert greedy[i].startswith(got[i][:32]) and len(got[i]) >= 3
            else:
                assert got[i] == greedy[i], i
        deadline = time.time() + 10
        while time.time() < deadline:
            health = httpx.get(server["url"] + "/health").json()
            if health["running"] == 0 and health["waiting"] == 0:
                break
            time.sleep(0.05)
        assert health == {**health, "status": "ok", "running": 0, "waiting": 0}

    server["log"].records.clear()
    burst()
    cancelled = [r for r in server["log"].records if r.get("cancelled")]
    assert len(cancelled) == 5 and all(r["completion_tokens"] < MAX_TOKENS for r in cancelled)
    assert all(r["status"] == 499 for r in cancelled)
    done = [r for r in server["log"].records if r["path"] == "/v1/completions" and not r.get("cancelled")]
    assert len(done) == 27 and all(r["completion_tokens"] == 32 and r["ttft_ms"] is not None for r in done)
    burst()
    gc.collect()
    before = _rss_mb()
    for _ in range(3):
        burst()
    gc.collect()
    grown = _rss_mb() - before
    assert grown < 16, grown  # no per-request leak (96 more requests; a burst frees what it allocates)
    metrics = httpx.get(server["url"] + "/metrics").text
    assert 'frawd_time_to_first_token_seconds_count{model="varied"}' in metrics
    assert "frawd_queue_depth" in metrics and "frawd_tokens_per_second" in metrics


def test_metrics_count_the_generated_tokens(server):
    def read(name: str) -> float:
        text = httpx.get(server["url"] + "/metrics").text
        found = re.search(rf'^{name}\{{model="small"\}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0  # (a model's line appears with its first figures)

    names = ("frawd_generated_tokens_total", "frawd_time_to_first_token_seconds_count",
             "frawd_time_to_first_token_seconds_sum")
    before = [read(name) for name in names]
    start = time.perf_counter()
    got = client(server).completions.create(model="small", prompt=PROMPTS[2], max_tokens=9, temperature=0, n=2)
    took = time.perf_counter() - start
    generated, ttfts, ttft_s = (read(name) - was for name, was in zip(names, before))
    assert generated == got.usage.completion_tokens and got.usage.completion_tokens > 2
    assert ttfts == 1 and 0 < ttft_s < took  # one request: its first token's wait, within the request's time


def test_the_tokens_per_second_gauge_is_the_rate_since_the_previous_read(monkeypatch):
    from frawdllm.serve import metrics

    from frawdllm.infer.scheduler import Scheduler

    scheduler = Scheduler.__new__(Scheduler)  # (a count alone: no engine, no thread)
    scheduler.generated_tokens = 1000
    clock = iter([10.0, 10.5, 12.5])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    rate = metrics._Rate(scheduler)
    scheduler.generated_tokens = 1010
    assert rate() == 20.0  # 10 tokens in 0.5 s
    scheduler.generated_tokens = 1110
    assert rate() == 50.0  # 100 in the 2 s since


@pytest.mark.timeout(200)
def test_schema_fuzzing_finds_no_server_error(server):
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server["url"] + "/openapi.json")
    failures, calls = [], []

    def served_model(case):  # half the bodies name a real model, so generation runs too
        if isinstance(case.body, dict) and "model" in case.body and hash(repr(case.body)) % 2:
            case.body["model"] = "varied"
        return case

    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [schemathesis.GenerationMode.POSITIVE]
        if operation.method.upper() == "POST":  # (a GET without parameters has no invalid form)
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode).map(served_model))
            @settings(max_examples=40, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
            def check(case):
                response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
                calls.append(response.status_code)
                if response.status_code >= 500:
                    failures.append((operation.label, response.status_code, response.text[:200], case.body))

            check()
    assert not failures
    assert len(calls) > 60 and any(code == 200 for code in calls) and any(code == 400 for code in calls)
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, "twice"], ids=["SIGTERM", "Ctrl-C", "Ctrl-C twice"])
def test_sigterm_drains_open_requests(tmp_path, stop):
    """SIGTERM or Ctrl-C: open requests finish, then exit 0. A second Ctrl-C quits at once: the
    cut requests are said in one line and the exit is 130 (it was 0, with a traceback a request)."""
    model, tok = varied_model(context_length=8192 if stop == "twice" else 96)  # (twice: a reply that lasts)
    model.save_pretrained(tmp_path / "m", tokenizer=tok)
    env = {**os.environ, "FRAWD_API_KEY": KEY}
    frawd = str(Path(sys.executable).parent / "frawd")
    proc = subprocess.Popen([frawd, "serve", "--model", str(tmp_path / "m"), "--port", "0", "--threads", "1",
                             "--max-tokens", "8000"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # --port 0: the line names the port the system chose
            if line.startswith("serving "):
                break
        port = int(re.search(r"http://127\.0\.0\.1:(\d+) ", line).group(1))
        assert port != 0, line
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            time.sleep(0.2)
        if hasattr(os, "SCHED_BATCH"):  # the event loop's thread does not preempt the engine's (yield_to_the_engine)
            policies = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{proc.pid}/task")}
            assert policies.pop(proc.pid) == os.SCHED_BATCH
            assert os.SCHED_OTHER in policies.values()  # the scheduler's thread, made before
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        stream = c.completions.create(model="m", prompt="abc", max_tokens=8000 if stop == "twice" else 80,
                                      temperature=0, stream=True)
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        if stop == "twice":
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            with pytest.raises(Exception):  # (the stream is cut: the client sees the connection end)
                for _ in chunks:
                    pass
            assert proc.wait(60) == 130
            log = proc.stderr.read()
            assert "frawd serve: stopped with 1 request(s) unfinished (a second Ctrl-C)" in log, log
            assert "Traceback" not in log, log
            return
        proc.send_signal(stop)
        reasons = []
        for chunk in chunks:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "length" and len(text) == 80  # (char model: one character per token)
        assert proc.wait(60) == 0
        log = proc.stderr.read()
        assert '"completion_tokens": 80' in log  # the access log line
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_command_bad_input(capsys, tmp_path):
    from cli_helpers import run_cli

    code, _, err = run_cli(capsys, "serve", "--model", tmp_path / "missing", "--port", free_port())
    assert code != 0 and len(err.strip().splitlines()) == 1 and "missing" in err
    model, tok = varied_model()
    model.save_pretrained(tmp_path / "a" / "m", tokenizer=tok)
    model.save_pretrained(tmp_path / "b" / "m", tokenizer=tok)
    code, _, err = run_cli(capsys, "serve", "--model", tmp_path / "a" / "m", "--model", tmp_path / "b" / "m")
    assert code != 0 and "NAME=DIR" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "serve", "--model", tmp_path / "a" / "m", "--max-queue", "0")
    assert code != 0 and "--max-queue" in err


def test_a_models_generation_config_gives_the_defaults_a_request_leaves_out():
    """The server ignored generation_config.json, which generate and chat read: the same seed
    served another text, and an imported model's extra end ids (stop_token_ids) never ended a
    reply."""
    model, tok = varied_model(n_layer=1)
    engine = test_engine(model, tok)
    greedy = expected_completion(engine, PROMPTS[2], max_new_tokens=24)
    end = greedy.tokens[5]
    cut = greedy.tokens[:greedy.tokens.index(end)]
    defaults = {"temperature": 0, "stop_token_ids": [end]}
    with live_server({"m": engine}, ServeOptions(), sampling={"m": defaults}) as url:
        assert httpx.get(url + "/v1/models/m").json()["sampling"] == {"temperature": 0, "stop_token_ids": [end]}
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = c.completions.create(model="m", prompt=PROMPTS[2], max_tokens=24)  # greedy, ending at `end`
        assert (got.choices[0].text, got.choices[0].finish_reason) == (tok.decode(cut), "stop")
        sampled = c.completions.create(model="m", prompt=PROMPTS[2], max_tokens=24, temperature=1.0, seed=5)
        alone = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=24, temperature=1.0, seed=5,
                                                           stop_token_ids=[end]))[0]
        assert sampled.choices[0].text == alone.text  # (the request's temperature wins; the file's end ids stay)
        messages = [{"role": "user", "content": PROMPTS[2]}]
        chat = c.chat.completions.create(model="m", messages=messages, max_tokens=24)
        ids = tok.render_chat(messages, add_generation_prompt=True)
        ends = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=(end, *ROLE_TOKEN_IDS))
        assert chat.choices[0].message.content == engine.generate([ids], ends)[0].text


def test_a_models_own_stop_settings_in_any_form_the_file_takes():
    """A file's lone stop string was split into characters (a stop at every newline), a lone
    stop id was a 500, and a list of more stop strings than a request may send refused every
    request that sent none."""
    model, tok = varied_model(n_layer=1)
    engine = test_engine(model, tok)
    greedy = expected_completion(engine, PROMPTS[2], max_new_tokens=24)
    end = greedy.tokens[5]
    stops = ["zq1", "zq2", "zq3", "zq4", greedy.text[2:4]]
    files = {"one": {"temperature": 0, "stop_token_ids": end}, "many": {"temperature": 0, "stop": stops},
             "lone": {"temperature": 0, "stop": greedy.text[2:4]}}
    with live_server({name: engine for name in files}, ServeOptions(), sampling=files) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        for name in files:
            got = c.completions.create(model=name, prompt=PROMPTS[2], max_tokens=24).choices[0]
            alone = engine.generate(PROMPTS[2], SamplingParams.from_dict({**files[name], "max_new_tokens": 24}))[0]
            assert (got.text, got.finish_reason) == (alone.text, "stop"), name


def test_serve_gives_each_model_its_generation_config(capsys, tmp_path, monkeypatch):
    import uvicorn

    import frawdllm.serve
    from cli_helpers import run_cli
    from frawdllm.modeldir import load_generation_config

    model, tok = varied_model(n_layer=1)
    model.save_pretrained(tmp_path / "m", tokenizer=tok)
    (tmp_path / "m" / "generation_config.json").write_text('{"temperature": 0.5, "stop_token_ids": [9], "stop": ["x"]}')
    model.save_pretrained(tmp_path / "plain", tokenizer=tok)
    given = {}
    real = frawdllm.serve.create_app
    monkeypatch.setattr(frawdllm.serve, "create_app", lambda e, o, sampling=None: given.update(sampling) or real(e, o))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    access = logging.getLogger("frawdllm.serve.access")  # (what the command sets up, put back after it)
    monkeypatch.setattr(access, "handlers", list(access.handlers))
    monkeypatch.setattr(access, "propagate", access.propagate)
    monkeypatch.setattr(access, "level", access.level)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    code, _, err = run_cli(capsys, "serve", "--model", f"a={tmp_path / 'm'}", "--model", f"b={tmp_path / 'plain'}",
                           "--port", free_port(), "--threads", "1")
    assert code == 0, err
    assert given == {"a": load_generation_config(tmp_path / "m"), "b": {}} and given["a"]["stop_token_ids"] == [9]
    (tmp_path / "m" / "generation_config.json").write_text('{"stop_token_ids": [100000]}')  # (refused at start,
    code, _, err = run_cli(capsys, "serve", "--model", tmp_path / "m", "--port", free_port())  # not per request)
    assert code == 1 and err == (f"frawd: error: {tmp_path / 'm' / 'generation_config.json'}: stop token id 100000 is "
                                 f"outside the vocabulary (size {model.config.vocab_size})\n")


def test_a_runs_model_folder_is_named_after_the_run(tmp_path, monkeypatch):
    from frawdllm.cli.serve import _named

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "shakespeare").mkdir(parents=True)
    assert _named("runs/shakespeare/model") == ("shakespeare", "runs/shakespeare/model")
    assert _named(str(tmp_path / "runs" / "x" / "model") + "/")[0] == "x"
    assert _named("runs/x/checkpoints/step_00000500/model")[0] == "x-step_00000500"
    assert _named("exports/tiny")[0] == "tiny"
    assert _named("x/models/model")[0] == "models"  # (any folder holding a `model` folder)
    assert _named("model")[0] == tmp_path.name  # (the folder it is in)
    assert _named("mine=runs/x/model") == ("mine", "runs/x/model")
    (tmp_path / "runs" / "lr=3e-4" / "model").mkdir(parents=True)  # '=' in a run's name: still a DIR
    assert _named("runs/lr=3e-4/model") == ("lr=3e-4", "runs/lr=3e-4/model")
    assert _named("runs/lr=1e-3/model")[0] == "lr=1e-3"  # (not made yet: the loader says it is missing)
    assert _named("org/tiny=runs/shakespeare") == ("org/tiny", "runs/shakespeare")  # (a name with a slash)
    monkeypatch.chdir(tmp_path / "runs" / "shakespeare")
    assert _named(".")[0] == "shakespeare"


def test_chunks_of_one_step_wake_the_event_loop_once():
    """What the scheduler's thread hands out while the loop is busy arrives in order, each
    item in its own queue, after a single wake-up of the loop."""
    import asyncio

    from frawdllm.serve.app import _Delivery

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), original(*a))[1]
        delivery = _Delivery(loop)
        queues = [asyncio.Queue() for _ in range(3)]
        listeners = [delivery.listener(q) for q in queues]
        thread = threading.Thread(target=lambda: [listeners[i % 3](i) for i in range(30)])
        thread.start()
        thread.join()  # (the loop has not run meanwhile: everything is pending)
        got = [[await asyncio.wait_for(q.get(), 5) for _ in range(10)] for q in queues]
        return got, len(wakeups)

    got, wakeups = asyncio.run(main())
    assert got == [list(range(i, 30, 3)) for i in range(3)]
    assert wakeups == 1


@pytest.mark.parametrize("chat", [False, True])
def test_token_events_are_written_as_json_dumps_would(chat):
    """A token's SSE event, formatted without building dicts (it runs per token per client),
    is the event of the dicts through json.dumps, for texts that need escaping too."""
    import asyncio
    from types import SimpleNamespace

    from frawdllm.infer.scheduler import Request
    from frawdllm.serve.replies import _Reply

    body = SimpleNamespace(model="m", stream_options=SimpleNamespace(include_usage=True))
    jobs = [Request([1], SamplingParams(num_samples=2), None)]
    reply = _Reply(body, jobs, asyncio.Queue(), chat, prompt_tokens=3, created=1, echoes=[""])
    for index, text in enumerate(['a "quoted" \\ back', "line\nbreak\t\x01", "héllo ✓ 🙂", " "]):
        field = {"delta": {"content": text}} if chat else {"text": text}
        choice = {"index": index, **field, "logprobs": None, "finish_reason": None}
        fast = reply._event(reply._token_choices(index, text))
        assert fast == reply._event([choice])
        assert json.loads(fast[len("data: "):])["choices"] == [choice]


def test_a_queued_stream_whose_client_leaves_leaves_the_queue_under_asgi_2_4(caplog):
    """Under ASGI spec 2.4 Starlette does not watch for disconnects (only a failed write
    tells, and a queued request writes nothing): the reply's own watcher takes a queued
    request whose client left out of the queue, while the running one goes on. A client
    gone is not logged as an internal error, and a failed write ends the request as a
    disconnect (the app returns: raised on, the server would log it as a bug)."""
    import asyncio

    from frawdllm.serve import create_app
    from test_scheduler import varied_model

    engine = test_engine(*varied_model(context_length=1024))
    forward = engine.forward

    def paced_forward(*args):  # ~200 steps/s: the first request runs for seconds
        time.sleep(0.005)
        return forward(*args)

    engine.forward = paced_forward
    app = create_app({"m": engine}, ServeOptions(max_batch=1, max_tokens=1000))

    async def stream(gone: asyncio.Event, sent: list) -> None:
        body = json.dumps({"model": "m", "prompt": "a", "max_tokens": 1000, "stream": True}).encode()
        scope = asgi_post(body, spec_version="2.4")
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if gone.is_set():
                raise OSError("the client went away")  # (what a 2.4 server does)
            sent.append(message)

        await app(scope, receive, send)

    async def main():
        health = next(r for r in app.routes if getattr(r, "path", "") == "/health").endpoint
        async with app.router.lifespan_context(app):
            stays, leaves = asyncio.Event(), asyncio.Event()
            sent_first, sent_second = [], []
            first = asyncio.ensure_future(stream(stays, sent_first))
            while not any(m.get("body") for m in sent_first):  # the first is generating
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(stream(leaves, sent_second))
            while (await health())["waiting"] == 0:
                await asyncio.sleep(0.01)
            leaves.set()
            await asyncio.wait_for(second, 2)  # (its last write failed; the first still has seconds to go)
            deadline = time.time() + 1  # (the scheduler drops it at its next step)
            while (await health())["waiting"] and time.time() < deadline:
                await asyncio.sleep(0.01)
            state = await health()
            assert not first.done() and state["waiting"] == 0 and state["running"] == 1, state
            assert [m["body"] for m in sent_second if m["type"] == "http.response.body"] in ([], [b""])
            stays.set()
            await asyncio.wait_for(first, 5)
            while (await health())["running"]:
                await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_truncate_drops_a_too_long_turn_with_its_answers_never_starting_at_a_reply():
    """A too-long user turn went with the turns before it, but its answer stayed as the
    first turn of the prompt: a reply without the message it answers."""
    from frawdllm import FrawdLLM, get_config
    from frawdllm.infer import Engine
    from frawdllm.serve.prompts import _reach, _within_reach
    from frawdllm.tokenizer import train_tokenizer

    tok = train_tokenizer(["sxrq"], kind="char")
    engine = Engine(FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=16, n_head=2,
                                        context_length=8)), tok)
    system, long = {"role": "system", "content": "s"}, {"role": "user", "content": "x" * (_reach(engine) + 1)}
    reply, question = {"role": "assistant", "content": "r"}, {"role": "user", "content": "q"}
    assert _within_reach([system, long, reply, question], engine, True) == [system, question]
    assert _within_reach([long, reply, reply, question, reply], engine, True) == [question, reply]
    assert _within_reach([system, question, reply], engine, True) == [system, question, reply]  # nothing too long
    # a system message stays wherever it stands (OpenAI's clients may send one after some turns)
    late = {"role": "system", "content": "t"}
    assert _within_reach([question, reply, late, long, reply, question], engine, True) == [late, question]


def test_a_text_prompt_starts_with_the_bos_its_tokenizers_template_adds_truncated_or_not():
    # (/v1/completions encoded text without it, unlike Engine.generate and transformers)
    from tokenizers import processors

    from frawdllm import FrawdLLM, get_config
    from frawdllm.infer import Engine
    from frawdllm.tokenizer import BOS_ID, Tokenizer, byte_tokenizer

    backend = byte_tokenizer().backend
    backend.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", BOS_ID)])
    tok = Tokenizer(backend)
    model = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, context_length=32, vocab_size=tok.vocab_size))
    engine = Engine(model, tok, weights="fp32")
    want = engine.generate("hello", SamplingParams(temperature=0, max_new_tokens=4))[0]
    with live_server({"m": engine}, ServeOptions()) as url:
        got = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4,
                                                         "temperature": 0}, timeout=60).json()
        assert got["usage"]["prompt_tokens"] == len(tok.encode("hello")) + 1
        assert got["choices"][0]["text"] == tok.decode(want.tokens)
        long = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x" * 100, "max_tokens": 4,
                                                          "truncate": True, "echo": True, "logprobs": 1,
                                                          "temperature": 0},
                          timeout=60).json()
        assert long["choices"][0]["logprobs"]["tokens"][0] == "<|bos|>"  # (first, after the cut)
        # the same prompt as token ids (transformers' encoding, the BOS first) keeps it too: it lost it
        ids = tok.encode("x" * 100) if tok.encode("x")[:1] == [BOS_ID] else [BOS_ID] + tok.encode("x" * 100)
        as_ids = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 4,
                                                            "truncate": True, "echo": True, "logprobs": 1,
                                                            "temperature": 0},
                            timeout=60).json()
        for key in ("tokens", "token_logprobs", "top_logprobs"):  # (the echo differs: ids are echoed decoded)
            assert as_ids["choices"][0]["logprobs"][key] == long["choices"][0]["logprobs"][key], key
        assert as_ids["usage"] == long["usage"]


def test_truncate_leaves_the_reply_its_room_and_offsets_skip_the_template_bos():
    """A tokenizer whose template adds a BOS (an imported Llama's): "truncate" keeps
    context - reserve tokens in all, the BOS included (it left one token too many, eating the
    reply's room), and the echo's text_offset counts from the text the echo shows (the BOS,
    not shown, is at 0 and does not shift the rest by its name's length)."""
    from tokenizers import processors

    from frawdllm import FrawdLLM, get_config
    from frawdllm.infer import Engine
    from frawdllm.tokenizer import BOS_ID, Tokenizer, byte_tokenizer

    backend = byte_tokenizer().backend
    backend.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", BOS_ID)])
    tok = Tokenizer(backend)
    model = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, context_length=32, vocab_size=tok.vocab_size))
    engine = Engine(model, tok, weights="fp32")
    with live_server({"m": engine}, ServeOptions()) as url:
        got = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x" * 100, "max_tokens": 4,
                                                         "truncate": True, "echo": True, "logprobs": 1,
                                                         "temperature": 0}, timeout=60).json()
    from frawdllm.infer.chat import reply_reserve

    keep = 32 - reply_reserve(32, 4)
    assert got["usage"]["prompt_tokens"] == keep, got["usage"]
    logprobs = got["choices"][0]["logprobs"]
    assert logprobs["tokens"][:2] == ["<|bos|>", "x"]
    assert logprobs["text_offset"][:keep] == [0] + list(range(keep - 1))
