"""The SSE events and whole bodies `_Reply` builds from a request's stream of chunks, without
a server: usage chunks only when asked, every choice's opening role and empty final delta,
chunk objects, no empty events for held text, and a failed generation as a 503."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from frawdllm.infer.engine import StreamChunk
from frawdllm.infer.sampling import SamplingParams
from frawdllm.infer.scheduler import Request as Job
from frawdllm.serve.replies import _Reply
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)


def events_of(chunks, chat, n=1, stream_options=None, echoes=("",), tokenizer=None, logprobs=None):
    """The decoded SSE events (and the raw tail) of a reply fed `chunks`."""
    async def run():
        queue = asyncio.Queue()
        for chunk in chunks:
            queue.put_nowait(chunk)
        body = SimpleNamespace(model="m", stream_options=stream_options)
        job = Job([1], SamplingParams(num_samples=n, logprobs=logprobs), listener=lambda chunk: None)
        reply = _Reply(body, [job], queue, chat, prompt_tokens=1, created=0, echoes=list(echoes), tokenizer=tokenizer)
        return "".join([e async for e in reply._events()])

    raw = asyncio.run(run())
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_false_sends_no_usage_chunk(chat):
    """stream_options {"include_usage": false} is OpenAI's default: no usage chunk (choices [])
    before [DONE], and no "usage" field in any chunk."""
    chunks = [StreamChunk(0, "a", 10), StreamChunk(0, "b", 11, "length")]
    events = events_of(chunks, chat, stream_options=SimpleNamespace(include_usage=False))
    assert all("usage" not in e for e in events)
    assert all(e["choices"] for e in events)
    with_usage = events_of(chunks, chat, stream_options=SimpleNamespace(include_usage=True))
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 2


def test_a_streamed_chat_reply_with_n_choices_opens_each_with_its_role():
    """n=3 streamed chat: the first event gives every choice its assistant role (clients
    build choice i's message from the deltas of index i), and the final delta of a choice
    that ended with no new text is empty (no "content": "")."""
    chunks = [StreamChunk(i, "x", 10) for i in range(3)] + [StreamChunk(i, "", 3, "stop") for i in range(3)]
    events = events_of(chunks, True, n=3)
    first = events[0]["choices"]
    assert [c["index"] for c in first] == [0, 1, 2]
    assert all(c["delta"] == {"role": "assistant", "content": ""} for c in first)
    finals = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert [(c["index"], c["delta"], c["finish_reason"]) for c in finals] == [(i, {}, "stop") for i in range(3)]


def test_chat_stream_chunks_are_chat_completion_chunks():
    events = events_of([StreamChunk(0, "a", 10), StreamChunk(0, "", 3, "stop")], True)
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    events = events_of([StreamChunk(0, "a", 10), StreamChunk(0, "", 3, "stop")], False)
    assert {e["object"] for e in events} == {"text_completion"}


@pytest.mark.parametrize("chat", [False, True])
def test_with_logprobs_a_token_whose_text_is_held_sends_no_empty_event(chat):
    """A token not printable yet (held: it may start a stop string, or is part of a
    character) makes no event, with logprobs as without: its entry goes with the next text."""
    from frawdllm.tokenizer import train_tokenizer
    from test_serve_logprobs import chunks_of

    tok = train_tokenizer(["abc,\nxyz hello world"], kind="char")
    chunks = chunks_of(tok, tok.encode("aac"), stop=("ab",))  # the first "a" is held
    assert chunks[0].text == ""
    events = events_of(chunks, chat, tokenizer=tok, logprobs=0)
    for e in (events[1:] if chat else events):  # (chat: the first event gives the role)
        choice = e["choices"][0]
        text = choice["delta"].get("content", "") if chat else choice["text"]
        assert text or choice["finish_reason"] is not None, e


def test_a_generation_that_fails_before_the_reply_is_a_503():
    """Unstreamed, a failed generation is the HTTP status of the reply: 503 (the server's
    engine failed, retry later), a server_error."""
    from frawdllm.serve.errors import ApiError

    async def run():
        queue = asyncio.Queue()
        queue.put_nowait(StreamChunk(0, "a", 10))
        queue.put_nowait(RuntimeError("the device went away"))
        body = SimpleNamespace(model="m", stream_options=None)
        job = Job([1], SamplingParams(), listener=lambda chunk: None)
        return await _Reply(body, [job], queue, False, prompt_tokens=1, created=0, echoes=[""]).whole()

    with pytest.raises(ApiError) as error:
        asyncio.run(run())
    assert error.value.status == 503 and "the device went away" in error.value.message
    assert error.value.body()["error"]["type"] == "server_error"
