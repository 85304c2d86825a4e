"""The HTTP layer: an OpenAI-compatible API over one `Scheduler` per model.

    app = create_app({"tiny": engine}, ServeOptions(api_key="..."))
    uvicorn.Server(server_config(app, host="127.0.0.1", port=8000)).run()

Routes: POST /v1/chat/completions and /v1/completions (JSON, or server-sent events ending
in `data: [DONE]` with "stream": true), GET /v1/models, /health, /metrics (Prometheus) and
/ (the chat page in `static/`). Everything about generation lives in
`frawdllm.infer.scheduler` (prompt scoring, `echo` with `logprobs`, is one PyTorch forward
per prompt on `_Scorer`'s thread, beside the scheduler). This module holds the routes; the
package's other modules what they do:

- `prompts.py`: requests into prompts (cut by "truncate") and `SamplingParams`; `max_tokens`
  and `n` above their caps are a 400;
- `replies.py`: scheduler chunks into OpenAI's bodies and server-sent events;
- `guard.py`: the API key (`Authorization: Bearer KEY`, compared in constant time) on
  /v1/*, bodies over `max_body_bytes` (413) or that stall (408), and one JSON access-log
  line per request (logger "frawdllm.serve.access");
- `errors.py`: every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`;
- `metrics.py`: /metrics; `options.py`: `ServeOptions`; `schemas.py`: the request bodies.

More than `max_in_flight` open requests or a full queue (a scheduler's, or a model's
scoring queue) is a 429. A client that goes away cancels its request (its batch row is
freed at the next step, a scoring request's next forward is not run), and so does one
that takes no bytes of its reply for `send_timeout` seconds (`server_config` closes its
connection).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import FrawdError
from ..infer.chat import ROLE_TOKEN_IDS, fit_history, reply_reserve
from ..infer.engine import Engine
from ..infer.sampling import SamplingParams, TokenLogprob
from ..infer.scheduler import Closed, QueueFull, Request as Job, Scheduler
from .errors import ApiError, _ClientGone, _disconnect
from .guard import _Guard
from .metrics import _Metrics
from .options import MAX_HEAD_BYTES, ServeOptions
from .prompts import (_check_fits, _check_text, _max_new, _params, _prompts, _settings, _text_within_reach,
                      _within_reach)
from .replies import _Reply, _completion_logprobs, _json_by_choice, _prompt_scored
from .schemas import ChatCompletionRequest, CompletionRequest


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

    # HEAD wherever GET is (RFC 9110; load balancers and monitors probe with it): headers only
    for path, endpoint in (("/", page), ("/health", health), ("/metrics", prometheus), ("/v1/models", list_models),
                           ("/v1/models/{model:path}", retrieve_model)):
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        scheduler = scheduler_for(body.model)
        engine = scheduler.engine
        if not engine.tokenizer.has_frawd_specials():  # (not a prompt too long: no retry or truncate helps)
            raise ApiError(400, f"model {body.model!r} cannot chat: its tokenizer lacks FrawdLLM's role tokens "
                                "(an imported tokenizer without them); use /v1/completions", param="model",
                           code="model_not_chat_capable")
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
        encoded, echoes, hidden = await asyncio.to_thread(_encode_prompts, prompts, body, engine, max_new)
        if max_new == 0:  # score the prompts, generate nothing
            return await _score(request, body, engine, encoded, echoes, hidden)
        params = _params(body, max_new, options, defaults[body.model])
        return await _answer(request, scheduler, body, encoded, params, chat=False, echoes=echoes or None,
                             hidden=hidden)

    def _encode_prompts(prompts: list, body: CompletionRequest, engine: Engine, max_new: int
                        ) -> tuple[list[list[int]], list[str], list[int]]:
        """Each prompt's ids as the engine takes them (cut by "truncate"), its echo, and how
        many of its first ids the echo does not show (a text's template BOS)."""
        encoded, echoes, hidden = [], [], []
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
                hidden.append(max(0, len(encoded[-1]) - len(echo)))  # (an empty prompt's <|eos|> too)
        return encoded, echoes, hidden

    def _open() -> None:
        """Count a request as open (`finish` or `_close` ends it), or a 429 at the limit."""
        if state["in_flight"] >= options.max_in_flight:
            raise ApiError(429, f"{state['in_flight']} requests are open (the server's limit); retry later",
                           code="too_many_requests")
        state["in_flight"] += 1

    def _close() -> None:
        state["in_flight"] -= 1

    async def _score(request: Request, body: CompletionRequest, engine: Engine, encoded: list[list[int]],
                     echoes: list[str], hidden: list[int]) -> Response:
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
                    _completion_logprobs(engine.tokenizer, _prompt_scored(engine.tokenizer, ids, scored[i], hidden[i]))
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
                      params: SamplingParams, chat: bool, echoes: list[str] | None = None,
                      hidden: list[int] | None = None):
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
                prompt_logprobs = list(zip(prompts, scored, hidden or [0] * len(prompts)))
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


def _shifted(listener, offset: int):
    """`listener` with every chunk's completion index moved up by `offset` (a request's later prompts)."""
    if offset == 0:
        return listener

    def put(item: Any) -> None:
        listener(item if isinstance(item, BaseException) else dataclasses.replace(item, index=item.index + offset))
    return put


__all__ = ["create_app", "server_config"]
