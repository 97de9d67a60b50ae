"""What keeps a web page from driving the API through its visitor's browser, which can reach a server on
the visitor's machine or network although the page's own site cannot.

- **Host** (DNS rebinding: a page's own domain made to resolve to 127.0.0.1): a request whose `Host` is not
  one of `--allowed-hosts` is refused (400). The default: a server bound to a loopback address answers to
  `localhost`, `127.0.0.1` and `[::1]` only; one bound to another address (a container, a host behind a
  load balancer, reached by names it cannot know) to any.
- **Origin**: a browser names the page a request comes from (`Origin`; `Sec-Fetch-Site` too). A request of
  another origin than this server's own is refused (403) unless its origin is one of `--allowed-origins`,
  which then also gets CORS answers, so that such a web application can read them. vLLM's
  `--allowed-origins` defaults to any; gracelm's to none. A client that is no browser sends neither header
  and is not concerned; the status page's own requests are same-origin.
- **Content-Type**: a request body is read as JSON only when it says so (`request_body.py`): a page can send
  `text/plain`, a form or a body without any type with no preflight, never `application/json`.
"""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from gracelm.serving.api_errors import APIError

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
            await problem.response()(scope, receive, send)
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
