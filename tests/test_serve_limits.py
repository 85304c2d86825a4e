"""`frawd serve` against hostile or careless clients: scoring requests count against the
same caps as generation and stop for a client that left; pipelined requests whose client
closes are cancelled and free their place; a header or a body that never ends is refused;
large logprob replies are built off the event loop; a client that stops reading loses its
place after the send timeout, and one that leaves is logged as cancelled."""

import asyncio
import gc
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from frawdllm.serve import ServeOptions, create_app
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)
from serve_helpers import LOOP_THREAD, AccessLog, asgi_post, live_server, test_engine
from test_scheduler import varied_model

SCORE = {"model": "m", "prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1}


@pytest.fixture
def access_log():
    log = AccessLog()
    logger = logging.getLogger("frawdllm.serve.access")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    yield log.records
    logger.removeHandler(log)


def paced_engine(context_length=1024):
    """~200 decode steps/s: a long reply is still running when its client leaves."""
    engine = test_engine(*varied_model(context_length=context_length))
    forward = engine.forward

    def paced_forward(*args):
        time.sleep(0.005)
        return forward(*args)

    engine.forward = paced_forward
    return engine


def gated_scoring(engine):
    """Makes `engine.prompt_logprobs` wait for the returned gate (a threading.Event) and
    count its calls in the returned list."""
    gate, calls = threading.Event(), []
    score = engine.prompt_logprobs

    def gated(ids, k):
        calls.append(ids)
        assert gate.wait(10)
        return score(ids, k)

    engine.prompt_logprobs = gated
    return gate, calls


def wait_until(condition, seconds=5.0):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def in_background(url, body, timeout=30):
    """POSTs `body` to /v1/completions on a thread; returns (thread, result list)."""
    result = []

    def post():
        try:
            result.append(httpx.post(url + "/v1/completions", json=body, timeout=timeout))
        except httpx.TimeoutException as error:
            result.append(error)

    thread = threading.Thread(target=post)
    thread.start()
    return thread, result


def raw_post(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(data) + data)


def read_reply(sock: socket.socket, seconds: float = 5.0) -> bytes:
    """What the server sends until it closes the connection (or `seconds` pass)."""
    sock.settimeout(seconds)
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return reply


# ---- scoring requests -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_scoring_counts_against_the_in_flight_cap_and_the_queue():
    """A prompt forward (max_tokens 0 with echo, or echo with logprobs) ran in a thread of its
    own before the request was counted: 10 at once got 200 against --max-in-flight 4. Now a
    model's scoring requests take turns, at most --max-queue waiting, and count as open."""
    engine = paced_engine()
    gate, calls = gated_scoring(engine)
    with live_server({"m": engine}, ServeOptions(max_in_flight=3, max_queue=1, max_tokens=1000)) as url:
        running, running_reply = in_background(url, SCORE)
        wait_until(lambda: len(calls) == 1)
        waiting, waiting_reply = in_background(url, SCORE)
        wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 1)
        for body in (SCORE, {**SCORE, "max_tokens": 2}):  # (echo with logprobs scores the prompt first)
            full = httpx.post(url + "/v1/completions", json=body, timeout=5)
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
            assert "scoring requests are waiting" in full.json()["error"]["message"]
        with httpx.stream("POST", url + "/v1/completions", timeout=10,
                          json={"model": "m", "prompt": "a", "max_tokens": 1000, "stream": True,
                                "temperature": 0}) as stream:  # (greedy never ends early)
            lines = stream.iter_lines()  # (kept: an iterator dropped closes the response)
            next(lines)  # three requests are open now
            for body in (SCORE, {"model": "m", "prompt": "a", "max_tokens": 2}):
                busy = httpx.post(url + "/v1/completions", json=body, timeout=5)
                assert busy.status_code == 429 and busy.json()["error"]["code"] == "too_many_requests", busy.text
        gate.set()
        for thread in (running, waiting):
            thread.join(30)
        assert [r.status_code for r in running_reply + waiting_reply] == [200, 200]
        assert len(calls) == 2  # the refused ones never ran a forward


