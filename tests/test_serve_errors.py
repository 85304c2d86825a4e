"""`frawd serve` with bad input: every client error is OpenAI's error object with a 4xx
status and a message that says what to change, logged and counted with that status; a
client that leaves a non-streaming request cancels it; the command refuses bad settings
in one line."""

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from cli_helpers import run_cli
from frawdllm.serve import ServeOptions
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)
from serve_helpers import AccessLog, live_server, test_engine
from test_scheduler import varied_model

CONTEXT = 64
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    engines = {name: test_engine(*varied_model(context_length=context))
               for name, context in [("m", CONTEXT), ("slow", 1024), ("broken", CONTEXT)]}
    forward = engines["slow"].forward

    def paced_forward(*args):  # ~200 steps/s: a long reply is still running when its client leaves
        time.sleep(0.005)
        return forward(*args)

    engines["slow"].forward = paced_forward

    def broken_encode(prompt):
        raise RuntimeError("a bug")

    engines["broken"].encode = broken_encode
    log = AccessLog()
    logger = logging.getLogger("frawdllm.serve.access")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        with live_server(engines, ServeOptions(max_tokens=1000, max_batch=2)) as url:
            yield {"url": url, "log": log, "tokenizer": engines["m"].tokenizer}
    finally:
        logger.removeHandler(log)


def post(server, path, body=None, content=None, headers=JSON, **kwargs):
    """(status, error object or body) of a POST; also checks the access log and /metrics
    record the status the client got."""
    records = server["log"].records
    seen = len(records)
    response = httpx.post(server["url"] + path, headers=headers, timeout=30, **kwargs,
                          content=json.dumps(body) if content is None else content)
    deadline = time.time() + 5  # (the line is written just after the reply is sent)
    while not [r for r in records[seen:] if r["path"] == path] and time.time() < deadline:
        time.sleep(0.01)
    record = [r for r in records[seen:] if r["path"] == path][-1]
    assert record["status"] == response.status_code, record
    return response.status_code, response.json().get("error", response.json())


def counted(server, path, status) -> float:
    """frawd_requests_total of (path, status) in /metrics."""
    line = f'frawd_requests_total{{path="{path}",status="{status}"}} '
    metrics = httpx.get(server["url"] + "/metrics").text
    return next((float(x[len(line):]) for x in metrics.splitlines() if x.startswith(line)), 0.0)


def test_lone_surrogates_are_a_400_naming_the_field(server):
    """JSON lets a string hold "\\ud800", which no UTF-8 text can."""
    before = counted(server, "/v1/chat/completions", 400)
    status, error = post(server, "/v1/completions", content=b'{"model": "m", "prompt": "ab\\ud800c"}')
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == "prompt"
    assert "the prompt" in error["message"] and "UTF-8" in error["message"]
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\udfff"}]}'
    status, error = post(server, "/v1/chat/completions", content=chat)
    assert status == 400 and error["param"] == "messages"
    assert "messages[1].content" in error["message"] and "UTF-8" in error["message"]
    assert counted(server, "/v1/chat/completions", 400) == before + 1
    for path, body in [("/v1/completions", b'{"model": "m", "prompt": "ab", "stop": ["x", "\\ud800"]}'),
                       ("/v1/chat/completions",
                        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "\\ud800"}')]:
        status, error = post(server, path, content=body)
        assert status == 400 and error["param"] == "stop" and "UTF-8" in error["message"], error


def test_an_unexpected_error_is_a_500_logged_as_500(server):
    before = counted(server, "/v1/completions", 500)
    status, error = post(server, "/v1/completions", {"model": "broken", "prompt": "ab", "max_tokens": 2})
    assert status == 500 and error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert counted(server, "/v1/completions", 500) == before + 1


def test_too_long_prompts_point_to_truncate(server):
    turns = [{"role": "user", "content": "a" * 100}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}]
    for path, body, tokens in [("/v1/completions", {"prompt": "a" * 100}, 100),
                               ("/v1/completions", {"prompt": [7] * 100}, 100),
                               ("/v1/chat/completions", {"messages": turns}, 1 + 102 + 3 + 3 + 1)]:
        status, error = post(server, path, {"model": "m", "max_tokens": 2, **body})
        assert status == 400 and error["type"] == "invalid_request_error", error
        message = error["message"]
        assert f"has {tokens} tokens" in message and f"context is {CONTEXT}" in message, message
        assert "overflow" not in message, message
        chat = "messages" in body
        assert message.endswith('"truncate": true keeps ' + ("the newest turns" if chat else "its last tokens")), message
        assert error["param"] == ("messages" if chat else "prompt"), error
        ok = httpx.post(server["url"] + path, headers=JSON, json={"model": "m", "max_tokens": 2, "truncate": True,
                                                                   **body})
        assert ok.status_code == 200, ok.text


