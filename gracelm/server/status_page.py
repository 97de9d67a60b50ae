"""The live status page: `/status` (one self-contained HTML page: inline CSS, an inline script that polls
`/status.json` every 2 s and draws its charts as inline SVG; no external asset, no build step) and
`/status.json` (what the page shows): the server's state, uptime, model, the requests in flight with their
progress, the requests admitted by API (chat, completions, Responses, Messages), KV-cache use, prefix-cache
hits, speculative decoding's acceptance (when it is on), output tokens per second over the last ten
minutes, during a drain its deadline and what is left, the progress of each batch not at its end (with
`--state-dir`), and the last stop's report kept in `--state-dir`.

Access follows the API key: without one both are open; with one `/status.json` needs `Authorization:
Bearer KEY` like `/v1`, and `/status` takes the same header or `?key=KEY`, since a browser cannot send a
header when it navigates. The page's script then sends the key from its own address as that header. A
query key rather than a cookie: a cookie is sent by the browser with every request to the server,
including those another page's script makes, so it would hand ambient authority to any web page the
user visits; the key in the address is sent only where it is written. Its price, the key in the access
log, is not paid: the access log's lines have the `key` parameter redacted (`_RedactKey`); the key does
stay in the browser's history.

Both routes are left out of the OpenAPI schema: they describe the server, not the OpenAI API.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.resources
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote_plus

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse

from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.errors import EngineDeadError
from gracelm.engine.output_processor import OpenRequest
from gracelm.lifecycle.last_shutdown import load_last_shutdown
from gracelm.lifecycle.server_state import Lifecycle, ServerState
from gracelm.observability.metrics import ServerMetrics
from gracelm.server.guards import api_key_dependency, is_valid_key
from gracelm.serving.api_errors import APIError
from gracelm.serving.server_config import ServerConfig

# The page lists this many requests in flight (oldest first) and counts the rest.
MAX_LISTED_REQUESTS = 50
# How long /status.json waits for the core's figures: a stuck core must not stall the page that shows it.
STATS_WAIT_S = 2.0

BatchProgress = Callable[[], Awaitable[list[dict[str, Any]]]]

def status_router(engine: AsyncEngine, settings: ServerConfig, state: ServerState, metrics: ServerMetrics,
                  model_name: str, batches: BatchProgress | None) -> APIRouter:
    """The two routes; the last stop's record is read now, before this run's stop replaces it. `batches`:
    the batches' progress (`BatchRunner.progress`; None without `--state-dir`)."""
    last_shutdown = load_last_shutdown(settings.state_dir)
    page = _Page.load()
    engine_stats = _EngineStats(engine)
    router = APIRouter()
    json_deps = [Depends(api_key_dependency(settings.api_key))] if settings.api_key else []
    if settings.api_key:
        _redact_key_in_access_log()

    @router.get("/status", include_in_schema=False)
    async def status_page(request: Request) -> HTMLResponse:
        if settings.api_key:
            _check_page_key(request, settings.api_key)
        return page.response()

    @router.get("/status.json", include_in_schema=False, dependencies=json_deps)
    async def status_json() -> JSONResponse:
        stats = await engine_stats.get()
        body = _snapshot(engine, stats, settings, state, metrics, model_name, last_shutdown)
        body["batches"] = None if batches is None else await batches()
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    return router


class _EngineStats:
    """The core's figures (the `stats` utility call), one call at a time, each waited for at most
    `STATS_WAIT_S`: a call that takes longer goes on (the core's monitor counts it as work due, so a
    frozen core is still found hung) and the next poll waits on it instead of sending another."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._call: asyncio.Future | None = None

    async def get(self) -> dict | None:
        """None when the core is gone, ends meanwhile, or has not answered in time."""
        if not self._engine.is_running:
            return None
        if self._call is None or self._call.done():
            self._call = asyncio.ensure_future(self._engine.stats())
            # Its end is read here, so that a failure nobody waits for any more is not reported as lost.
            self._call.add_done_callback(lambda call: call.cancelled() or call.exception())
        try:
            return await asyncio.wait_for(asyncio.shield(self._call), STATS_WAIT_S)
        except (TimeoutError, EngineDeadError):
            return None


def _snapshot(engine: AsyncEngine, stats: dict | None, settings: ServerConfig, state: ServerState,
              metrics: ServerMetrics, model_name: str, last_shutdown: dict | None) -> dict[str, Any]:
    now, clock = time.time(), time.monotonic()
    open_requests = engine.open_requests()
    started = state.entered[Lifecycle.STARTING.value]
    return {
        "state": _state_name(state, engine),
        "now": now,
        "started_at": started,
        "uptime_s": now - started,
        "model": {"name": model_name, "max_model_len": engine.config.max_model_len},
        "requests": {
            "active": state.num_active,
            "in_flight": state.num_in_flight,  # sequences, against the bound (--max-num-queued-reqs)
            "max_in_flight": state.max_in_flight,
            "running": sum(r.first_token_time is not None for r in open_requests),
            "waiting": sum(r.first_token_time is None for r in open_requests),
            "listed": [_request_view(r, now, engine.config.max_model_len)
                       for r in open_requests[:MAX_LISTED_REQUESTS]],
            "not_listed": max(0, len(open_requests) - MAX_LISTED_REQUESTS),
            "admitted_by_api": dict(metrics.api_totals),  # since the start
        },
        "engine": _engine_view(stats),
        "throughput": {"bucket_s": metrics.throughput.bucket_s,
                       "tokens_per_s": metrics.throughput.tokens_per_s()},
        "drain": _drain_view(state, engine, settings.drain_grace_period, now, clock),
        "last_shutdown": last_shutdown,
        "keeps_last_shutdown": settings.state_dir is not None,
    }


def _state_name(state: ServerState, engine: AsyncEngine) -> str:
    """starting, ready, draining, stopping or dead."""
    if not state.alive or engine.failed:
        return Lifecycle.DEAD.value
    return "ready" if state.ready else state.lifecycle.value


def _request_view(request: OpenRequest, now: float, max_model_len: int | None) -> dict[str, Any]:
    """One request's progress: tokens so far out of the most it may get (all `n` completions)."""
    per_completion = request.max_tokens
    if per_completion is None and max_model_len is not None:
        per_completion = max_model_len - request.num_prompt_tokens
    return {"id": request.request_id, "phase": "waiting" if request.first_token_time is None else "running",
            "age_s": now - request.arrival_time, "prompt_tokens": request.num_prompt_tokens, "n": request.n,
            "generated": request.num_generated,
            "max_tokens": None if per_completion is None else per_completion * request.n}


