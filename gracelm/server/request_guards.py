"""Checks a request passes before any route reads it: the body-size limit (413), the count of uploads at once
(429), and the API key (401)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from fastapi import Request
from fastapi.security import HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gracelm.serving.api_errors import APIError

# Before answering 413, the rest of the body is read and dropped, up to these bounds: a connection closed
# with unread bytes in its receive buffer is reset by the kernel, and the reset can destroy the 413 before
# the client reads it (seen under load in about half of such refusals).
_DRAIN_BYTES = 16 << 20
_DRAIN_S = 2.0


class BodySizeLimit:
    """Pure ASGI middleware (so streaming and disconnect detection pass through untouched): reads the
    body up to `limit` bytes, answers 413 beyond it, and replays it to the app. An upload (`uploads`: its
    path and limit) is passed through as it comes instead, counted (413 beyond its limit), the app spooling
    it to disk: whole in memory, a 100 MB one cost about 5x its size. At most `max_uploads` at once; one
    more is a 429 before its body is read."""

    def __init__(self, app: ASGIApp, limit: int, uploads: dict[str, int] | None = None,
                 max_uploads: int = 2) -> None:
        self.app = app
        self.limit = limit
        self.uploads = uploads or {}
        self.max_uploads = max_uploads
        self._uploading = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        limit = self.uploads.get(scope["path"], self.limit)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit)
            return
        if scope["path"] in self.uploads:
            await self._upload(scope, receive, send, limit)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._refuse(scope, receive, send, limit)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        error = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large",
                         headers={"Connection": "close"})
        await _answer_unread(error, scope, receive, send)

    async def _upload(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        if self._uploading >= self.max_uploads:
            error = APIError(429, f"{self.max_uploads} uploads are in progress, the most at once; retry when "
                                  f"one has ended", code="too_many_uploads",
                             headers={"Connection": "close", "Retry-After": "1"})
            await _answer_unread(error, scope, receive, send)
            return
        self._uploading += 1
        try:
            await self.app(scope, _counted(receive, limit), send)
        finally:
            self._uploading -= 1


async def _answer_unread(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """`error`, answered once what is left of the body is dropped (or after `_DRAIN_S`)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(_drop_body(receive), _DRAIN_S)
    await error.response()(scope, receive, send)


def _counted(receive: Receive, limit: int) -> Receive:
    """`receive`, raising a 413 once the body passes `limit` bytes (the app's error handler answers it)."""
    size = 0

    async def counted() -> Message:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large",
                           headers={"Connection": "close"})
        return message

    return counted


async def _drop_body(receive: Receive) -> None:
    """Reads what is left of the request body, up to `_DRAIN_BYTES`, and keeps none of it."""
    dropped = 0
    while dropped <= _DRAIN_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def api_key_dependency(api_keys: list[str]) -> APIKeyBearer:
    """A FastAPI dependency demanding `Authorization: Bearer <key>`, any of `api_keys` (`APIKeyBearer`)."""
    return APIKeyBearer(api_keys)


def is_valid_key(token: bytes, api_keys: list[str]) -> bool:
    """Whether `token` is one of the keys, compared as UTF-8 bytes in constant time: every key is compared,
    so the time says nothing about which key, or how much of one, matched."""
    matched = False
    for key in api_keys:
        matched |= hmac.compare_digest(token, key.encode("utf-8"))
    return matched


class APIKeyBearer(HTTPBearer):
    """Demands `Authorization: Bearer <key>` with one of the keys, compared in constant time as UTF-8
    bytes: the server reads headers as latin-1 (HTTP's own rule), so the header's original bytes are those
    of its latin-1 text, and a non-ASCII key sent as UTF-8 matches. A FastAPI security scheme, so that the
    OpenAPI schema declares it on the routes that need it; a missing or malformed header is our 401 with
    OpenAI's body, not FastAPI's."""

    def __init__(self, api_keys: list[str]) -> None:
        super().__init__(scheme_name="APIKey", description="One of the server's API keys (`--api-key`).",
                         auto_error=False)
        self._keys = list(api_keys)

    async def __call__(self, request: Request) -> None:  # type: ignore[override]  # checks, returns nothing
        credentials = await super().__call__(request)
        token = credentials.credentials.strip().encode("latin-1") if credentials is not None else None
        if token is None or not is_valid_key(token, self._keys):
            raise APIError(401, "missing or invalid API key; send `Authorization: Bearer <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