def test_truncate_leaves_room_for_the_reply(server):
    """Chat's "truncate" kept history up to context - 1 tokens, so once a conversation
    (the chat page's, which always truncates) neared the context every reply stopped
    after a token or two. Now the prompt leaves max_tokens, at most half the context."""
    turns = []
    for i in range(12):
        turns += [{"role": "user", "content": "a" * 3}, {"role": "assistant", "content": "b" * 3}]
    turns.append({"role": "user", "content": "c"})  # 1 + 12 * 10 + 3 + 1 = 125 tokens in all
    for max_tokens, room in [(2, 2), (20, 20), (500, CONTEXT // 2)]:
        for path, body in [("/v1/chat/completions", {"messages": turns}),
                           ("/v1/completions", {"prompt": "a" * (CONTEXT + 10)})]:
            status, reply = post(server, path, {"model": "m", "max_tokens": max_tokens, "truncate": True,
                                                "temperature": 0, **body})
            assert status == 200, reply
            prompt = reply["usage"]["prompt_tokens"]
            if "prompt" in body:
                assert prompt == CONTEXT - room, (max_tokens, reply["usage"])
            else:  # whole exchanges of 10 tokens go: 5 + 10k tokens are left
                assert CONTEXT - room - 10 < prompt <= CONTEXT - room and (prompt - 5) % 10 == 0, \
                    (max_tokens, reply["usage"])


def test_truncate_of_a_text_too_long_to_tokenize_keeps_its_end(server):
    """A text longer than the context could hold in any tokenization is cut by characters
    before tokenizing: to its end, as the tokens are cut after."""
    prompt = "x" * 300 + "the quick brown fox jumps over the lazy dog"  # (the context's reach: 260 characters)
    body = {"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True, "truncate": True}
    status, reply = post(server, "/v1/completions", body)
    assert status == 200 and reply["choices"][0]["text"].startswith(prompt[-(CONTEXT - 5):]), reply


def test_a_turn_too_long_to_tokenize_is_named(server):
    """With "truncate" a long system message is the one refused (old turns would go), without
    it the newest long turn."""
    messages = [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "u" * 301},
                {"role": "user", "content": "q"}]
    for truncate, named in [(True, "messages[0] has 300 characters"), (False, "messages[1] has 301 characters")]:
        status, error = post(server, "/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": messages,
                                                              "truncate": truncate})
        assert status == 400 and error["code"] == "context_length_exceeded", error
        assert error["message"].startswith(named + ", more than the model's context of 64 tokens"), error


def test_truncate_keeps_a_scored_prompt_that_fits_whole(server):
    """Scoring (max_tokens 0 with echo) generates nothing, yet "truncate" kept a token of
    room for a reply: a prompt of exactly the context lost its first token."""
    ids = [7 + i % 20 for i in range(CONTEXT)]
    scored = {}
    for truncate in (False, True):
        status, reply = post(server, "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 0, "echo": True,
                                                         "logprobs": 0, "truncate": truncate})
        assert status == 200, reply
        scored[truncate] = reply
    assert scored[True]["usage"]["prompt_tokens"] == scored[False]["usage"]["prompt_tokens"] == CONTEXT
    assert scored[True]["choices"] == scored[False]["choices"]


