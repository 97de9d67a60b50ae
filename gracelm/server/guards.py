"""The checks a request passes before any route reads it: the body-size limit (413), the count of uploads at
once (429), the API key (401), and what keeps a web page from driving the API through its visitor's browser,
which can reach a server on the visitor's machine or network although the page's own site cannot.

- **Host** (DNS rebinding: a page's own domain made to resolve to 127.0.0.1): a request whose `Host` is not
  one of `--allowed-hosts` is refused (400). The default: a server bound to a loopback address answers to
  `localhost`, `127.0.0.1` and `[::1]` only; one bound to another address (a container, a host behind a
  load balancer, reached by names it cannot know) to any.
- **Origin**: a browser names the page a request comes from (`Origin`; `Sec-Fetch-Site` too). A request of
  another origin than this server's own is refused (403) unless its origin is one of `--allowed-origins`,
  which then also gets CORS answers, so that such a web application can read them. vLLM's
  `--allowed-origins` defaults to any; gracelm's to none. A client that is no browser sends neither header
  and is not concerned; the status page's own requests are same-origin.
- **Content-Type**: a request body is read as JSON only when it says so (`serving/request_fields.py`): a page
  can send `text/plain`, a form or a body without any type with no preflight, never `application/json`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress

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
    await error.response(scope["path"])(scope, receive, send)


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
    """A FastAPI dependency demanding `Authorization: Bearer <key>` or `x-api-key: <key>`, any of
    `api_keys` (`APIKeyBearer`)."""
    return APIKeyBearer(api_keys)


def is_valid_key(token: bytes, api_keys: list[str]) -> bool:
    """Whether `token` is one of the keys, compared as UTF-8 bytes in constant time: every key is compared,
    so the time says nothing about which key, or how much of one, matched."""
    matched = False
    for key in api_keys:
        matched |= hmac.compare_digest(token, key.encode("utf-8"))
    return matched


class APIKeyBearer(HTTPBearer):
    """Demands `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's header, which its SDKs and
    Claude Code send; taken on every route, as vLLM and SGLang take it) with one of the keys, compared in
    constant time as UTF-8 bytes: the server reads headers as latin-1 (HTTP's own rule), so the header's
    original bytes are those of its latin-1 text, and a non-ASCII key sent as UTF-8 matches. When both
    headers come, the key of either lets the request in: both are the client's. A FastAPI security scheme,
    so that the OpenAPI schema declares it on the routes that need it; a missing or malformed header is our
    401 in the shape of the API asked (`api_errors.error_shape`), not FastAPI's."""

    def __init__(self, api_keys: list[str]) -> None:
        super().__init__(scheme_name="APIKey", description="One of the server's API keys (`--api-key`).",
                         auto_error=False)
        self._keys = list(api_keys)

    async def __call__(self, request: Request) -> None:  # type: ignore[override]  # checks, returns nothing
        credentials = await super().__call__(request)
        tokens = [credentials.credentials] if credentials is not None else []
        tokens += request.headers.getlist("x-api-key")
        if not any(is_valid_key(token.strip().encode("latin-1"), self._keys) for token in tokens):
            raise APIError(401, "missing or invalid API key; send `Authorization: Bearer <key>` or "
                                "`x-api-key: <key>`", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# What a browser's page may do across sites without asking (the rest, it asks first: a CORS preflight).
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """The hosts a server bound to `bind_host` answers to by default; None: any."""
    if bind_host == "localhost":
        return list(LOOPBACK_HOSTS)
    try:
        loopback = ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return None
    return list(LOOPBACK_HOSTS) if loopback else None


class BrowserGuard:
    """Pure ASGI middleware (streams pass through untouched) checking Host and Origin before any route."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str] | None, allowed_origins: list[str]) -> None:
        self.app = app
        self.hosts = None if allowed_hosts is None or "*" in allowed_hosts \
            else {host.lower() for host in allowed_hosts}
        self.origins = {origin.rstrip("/").lower() for origin in allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = self._problem(scope)
        if problem is not None:
            await problem.response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _problem(self, scope: Scope) -> APIError | None:
        headers = {name.lower(): value.decode("latin-1") for name, value in scope["headers"]}
        host = headers.get(b"host", "")
        if self.hosts is not None and _without_port(host).lower() not in self.hosts:
            return APIError(400, f"Host {host!r} is not one this server answers to (--allowed-hosts)",
                            param="Host", code="invalid_host")
        origin = headers.get(b"origin")
        if origin is not None and origin != "null":
            own = origin.split("://", 1)[-1].lower() == host.lower()
            if own or origin.rstrip("/").lower() in self.origins:
                return None
            return APIError(403, f"requests from the web page {origin!r} are refused (--allowed-origins)",
                            param="Origin", code="origin_not_allowed")
        site = headers.get(b"sec-fetch-site", "none")
        if site in ("cross-site", "same-site") and scope["method"] not in _SAFE_METHODS:
            return APIError(403, f"a {site} request of a web page is refused (--allowed-origins)",
                            param="Origin", code="origin_not_allowed")
        if origin == "null" and scope["method"] not in _SAFE_METHODS:  # a sandboxed page, a file
            return APIError(403, "a request of an opaque origin is refused", param="Origin",
                            code="origin_not_allowed")
        return None


def _without_port(host: str) -> str:
    if host.startswith("["):  # [::1]:8000
        return host[:host.index("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
