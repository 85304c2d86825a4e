"""The HTTP layer: an OpenAI-compatible API over one `Scheduler` per model.

    app = create_app({"tiny": engine}, ServeOptions(api_key="..."))
    uvicorn.Server(server_config(app, host="127.0.0.1", port=8000)).run()

Routes: POST /v1/chat/completions and /v1/completions (JSON, or server-sent events ending
in `data: [DONE]` with "stream": true), GET /v1/models, /health, /metrics (Prometheus) and
/ (the chat page in `static/`). Everything about generation lives in
`frawdllm.infer.scheduler` (prompt scoring, `echo` with `logprobs`, is one PyTorch forward
per prompt on `_Scorer`'s thread, beside the scheduler); this module turns requests into prompts and `SamplingParams`,
scheduler chunks into OpenAI's bodies, and enforces the limits:

- an API key (`Authorization: Bearer KEY`, compared in constant time) on /v1/*;
- bodies over `max_body_bytes` are a 413, a body that stalls a 408, more than
  `max_in_flight` open requests or a full queue (a scheduler's, or a model's scoring
  queue) a 429, `max_tokens` and `n` above their caps a 400;
- every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`;
- a client that goes away cancels its request (its batch row is freed at the next step, a
  scoring request's next forward is not run), and so does one that takes no bytes of its
  reply for `send_timeout` seconds (`server_config` closes its connection);
- one JSON access-log line per request (logger "frawdllm.serve.access").
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import functools
import hmac
import json
import logging
import math
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import FrawdError, check_unicode
from ..infer.chat import ROLE_TOKEN_IDS, fit_history, reply_reserve
from ..infer.engine import Engine, StreamChunk
from ..infer.sampling import MIN_TEMPERATURE, SamplingParams, TokenLogprob
from ..infer.scheduler import Closed, QueueFull, Request as Job, Scheduler
from ..infer.textstream import open_character_tail
from .schemas import MAX_STOP, ChatCompletionRequest, CompletionRequest

access_log = logging.getLogger("frawdllm.serve.access")


@dataclass
class ServeOptions:
    """The server's limits (`frawd serve`'s flags): per model, and for the whole process."""

    api_key: str | None = None
    max_batch: int = 32  # rows decoded together, per model
    max_queue: int = 256  # requests waiting for a row, per model
    max_in_flight: int = 512  # open requests (waiting, running or streaming), all models
    max_tokens: int = 1024  # cap on max_tokens
    default_max_tokens: int = 256  # when a request gives none
    max_n: int = 8  # cap on n
    max_body_bytes: int = 1 << 20
    body_timeout: float = 10.0  # seconds a request body may go without a byte: then a 408
    min_body_rate: int = 1024  # bytes/s a body must average once it has taken body_timeout seconds (0: any rate)
    send_timeout: float = 30.0  # seconds a client may take no bytes of a reply: then its connection is closed


# The request line and headers together (uvicorn's h11 parser refuses more with a 400).
MAX_HEAD_BYTES = 64 * 1024


def server_config(app: Any, **settings: Any) -> Any:
    """uvicorn's settings for `app` (made by `create_app`), for `frawd serve` and the tests
    alike. The h11 parser, not httptools: httptools buffers a header of any size (a
    never-ending one grew the server by 330 MB and stalled the event loop), and it lets a
    client that closes under pipelined requests go unnoticed (uvicorn tells only the last
    request, which never started, so the first generated to max_tokens). h11 costs ~3 us
    more CPU per streamed event and ~75 us per request (docs/serving.md)."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    send_timeout = app.state.options.send_timeout

    class Protocol(H11Protocol):
        """h11, and a connection whose client takes no bytes for `send_timeout` seconds is
        closed. Its reply waits for room in the full write buffer: it held its place under
        --max-in-flight (and a SIGTERM drain) for as long as the client kept the socket open.
        Closed, the request sees a disconnect and ends as cancelled (499)."""

        stalled: asyncio.TimerHandle | None = None

        def pause_writing(self) -> None:  # (the transport's buffer is full)
            super().pause_writing()
            self._unstall()
            self.stalled = self.loop.call_later(send_timeout, self.transport.abort)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._unstall()

        def connection_lost(self, exc: Exception | None) -> None:
            self._unstall()
            super().connection_lost(exc)

        def _unstall(self) -> None:
            if self.stalled is not None:
                self.stalled.cancel()
                self.stalled = None

    return uvicorn.Config(app, http=Protocol, h11_max_incomplete_event_size=MAX_HEAD_BYTES, **settings)


# What a field of several forms takes, said when a value has none of them.
UNION_HELP = {
    "prompt": "must be a text, a list of token ids, or a list of texts or of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": 'must be a string or a list of {"type": "text", "text": ...} parts (this server reads text only)',
    "tool_choice": 'must be a string or an object',
    "function_call": 'must be a string or an object',
}


def _is_type_name(part: str) -> bool:
    """Whether a pydantic error location part names one form of a union (`str`, `list[int]`...)."""
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list") or part.startswith("function-")