def _engine_view(stats: dict | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    queries = stats.get("prefix_cache_queries", 0)
    return {"core_state": stats.get("state"), "kv_usage": stats["kv_usage"],
            "kv_blocks_total": stats["kv_blocks_total"], "kv_blocks_free": stats["kv_blocks_free"],
            "prefix_cache_hits": stats.get("prefix_cache_hits", 0), "prefix_cache_queries": queries,
            "prefix_cache_hit_rate": stats.get("prefix_cache_hits", 0) / queries if queries else None,
            "spec_decode": _spec_decode_view(stats.get("spec_decode"))}


def _spec_decode_view(spec: dict | None) -> dict[str, Any] | None:
    """Speculative decoding's method and how much of what it proposed was kept, since the start; None when
    speculation is off (or the core does not report it). The rates are None until a first draft."""
    if spec is None or spec["method"] == "off":
        return None
    drafts, draft_tokens, accepted = spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]
    return {"method": spec["method"], "num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "accepted_per_draft": accepted / drafts if drafts else None}


def _drain_view(state: ServerState, engine: AsyncEngine, grace_period: float, now: float,
                clock: float) -> dict[str, Any] | None:
    """While draining: since when, whether the grace period still admits requests, the deadline at which
    the core aborts what is left (set once the grace period ends), and how many answers are left."""
    if state.lifecycle is not Lifecycle.DRAINING:
        return None
    started = state.entered[Lifecycle.DRAINING.value]
    deadline = engine.stop_deadline
    return {"started_at": started,
            "accepting": state.accepting,
            "grace_ends_at": started + grace_period if state.accepting else None,
            "deadline_at": None if deadline is None else now + (deadline - clock),
            "seconds_left": None if deadline is None else max(0.0, deadline - clock),
            "requests_left": state.num_active}


def _check_page_key(request: Request, api_keys: list[str]) -> None:
    """The page's key, one of the API's: `?key=` or the API's header, compared in constant time as UTF-8
    bytes."""
    given = request.query_params.get("key")
    if given is not None and is_valid_key(given.encode("utf-8"), api_keys):
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and is_valid_key(token.strip().encode("latin-1"), api_keys):
        return
    raise APIError(401, "missing or invalid API key; open /status?key=<key>", code="invalid_api_key")


class _Page:
    """The HTML, read once, served with a content security policy that allows its own inline style and
    script (by their hashes) and requests to this server only."""

    def __init__(self, html: str) -> None:
        self.html = html
        script = _hashes(html, "script")
        style = _hashes(html, "style")
        self.headers = {
            "Content-Security-Policy": f"default-src 'none'; script-src {script}; style-src {style}; "
                                       f"connect-src 'self'; img-src data:; base-uri 'none'; "
                                       f"form-action 'none'; frame-ancestors 'none'",
            "Cache-Control": "no-store",
            "Referrer-Policy": "no-referrer",
            "X-Content-Type-Options": "nosniff",
        }

    @classmethod
    def load(cls) -> _Page:
        return cls(importlib.resources.files(__package__).joinpath("static/status.html").read_text("utf-8"))

    def response(self) -> HTMLResponse:
        return HTMLResponse(self.html, headers=self.headers)


def _hashes(html: str, tag: str) -> str:
    """CSP source expressions of each inline `<tag>` element's text."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    digests = (base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode() for body in bodies)
    return " ".join(f"'sha256-{digest}'" for digest in digests) or "'none'"


class _RedactKey(logging.Filter):
    """Hides the value of a `key` query parameter in uvicorn's access-log lines, however its name is
    percent-encoded (`?k%65y=` is the same parameter to the route)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted(arg) if isinstance(arg, str) else arg for arg in record.args)
        return True


def _redacted(path: str) -> str:
    """`path` with the value of each query parameter named `key` (once decoded) replaced."""
    base, question, query = path.partition("?")
    if not question:
        return path
    pairs = [(pair.partition("=")[0], pair) for pair in query.split("&")]
    return base + "?" + "&".join(f"{name}=<redacted>" if unquote_plus(name) == "key" else pair
                                 for name, pair in pairs)


def _redact_key_in_access_log() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _RedactKey) for f in access.filters):
        access.addFilter(_RedactKey())