def test_truncate_answers_a_turn_that_fits_the_context_but_not_the_room_for_the_reply(server):
    """A conversation answered without "truncate" was refused with it (the chat page always
    asks for it) when its newest turn fitted the context but not with max_tokens of room:
    that turn (with the system message) is now the prompt, and the reply gets the room left."""
    system, newest = {"role": "system", "content": "s"}, {"role": "user", "content": "a" * 40}
    history = [{"role": "user", "content": "x" * 10}, {"role": "assistant", "content": "y"}]
    for messages, truncated in [([system, newest], 47), ([system, *history, newest], 47)]:  # (of 47 and 62)
        body = {"model": "m", "messages": messages, "max_tokens": 200, "temperature": 0}
        plain = httpx.post(server["url"] + "/v1/chat/completions", json=body).json()
        status, reply = post(server, "/v1/chat/completions", {**body, "truncate": True})
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == truncated <= plain["usage"]["prompt_tokens"], (reply, plain)
        assert reply["choices"][0]["finish_reason"] == "length"
    status, error = post(server, "/v1/chat/completions", {"model": "m", "max_tokens": 2, "truncate": True,
                                                          "messages": [system, {**newest, "content": "a" * 60}]})
    assert status == 400 and error["code"] == "context_length_exceeded", error
    assert error["message"] == ("the message needs 67 tokens with the template and the system message but the "
                                f"model's context is {CONTEXT}; shorten it")