@pytest.mark.timeout(60)
def test_a_scoring_request_whose_client_left_runs_no_further_forward(access_log):
    """Ten scoring requests whose clients gave up kept the model busy for ~20 s: a request
    whose client left stops before its next prompt, and one still waiting never starts."""
    engine = test_engine(*varied_model())
    gate, calls = gated_scoring(engine)
    three = {**SCORE, "prompt": ["abc", "bca", "cab"]}
    with live_server({"m": engine}, ServeOptions()) as url:
        running, running_reply = in_background(url, three, timeout=0.5)  # in its first prompt's forward
        wait_until(lambda: len(calls) == 1)
        waiting, waiting_reply = in_background(url, three, timeout=0.5)
        with_generation, generation_reply = in_background(url, {**three, "max_tokens": 5}, timeout=0.5)
        for thread in (running, waiting, with_generation):
            thread.join(10)
        assert all(isinstance(r, httpx.TimeoutException) for r in running_reply + waiting_reply + generation_reply)
        wait_until(lambda: len([r for r in access_log if r["path"] == "/v1/completions"]) == 3)
        gate.set()
        assert httpx.post(url + "/v1/completions", json=SCORE, timeout=10).status_code == 200  # (after the rest)
        assert len(calls) == 2, calls  # the first prompt that had started, and the last request
        assert httpx.get(url + "/health").json() | {"models": None} == \
            {"status": "ok", "models": None, "running": 0, "waiting": 0}
    left = [r for r in access_log if r["path"] == "/v1/completions"][:3]
    assert all(r["status"] == 499 and r["cancelled"] and r["model"] == "m" for r in left), left


