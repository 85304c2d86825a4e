"""How the server lays out logprobs against the text it sends: each streamed event carries
its own tokens' entries, `text_offset` counts characters of the returned text (a token
inside a multi-byte character starts where that character starts), and the tokens of a
stop string, which is cut from the text, are not reported. Driven at the level of a reply
(`_Reply` fed the chunks a scheduler would deliver) so that how chunks bunch up between
two event-loop turns is chosen by the test, and once end to end through a live server."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from frawdllm.infer.engine import StreamChunk
from frawdllm.infer.sampling import SamplingParams, TokenLogprob
from frawdllm.infer.scheduler import Request as Job
from frawdllm.infer.textstream import TextStream
from frawdllm.serve import ServeOptions
from frawdllm.serve.replies import _Reply
from frawdllm.tokenizer import byte_tokenizer, train_tokenizer
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)
from serve_helpers import live_server, test_engine
from test_scheduler import varied_model


def chunks_of(tokenizer, ids, stop=(), max_tokens=None, prompt=()):
    """The StreamChunks a scheduler delivers for `ids` (each with a logprob entry): text as
    `TextStream` releases it; the last chunk finishes the reply ("stop" at a stop string)."""
    stream, chunks = TextStream(tokenizer, stop, prompt), []
    for i, token in enumerate(ids):
        text = stream.push(token)
        reason = "stop" if stream.stopped else "length" if i == len(ids) - 1 else None
        if reason == "length":
            text += stream.finish()
        chunks.append(StreamChunk(0, text, token, reason, TokenLogprob(token, -0.5 - i)))
        if reason:
            break
    return chunks


def reply(tokenizer, chunks, chat=False, echo="", prompt=(1,)):
    queue = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    body = SimpleNamespace(model="m", stream_options=None)
    job = Job(list(prompt), SamplingParams(logprobs=0), listener=lambda chunk: None)
    return _Reply(body, [job], queue, chat, prompt_tokens=1, created=0, echoes=[echo], tokenizer=tokenizer)


def streamed(tokenizer, chunks, chat=False):
    """Every event's (text, logprob tokens, text_offsets) of the reply streamed, all its
    chunks ready at once (a client behind by several tokens gets them in one write)."""
    async def run():
        return [e async for e in reply(tokenizer, chunks, chat)._events()]

    events = [json.loads(line[6:]) for e in asyncio.run(run()) for line in e.splitlines()
              if line.startswith("data: {")]
    out = []
    for event in events:
        choice = event["choices"][0]
        text = choice["delta"].get("content", "") if chat else choice["text"]
        logprobs = choice["logprobs"]
        if chat:
            tokens = [e["token"] for e in logprobs["content"]] if logprobs else []
            out.append((text, tokens, None))
        else:
            out.append((text, logprobs["tokens"] if logprobs else [], logprobs["text_offset"] if logprobs else []))
    return [e for e in out if e[0] or e[1]]


def whole(tokenizer, chunks, chat=False, prompt=(1,)):
    async def run():
        r = reply(tokenizer, chunks, chat, prompt=prompt)
        while None in r.reasons:
            await r._next()
        return r._whole()["choices"][0]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def char_tok():
    return train_tokenizer(["abc,\nxyz hello world"], kind="char")


@pytest.mark.parametrize("chat", [False, True])
def test_each_streamed_event_carries_its_own_tokens_logprobs(char_tok, chat):
    """All chunks were taken from the queue before any event was made, so the first event
    with text carried every token's entry and the others none."""
    ids = char_tok.encode("hello world")
    events = streamed(char_tok, chunks_of(char_tok, ids), chat)
    assert [text for text, _, _ in events] == list("hello world")
    assert [tokens for _, tokens, _ in events] == [[c] for c in "hello world"]
    if not chat:
        assert [offsets for _, _, offsets in events] == [[i] for i in range(len("hello world"))]