@pytest.mark.alone
def test_a_megabyte_prompt_is_refused_by_its_length_and_stalls_no_one(server):
    """Tokenizing 1M characters held the event loop (and every stream) for ~1.4 s, even for a
    request then refused: a text too long to ever fit is refused by its length."""
    huge = "abc " * 250_000
    start = time.perf_counter()
    status, error = post(server, "/v1/completions", {"model": "m", "prompt": huge, "max_tokens": 2})
    assert status == 400 and error["code"] == "context_length_exceeded", error
    assert "1,000,000 characters" in error["message"] and '"truncate": true' in error["message"]
    long = huge[:200_000]  # (two of them in one body: under --max-body)
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": long},
                                                         {"role": "assistant", "content": "b"},
                                                         {"role": "user", "content": "c"}]}
    status, error = post(server, "/v1/chat/completions", chat)
    assert status == 400 and error["code"] == "context_length_exceeded" and "messages[0]" in error["message"]
    assert time.perf_counter() - start < 1.0
    # with truncate: the tail of the text, the turns after the long one
    want = httpx.post(server["url"] + "/v1/completions", json={"model": "m", "prompt": huge[-200:], "max_tokens": 3,
                                                                "temperature": 0, "truncate": True}).json()
    got = httpx.post(server["url"] + "/v1/completions", json={"model": "m", "prompt": huge, "max_tokens": 3,
                                                               "temperature": 0, "truncate": True}).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert httpx.post(server["url"] + "/v1/chat/completions", json={**chat, "truncate": True}).status_code == 200
    chat["messages"][-1]["content"] = long  # the newest message cannot be dropped
    status, error = post(server, "/v1/chat/completions", {**chat, "truncate": True})
    assert status == 400 and error["code"] == "context_length_exceeded" and "messages[2]" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_prompts_are_tokenized_off_the_event_loop(server, monkeypatch, path):
    """A megabyte of chat turns, each short enough to pass the check on its length, was
    tokenized on the event loop: every stream and /health stalled for 0.4-1 s; so were 32
    completions prompts with "truncate" (1.35 s). Now /health answers while a request's
    prompts are being tokenized."""
    tokenizer, inside, release, replies = server["tokenizer"], threading.Event(), threading.Event(), []
    encode = tokenizer.encode

    def held(text):  # (until /health has answered)
        inside.set()
        release.wait(5)
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", held)
    body = {"model": "m", "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "abc"}]} if "chat" in path else {"prompt": "abc"})
    chat = threading.Thread(target=lambda: replies.append(httpx.post(server["url"] + path, json=body, timeout=30)))
    chat.start()
    try:
        assert inside.wait(5)
        health = httpx.get(server["url"] + "/health", timeout=2)  # (a timeout: the event loop is held)
    finally:
        release.set()
        chat.join(10)
    assert health.status_code == 200 and replies[0].status_code == 200, replies


@pytest.mark.parametrize("field, value, param", [
    ("logit_bias", {"50": 100}, "logit_bias"), ("best_of", 2, "best_of"), ("suffix", "x", "suffix"),
    ("response_format", {"type": "json_object"}, "response_format"), ("stream_options", {"include_usage": True},
                                                                      "stream_options"),
    ("frequency_penalty", 0.5, "frequency_penalty")])
def test_fields_that_would_change_the_output_are_refused_not_ignored(server, field, value, param):
    status, error = post(server, "/v1/completions", {"model": "m", "prompt": "ab", "max_tokens": 2, field: value})
    assert status == 400 and error["param"] == param, error
    assert "not supported" in error["message"] or "only allowed when stream is true" in error["message"], error


def test_chat_logprobs_need_the_switch_and_the_switch_alone_gives_the_sampled_tokens(server):
    chat = {"model": "m", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    status, error = post(server, "/v1/chat/completions", {**chat, "top_logprobs": 3})
    assert status == 400 and error["param"] == "top_logprobs" and error["message"] == "top_logprobs needs logprobs: true"
    status, reply = post(server, "/v1/chat/completions", {**chat, "logprobs": True})
    assert status == 200, reply
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] == 4, reply
    assert "".join(c["token"] for c in content) == reply["choices"][0]["message"]["content"]
    assert all(c["top_logprobs"] == [] and c["logprob"] <= 0 for c in content), content


def test_an_empty_stop_string_is_a_400_on_stop(server):
    for stop in ("", ["a", ""]):
        status, error = post(server, "/v1/completions", {"model": "m", "prompt": "ab", "max_tokens": 2, "stop": stop})
        assert status == 400 and error["param"] == "stop" and error["message"] == "stop strings must not be empty", error


def test_the_default_temperature_is_openais_1(server):
    """(The test server's model has no generation_config.json.)"""
    base = {"model": "m", "prompt": "ab", "max_tokens": 12, "seed": 5}
    texts = [post(server, "/v1/completions", {**base, **extra})[1]["choices"][0]["text"]
             for extra in ({}, {"temperature": 1.0}, {"temperature": 0})]
    assert texts[0] == texts[1] != texts[2], texts


def test_chat_tools_are_refused_and_neutral_values_pass(server):
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for extra in ({"tools": [tool]}, {"functions": [tool["function"]]}, {"tool_choice": "required"},
                  {"function_call": {"name": "f"}}):
        status, error = post(server, "/v1/chat/completions", {**chat, **extra})
        (name,) = extra  # the field refused is the one named ("tools" was named for a tool_choice alone)
        assert status == 400 and error["param"] == name and error["message"].startswith(f"{name} ") \
            and "not supported" in error["message"], (extra, error)
    neutral = {"tools": [], "tool_choice": "none", "function_call": "auto", "logit_bias": {}, "response_format": {"type": "text"},
               "top_logprobs": 0, "logprobs": False, "frequency_penalty": 0}
    assert post(server, "/v1/chat/completions", {**chat, **neutral})[0] == 200
    assert post(server, "/v1/completions", {"model": "m", "prompt": "ab", "max_tokens": 2, "best_of": 1,
                                            "suffix": "", "logprobs": None})[0] == 200


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("n", "2"), ("max_tokens", True), ("max_tokens", 5.0),
                                          ("truncate", "yes"), ("echo", 1)])
def test_types_are_strict(server, field, value):
    status, error = post(server, "/v1/completions", {"model": "m", "prompt": "ab", "max_tokens": 2, field: value})
    assert status == 400 and error["param"] == field, error


def test_a_value_of_none_of_a_fields_forms_says_which_forms_it_takes(server):
    status, error = post(server, "/v1/completions", {"model": "m", "prompt": 5})
    assert status == 400 and error["param"] == "prompt" and "a list of token ids" in error["message"], error
    status, error = post(server, "/v1/completions", {"model": "m", "prompt": []})
    assert status == 400 and "empty list" in error["message"], error
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    status, error = post(server, "/v1/chat/completions", {"model": "m", "messages": [image]})
    assert status == 400 and error["param"] == "messages[0].content" and "text only" in error["message"], error
    status, error = post(server, "/v1/completions", content=b'{"model": "m", "prompt": "a", "temperature": NaN}')
    assert status == 400 and "finite" in error["message"], error
    status, error = post(server, "/v1/completions", {"model": "m", "prompt": "a", "max_completion_tokens": 5000})
    assert status == 400 and error["param"] == "max_completion_tokens" and "max_completion_tokens is 5000" in \
        error["message"], error
    status, error = post(server, "/v1/completions", content='{"model": "m", "prompt": "é"}'.encode("latin-1"))
    assert status == 400 and "not valid JSON" in error["message"] and "UTF-8" in error["message"], error


