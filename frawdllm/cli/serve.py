"""`frawd serve`: the OpenAI-compatible API (and a chat page) over one or more models."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path

import click

from ..errors import FrawdError
from .options import FiniteFloat
from .sampling_flags import check_stop_ids, load_engine, quantize_option


def default_name(directory: str) -> str:
    """A model directory's name; a run's published model (RUN/model) is named after the run
    and a checkpoint's (RUN/checkpoints/step_N/model) after the run and step: every run
    calls its model folder `model`."""
    path = Path(os.path.abspath(directory))
    if path.name != "model" or path.parent == path.parent.parent:
        return path.name or directory
    holder = path.parent
    if re.fullmatch(r"step_\d+", holder.name) and holder.parent.name == "checkpoints" and holder.parent.parent.name:
        return f"{holder.parent.parent.name}-{holder.name}"
    return holder.name


def _named(spec: str) -> tuple[str, str]:
    """'NAME=DIR' or 'DIR' (named by `default_name`); a folder that exists is a DIR even
    with '=' in its path, and so is anything whose part before '=' holds a path separator,
    unless the part after it is a folder (a hub-style name: org/tiny=runs/x/model)."""
    name, sep, directory = spec.partition("=")
    if not sep or os.path.isdir(spec) or (os.path.dirname(name) and not os.path.isdir(directory)):  # (a path)
        directory = spec
        name = default_name(spec)
    if not name or not directory:
        raise FrawdError(f"--model {spec!r}: give DIR or NAME=DIR")
    return name, directory


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to HOST:PORT (port 0: a free one) for uvicorn to serve on. Bound before
    the models load, so that a port in use is a one-line error at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:  # (a port in use, an address not this machine's, a host that does not resolve)
        sock.close()
        raise FrawdError(f"cannot listen on {host}:{port}: {(error.strerror or str(error)).lower()}") from None
    return sock


def default_tokens(given: int | None, cap: int) -> int:
    """max_tokens of a request that gives none: --default-max-tokens, else 256 within the cap."""
    from ..serve import ServeOptions

    if given is None:
        return min(ServeOptions.default_max_tokens, cap)
    if given > cap:
        raise FrawdError(f"--default-max-tokens {given} is above --max-tokens {cap}: "
                         "a request without max_tokens would get more than the cap")
    return given


@click.command()
@click.option("--model", "models", multiple=True, required=True, metavar="[NAME=]DIR",
              help="A model directory, named NAME, or after the directory (RUN/model: after the run; "
                   "RUN/checkpoints/step_N/model: RUN-step_N). Repeatable: several models, chosen by the "
                   "request's \"model\".")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; then set an API key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: a free one, printed).")
@click.option("--api-key", envvar="FRAWD_API_KEY", default=None, show_envvar=True,
              help="Requests to /v1/* must send 'Authorization: Bearer KEY' [default: none needed].")
@click.option("--max-batch", type=click.IntRange(1, 1024), default=32, show_default=True,
              help="Rows decoded together per model (continuous batching).")
@click.option("--max-queue", type=click.IntRange(1), default=256, show_default=True,
              help="Requests waiting for a row per model; beyond it a 429.")
@click.option("--max-in-flight", type=click.IntRange(1), default=512, show_default=True,
              help="Open requests (waiting, running, streaming) in all; beyond it a 429.")
@click.option("--max-tokens", type=click.IntRange(1), default=1024, show_default=True,
              help="The largest max_tokens a request may ask for.")
@click.option("--default-max-tokens", type=click.IntRange(1), default=None,
              help="max_tokens of a request that gives none (at most the context) [default: 256, or "
                   "--max-tokens if lower].")
@click.option("--max-n", type=click.IntRange(1), default=8, show_default=True, help="The largest n.")
@click.option("--max-body", "max_body", type=click.IntRange(1), default=1 << 20, show_default=True,
              help="The largest request body in bytes; beyond it a 413.")
@click.option("--send-timeout", type=FiniteFloat(0, min_open=True), default=30.0, show_default=True,
              help="Seconds a client may take no bytes of a reply; then its connection is closed and its "
                   "place freed.")
@click.option("--native", type=click.Choice(["auto", "fp16", "fp32", "off"]), default="auto", show_default=True,
              help="The C forward (see frawd generate --help).")
@quantize_option
@click.option("--threads", type=int, default=None, help="CPU threads, at most 8 per CPU [default: torch's choice].")
@click.option("--log-level", type=click.Choice(["info", "warning", "error"]), default="info", show_default=True,
              help="info prints one JSON access-log line per request on stderr.")
def serve(models: tuple[str, ...], host: str, port: int, api_key: str | None, max_batch: int, max_queue: int,
          max_in_flight: int, max_tokens: int, default_max_tokens: int | None, max_n: int, max_body: int, send_timeout: float,
          native: str,
          quantize: str, threads: int | None, log_level: str) -> None:
    """Serve models over an OpenAI-compatible API, with a chat page at /.

    POST /v1/chat/completions and /v1/completions (streaming with "stream": true), GET
    /v1/models, /health and /metrics (Prometheus). Requests share each model through
    continuous batching. SIGTERM (or Ctrl-C) finishes the open requests, then exits.

    \b
    Examples:
      frawd serve --model runs/shakespeare/model
      FRAWD_API_KEY=secret frawd serve --model a=runs/a/model --model b=runs/b/model --port 9000
    """
    import uvicorn

    from ..infer import SamplingParams
    from ..modeldir import load_generation_config
    from ..serve import ServeOptions, create_app, server_config

    named = [_named(spec) for spec in models]
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise FrawdError(f"two models are named {sorted(n for n in names if names.count(n) > 1)[0]!r}; "
                         "give each its own name: --model NAME=DIR")
    if api_key == "" or (api_key is None and os.environ.get("FRAWD_API_KEY") == ""):  # (click: "" = unset)
        raise FrawdError("the API key is empty (--api-key or FRAWD_API_KEY): give a key, or neither to need none")
    if api_key is not None and (api_key != api_key.strip() or not api_key.isascii() or not api_key.isprintable()):
        # HTTP trims a header's spaces and clients send ASCII only: such a key could never match
        raise FrawdError("the API key (--api-key or FRAWD_API_KEY) must be printable ASCII without leading or "
                         "trailing spaces: no client could send it")
    default_max_tokens = default_tokens(default_max_tokens, max_tokens)
    options = ServeOptions(api_key=api_key, max_batch=max_batch, max_queue=max_queue, max_in_flight=max_in_flight,
                           max_tokens=max_tokens, default_max_tokens=default_max_tokens, max_n=max_n,
                           max_body_bytes=max_body, send_timeout=send_timeout)
    with _listen(host, port) as sock:
        engines, sampling = {}, {}
        for name, directory in named:
            engine = load_engine(directory, quantize=quantize, threads=threads, native=native)
            engine.plan()  # measured (once per machine) before the first request, not during it
            engines[name] = engine
            sampling[name] = load_generation_config(directory)  # (a request's fields override them)
            # (else every request would be refused, and not the file)
            check_stop_ids(engine, SamplingParams.from_dict(sampling[name]), directory)
        app = create_app(engines, options, sampling)
        access = logging.getLogger("frawdllm.serve.access")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)
        access.setLevel(log_level.upper())
        access.propagate = False
        if not _loopback(host) and api_key is None:
            click.echo(f"warning: listening on {host} without an API key: anyone who can reach it can use it",
                       err=True)
        address = f"[{host}]" if ":" in host else host
        click.echo(f"serving {', '.join(engines)} on http://{address}:{sock.getsockname()[1]} "
                   "(OpenAI API at /v1, chat page at /)", err=True)
        # uvicorn drains open requests on SIGTERM or Ctrl-C, then raises the signal again under
        # the handler it found: these note it (raising SystemExit there, under a forced quit,
        # went off inside the event loop while requests still ran, one traceback each).
        stops: list[int] = []
        signal.signal(signal.SIGTERM, lambda sig, _: stops.append(sig))
        signal.signal(signal.SIGINT, lambda sig, _: stops.append(sig))
        config = server_config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=120)

        class DrainingServer(uvicorn.Server):
            """uvicorn's server, counting the requests its shutdown left unfinished: cancelled at
            the end of the graceful drain, or abandoned by a forced quit (a second Ctrl-C)."""

            unfinished = 0

            async def shutdown(self, sockets=None) -> None:
                await super().shutdown(sockets)
                self.unfinished = len(self.server_state.tasks)  # (a finished request's task is gone from it)

        server = DrainingServer(config)
        logging.getLogger("uvicorn.error").addFilter(_QuietCancels(server))
        server.run(sockets=[sock])
        # A forced quit skips the app's shutdown, which closes the schedulers: their (daemon)
        # threads were still in a forward as Python finalised, and the process sometimes
        # aborted (SIGABRT, not 130). Each stops at its next step (a no-op once closed).
        for scheduler in app.state.schedulers.values():
            scheduler.close(drain=False, timeout=30.0)
        if stops and server.unfinished:  # a drain that did not end every request is no clean exit
            click.echo(f"frawd serve: stopped with {server.unfinished} request(s) unfinished "
                       f"({'a second Ctrl-C' if server.force_exit else 'the 120 s drain ran out'})", err=True)
            raise SystemExit(128 + stops[-1])  # (130 for SIGINT, 143 for SIGTERM, as a shell reports them)


class _QuietCancels(logging.Filter):
    """Once shutting down, the requests (and the lifespan task) that the shutdown cancels
    each logged a traceback ("Exception in ASGI application ... CancelledError"): expected
    there, and said in one line at the end instead (`frawd serve: stopped with N ...`)."""

    def __init__(self, server) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.server.should_exit or record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, asyncio.CancelledError) or "CancelledError" in record.getMessage())
