"""The ASGI layer in front of the routes (`_Guard`): the API key, body size and pace,
open-request limits and the access log, before any route runs."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .errors import ApiError
from .metrics import _Metrics


access_log = logging.getLogger("frawdllm.serve.access")


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


KNOWN_PATHS = {"/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"}