# ---- pipelined requests -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_pipelined_requests_whose_client_closes_are_cancelled(access_log, caplog, stream):
    """Two requests on one connection, then the client closes: uvicorn's httptools parser told
    only the second (not started) that the client left, so the first generated to max_tokens,
    was logged 200 with a RuntimeError traceback, and held its in-flight place until the
    garbage collector ran (a later 429 said 1 request was open with none)."""
    engine = paced_engine()
    with live_server({"m": engine}, ServeOptions(max_in_flight=1, max_tokens=1000)) as url:
        host, port = url.removeprefix("http://").split(":")
        request = raw_post({"model": "m", "prompt": "a", "max_tokens": 1000, "stream": stream, "temperature": 0})
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request + request)
            wait_until(lambda: httpx.get(url + "/health").json()["running"] == 1)
        wait_until(lambda: httpx.get(url + "/health").json()["running"] == 0, 2)  # (1000 tokens: 5 s)
        wait_until(lambda: any(r["path"] == "/v1/completions" for r in access_log), 2)
        reply = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2}, timeout=5)
        assert reply.status_code == 200, reply.text  # (its in-flight place was given back)
    first = next(r for r in access_log if r["path"] == "/v1/completions")
    assert first["status"] == 499 and first["cancelled"] and first["completion_tokens"] < 1000, first
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.timeout(60)
def test_a_failed_write_cancels_the_request_and_frees_its_place(access_log, caplog):
    """Where a write to a closed connection raises (uvicorn on httptools and uvloop:
    RuntimeError "unable to perform operation on <TCPTransport closed=True>") and no
    disconnect is ever received, the request is ended as a disconnect at once: its row
    leaves, its place is free without the garbage collector, the log says 499."""
    app = create_app({"m": paced_engine()}, ServeOptions(max_in_flight=1, max_tokens=1000))

    async def call(body: dict, fail_after: int | None) -> list:
        data, sent = json.dumps(body).encode(), []
        scope = asgi_post(data)
        messages = [{"type": "http.request", "body": data, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # (never a disconnect: the pipelined case)

        async def send(message):
            if fail_after is not None and len(sent) >= fail_after:
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True reading=False>; "
                                   "the handler is closed")
            sent.append(message)

        await app(scope, receive, send)
        return sent

    async def main():
        health = next(r for r in app.routes if getattr(r, "path", "") == "/health").endpoint
        async with app.router.lifespan_context(app):
            for stream, fail_after in [(True, 2), (False, 0)]:  # after the first event; at the reply's head
                body = {"model": "m", "prompt": "a", "max_tokens": 1000 if stream else 50, "stream": stream,
                        "temperature": 0}
                await asyncio.wait_for(call(body, fail_after), 10)  # (returns: no exception for the server)
                deadline = time.time() + 1  # (the row leaves at the scheduler's next step)
                while (await health())["running"] and time.time() < deadline:
                    await asyncio.sleep(0.01)
                assert (await health())["running"] == 0
                sent = await call({"model": "m", "prompt": "a", "max_tokens": 2}, None)  # max_in_flight is 1
                assert sent[0]["status"] == 200, sent

    gc.disable()  # (the place must come back without the collector)
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    statuses = [r["status"] for r in access_log]
    assert statuses == [499, 200, 499, 200], access_log
    assert access_log[0]["cancelled"] and access_log[0]["completion_tokens"] < 1000
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# ---- headers and bodies that never end ----------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server():
    with live_server({"m": test_engine(*varied_model())}, ServeOptions(body_timeout=0.3, min_body_rate=64)) as url:
        host, port = url.removeprefix("http://").split(":")
        yield url, (host, int(port))


@pytest.mark.timeout(60)
def test_a_header_past_the_limit_is_refused_not_buffered(small_server):
    """One header line that never ended was buffered whole (300 MB: +330 MB of memory, the
    event loop stalled for seconds). Past 64 KiB of request head the server answers 400 and
    closes; a 32 KiB header (a big cookie) still passes."""
    url, address = small_server
    cookie = "c=" + "x" * 32 * 1024
    assert httpx.get(url + "/health", headers={"Cookie": cookie}).status_code == 200
    with socket.create_connection(address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        try:
            for _ in range(16):  # 16 MiB unless the server stops reading
                sock.sendall(b"a" * (1 << 20))
        except OSError:
            pass  # (the server closed the connection)
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]


@pytest.mark.timeout(60)
def test_a_stalled_body_is_a_408_and_a_slow_one_passes(small_server):
    """A body that stops coming was held forever (and held a SIGTERM drain for its full
    120 s): after `body_timeout` seconds without a byte the request is a 408 error object."""
    url, address = small_server
    body = json.dumps({"model": "m", "prompt": "ab", "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    with socket.create_connection(address) as sock:
        sock.sendall(head + body[:10])
        start = time.time()
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert time.time() - start < 3
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "invalid_request_error" and "stalled" in error["message"], error
    with socket.create_connection(address) as sock:  # pieces 0.1 s apart: each within the limit
        sock.sendall(head.replace(b"Host: x", b"Host: x\r\nConnection: close"))  # (closed after the reply)
        for start in range(0, len(body), 16):
            time.sleep(0.1)
            sock.sendall(body[start:start + 16])
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    # a byte every 0.1 s: no gap reaches body_timeout, yet such a body held a SIGTERM drain for
    # its full 120 s; past body_timeout it must average min_body_rate (64 bytes/s here)
    with socket.create_connection(address) as sock:
        sock.sendall(head)
        start = time.time()
        try:
            for byte in body:
                time.sleep(0.1)
                sock.sendall(bytes([byte]))
        except OSError:
            pass  # (the server answered and closed)
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert time.time() - start < 2.5
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert "slower than 64 bytes/s" in error["message"], error


# ---- large replies ----------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_logprob_replies_are_built_off_the_event_loop(small_server, monkeypatch):
    """An 11 MB logprob reply (n=8, echo, logprobs=5 over 32 prompts of 250 tokens) was built
    and serialised on the event loop, stalling every stream and /health for ~1 s. The
    logprob entries of a whole reply, a scoring reply and a stream's echoed prompt are now
    built on a worker thread."""
    url, _ = small_server
    from frawdllm.serve import replies

    threads = []
    name = replies._completion_token  # (each logprob entry's token, named)

    def recorded(tokenizer, token):
        threads.append(threading.current_thread().name)
        return name(tokenizer, token)

    monkeypatch.setattr(replies, "_completion_token", recorded)
    base = {"model": "m", "prompt": ["abc", "cab"], "n": 2, "echo": True, "logprobs": 2, "temperature": 0}
    for body in ({**base, "max_tokens": 3}, {**base, "max_tokens": 0}, {**base, "max_tokens": 1, "stream": True}):
        threads.clear()
        reply = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert reply.status_code == 200, reply.text
        assert threads and LOOP_THREAD not in threads[:2 * 2 * 3], (body, threads)  # (the echoed prompts' tokens)


# ---- clients that stop reading ------------------------------------------------------------------------
BIG_STREAM = {"model": "m", "prompt": "abcdefg" * 30, "max_tokens": 5, "n": 8, "echo": True, "logprobs": 5,
              "stream": True}  # (~250 KB of events, past the buffers of a send_buffer=4096 server)


def stalled_client(address, body: dict) -> socket.socket:
    """A connection that sends `body`, reads the reply's status line, then nothing more (with
    a 2 KB receive window: the server's buffers fill)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.settimeout(10)
    sock.connect(address)
    sock.sendall(raw_post(body))
    assert sock.recv(12, socket.MSG_WAITALL) == b"HTTP/1.1 200"
    return sock


def generated_whole(url: str) -> bool:
    """Whether the server's requests were all submitted (their prompt tokens counted) and
    generated to their end."""
    submitted = 'frawd_prompt_tokens_total{model="m"}' in httpx.get(url + "/metrics").text
    health = httpx.get(url + "/health").json()
    return submitted and health["running"] == health["waiting"] == 0


def address_of(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.mark.timeout(60)
def test_a_client_that_takes_no_bytes_is_closed_after_the_send_timeout(access_log, caplog):
    """Streams to clients that never read held their --max-in-flight places after generation
    had ended (every new request a 429, /health saying nothing runs) and a SIGTERM drain for
    as long as the clients kept their sockets open. A connection whose client takes no bytes
    for `send_timeout` seconds is now closed: its request is cancelled (499) and its place
    free, and a shutdown waits no longer for it."""
    engine = test_engine(*varied_model(context_length=1024))
    sockets = []
    try:
        with live_server({"m": engine}, ServeOptions(max_in_flight=1, send_timeout=0.5), send_buffer=4096) as url:
            sockets.append(stalled_client(address_of(url), BIG_STREAM))  # holds the one place
            small = {"model": "m", "prompt": "a", "max_tokens": 2}
            wait_until(lambda: httpx.post(url + "/v1/completions", json=small).status_code == 200)
            sockets.append(stalled_client(address_of(url), BIG_STREAM))
            start = time.time()  # (leaving the block stops the server: it drains open requests)
        assert time.time() - start < 3
    finally:
        for sock in sockets:
            sock.close()
    stalled = [r for r in access_log if r["path"] == "/v1/completions" and r["prompt_tokens"] > 1]
    assert [(r["status"], r["cancelled"]) for r in stalled] == [(499, True)] * 2, stalled
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.timeout(60)
def test_a_stream_whose_client_closed_without_reading_is_logged_and_counted_cancelled(access_log, monkeypatch):
    """A client that read nothing of a reply generated whole, then closed, was logged and
    counted in /metrics as a 200 with every token and finish "stop": the stream, cancelled
    while it waited (here for its echoed prompt's logprobs, built on a worker thread), had
    all its jobs done. (A stream waiting for a write: the test above.)"""
    from frawdllm.serve import replies

    release, name = threading.Event(), replies._completion_token  # (each logprob entry's token, named)
    monkeypatch.setattr(replies, "_completion_token", lambda *args: release.wait(5) and name(*args))
    engine = test_engine(*varied_model(context_length=1024))
    try:
        with live_server({"m": engine}, ServeOptions()) as url:
            with stalled_client(address_of(url), BIG_STREAM):
                wait_until(lambda: generated_whole(url))
            wait_until(lambda: any(r["path"] == "/v1/completions" for r in access_log))
            release.set()  # (the worker thread: the server waits for it when it stops)
            metrics = httpx.get(url + "/metrics").text
    finally:
        release.set()
    record = next(r for r in access_log if r["path"] == "/v1/completions")
    assert record["status"] == 499 and record["cancelled"], record
    assert 'frawd_requests_total{path="/v1/completions",status="499"} 1.0' in metrics
    assert 'path="/v1/completions",status="200"' not in metrics


@pytest.mark.timeout(60)
def test_a_generation_request_beyond_the_queue_is_a_429_queue_full():
    """One request decoding (--max-batch 1) and one waiting (--max-queue 1): the next is a 429
    `queue_full` (the scheduler's QueueFull), and the two before it complete."""
    engine = paced_engine()
    long = {"model": "m", "prompt": "a", "max_tokens": 200, "temperature": 0}
    with live_server({"m": engine}, ServeOptions(max_batch=1, max_queue=1, max_tokens=1000)) as url:
        running, running_reply = in_background(url, long)
        wait_until(lambda: httpx.get(url + "/health").json()["running"] == 1)
        waiting, waiting_reply = in_background(url, long)
        wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 1)
        full = httpx.post(url + "/v1/completions", json={**long, "max_tokens": 2}, timeout=5)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
        for thread in (running, waiting):
            thread.join(30)
        assert [r.status_code for r in running_reply + waiting_reply] == [200, 200]