def test_echo_of_token_ids_is_the_decoded_prompt(server):
    body = {"model": "m", "max_tokens": 3, "temperature": 0, "echo": True}
    as_text = httpx.post(server["url"] + "/v1/completions", json={**body, "prompt": "ab cd"}).json()
    ids = server["tokenizer"].encode("ab cd")
    as_ids = httpx.post(server["url"] + "/v1/completions", json={**body, "prompt": [ids, ids]}).json()
    assert as_text["choices"][0]["text"].startswith("ab cd")
    assert [c["text"] for c in as_ids["choices"]] == [as_text["choices"][0]["text"]] * 2


def test_echo_of_a_truncated_prompt_is_the_part_the_model_was_given(server):
    """With "truncate", echo gave the whole prompt as sent while its logprobs covered the kept
    tail (their tokens did not join to the text, their text_offset started at 0 on the tail):
    the echo is now the tail, and the tokens join to the text."""
    prompt = "the quick brown fox jumps over the lazy dog " * 3  # 132 characters, context 64
    tail = prompt[-(CONTEXT - 5):]  # (5: max_tokens, the room kept for the reply)
    ids = server["tokenizer"].encode(prompt)
    for given in (prompt, ids):
        for stream in (False, True):
            body = {"model": "m", "prompt": given, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 1,
                    "truncate": True, "stream": stream}
            reply = httpx.post(server["url"] + "/v1/completions", json=body)
            events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
            choices = [e["choices"][0] for e in events] if stream else reply.json()["choices"]
            text = "".join(c["text"] for c in choices)
            tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
            offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
            assert text.startswith(tail) and len(text) == len(tail) + 5, (given, stream, text)
            assert "".join(tokens) == text and offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_an_oversized_chunked_body_is_a_413(server):
    def chunks():  # no Content-Length: the size is known only as the body arrives
        for _ in range(11):
            yield b" " * 100_000

    status, error = post(server, "/v1/completions", content=chunks())
    assert status == 413 and error["type"] == "invalid_request_error" and "larger than" in error["message"]


def test_a_body_of_exactly_the_size_cap_is_read_and_one_byte_more_is_a_413(server):
    from frawdllm.serve.options import ServeOptions

    cap = ServeOptions().max_body_bytes
    body = json.dumps({"model": "m", "prompt": "ab", "max_tokens": 1}).encode()
    body += b" " * (cap - len(body))  # (JSON allows trailing whitespace)

    def chunked(data):  # no Content-Length: counted as it arrives
        for start in range(0, len(data), 100_000):
            yield data[start:start + 100_000]

    for sent in (lambda data: data, chunked):
        status, _ = post(server, "/v1/completions", content=sent(body))
        assert status == 200
        status, error = post(server, "/v1/completions", content=sent(body + b" "))
        assert status == 413 and f"larger than {cap} bytes" in error["message"]


