"""A live `frawd serve` app on a free local port, run by uvicorn on a thread of the test process."""

import json
import logging
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from frawdllm.infer import native as native_forward
from frawdllm.infer import Engine
from frawdllm.serve import ServeOptions, create_app, server_config


class AccessLog(logging.Handler):
    """Collects the server's access-log lines (add it to the "frawdllm.serve.access" logger)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(json.loads(record.getMessage()))


LOOP_THREAD = "serve-event-loop"  # the live server's event loop runs on the thread of this name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine(model, tok) -> Engine:
    """The native forward everywhere when it can run (so every batch size takes the same
    path as `Engine.generate` alone), else PyTorch everywhere."""
    return Engine(model, tok, native=native_forward.available())


test_engine.__test__ = False  # (not a test)


def asgi_post(body: bytes, spec_version: str = "2.3", path: str = "/v1/completions") -> dict:
    """The ASGI scope of a JSON POST of `body`, for calling the app directly."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


@contextmanager
def live_server(engines: dict, options: ServeOptions, send_buffer: int | None = None, sampling: dict | None = None):
    """Yields the base URL ("http://127.0.0.1:PORT") while the server runs. `send_buffer`:
    the kernel's send buffer of each connection, in bytes (small: a client that does not
    read fills it, and then the server's own buffer, after a few kilobytes). `sampling`:
    create_app's per-model generation_config defaults."""
    app = create_app(engines, options, sampling)
    sock = socket.socket()
    if send_buffer is not None:  # (accepted connections inherit it)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=LOOP_THREAD)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