@pytest.mark.parametrize("chat", [False, True])
def test_a_stop_strings_tokens_are_not_reported(char_tok, chat):
    """The stop string ",\\nx" is cut from the text; its tokens' logprobs were still sent,
    so the tokens no longer joined to the text."""
    ids = char_tok.encode("abc,\nxyz")
    chunks = chunks_of(char_tok, ids, stop=(",\nx",))
    assert "".join(c.text for c in chunks) == "abc" and chunks[-1].finish_reason == "stop"
    events = streamed(char_tok, chunks, chat)
    assert "".join(text for text, _, _ in events) == "abc"
    assert [t for _, tokens, _ in events for t in tokens] == ["a", "b", "c"]
    choice = whole(char_tok, chunks, chat)
    tokens = [e["token"] for e in choice["logprobs"]["content"]] if chat else choice["logprobs"]["tokens"]
    assert tokens == ["a", "b", "c"]
    # a token that the cut splits keeps its entry: its text began before the stop string
    chunks = chunks_of(char_tok, char_tok.encode("abc,\nxyz"), stop=("c,\n",))
    assert "".join(c.text for c in chunks) == "ab"
    assert [t for _, tokens, _ in streamed(char_tok, chunks, chat) for t in tokens] == ["a", "b"]


def test_a_held_token_waits_for_its_text(char_tok):
    """Stop "ab", tokens "a", "a", "c": the first "a" is held (it could start "ab"), the
    second releases it and is held in its turn, "c" releases the rest. An entry goes out
    with the event whose text reaches its token."""
    ids = char_tok.encode("aac")
    events = streamed(char_tok, chunks_of(char_tok, ids, stop=("ab",)))
    assert [(text, tokens) for text, tokens, _ in events] == [("a", ["a"]), ("ac", ["a", "c"])]


def test_text_offset_counts_characters_of_the_text():
    """Byte tokens of multi-byte characters: the offsets counted each token's own U+FFFD
    text, so past "é" they no longer indexed the text (and ran past its end)."""
    tok = byte_tokenizer()
    text = "hé wörld 😀 x"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # a token a byte
    # independent: where each token's first byte falls, in characters of the text
    raw = text.encode()
    want = [len(raw[:i].decode("utf-8", errors="ignore")) for i in range(len(raw))]
    choice = whole(tok, chunks_of(tok, ids))
    assert choice["text"] == text
    assert choice["logprobs"]["text_offset"] == want
    assert all(text[o] == "x" for o, t in zip(want, choice["logprobs"]["tokens"]) if t == "x")
    events = streamed(tok, chunks_of(tok, ids))
    assert [o for _, _, offsets in events for o in offsets] == want
    assert "".join(t for t, _, _ in events) == text


def test_completions_top_logprobs_hold_the_chosen_token_too(char_tok):
    """As OpenAI's and vLLM's completions do (up to k + 1 entries): a sampled token outside
    the k likeliest was missing from its own position's top_logprobs."""
    a, b, c = char_tok.encode("abc")
    chunks = [StreamChunk(0, "a", a, None, TokenLogprob(a, -0.1, ((a, -0.1),))),  # the likeliest: once
              StreamChunk(0, "b", b, None, TokenLogprob(b, -3.0, ((c, -0.2),))),  # sampled outside the top 1
              StreamChunk(0, "c", c, "length", TokenLogprob(c, -0.5, ()))]  # logprobs 0: the chosen alone
    tops = whole(char_tok, chunks)["logprobs"]["top_logprobs"]
    assert tops == [{"a": -0.1}, {"c": -0.2, "b": -3.0}, {"c": -0.5}]


