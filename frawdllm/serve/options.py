"""The server's limits and settings (`ServeOptions`: `frawd serve`'s flags)."""

from __future__ import annotations

from dataclasses import dataclass


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

