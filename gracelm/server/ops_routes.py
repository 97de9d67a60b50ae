"""The operator's routes, never behind the API key: `/health` (liveness), `/ready` (readiness), `/version`
and `/metrics` (Prometheus). A probe answers from the lifecycle state and the engine's, without a request
to the engine core; the scrape asks the core for its stats while it runs."""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gracelm.batch.journal import Journal
from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.errors import EngineDeadError
from gracelm.lifecycle.server_state import ServerState
from gracelm.observability.metrics import ServerMetrics
from gracelm.server.openapi_docs import HealthStatus, Readiness, VersionInfo, answers, plain_text, probe


def package_version() -> str:
    try:
        return importlib.metadata.version("gracelm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def probe_router(engine: AsyncEngine, state: ServerState) -> APIRouter:
    """`/health`, `/ready` and `/version`."""
    router = APIRouter()

    @router.get("/health", responses=probe(HealthStatus, "The engine is dead."))
    async def health() -> JSONResponse:
        alive = state.alive and not engine.failed
        return JSONResponse({"status": "ok" if alive else "dead", "state": state.lifecycle.value},
                            status_code=200 if alive else 503)

    @router.get("/ready", responses=probe(Readiness, "Not running: starting, draining, stopping or dead."))
    async def ready() -> JSONResponse:
        ok = state.ready and not engine.failed
        return JSONResponse({"ready": ok, "state": state.lifecycle.value}, status_code=200 if ok else 503)

    @router.get("/version", responses=answers(VersionInfo, 500))
    async def version() -> dict:
        return {"version": package_version()}

    return router


def metrics_router(engine: AsyncEngine, state: ServerState, metrics: ServerMetrics,
                   batch_progress: Callable[[], Awaitable[list[dict[str, Any]]]] | None,
                   journal: Journal | None) -> APIRouter:
    """`/metrics`: the engine's stats and timings, the lifecycle state, and the batches' progress."""
    router = APIRouter()

    @router.get("/metrics", response_class=Response, responses=plain_text(500))
    async def prometheus_metrics() -> Response:
        if engine.is_running:
            # The engine may end while we ask; the scrape still answers, with the lifecycle state saying so.
            with contextlib.suppress(EngineDeadError):
                metrics.set_engine_stats(await engine.stats())
                metrics.observe_request_timings(await engine.request_timings(metrics.timings_seen))
        else:
            metrics.set_core_state(None)
        metrics.set_lifecycle(state.lifecycle.value)
        metrics.set_request_faults(engine.request_faults)
        if batch_progress is not None:
            metrics.set_batches(await batch_progress())
        if journal is not None:
            metrics.set_crashed_lines(journal.crash_culprits)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return router