def test_completions_name_tokens_that_hold_part_of_a_character_by_their_bytes():
    """Byte tokens of "日" (e6 97 a5): each was the key U+FFFD in top_logprobs, so a position's
    partial tokens overwrote each other (fewer than k keys) and the chosen token's own value
    was lost. They are "bytes:\\xe6" as OpenAI's completions name them; whole characters keep
    their text."""
    tok = byte_tokenizer()
    e6, x97, xa5 = tok.encode("日")
    x, y = tok.encode("xy")
    chunks = [StreamChunk(0, "", e6, None, TokenLogprob(e6, -0.5, ((x97, -0.4), (e6, -0.5), (xa5, -0.9)))),
              StreamChunk(0, "", x97, None, TokenLogprob(x97, -2.5, ((xa5, -0.1), (e6, -2.0), (x, -2.2)))),
              StreamChunk(0, "日", xa5, None, TokenLogprob(xa5, -0.2, ((xa5, -0.2), (y, -3.0)))),
              StreamChunk(0, "x", x, "length", TokenLogprob(x, -0.3, ((x, -0.3),)))]
    logprobs = whole(tok, chunks)["logprobs"]
    assert logprobs["tokens"] == ["bytes:\\xe6", "bytes:\\x97", "bytes:\\xa5", "x"]
    assert logprobs["top_logprobs"] == [
        {"bytes:\\x97": -0.4, "bytes:\\xe6": -0.5, "bytes:\\xa5": -0.9},
        {"bytes:\\xa5": -0.1, "bytes:\\xe6": -2.0, "x": -2.2, "bytes:\\x97": -2.5},  # the chosen one, k + 1
        {"bytes:\\xa5": -0.2, "y": -3.0}, {"x": -0.3}]
    assert logprobs["text_offset"] == [0, 0, 0, 1]


def test_text_offsets_after_a_prompt_that_ends_inside_a_character():
    """Prompt ids "hello " + 2 bytes of 😀, reply its other 2 and " あ": the reply's text is
    " あ" (the character is the prompt's), and the offsets counted the first reply byte's own
    U+FFFD, so they ran one past it."""
    tok = byte_tokenizer()
    ids = tok.encode("hello 😀 あ")
    prompt, rest = ids[:8], ids[8:]
    choice = whole(tok, chunks_of(tok, rest, prompt=prompt), prompt=prompt)
    assert choice["text"] == " あ"
    assert choice["logprobs"]["text_offset"] == [0, 0, 0, 1, 1, 1]


def test_an_echoed_prompts_special_tokens_are_text_of_the_echo():
    """A token-id prompt's echo is its decoding, special tokens' names included, and its
    offsets counted each special token as no text: [<|bos|>, "v", "e"] got [0, 0, 1]. A
    text prompt's template BOS is not in its echo: it stays at 0, and the text starts there."""
    from frawdllm.serve.replies import _prompt_scored

    tok = byte_tokenizer()
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    h, e_head = tok.encode("hé")[:2]  # "h" and the first byte of "é": a character cut short
    ids = [bos, h, e_head, eos, *tok.encode("x")]
    text = tok.decode(ids)
    assert text == "<|bos|>h\ufffd<|eos|>x"  # (the echo the server sends)
    offsets = [start for _, _, start in _prompt_scored(tok, ids, [None] * len(ids))]
    assert offsets == [0, 7, 8, 9, 16]
    shown = [text[start:] for start in offsets]
    assert shown[0].startswith("<|bos|>") and shown[3].startswith("<|eos|>") and shown[4] == "x"
    hidden = [start for _, _, start in _prompt_scored(tok, [bos, *tok.encode("ab")], [None] * 3, hidden=1)]
    assert hidden == [0, 0, 1]  # the echo is "ab"


