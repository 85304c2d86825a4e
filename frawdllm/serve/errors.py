"""The errors the server answers with: OpenAI's error object (`ApiError`), and a client
that left before its reply was ready (`_ClientGone`, `_disconnect`)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse


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


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone away (after the body, receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClientGone(Exception):
    """Put in a reply's queue when its client disconnects (see `_Reply.events`)."""