class ApiError(Exception):
    """An error answered with OpenAI's error object."""

    TYPES = {401: "authentication_error", 429: "rate_limit_error"}  # other 4xx: invalid_request_error

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class _Metrics:
    def __init__(self, models: dict[str, Scheduler]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("frawd_requests", "HTTP requests answered", ["path", "status"], registry=r)
        self.prompt_tokens = Counter("frawd_prompt_tokens", "Prompt tokens of accepted requests", ["model"],
                                     registry=r)
        self.generated = Counter("frawd_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("frawd_time_to_first_token_seconds", "Submit to first token", ["model"], registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.latency = Histogram("frawd_request_seconds", "Request duration", ["model"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        queue = Gauge("frawd_queue_depth", "Requests waiting for a batch row", ["model"], registry=r)
        running = Gauge("frawd_running_rows", "Rows in the running batch", ["model"], registry=r)
        rate = Gauge("frawd_tokens_per_second", "Tokens generated per second since the previous scrape", ["model"],
                     registry=r)
        for name, scheduler in models.items():
            queue.labels(name).set_function(lambda s=scheduler: s.queue_depth)
            running.labels(name).set_function(lambda s=scheduler: s.running)
            rate.labels(name).set_function(_Rate(scheduler))


class _Rate:
    """Tokens/s of a scheduler between two reads."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.last = scheduler, (time.perf_counter(), scheduler.generated_tokens)

    def __call__(self) -> float:
        now, count = time.perf_counter(), self.scheduler.generated_tokens
        (then, before), self.last = self.last, (now, count)
        return (count - before) / max(now - then, 1e-9)


class _Guard:
    """ASGI middleware: the API key on /v1/* (401, before the body is read: a request
    without the key learns nothing about its body), the body-size cap (413), a body that
    stalls (408), a write to a client that left (a disconnect, 499), and the access log."""

    def __init__(self, app: Any, max_body_bytes: int, body_timeout: float, min_body_rate: int, metrics: _Metrics,
                 api_key: str | None) -> None:
        self.app, self.max_body, self.body_timeout, self.min_rate = app, max_body_bytes, body_timeout, min_body_rate
        self.metrics, self.api_key = metrics, api_key

    def _key_ok(self, scope: dict) -> bool:
        if self.api_key is None or not scope["path"].startswith("/v1/"):
            return True
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, given = header.partition(" ")  # compared in constant time
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        scope.setdefault("state", {})["log"] = log = {}
        status = {"code": 0}
        received, body_done, body_cut, send_failed = 0, False, False, False
        body_start = 0.0  # (when the body's first read began)
        too_large = f"the request body is larger than {self.max_body} bytes"

        async def limited_receive() -> dict:
            nonlocal received, body_done, body_cut, body_start
            if body_done:  # (after the body, receive() waits for a disconnect: no time limit)
                message = await receive()
            else:
                # A body that stops coming would hold its connection, and a SIGTERM drain, forever;
                # one trickled a byte every few seconds too: past its first body_timeout seconds,
                # it must keep up min_body_rate on average.
                body_start = body_start or time.perf_counter()
                deadline = body_start + self.body_timeout + (received / self.min_rate if self.min_rate else math.inf)
                wait = min(self.body_timeout, deadline - time.perf_counter())
                try:
                    message = await asyncio.wait_for(receive(), max(wait, 0.0))
                except asyncio.TimeoutError:
                    why = (f"nothing came for {self.body_timeout:g} s" if wait >= self.body_timeout else
                           f"{received:,} bytes in {time.perf_counter() - body_start:.0f} s, slower than "
                           f"{self.min_rate:,} bytes/s")
                    raise StarletteHTTPException(  # (and close: the rest of the body may still come)
                        408, f"the request body stalled: {why}", headers={"Connection": "close"}) from None
            if message["type"] == "http.disconnect" and not body_done:
                body_cut = True  # the client left mid-body: 499, though FastAPI answers it as a 400
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > self.max_body:  # (a chunked body has no length header)
                    # an HTTPException: FastAPI turns any other error while reading a body into a 400
                    raise StarletteHTTPException(413, too_large)
            return message

        async def logged_send(message: dict) -> None:
            nonlocal send_failed
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            try:
                await send(message)
            except (OSError, RuntimeError) as error:  # (uvloop: RuntimeError on a closed transport)
                if isinstance(error, RuntimeError) and "closed" not in str(error):
                    raise
                send_failed = True  # the client is gone: unwind the request as a disconnect
                raise ClientDisconnect() from None

        try:
            length = dict(scope["headers"]).get(b"content-length")
            if not self._key_ok(scope):
                await ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key"
                               ).response({"WWW-Authenticate": "Bearer"})(scope, receive, logged_send)
            elif length is not None and (not length.isdigit() or int(length) > self.max_body):
                await ApiError(413, too_large).response()(scope, receive, logged_send)
            else:
                await self.app(scope, limited_receive, logged_send)
        except ClientDisconnect:
            if not send_failed:
                raise
            # (nothing left to answer: raised on, uvicorn would log it as a bug)
        except Exception:
            status["code"] = status["code"] or 500  # (answered by the last-resort handler, outside this middleware)
            raise
        finally:  # also when the client went away mid-stream (status 499, as nginx logs it)
            gone = body_cut or send_failed or "cancelled" in log
            self._log(scope, status["code"] if status["code"] and not gone else 499, start, log)

    def _log(self, scope: dict, status: int, start: float, log: dict) -> None:
        path = scope["path"]
        known = path if path in KNOWN_PATHS else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        self.metrics.requests.labels(known, str(status)).inc()
        if not access_log.isEnabledFor(logging.INFO):
            return
        client = scope.get("client") or ("-", 0)
        record = {"time": round(time.time(), 3), "client": client[0], "method": scope["method"], "path": path,
                  "status": status, "ms": round(1000 * (time.perf_counter() - start), 1), **log}
        access_log.info(json.dumps(record))


class _Delivery:
    """Scheduler chunks to the event loop's queues with one wake-up for all that arrive
    together: a decode step of 32 rows hands out 32 chunks, and waking the loop once per
    chunk (a write to its wake-up pipe, a pass of the loop) costs more than the chunk."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.lock = loop, threading.Lock()
        self.pending: list[tuple[asyncio.Queue, Any]] = []

    def listener(self, chunks: asyncio.Queue):
        """A scheduler listener that puts its items into `chunks`."""
        def put(item: Any) -> None:
            with self.lock:
                self.pending.append((chunks, item))
                if len(self.pending) > 1:
                    return  # a wake-up is already on its way
            self.loop.call_soon_threadsafe(self._flush)
        return put

    def _flush(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for chunks, item in pending:
            chunks.put_nowait(item)


def yield_to_the_engine() -> bool:
    """Keep the calling thread (the event loop's) from preempting the engine's threads when it
    wakes; returns whether that was possible (Linux).

    A step's HTTP work (formatting and sending its chunks) wakes this thread while the next
    forward runs on every core; Linux then preempted one of the forward's threads, and the
    others waited for it (at the forward's barriers when this was measured; now the others take
    its share of each phase, but the preempted thread's core is still lost to the forward
    meanwhile). Under SCHED_BATCH a thread keeps its share
    of the CPU (the same nice value, so other processes are not favoured over it) but does not
    preempt on wakeup: it runs when a core comes free, between forwards. On a 2-core Xeon
    (serve_load.py, `tiny`), one run after another: 1 client 1,210-1,300 -> 1,660-1,900
    tokens/s; servers with and without it side by side, levels interleaved (3 x 5 rounds):
    1 client above 1,440 tokens/s in 6 of 15 rounds against 3 of 15, medians 1,175-1,524
    against 1,218-1,302; 32 clients the same within noise (4,538-4,862 against 4,537-4,642).
    (nice 10 instead gave about the same, but lowers the thread against every other process.)"""
    if not (hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH")):
        return False
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return False
    return True


KNOWN_PATHS = {"/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"}


def create_app(engines: dict[str, Engine], options: ServeOptions | None = None,
               sampling: dict[str, dict[str, Any]] | None = None) -> FastAPI:
    """The API over `engines` (model name -> Engine), one scheduler each. `sampling`: per
    model, the sampling defaults of its generation_config.json (`load_generation_config`),
    which a request's own fields override (see `_params`)."""
    options = options or ServeOptions()
    if not engines:
        raise FrawdError("give at least one model")
    defaults = {name: _settings((sampling or {}).get(name) or {}) for name in engines}
    schedulers = {name: Scheduler(engine, max_batch=options.max_batch, max_queue=options.max_queue)
                  for name, engine in engines.items()}
    scorers = {name: _Scorer(engine, options.max_queue) for name, engine in engines.items()}
    metrics = _Metrics(schedulers)
    created = int(time.time())
    state = {"in_flight": 0}
    deliveries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> _Delivery

    async def lifespan(app: FastAPI):
        yield_to_the_engine()  # (lifespan runs on the event loop's thread)
        yield
        for scheduler in schedulers.values():  # uvicorn has waited for open requests (SIGTERM drain)
            await asyncio.to_thread(scheduler.close, True, 30.0)
        for scorer in scorers.values():
            scorer.pool.shutdown(wait=False)

    # (redirect_slashes off: POST /v1/completions/ is a 404, not a redirect built from the Host header)
    app = FastAPI(title="FrawdLLM", version="1", lifespan=lifespan, redirect_slashes=False,
                  description="An OpenAI-compatible API over FrawdLLM models, with continuous batching.")
    app.state.schedulers = schedulers
    app.state.options = options

    # ---- errors: OpenAI's object -----------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":  # (its "loc" is a character offset, not a field)
            reason = first.get("ctx", {}).get("error", "")  # (json's msg: "Invalid control character at")
            where = [p for p in first.get("loc", ()) if isinstance(p, int)]
            if where:
                reason = f"{reason.removesuffix(' at')} at character {where[0]}"
            return ApiError(400, f"the request body is not valid JSON: {reason}").response()
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        if not where:  # the body as a whole: missing, not an object, or not sent as JSON
            text = "the request body must be a JSON object"
            sent_as = request.headers.get("content-type")
            if "json" not in (sent_as or ""):
                text += f" sent with Content-Type: application/json (this one: {sent_as or 'none'})"
            return ApiError(400, text, code="invalid_value").response()
        message = first.get("msg", "invalid request")
        branch = next((i for i, part in enumerate(where) if _is_type_name(part)), None)
        if branch is not None:  # a field of several forms: pydantic names the form it tried first
            where = where[:branch]
            message = UNION_HELP.get(where[-1] if where else "", "has none of its accepted forms")
        field = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in where).lstrip(".")
        return ApiError(400, f"{field}: {message}", param=field, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 400 and error.detail == "There was an error parsing the body":
            return ApiError(400, "the request body is not valid JSON: not UTF-8 text, nested too deep, "
                                 "or a number too long").response()
        return ApiError(error.status_code, str(error.detail)).response(error.headers)  # (405: Allow)

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception) -> Response:
        if isinstance(error, ClientDisconnect):  # (under ASGI 2.4: a streaming client went away) no bug
            return Response(status_code=499)
        logging.getLogger("frawdllm.serve").exception("internal error")
        return ApiError(500, f"internal error: {type(error).__name__}").response()

    def scheduler_for(name: str) -> Scheduler:
        if name not in schedulers:
            raise ApiError(404, f"the model {name!r} does not exist; this server has {', '.join(schedulers)}",
                           param="model", code="model_not_found")
        return schedulers[name]

    # ---- routes ----------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files(__package__).joinpath("static/index.html").read_text("utf-8"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "models": list(schedulers),
                "running": sum(s.running for s in schedulers.values()),
                "waiting": sum(s.queue_depth for s in schedulers.values())  # (scoring requests too)
                + sum(s.waiting for s in scorers.values())}

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # (load-balancer probes)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "frawdllm",
                "context_length": schedulers[name].engine.config.context_length,
                "max_tokens": options.max_tokens,  # (the cap on a request's max_tokens: the page's limit)
                "sampling": {k: list(v) if isinstance(v, tuple) else v for k, v in defaults[name].items()}}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in schedulers]}

    @app.get("/v1/models/{model:path}")  # (names like org/model hold a slash)
    async def retrieve_model(model: str) -> dict:
        scheduler_for(model)  # (a 404 naming the models there are)
        return model_card(model)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        scheduler = scheduler_for(body.model)
        engine = scheduler.engine
        max_new = _max_new(body, options, engine)
        messages = [m.as_message() for m in body.messages]
        for i, message in enumerate(messages):
            _check_text(message["content"], f"messages[{i}].content", param="messages")
        messages = _within_reach(messages, engine, body.truncate)

        def prompt() -> list[int]:
            try:
                if body.truncate:  # room for the reply, as `frawd chat` keeps
                    context = engine.config.context_length
                    return fit_history(engine.tokenizer, messages, context, reply_reserve(context, max_new))[0]
                return engine.tokenizer.render_chat(messages, add_generation_prompt=True)
            except FrawdError as error:
                raise ApiError(400, str(error), param="messages", code="context_length_exceeded") from None

        # (on a worker thread: a megabyte of turns, each within reach, took the event loop, and
        # every stream and /health, for ~1 s; the tokenizer lets the loop in between turns)
        ids = await asyncio.to_thread(prompt)
        _check_fits(ids, engine, chat=True)
        params = _params(body, max_new, options, defaults[body.model], stop_token_ids=ROLE_TOKEN_IDS)
        return await _answer(request, scheduler, body, [ids], params, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        scheduler = scheduler_for(body.model)
        engine = scheduler.engine
        max_new = _max_new(body, options, engine)
        prompts = _prompts(body.prompt, min(options.max_batch, options.max_queue))
        # tokenized on a worker thread, as chat's: 32 prompts of a megabyte's reach took the event
        # loop, and every stream and /health, for over a second
        encoded, echoes = await asyncio.to_thread(_encode_prompts, prompts, body, engine, max_new)
        if max_new == 0:  # score the prompts, generate nothing
            return await _score(request, body, engine, encoded, echoes)
        params = _params(body, max_new, options, defaults[body.model])
        return await _answer(request, scheduler, body, encoded, params, chat=False, echoes=echoes or None)

    def _encode_prompts(prompts: list, body: CompletionRequest, engine: Engine, max_new: int
                        ) -> tuple[list[list[int]], list[str]]:
        """Each prompt's ids as the engine takes them (cut by "truncate"), and its echo."""
        encoded, echoes = [], []
        for i, prompt in enumerate(prompts):
            what = "the prompt" if len(prompts) == 1 else f"prompt[{i}]"
            # the BOS a text's tokenizer template adds (an imported Llama's), kept first; a
            # token-id prompt that starts with it keeps it too (as the engine's "slide" does)
            template = list(getattr(engine.tokenizer, "prompt_prefix", []))
            prefix: list[int] = []
            if isinstance(prompt, str):
                _check_text(prompt, what, param="prompt")
                prefix = template
                ids = engine.tokenizer.encode(_text_within_reach(prompt, engine, body.truncate, what))
            else:
                ids = list(prompt)
                if template and ids[:len(template)] == template:
                    prefix, ids = template, ids[len(template):]
            dropped = 0
            if body.truncate:  # the last tokens that leave room for the reply, as chat does
                context = engine.config.context_length
                reserve = reply_reserve(context, max_new) if max_new else 0  # (scoring generates nothing)
                keep = max(0, context - reserve - len(prefix))
                dropped = max(0, len(ids) - keep)
                ids = ids[dropped:]  # (keep 0: empty, a prompt of <|eos|>)
            echo = ids if isinstance(prompt, str) else prefix + ids  # (a text's template BOS was not in it)
            ids = prefix + ids
            _check_fits(ids, engine, chat=False, what=what)
            try:
                encoded.append(engine.encode(ids))  # (ids inside the vocabulary; an empty prompt becomes <|eos|>)
            except FrawdError as error:
                raise ApiError(400, f"{what}: {error}" if len(prompts) > 1 else str(error), param="prompt") from None
            if body.echo:  # the prompt as sent (token ids: decoded); cut by "truncate", the part the model got
                whole = isinstance(prompt, str) and not dropped
                echoes.append(prompt if whole else engine.tokenizer.decode(echo))
        return encoded, echoes

    def _open() -> None:
        """Count a request as open (`finish` or `_close` ends it), or a 429 at the limit."""
        if state["in_flight"] >= options.max_in_flight:
            raise ApiError(429, f"{state['in_flight']} requests are open (the server's limit); retry later",
                           code="too_many_requests")
        state["in_flight"] += 1

    def _close() -> None:
        state["in_flight"] -= 1

    async def _score(request: Request, body: CompletionRequest, engine: Engine, encoded: list[list[int]],
                     echoes: list[str]) -> Response:
        """`max_tokens: 0` with `echo`: each prompt back with its tokens' logprobs (if asked),
        as scoring clients ask (no generation: nothing joins the batch)."""
        if not body.echo or body.stream:
            raise ApiError(400, "max_tokens 0 (scoring a prompt) needs echo: true, and is not streamed",
                           param="max_tokens")
        _params(body, 1, options, defaults[body.model])  # (the other fields checked as for any request)
        tokens = sum(len(ids) for ids in encoded)
        log = request.scope["state"]["log"]
        log.update(model=body.model, prompt_tokens=tokens, n=body.n, stream=False)
        scored = None

        def reply() -> dict:
            choices = []
            for i, ids in enumerate(encoded):
                logprobs = None if scored is None else \
                    _completion_logprobs(engine.tokenizer, _prompt_scored(engine.tokenizer, ids, scored[i]))
                choices += [{"index": i * body.n + j, "text": echoes[i], "logprobs": logprobs,
                             "finish_reason": "length"} for j in range(body.n)]
            return {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
                    "model": body.model, "system_fingerprint": None, "choices": choices,
                    "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}}

        started = time.perf_counter()
        _open()
        metrics.prompt_tokens.labels(body.model).inc(tokens)  # (counted as a generating request's are)
        try:
            if body.logprobs is None:
                return JSONResponse(reply())
            scored = await scorers[body.model].score(request, encoded, body.logprobs)
            return await asyncio.to_thread(lambda: _json_by_choice(reply()))  # (megabytes: see _json_by_choice)
        except _ClientGone:
            log["cancelled"] = True
            return Response(status_code=499)
        finally:
            _close()
            metrics.latency.labels(body.model).observe(time.perf_counter() - started)

    async def _answer(request: Request, scheduler: Scheduler, body: Any, prompts: list[list[int]],
                      params: SamplingParams, chat: bool, echoes: list[str] | None = None):
        """Submit each prompt (one job each) and answer with all their completions; with echo
        and logprobs, the prompts are scored first."""
        prompt_tokens = sum(len(ids) for ids in prompts)
        log = request.scope["state"]["log"]
        log.update(model=body.model, prompt_tokens=prompt_tokens, n=params.num_samples, stream=body.stream)
        if len(prompts) > 1:
            log["prompts"] = len(prompts)
        _open()
        loop = asyncio.get_running_loop()
        delivery = deliveries.get(loop) or deliveries.setdefault(loop, _Delivery(loop))
        chunks: asyncio.Queue = asyncio.Queue()
        jobs: list[Job] = []
        prompt_logprobs = None
        try:
            if echoes and params.logprobs is not None:  # the prompts' own logprobs, reported first
                scored = await scorers[body.model].score(request, prompts, params.logprobs)
                prompt_logprobs = list(zip(prompts, scored))
            for i, ids in enumerate(prompts):  # prompt i's completions are choices i * n ... i * n + n - 1
                jobs.append(scheduler.submit(ids, params, _shifted(delivery.listener(chunks), i * params.num_samples)))
        except BaseException as error:
            _close()
            for job in jobs:
                job.cancel()
            if isinstance(error, _ClientGone):
                log["cancelled"] = True
                return Response(status_code=499)
            if isinstance(error, QueueFull):
                raise ApiError(429, str(error), code="queue_full") from None
            if isinstance(error, Closed):
                raise ApiError(503, "the server is shutting down", code="shutting_down") from None
            if isinstance(error, FrawdError):
                raise ApiError(400, str(error)) from None
            raise
        metrics.prompt_tokens.labels(body.model).inc(prompt_tokens)
        reply = _Reply(body, jobs, chunks, chat, prompt_tokens, created=int(time.time()),
                       echoes=echoes or [""] * len(prompts), tokenizer=scheduler.engine.tokenizer,
                       prompt_logprobs=prompt_logprobs)
        reply.log = log
        if body.stream:
            return _Stream(reply.events(request, finish), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        whole = asyncio.ensure_future(reply.whole())
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait((whole, gone), return_when=asyncio.FIRST_COMPLETED)
            if not whole.done():  # the client went away: nobody reads this, the log says 499 cancelled
                return Response(status_code=499)
            return whole.result()
        finally:
            whole.cancel()
            gone.cancel()
            finish(reply)

    def finish(reply: "_Reply") -> None:
        for job in reply.jobs:
            job.cancel()  # (no-op when it finished): a client gone frees the rows
        _close()
        model = reply.body.model
        metrics.generated.labels(model).inc(reply.completion_tokens)
        metrics.latency.labels(model).observe(time.perf_counter() - reply.submitted)
        if reply.first_token_at is not None:
            metrics.ttft.labels(model).observe(reply.first_token_at - reply.submitted)
        request_log = reply.log
        request_log.update(completion_tokens=reply.completion_tokens, ttft_ms=reply.ttft_ms,
                         finish=reply.finish_reasons)
        if not all(job.done for job in reply.jobs):
            request_log["cancelled"] = True

    app.add_middleware(_Guard, max_body_bytes=options.max_body_bytes, body_timeout=options.body_timeout,
                       min_body_rate=options.min_body_rate, metrics=metrics, api_key=options.api_key)
    return app


class _Scorer:
    """Scores prompts (`echo` with `logprobs`: one PyTorch forward a prompt) for one model,
    one request at a time on a thread of its own, as generation waits for a row: at most
    `max_queue` requests wait (a 429 beyond), and one whose client left runs no further
    forward (the one under way, a prompt's, finishes)."""

    def __init__(self, engine: Engine, max_queue: int) -> None:
        self.engine, self.max_queue = engine, max_queue
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="frawd-score")
        self.open = 0  # requests whose client waits for them, the one running included

    @property
    def waiting(self) -> int:
        return max(self.open - 1, 0)

    async def score(self, request: Request, prompts: list[list[int]], k: int) -> list[list[TokenLogprob | None]]:
        """Each prompt's token logprobs (`Engine.prompt_logprobs`); `_ClientGone` if the client left first."""
        if self.waiting >= self.max_queue:
            raise ApiError(429, f"{self.waiting} scoring requests are waiting for this model (the server's "
                                "limit); retry later", code="queue_full")
        left = threading.Event()

        def run() -> list | None:
            scored = []
            for ids in prompts:
                if left.is_set():
                    return None
                scored.append(self.engine.prompt_logprobs(ids, k))
            return scored

        self.open += 1
        done = asyncio.wrap_future(self.pool.submit(run))
        done.add_done_callback(lambda future: future.cancelled() or future.exception())  # (one that left: unread)
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                raise _ClientGone()
            return done.result()
        finally:
            self.open -= 1
            left.set()
            gone.cancel()


class _Stream(StreamingResponse):
    """A StreamingResponse that closes its events when it ends, however it ends: a failed
    write ends the `async for` without closing the generator, whose `finally` (the request's
    `finish`: its rows and its in-flight place) would then wait for the garbage collector."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone away (after the body, receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _check_text(text: str, what: str, param: str) -> None:
    try:
        check_unicode(text, what)
    except FrawdError as error:
        raise ApiError(400, str(error), param=param) from None


def _prompts(prompt: str | list, most: int) -> list[str | list[int]]:
    """A completion request's prompts: one (text or ids) or a list of them (at most `most`:
    a batch's rows and the queue's places, so that the request can be taken whole)."""
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt is an empty list: give a text, token ids, or a list of either", param="prompt")
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > most:
        raise ApiError(400, f"{len(prompt)} prompts; this server takes at most {most} in one request", param="prompt")
    return list(prompt)


CHARS_PER_TOKEN_MARGIN = 4  # normalization can shorten a text (composing accents): a generous margin


def _reach(engine: Engine) -> int:
    """Characters beyond which a text surely holds more tokens than the context: checked
    before tokenizing, which for a megabyte prompt would hold the event loop for seconds."""
    return (engine.config.context_length + 1) * engine.tokenizer.longest_token_chars * CHARS_PER_TOKEN_MARGIN


def _text_within_reach(text: str, engine: Engine, truncate: bool, what: str) -> str:
    """`text`, or its tail with "truncate" (tokenization is local: the tail's last tokens are
    the text's), or a 400 when it cannot fit the context."""
    reach = _reach(engine)
    if len(text) <= reach:
        return text
    if truncate:
        return text[-reach:]
    raise ApiError(400, f"{what} has {len(text):,} characters, more than the model's context of "
                        f"{engine.config.context_length} tokens can hold; \"truncate\": true keeps its end",
                   param="prompt", code="context_length_exceeded")


def _within_reach(messages: list[dict], engine: Engine, truncate: bool) -> list[dict]:
    """The conversation without turns too long to ever fit the context: with "truncate"
    they, every turn before them and the answers right after them go (whole exchanges, as
    fit_history drops them: the rest never starts with an answer), else a 400; the system
    messages and the newest one must fit either way."""
    reach = _reach(engine)
    long = [i for i, m in enumerate(messages) if len(m["content"]) > reach]
    if not long:
        return messages
    system = [i for i in long if messages[i]["role"] == "system"]
    if not truncate or system or long[-1] == len(messages) - 1:
        i = system[0] if system and truncate else long[-1]
        raise ApiError(400, f"messages[{i}] has {len(messages[i]['content']):,} characters, more than the "
                            f"model's context of {engine.config.context_length} tokens can hold"
                            + ("" if truncate else '; "truncate": true drops old turns'),
                       param="messages", code="context_length_exceeded")
    rest = long[-1] + 1
    while rest < len(messages) - 1 and messages[rest]["role"] == "assistant":  # its answers go with it
        rest += 1
    return [m for m in messages[:rest] if m["role"] == "system"] + messages[rest:]


def _shifted(listener, offset: int):
    """`listener` with every chunk's completion index moved up by `offset` (a request's later prompts)."""
    if offset == 0:
        return listener

    def put(item: Any) -> None:
        listener(item if isinstance(item, BaseException) else dataclasses.replace(item, index=item.index + offset))
    return put


def _check_fits(ids: list[int], engine: Engine, chat: bool, what: str = "the prompt") -> None:
    context = engine.config.context_length
    if len(ids) > context:
        keeps = "the newest turns" if chat else "its last tokens"
        raise ApiError(400, f"{what} has {len(ids)} tokens but the model's context is {context}; "
                            f'"truncate": true keeps {keeps}', param="messages" if chat else "prompt",
                       code="context_length_exceeded")


def _max_new(body: Any, options: ServeOptions, engine: Engine) -> int:
    """The request's max_completion_tokens (the newer name) or max_tokens, checked against the cap."""
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = getattr(body, name)
    if asked is not None and asked > options.max_tokens:
        raise ApiError(400, f"{name} is {asked}; this server allows at most {options.max_tokens}", param=name)
    if asked == 0 and not isinstance(body, CompletionRequest):
        raise ApiError(400, f"{name} must be at least 1 (0 scores a prompt: completions with echo)", param=name)
    return asked if asked is not None else min(options.default_max_tokens, engine.config.context_length)


def _refuse_unsupported(body: Any) -> None:
    """A 400 for an OpenAI field this server cannot honour, when its value would change the
    output (its neutral values pass: clients send them by default)."""
    def no(name: str, why: str) -> ApiError:
        return ApiError(400, f"{name} {why}", param=name)

    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0):
            raise no(name, "is not supported; use repetition_penalty (1 = off, 1.1-1.3 typical)")
    if getattr(body, "top_logprobs", None) and not body.logprobs:
        raise no("top_logprobs", "needs logprobs: true")
    if body.logit_bias:
        raise no("logit_bias", "is not supported by this server")
    if body.response_format not in (None, {}, {"type": "text"}):
        raise no("response_format", 'is not supported: only {"type": "text"} (this server has no JSON mode)')
    if getattr(body, "tools", None) or getattr(body, "functions", None) or \
            getattr(body, "tool_choice", None) not in (None, "none", "auto") or \
            getattr(body, "function_call", None) not in (None, "none", "auto"):  # (tool_choice's old name)
        raise no("tools", "are not supported: this server's models have no tool calls")
    if getattr(body, "best_of", None) not in (None, 1):
        raise no("best_of", "is not supported; n gives several completions")
    if getattr(body, "suffix", None):
        raise no("suffix", "is not supported (no fill-in-the-middle)")
    if body.stream_options is not None and not body.stream:
        raise no("stream_options", "is only allowed when stream is true")


def _settings(values: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json's settings as SamplingParams holds them (one stop string a
    tuple of one, one stop id a tuple): only the fields the file sets."""
    params = SamplingParams.from_dict(values)
    return {name: getattr(params, name) for name in values}


def _params(body: Any, max_new: int, options: ServeOptions, defaults: dict[str, Any] | None = None,
            stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """A request's SamplingParams. `defaults`, the model's generation_config.json, fill what
    the request leaves out: temperature (else OpenAI's 1), top_p, top_k, min_p,
    repetition_penalty and the stop strings; its stop_token_ids always end a reply, as in
    `frawd generate`. (Its seed, num_samples and max_new_tokens do not apply: a request's
    own, `n` and --default-max-tokens do.)"""
    defaults = defaults or {}
    if body.n > options.max_n:
        raise ApiError(400, f"n is {body.n}; this server allows at most {options.max_n}", param="n")
    if body.n > options.max_batch:
        raise ApiError(400, f"n is {body.n} but a batch holds {options.max_batch} rows", param="n")
    _refuse_unsupported(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"at most {MAX_STOP} stop strings", param="stop")
    if any(s == "" for s in stop):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    for i, text in enumerate(stop):
        _check_text(text, "stop" if isinstance(body.stop, str) else f"stop[{i}]", param="stop")
    if body.stop is None:  # the model's own (checked when the server started; the cap is the requests')
        stop = list(defaults.get("stop", ()))
    seed = None if body.seed is None else body.seed % 2**63  # OpenAI's seeds are any int64 (-1 included)
    if isinstance(body, CompletionRequest):  # a count (0: the sampled token's alone)
        logprobs = body.logprobs
    else:  # a switch, and a count beside it
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    ends = tuple(dict.fromkeys((*defaults.get("stop_token_ids", ()), *stop_token_ids)))
    temperature = defaults.get("temperature", 1.0) if body.temperature is None else body.temperature
    values = dict(max_new_tokens=max_new, num_samples=body.n, stop=stop, stop_token_ids=ends,
                  seed=seed, temperature=temperature, logprobs=logprobs)
    for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None or defaults.get(name) is not None:
            values[name] = value if value is not None else defaults[name]
    if 0 < values["temperature"] < MIN_TEMPERATURE or values.get("top_p") == 0:
        values["temperature"] = 0  # below the sampler's floor, or top_p 0 (the likeliest token): greedy
        values.pop("top_p", None)
    try:
        return SamplingParams(**values)
    except FrawdError as error:
        raise ApiError(400, str(error)) from None


def _piece(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    """A token's text (its bytes decoded, U+FFFD for part of a character) and bytes."""
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


class _TextOffsets:
    """Where each token of a stream starts in its decoded text, in characters (what
    `text_offset` counts): its bytes run through one incremental UTF-8 decoder, so a token
    that ends or starts inside a character ("é" as two byte-level tokens) does not count
    a U+FFFD of its own. A special token is no text (decoding skips it). `context`: the
    prompt's ids; where they end inside a character, the reply's text (`TextStream`) starts
    after it, and so do the offsets."""

    def __init__(self, tokenizer: Any, start: int = 0, context: Sequence[int] = ()) -> None:
        self.tokenizer, self.chars = tokenizer, start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        tail = open_character_tail(tokenizer, context)
        self._decoder.decode(b"".join(tokenizer.token_bytes(t) for t in tail if t not in tokenizer.special_ids))
        self._prompt_char = bool(self._decoder.getstate()[0])  # the next character decoded is the prompt's

    def span(self, token: int) -> tuple[int, int]:
        """(where the token's text starts, where the text decoded so far ends) after it."""
        start = self.chars  # (inside a character: where that character starts)
        if token not in self.tokenizer.special_ids:
            text = self._decoder.decode(self.tokenizer.token_bytes(token))
            if self._prompt_char and text:
                text, self._prompt_char = text[1:], False
            self.chars += len(text)
        return start, self.chars


def _prompt_scored(tokenizer: Any, ids: list[int], logprobs: list[TokenLogprob | None]
                   ) -> list[tuple[int, TokenLogprob | None, int]]:
    """An echoed prompt's (token, logprob, where its text starts) triples."""
    offsets = _TextOffsets(tokenizer)
    return [(token, entry, offsets.span(token)[0]) for token, entry in zip(ids, logprobs)]


def _completion_token(tokenizer: Any, token: int) -> str:
    """A token's name in the completions API: its text, or, for bytes that are not whole
    UTF-8 (part of a character), "bytes:\\xe6\\x97" as OpenAI's completions write them, so
    that each key of a position's top_logprobs names one token (as U+FFFD, every partial
    token had the same key: later ones overwrote the earlier, the chosen one's too)."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _completion_logprobs(tokenizer: Any, scored: list[tuple[int, TokenLogprob | None, int]]) -> dict:
    """The completions API's logprobs object (tokens, token_logprobs, top_logprobs,
    text_offset) for (token, logprob or None, where its text starts) triples."""
    tokens = [_completion_token(tokenizer, token) for token, _, _ in scored]
    tops = []
    for (token, entry, _), name in zip(scored, tokens):
        if entry is None:
            tops.append(None)
            continue
        # the k likeliest, and the sampled token's own where it is not among them (up to k + 1,
        # as OpenAI's and vLLM's completions give them); two tokens of one name (an added
        # token spelling a vocabulary token's bytes) keep the likelier's value, or the chosen one's
        top = {}
        for t, lp in entry.top:
            top.setdefault(_completion_token(tokenizer, t), lp)
        top[name] = entry.logprob
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for _, e, _ in scored],
            "top_logprobs": tops, "text_offset": [start for _, _, start in scored]}


def _json_by_choice(body: dict) -> Response:
    """A reply with logprobs, built on a worker thread: with echo it can take megabytes (11 MB
    for 32 prompts of 250 tokens, n=8, logprobs=5), and built and serialised on the event loop
    it stalled every stream and /health for ~0.7 s. Its choices are serialised one at a time:
    json.dumps holds the GIL, and so the event loop, for the whole of one call (~0.3 s there)."""
    dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    head = dumps({key: value for key, value in body.items() if key != "choices"})
    text = head[:-1] + ',"choices":[' + ",".join(map(dumps, body["choices"])) + "]}"
    return Response(text.encode(), media_type="application/json")


class _ClientGone(Exception):
    """Put in a reply's queue when its client disconnects (see `_Reply.events`)."""


class _Reply:
    """One request's answer being put together from the chunks of its jobs (one per prompt)."""

    def __init__(self, body: Any, jobs: list[Job], chunks: asyncio.Queue, chat: bool, prompt_tokens: int,
                 created: int, echoes: list[str], tokenizer: Any = None,
                 prompt_logprobs: list[tuple[list[int], list[TokenLogprob | None]]] | None = None) -> None:
        self.body, self.jobs, self.chunks, self.chat = body, jobs, chunks, chat
        self.prompt_tokens, self.created = prompt_tokens, created
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.n = jobs[0].params.num_samples  # completions per prompt
        total = self.n * len(jobs)
        self.echoes = [echoes[i // self.n] for i in range(total)]  # completions: the prompt, with echo
        self.texts, self.reasons, self.counts = [""] * total, [None] * total, [0] * total
        self.tokenizer = tokenizer
        self.wants_logprobs = jobs[0].params.logprobs is not None
        # Each choice's logprob entries not yet in an event, with where their text starts and
        # ends (in the choice's text, echo included). An entry goes out with the event whose
        # text reaches its start; one whose text never comes (a stop string cut it) is dropped.
        self._unsent: list[list[tuple[TokenLogprob, int, int]]] = [[] for _ in range(total)]
        self._offsets = [_TextOffsets(tokenizer, len(echo), jobs[i // self.n].prompt)
                         for i, echo in enumerate(self.echoes)] if self.wants_logprobs else []
        # echo with logprobs: each prompt's (ids, logprobs), reported before its choices' tokens
        self.prompt_logprobs = prompt_logprobs
        self._prompt_sent = [prompt_logprobs is None] * total
        self.log: dict = {}
        self._head: str | None = None
        self._no_usage = ""

    @property
    def submitted(self) -> float:
        return self.jobs[0].submitted

    @property
    def first_token_at(self) -> float | None:
        firsts = [job.first_token_at for job in self.jobs if job.first_token_at is not None]
        return min(firsts) if firsts else None

    @property
    def completion_tokens(self) -> int:
        return sum(self.counts)

    @property
    def finish_reasons(self) -> list:
        return list(self.reasons)

    @property
    def ttft_ms(self) -> float | None:
        first = self.first_token_at
        return None if first is None else round(1000 * (first - self.submitted), 1)

    def _take(self, item: StreamChunk | BaseException) -> StreamChunk:
        if isinstance(item, _ClientGone):
            raise item
        if isinstance(item, BaseException):
            raise ApiError(503, f"generation failed: {item}")
        self.counts[item.index] += item.token is not None
        self.texts[item.index] += item.text
        if item.logprob is not None:
            self._unsent[item.index].append((item.logprob, *self._offsets[item.index].span(item.logprob.token)))
        if item.finish_reason is not None:
            self.reasons[item.index] = item.finish_reason
        return item

    async def _next(self) -> StreamChunk:
        return self._take(await self.chunks.get())

    def _usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def whole(self) -> JSONResponse:
        while None in self.reasons:  # (every sample's last chunk taken)
            await self._next()
        if self.wants_logprobs:  # (megabytes with echo: see _json_by_choice)
            return await asyncio.to_thread(lambda: _json_by_choice(self._whole()))
        return JSONResponse(self._whole())

    def _whole(self) -> dict:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": self._new_logprobs(i), "finish_reason": reason}
                       for i, (text, reason) in enumerate(zip(self.texts, self.reasons))]
        else:
            choices = [{"index": i, "text": echo + text, "logprobs": self._new_logprobs(i), "finish_reason": reason}
                       for i, (echo, text, reason) in enumerate(zip(self.echoes, self.texts, self.reasons))]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.body.model, "system_fingerprint": None,
                "choices": choices, "usage": self._usage()}

    def _new_logprobs(self, index: int) -> dict | None:
        """choices[index].logprobs for the tokens not yet sent whose text has begun in the
        choice's text so far (all of them, unstreamed), in OpenAI's form: chat's `content`
        list (token, logprob, bytes, top_logprobs) or the completions' parallel lists (tokens,
        token_logprobs, top_logprobs, text_offset). A token's text: in chat its bytes decoded
        (U+FFFD for part of a character); in completions `_completion_token`'s name
        (`bytes:\\xNN` for part of a character). Once the choice has finished, the tokens whose text
        never came (a stop string's: it is cut from the text) are dropped."""
        if not self.wants_logprobs:
            return None
        shown = len(self.echoes[index]) + len(self.texts[index])  # characters of the choice's text so far
        unsent = self._unsent[index]
        ready = 0
        while ready < len(unsent) and (unsent[ready][1] < shown or unsent[ready][2] <= shown):
            ready += 1  # (a token of no text counts as shown where the text reaches it)
        entries = [entry for entry, _, _ in unsent[:ready]]
        starts = [start for _, start, _ in unsent[:ready]]
        self._unsent[index] = [] if self.reasons[index] is not None else unsent[ready:]

        if self.chat:
            content = []
            for entry in entries:
                text, raw = _piece(self.tokenizer, entry.token)
                top = [{"token": t, "logprob": lp, "bytes": b} for (t, b), lp in
                       ((_piece(self.tokenizer, token), lp) for token, lp in entry.top)]
                content.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        scored = [(entry.token, entry, start) for entry, start in zip(entries, starts)]
        if not self._prompt_sent[index]:  # echo: the prompt's tokens first (the first has no logprob)
            self._prompt_sent[index] = True
            ids, prompt = self.prompt_logprobs[index // self.n]
            scored = _prompt_scored(self.tokenizer, ids, prompt) + scored
        return _completion_logprobs(self.tokenizer, scored)

    def _token_choices(self, index: int, text: str) -> str:
        """json.dumps of a token event's choices, [{"index", "delta": {"content"} or "text",
        "logprobs": null, "finish_reason": null}], written without building the dicts: it
        runs once per token per client (tested equal to json.dumps)."""
        text = json.dumps(text, ensure_ascii=False)
        field = f'"delta": {{"content": {text}}}' if self.chat else f'"text": {text}'
        return f'[{{"index": {index}, {field}, "logprobs": null, "finish_reason": null}}]'

    def _event(self, choices: list[dict] | str, usage: dict | None = None) -> str:
        """One SSE event: {"id", "object", "created", "model", "system_fingerprint", "choices"
        (, "usage")}, its constant head serialised once per reply (an event per token);
        `choices` as dicts or already serialised."""
        if self._head is None:
            head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.body.model, "system_fingerprint": None}
            self._head = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": '
            options = self.body.stream_options  # with include_usage every chunk has the field, null until the last
            self._no_usage = ', "usage": null' if options is not None and options.include_usage else ""
        tail = self._no_usage if usage is None else ', "usage": ' + json.dumps(usage, ensure_ascii=False)
        if not isinstance(choices, str):
            choices = json.dumps(choices, ensure_ascii=False)
        return self._head + choices + tail + "}\n\n"

    async def events(self, request: Request, finish: Any) -> AsyncIterator[str]:
        # A client that goes away: Starlette cancels this stream where the server speaks ASGI
        # spec 2.3 (uvicorn), but not under 2.4, where only a failed write would tell, and a
        # request still queued writes nothing. This watcher (one task a request, not a timer
        # per chunk) covers both. And a write to a client that left returns without an error:
        # a reply generated whole was "sent" to its end and logged 200 (Starlette cancels only
        # a stream that waits, and this one never waited again). A disconnect wakes the
        # watcher before the write it unblocks, so the check after each write sees it.
        gone = asyncio.ensure_future(_disconnect(request))
        gone.add_done_callback(lambda task: task.cancelled() or self.chunks.put_nowait(_ClientGone()))
        try:
            async for event in self._events():
                yield event
                if gone.done():
                    raise _ClientGone()
        except ApiError as error:  # generation failed after the 200 went out: said in the stream, as OpenAI does
            self.log["error"] = error.message
            yield "data: " + json.dumps(error.body(), ensure_ascii=False) + "\n\n"
            yield "data: [DONE]\n\n"
        except (_ClientGone, asyncio.CancelledError) as error:  # (Starlette cancels a stream that waits)
            # the client left, maybe after its reply was generated whole: nobody reads the rest
            self.log["cancelled"] = True  # (and finish() cancels the jobs)
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            gone.cancel()
            finish(self)

    async def _events(self) -> AsyncIterator[str]:
        """The SSE events of the reply, until its [DONE] (`_ClientGone` ends them early)."""
        if self.chat:
            yield self._event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(self.n)])
        elif any(self.echoes):
            def echoed() -> str:  # (megabytes with logprobs: built as _json_by_choice builds a reply)
                choices = [json.dumps({"index": i, "text": echo, "logprobs": self._new_logprobs(i),
                                       "finish_reason": None}, ensure_ascii=False)
                           for i, echo in enumerate(self.echoes)]
                return self._event("[" + ", ".join(choices) + "]")
            yield await asyncio.to_thread(echoed) if self.prompt_logprobs else echoed()
        while None in self.reasons:  # (every sample's last chunk taken)
            chunks = [await self.chunks.get()]
            while not self.chunks.empty():  # a client that fell behind gets what is ready in one write
                chunks.append(self.chunks.get_nowait())
            events = []
            for chunk in chunks:
                try:
                    chunk = self._take(chunk)  # (taken as its event is made: its logprobs go with it)
                except ApiError:  # generation failed: what came before it still goes out first
                    if events:
                        yield "".join(events)
                    raise
                if chunk.finish_reason is None:
                    if chunk.text and self.wants_logprobs:  # (a token's logprobs go with the next text)
                        field = {"delta": {"content": chunk.text}} if self.chat else {"text": chunk.text}
                        events.append(self._event([{"index": chunk.index, **field,
                                                    "logprobs": self._new_logprobs(chunk.index),
                                                    "finish_reason": None}]))
                    elif chunk.text:  # (else a token that is not printable yet)
                        events.append(self._event(self._token_choices(chunk.index, chunk.text)))
                    continue
                if self.chat:
                    delta = {"content": chunk.text} if chunk.text else {}
                    choice = {"index": chunk.index, "delta": delta, "logprobs": self._new_logprobs(chunk.index),
                              "finish_reason": chunk.finish_reason}
                else:
                    choice = {"index": chunk.index, "text": chunk.text, "logprobs": self._new_logprobs(chunk.index),
                              "finish_reason": chunk.finish_reason}
                events.append(self._event([choice]))
            if events:
                yield "".join(events)
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield self._event([], usage=self._usage())
        yield "data: [DONE]\n\n"


__all__ = ["create_app", "ServeOptions", "ApiError", "server_config"]
