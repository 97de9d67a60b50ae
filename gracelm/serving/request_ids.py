"""Request ids and the `X-Request-Id` header: a client (or a proxy) that sends one gets its requests named
by it, and every answer carries the header — the client's value, or the id the server gave the request.

An id goes into the log and into a response header, so a client's is refused (a 400 naming it) unless it is
printable ASCII of a bounded length (`checked`): a newline in it forged log lines, and an answer whose
header it broke never reached the client."""

from __future__ import annotations

import uuid

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gracelm.serving.api_errors import APIError

HEADER = "X-Request-Id"
MAX_CHARS = 256
_STATE_KEY = "request_id"


def checked(value: str, param: str) -> str:
    """`value`, a client's id given as `param`, where it is safe in a log line and a header."""
    if len(value) > MAX_CHARS or not (value.isascii() and value.isprintable()):
        raise APIError(400, f"{param} must be at most {MAX_CHARS} printable ASCII characters (no control "
                            f"characters), got {len(value)} characters", param=param, code="invalid_value")
    return value


def assign(raw_request: Request, body_id: str | None, prefix: str) -> str:
    """The id of a generation request: `prefix-` then the client's header, else the body's `request_id`
    (vLLM's field), else a fresh one (each client's `checked`). It is also the answer's header when the
    client sent none."""
    header = raw_request.headers.get(HEADER)
    if header:
        base = checked(header, HEADER)
    else:
        base = checked(body_id, "request_id") if body_id else uuid.uuid4().hex
    request_id = f"{prefix}-{base}"
    raw_request.scope.setdefault("state", {})[_STATE_KEY] = request_id
    return request_id


class RequestIdHeader:
    """Pure ASGI middleware (streams pass through untouched): sets `X-Request-Id` on every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(HEADER.lower().encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                value = sent or str(scope.get("state", {}).get(_STATE_KEY) or uuid.uuid4().hex).encode()
                message["headers"] = [*message.get("headers", []), (HEADER.lower().encode(), value)]
            await send(message)

        await self.app(scope, receive, send_with_id)