def test_body_and_method_errors_say_what_is_wrong(server):
    status, error = post(server, "/v1/completions", content=b'{"model": "m", prompt}')
    assert status == 400 and error["param"] is None
    assert error["message"] == "the request body is not valid JSON: Expecting property name enclosed in double " \
                               "quotes at character 15", error
    # a raw control character: the message ended "Invalid control character at" (where, it did not say)
    status, error = post(server, "/v1/completions", content=b'{"model":"m","prompt":"hi\x00","max_tokens":3}')
    assert error["message"] == "the request body is not valid JSON: Invalid control character at character 25"
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # (curl -d without -H)
    status, error = post(server, "/v1/completions", content=b'{"model": "m", "prompt": "ab"}', headers=form)
    assert status == 400 and "Content-Type: application/json" in error["message"], error
    status, error = post(server, "/v1/completions", content=b'{"model": "m", "prompt": "ab"}', headers={})
    assert status == 400 and "Content-Type: application/json" in error["message"], error
    status, error = post(server, "/v1/completions", content=b'["m", "ab"]')
    assert status == 400 and "JSON object" in error["message"], error
    wrong = httpx.get(server["url"] + "/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
    assert wrong.headers["allow"] == "POST"  # (HTTP requires it with a 405)
    # a trailing slash is another route: a 404, not a redirect to a URL built from the Host header
    slash = httpx.post(server["url"] + "/v1/completions/", headers={**JSON, "Host": "evil.example"},
                       content=b'{"model": "m", "prompt": "ab"}')
    assert slash.status_code == 404 and "location" not in slash.headers, slash.headers
    assert slash.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.timeout(60)
def test_a_client_that_leaves_cancels_its_non_streaming_request(server):
    """A non-streaming request whose client times out stops generating (its row is freed)
    and is logged and counted as 499 cancelled."""
    before = counted(server, "/v1/chat/completions", 499)
    body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000,
            "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server["url"] + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.time() + 3  # (1000 tokens take over 5 s)
    while httpx.get(server["url"] + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(server["url"] + "/health").json()["running"] == 0
    record = next(r for r in reversed(server["log"].records) if r["path"] == "/v1/chat/completions")
    assert record["status"] == 499 and record["cancelled"] and record["completion_tokens"] < 1000, record
    assert counted(server, "/v1/chat/completions", 499) == before + 1


def test_a_client_that_leaves_mid_body_is_logged_499_not_400(server):
    """A body cut short by the client's disconnect is no malformed request: 499, as a
    stream its client left (a complete but malformed body stays a 400)."""
    before = counted(server, "/v1/completions", 499)
    records = server["log"].records
    seen = len(records)
    host, port = server["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n" + b'{"model": "m", "prompt": "ab')
        time.sleep(0.2)  # (the server has the partial body before the socket closes)
    deadline = time.time() + 5
    while not [r for r in records[seen:] if r["path"] == "/v1/completions"] and time.time() < deadline:
        time.sleep(0.01)
    record = [r for r in records[seen:] if r["path"] == "/v1/completions"][-1]
    assert record["status"] == 499, record
    assert counted(server, "/v1/completions", 499) == before + 1
    status, error = post(server, "/v1/completions", content=b'{"model": "m", "prompt": "ab')
    assert status == 400, error


# ---- the command ---------------------------------------------------------------------------------
def one_line_error(capsys, *args) -> str:
    code, _, err = run_cli(capsys, "serve", *args)
    assert code == 1 and len(err.strip().splitlines()) == 1, (code, err)
    return err.strip()


def test_serve_refuses_a_port_in_use_in_one_line(capsys, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = one_line_error(capsys, "--model", tmp_path / "m", "--port", port)
    assert err.startswith(f"frawd: error: cannot listen on 127.0.0.1:{port}: ") and "in use" in err, err
    err = one_line_error(capsys, "--model", tmp_path / "m", "--host", "192.0.2.1")  # (no machine's own)
    assert err.startswith("frawd: error: cannot listen on 192.0.2.1:8000: "), err


def test_serve_refuses_a_port_out_of_range(capsys, tmp_path):
    code, _, err = run_cli(capsys, "serve", "--model", tmp_path / "m", "--port", 99999)
    assert code == 2 and "--port" in err and "99999" in err, err


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_serve_refuses_a_send_timeout_that_is_not_finite(capsys, tmp_path, value):
    """nan passes every range (its comparisons are all false) and reached loop.call_later."""
    code, _, err = run_cli(capsys, "serve", "--model", tmp_path / "m", "--send-timeout", value)
    assert (code, err) == (2, f"frawd: error: Invalid value for '--send-timeout': {value} is not a finite number "
                              "(see frawd serve --help)\n")


def test_serve_refuses_a_default_above_the_cap(capsys, tmp_path):
    err = one_line_error(capsys, "--model", tmp_path / "m", "--default-max-tokens", 500, "--max-tokens", 100)
    assert "--default-max-tokens 500" in err and "--max-tokens 100" in err, err
    from frawdllm.cli.serve import default_tokens

    assert default_tokens(None, 1024) == 256 and default_tokens(None, 128) == 128  # a lower cap alone is fine
    assert default_tokens(100, 100) == 100


def test_serve_refuses_an_empty_api_key_from_the_environment(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FRAWD_API_KEY", "")
    from_env = one_line_error(capsys, "--model", tmp_path / "m")
    monkeypatch.delenv("FRAWD_API_KEY")
    from_flag = one_line_error(capsys, "--model", tmp_path / "m", "--api-key", "")
    assert from_env == from_flag and "API key is empty" in from_env, from_env


@pytest.mark.parametrize("key", ["secret ", " secret", "sécret", "sec\tret"])
def test_serve_refuses_an_api_key_no_client_could_send(capsys, tmp_path, key):
    """HTTP trims a header's spaces and clients send ASCII: such a key would make every
    request a 401."""
    error = one_line_error(capsys, "--model", tmp_path / "m", "--api-key", key)
    assert "printable ASCII without leading or trailing spaces" in error, error


def test_nulls_openai_allows_mean_the_defaults(server):
    """OpenAI declares n, stream, echo and prompt nullable (generated clients send nulls)."""
    base = {"model": "m", "max_tokens": 3, "temperature": 0}
    status, plain = post(server, "/v1/completions", {**base, "prompt": "ab"})
    assert status == 200
    status, nulls = post(server, "/v1/completions", {**base, "prompt": "ab", "n": None, "stream": None,
                                                     "echo": None})
    assert status == 200 and [c["text"] for c in nulls["choices"]] == [c["text"] for c in plain["choices"]]
    status, empty = post(server, "/v1/completions", {**base, "prompt": ""})
    status_null, null = post(server, "/v1/completions", {**base, "prompt": None})
    assert (status, status_null) == (200, 200) and null["choices"][0]["text"] == empty["choices"][0]["text"]
    chat = {**base, "messages": [{"role": "user", "content": "hi"}]}
    assert post(server, "/v1/chat/completions", {**chat, "n": None, "stream": None})[0] == 200
    # our "truncate" too, as its neighbours top_k, min_p... ("Input should be a valid boolean")
    assert post(server, "/v1/completions", {**base, "prompt": "ab", "truncate": None})[0] == 200
    assert post(server, "/v1/chat/completions", {**chat, "truncate": None})[0] == 200


def test_any_int64_seed_and_top_p_zero_are_taken(server):
    """OpenAI's seed is any int64 (-1 is a common sentinel); top_p 0 keeps the likeliest token."""
    base = {"model": "m", "prompt": "ab", "max_tokens": 6}
    texts = [post(server, "/v1/completions", {**base, "seed": seed, "temperature": 1.0})[1]["choices"][0]["text"]
             for seed in (-1, -1, -(2**63))]
    assert texts[0] == texts[1]
    greedy = post(server, "/v1/completions", {**base, "temperature": 0})[1]["choices"][0]["text"]
    status, top_p_zero = post(server, "/v1/completions", {**base, "temperature": 1.0, "top_p": 0})
    assert status == 200 and top_p_zero["choices"][0]["text"] == greedy


def test_a_generation_that_fails_mid_stream_says_so_in_the_stream():
    """The 200 and the first tokens had gone out: the error became an "internal error"
    traceback in the server's log, and the client got a stream that just stopped (no error,
    no [DONE])."""
    engine = test_engine(*varied_model(context_length=CONTEXT))
    forward, calls = engine.forward, []

    def failing_forward(*args):
        calls.append(1)
        if len(calls) > 3:  # the prefill and a few decode steps, then a failure
            raise RuntimeError("the device went away")
        return forward(*args)

    engine.forward = failing_forward
    with live_server({"m": engine}, ServeOptions()) as url:
        reply = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 20,
                                                          "temperature": 0, "stream": True}, timeout=30)
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert reply.status_code == 200 and events[-1] == "[DONE]", reply.text
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "the device went away" in error["message"], error
        assert any("choices" in json.loads(e) for e in events[:-2]), events  # (tokens had gone out first)
        assert httpx.get(url + "/health").status_code == 200


def test_a_requests_own_sampling_values_win_over_the_models_file():
    """generation_config.json fills only what a request leaves out: an explicit `stop: []`
    (no stop strings) and an explicit top_k keep their values; every int64 seed is a seed
    of its own (negative ones distinct from every positive one)."""
    from frawdllm.serve.options import ServeOptions
    from frawdllm.serve.prompts import _params
    from frawdllm.serve.schemas import CompletionRequest

    options, file = ServeOptions(), {"stop": ("\n",), "top_k": 40, "temperature": 0.5}
    left_out = _params(CompletionRequest(model="m", prompt="hi"), 8, options, file)
    assert (left_out.stop, left_out.top_k, left_out.temperature) == (("\n",), 40, 0.5)
    given = _params(CompletionRequest(model="m", prompt="hi", stop=[], top_k=5, temperature=0.7), 8, options, file)
    assert (given.stop, given.top_k, given.temperature) == ((), 5, 0.7)
    given = (-1, -5, 5, 2**63 - 1, -(2**63))  # (mod 2**63, -1 and 2**63 - 1 drew the same text)
    seeds = [_params(CompletionRequest(model="m", prompt="hi", seed=seed), 8, options).seed for seed in given]
    assert seeds == [2**64 - 1, 2**64 - 5, 5, 2**63 - 1, 2**63]


def test_max_completion_tokens_wins_over_max_tokens_and_the_default_fits_the_context(server):
    """The newer name wins (a request holding both got max_tokens' count under a swap), a
    max_tokens over the cap beside a valid max_completion_tokens is not read, and without
    either a reply is at most the context long (not the server's default of more)."""
    from frawdllm.serve.errors import ApiError
    from frawdllm.serve.options import ServeOptions
    from frawdllm.serve.prompts import _max_new
    from frawdllm.serve.schemas import ChatCompletionRequest, CompletionRequest

    engine = test_engine(*varied_model(context_length=CONTEXT))
    options = ServeOptions(max_tokens=100, default_max_tokens=256)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert _max_new(ChatCompletionRequest(**chat, max_tokens=8, max_completion_tokens=3), options, engine) == 3
    assert _max_new(ChatCompletionRequest(**chat, max_tokens=5000, max_completion_tokens=3), options, engine) == 3
    assert _max_new(ChatCompletionRequest(**chat, max_tokens=8), options, engine) == 8
    with pytest.raises(ApiError, match="max_completion_tokens is 101; this server allows at most 100"):
        _max_new(ChatCompletionRequest(**chat, max_completion_tokens=101), options, engine)
    assert _max_new(CompletionRequest(model="m", prompt="hi"), options, engine) == CONTEXT
    assert _max_new(CompletionRequest(model="m", prompt="hi"), ServeOptions(default_max_tokens=16), engine) == 16
    status, body = post(server, "/v1/chat/completions", {**chat, "max_tokens": 8, "max_completion_tokens": 3,
                                                          "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] <= 3


def test_chat_with_a_model_whose_tokenizer_has_no_role_tokens_is_not_a_context_error():
    """Its 400 said code "context_length_exceeded" (clients shorten and retry on it) and
    "this tokenizer"; completions still work."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    from frawdllm import FrawdLLM, get_config
    from frawdllm.tokenizer import Tokenizer

    letters = "abcdefghijklmnopqrstuvwxyz "
    plain = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(letters)}, unk_token="a"))
    plain.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    model = FrawdLLM(get_config("tiny", vocab_size=len(letters), n_layer=1, n_embd=16, n_head=2, context_length=32))
    with live_server({"plain": test_engine(model, Tokenizer(plain))}, ServeOptions()) as url:
        chat = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        completion = httpx.post(url + "/v1/completions", timeout=30,
                                json={"model": "plain", "prompt": "hi", "max_tokens": 2})
    error = chat.json()["error"]
    assert chat.status_code == 400 and (error["code"], error["param"]) == ("model_not_chat_capable", "model")
    assert error["message"].startswith("model 'plain' cannot chat: its tokenizer lacks FrawdLLM's role tokens")
    assert completion.status_code == 200, completion.text
