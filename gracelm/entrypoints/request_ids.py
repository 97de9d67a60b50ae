"""Request ids and the `X-Request-Id` header: a client (or a proxy) that sends one gets its requests named
by it, and every answer carries the header — the client's value, or the id the server gave the request."""

from __future__ import annotations

import uuid

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"
_STATE_KEY = "request_id"


def assign(raw_request: Request, body_id: str | None, prefix: str) -> str:
    """The id of a generation request: `prefix-` then the client's header, else the body's `request_id`
    (vLLM's field), else a fresh one. It is also the answer's header when the client sent none."""
    base = raw_request.headers.get(HEADER) or body_id or uuid.uuid4().hex
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