def test_a_live_server_reports_the_text_it_sends():
    """End to end: a stop string that spans tokens, streamed and not, completions and chat:
    the reported tokens join to the text sent."""
    model, tok = varied_model(context_length=128)
    engine = test_engine(model, tok)
    greedy = engine.generate("the", SamplingParams(temperature=0, max_new_tokens=12))[0]
    stop = greedy.text[4:7]  # three characters in the middle of the greedy reply
    assert len(stop) == 3 and greedy.text.find(stop) == 4
    with live_server({"m": engine}, ServeOptions()) as url:
        for stream in (False, True):
            body = {"model": "m", "prompt": "the", "max_tokens": 12, "temperature": 0, "logprobs": 1,
                    "stop": stop, "stream": stream}
            response = httpx.post(url + "/v1/completions", json=body, timeout=30)
            if stream:
                choices = [json.loads(line[6:])["choices"][0] for line in response.text.splitlines()
                           if line.startswith("data: {")]
            else:
                choices = response.json()["choices"]
            text = "".join(c["text"] for c in choices)
            tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
            assert text == greedy.text[:4] and "".join(tokens) == text, (stream, text, tokens)
            for c in choices:  # each event's tokens are its own text
                assert "".join(c["logprobs"]["tokens"] if c["logprobs"] else []) == c["text"], choices
        # a scoring request (max_tokens 0, echo) counts in /metrics as a generating one does
        def metric(name):
            line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith(name + '{model="m"}'))
            return float(line.split()[-1])

        before = (metric("frawd_prompt_tokens_total"), metric("frawd_request_seconds_count"))
        body = {"model": "m", "prompt": "the cat", "max_tokens": 0, "echo": True, "logprobs": 0}
        scored = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        assert scored["usage"]["prompt_tokens"] == len(tok.encode("the cat"))
        after = (metric("frawd_prompt_tokens_total"), metric("frawd_request_seconds_count"))
        assert after == (before[0] + len(tok.encode("the cat")), before[1] + 1)
        # an echoed token-id prompt holding special tokens: each offset points at its token's text
        ids = [tok.token_to_id("<|bos|>"), *tok.encode("the"), tok.token_to_id("<|user|>"), *tok.encode("c")]
        for max_tokens in (0, 3):
            body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "echo": True, "logprobs": 0,
                    "temperature": 0}
            choice = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
            logprobs = choice["logprobs"]
            assert choice["text"].startswith("<|bos|>the<|user|>c") and len(logprobs["tokens"]) == 6 + max_tokens
            for token, start in zip(logprobs["tokens"], logprobs["text_offset"]):
                assert choice["text"][start:].startswith(token), (token, start, choice["text"])


@pytest.mark.parametrize("chat", [False, True])
def test_a_last_token_of_no_text_is_still_reported(char_tok, chat):
    """A reply that reaches max_tokens on a special token (no text in a reply's decoding):
    its entry starts and ends where the text ends, and it is reported, as every generated
    token is (only a stop string's tokens, cut from the text, are dropped)."""
    user = 4  # <|user|>: not a stop token of completions
    assert user in char_tok.special_ids
    ids = char_tok.encode("ab") + [user]
    chunks = chunks_of(char_tok, ids)
    assert "".join(c.text for c in chunks) == "ab" and chunks[-1].finish_reason == "length"
    choice = whole(char_tok, chunks, chat)
    if chat:
        assert [e["token"] for e in choice["logprobs"]["content"]] == ["a", "b", "<|user|>"]
    else:
        assert choice["logprobs"]["tokens"] == ["a", "b", "<|user|>"]
        assert choice["logprobs"]["text_offset"] == [0, 1, 2]
    assert [t for _, tokens, _ in streamed(char_tok, chunks, chat) for t in tokens] == ["a", "b", "<|user|>"]


def test_completions_top_logprobs_give_the_chosen_tokens_value_under_a_shared_name():
    """Two tokens of one name (an added token spelling a vocabulary token's bytes): the
    position's top_logprobs keeps the chosen token's own logprob under that name, so that
    top_logprobs[i][tokens[i]] == token_logprobs[i] as clients assume."""
    from types import SimpleNamespace

    from frawdllm.infer.sampling import TokenLogprob
    from frawdllm.serve.replies import _completion_logprobs

    names = {7: b"x", 8: b"x", 9: b"y"}
    tok = SimpleNamespace(token_bytes=lambda t: names[t])
    entry = TokenLogprob(8, -2.0, ((7, -0.1), (8, -2.0), (9, -3.0)))
    got = _completion_logprobs(tok, [(8, entry, 0)])
    assert got["tokens"] == ["x"] and got["token_logprobs"] == [-2.0]
    assert got["top_logprobs"] == [{"x": -2.0, "y": -3.0}]
