"""The FastAPI app of `gracelm serve`, put together from one router per group of routes: the operator's
(`ops_routes.py`), the OpenAI-compatible ones (`openai_routes.py`), the Batch API's (`batch_routes.py`), those
the field's routers call on their workers (`worker_routes.py`) and the status page (`status_page.py`), behind
the middleware that guards every request. Its lifespan turns the server RUNNING, starts the background tasks
(the stats logger, the batch runner) and reports the start-up timeline (`startup_timeline`): one log line and
the `gracelm_startup_phase_seconds` gauges.

Imported while the engine core loads (`api_server._serve`), since FastAPI, pydantic and uvicorn take about a
second to import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

import gracelm.startup_timeline as startup_timeline
from gracelm.batch.journal import Journal
from gracelm.batch.runner import BatchRunner
from gracelm.engine.async_engine import AsyncEngine
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.server_state import Lifecycle, ServerState
from gracelm.observability.metrics import ServerMetrics
from gracelm.observability.stats_logger import log_stats_forever
from gracelm.server.batch_lines import BatchLines
from gracelm.server.batch_routes import batch_router
from gracelm.server.embeddings_routes import embeddings_router
from gracelm.server.guards import BodySizeLimit, BrowserGuard, api_key_dependency, default_allowed_hosts
from gracelm.server.messages_routes import messages_router
from gracelm.server.openai_routes import openai_router, tokens_router
from gracelm.server.openapi_docs import install_openapi
from gracelm.server.ops_routes import metrics_router, package_version, probe_router
from gracelm.server.responses_routes import responses_router
from gracelm.server.status_page import status_router
from gracelm.server.worker_routes import worker_routers
from gracelm.serving.api_errors import install_error_handlers
from gracelm.serving.grammar_checker import GrammarChecker
from gracelm.serving.request_client import ID_HEADER, RequestIdHeader
from gracelm.serving.request_fields import RequestLimits
from gracelm.serving.server_config import ServerConfig
from gracelm.serving.serving_chat import ServingChat
from gracelm.serving.serving_completion import ServingCompletion
from gracelm.serving.serving_embedding import ServingEmbedding
from gracelm.serving.serving_options import ServingOptions
from gracelm.serving.serving_warmup import warmed_up

logger = logging.getLogger("gracelm.server")


def build_app(engine: AsyncEngine, settings: ServerConfig, state: ServerState, metrics: ServerMetrics,
              ledger: Ledger, served: ServingOptions, journal: Journal | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; its lifespan moves `state` to RUNNING and back to STOPPING, and
    runs the batches of `journal` (`--state-dir`'s, if any) meanwhile."""
    limits = RequestLimits(settings.max_stop_strings, settings.max_stop_chars)
    grammars = GrammarChecker.for_engine(engine, ledger)
    chat = ServingChat(engine, state, metrics, served, limits, grammars)
    completion = ServingCompletion(engine, state, metrics, served, limits, grammars)
    embedding = ServingEmbedding(engine, state, metrics, served, limits, grammars)
    runner = None if journal is None else BatchRunner(journal, BatchLines(chat, completion), state,
                                                      engine.config.max_num_seqs)
    background = [("batch-runner", runner.run)] if runner is not None else []
    if settings.stats_interval > 0:
        background.insert(0, ("stats-logger", lambda: log_stats_forever(engine, metrics,
                                                                         settings.stats_interval)))
    app = FastAPI(title="gracelm", version=package_version(), docs_url=None, redoc_url=None,
                  lifespan=warmed_up(_lifespan(state, ledger, metrics, background), engine))
    install_error_handlers(app)
    install_openapi(app)
    _install_guards(app, settings)
    auth = [Depends(api_key_dependency(settings.api_key))] if settings.api_key else []
    progress = None if runner is None else runner.progress
    app.include_router(probe_router(engine, state))
    app.include_router(metrics_router(engine, state, metrics, progress, journal))
    v1 = openai_router(engine, served, chat, completion, auth)
    v1.include_router(batch_router(journal, runner))
    v1.include_router(responses_router(chat, journal, settings))
    app.include_router(v1)
    app.include_router(tokens_router(engine, served, chat, auth))
    app.include_router(messages_router(chat, auth))
    app.include_router(embeddings_router(embedding, auth))
    for router in worker_routers(engine, state, served, chat, completion, auth):
        app.include_router(router)
    app.include_router(status_router(engine, settings, state, metrics, served.model_name, progress))
    return app


def _lifespan(state: ServerState, ledger: Ledger, metrics: ServerMetrics,
              background: list[tuple[str, Callable[[], Any]]]) -> Callable:
    """RUNNING, then the `background` tasks (named coroutine functions), each held in the ledger until the
    app stops. The batch runner comes after RUNNING: a batch line is admitted only then."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.set(Lifecycle.RUNNING)
        tasks = []
        for name, run in background:
            task = asyncio.create_task(run(), name=name)
            tasks.append((task, ledger.acquire(ResourceKind.TASK, f"asyncio task {name}", task.cancel,
                                               inline=True)))
        _report_startup(metrics)
        try:
            yield
        finally:
            if state.alive:
                state.set(Lifecycle.STOPPING)
            for _, handle in tasks:
                ledger.release(handle)
            await asyncio.gather(*(task for task, _ in tasks), return_exceptions=True)

    return lifespan


def _install_guards(app: FastAPI, settings: ServerConfig) -> None:
    """The middleware every request crosses, outermost last: its id, CORS, the browser guard, the size
    limit."""
    app.add_middleware(BodySizeLimit, limit=settings.max_request_body_bytes,
                       uploads={"/v1/files": settings.max_upload_bytes})
    hosts = settings.allowed_hosts or default_allowed_hosts(settings.host)
    app.add_middleware(BrowserGuard, allowed_hosts=hosts, allowed_origins=settings.allowed_origins)
    if settings.allowed_origins:  # outside the guard: a preflight is answered before it
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=[ID_HEADER])
    app.add_middleware(RequestIdHeader)


def _report_startup(metrics: ServerMetrics) -> None:
    """The start-up is over once the app runs: its timeline, logged once and kept in /metrics."""
    timeline = startup_timeline.current()
    if timeline is None:
        return
    timeline.mark("http")
    logger.info("start-up timeline (ms): %s", timeline.summary())
    metrics.set_startup_phases({**timeline.phases(), "total": timeline.total()})
