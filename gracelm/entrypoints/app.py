"""The FastAPI app of `gracelm serve`: the OpenAI-compatible routes, `/health`, `/ready`, `/metrics` and
`/version`, in front of an `AsyncEngine`. Its lifespan turns the server RUNNING and reports the start-up
timeline (`startup_timeline`): one log line and the `gracelm_startup_phase_seconds` gauges.

Imported while the engine core loads (`api_server._serve`), since FastAPI, pydantic and uvicorn take about a
second to import.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
from collections.abc import AsyncIterator

import pydantic
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import gracelm.startup_timeline as startup_timeline
from gracelm.batch.journal import Journal
from gracelm.batch.runner import BatchRunner
from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.errors import EngineDeadError
from gracelm.entrypoints import request_ids, serving_tokenize
from gracelm.entrypoints.api_errors import install_error_handlers
from gracelm.entrypoints.batch_lines import BatchLines
from gracelm.entrypoints.batch_routes import batch_router
from gracelm.entrypoints.browser_guard import BrowserGuard, default_allowed_hosts
from gracelm.entrypoints.grammar_checker import GrammarChecker
from gracelm.entrypoints.metrics import ServerMetrics
from gracelm.entrypoints.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from gracelm.entrypoints.openapi_docs import (
    HealthStatus,
    Readiness,
    VersionInfo,
    answers,
    generation,
    install_openapi,
    json_body,
    plain_text,
    probe,
)
from gracelm.entrypoints.request_body import parse_request
from gracelm.entrypoints.request_client import HttpClient
from gracelm.entrypoints.request_guards import BodySizeLimit, api_key_dependency
from gracelm.entrypoints.request_limits import RequestLimits
from gracelm.entrypoints.server_config import ServerConfig
from gracelm.entrypoints.serving_chat import ServingChat
from gracelm.entrypoints.serving_completion import ServingCompletion
from gracelm.entrypoints.serving_options import ServingOptions
from gracelm.entrypoints.stats_logger import log_stats_forever
from gracelm.entrypoints.status_page import status_router
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.server_state import Lifecycle, ServerState

logger = logging.getLogger("gracelm.server")


def build_app(engine: AsyncEngine, settings: ServerConfig, state: ServerState, metrics: ServerMetrics,
              ledger: Ledger, served: ServingOptions, journal: Journal | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; its lifespan moves `state` to RUNNING and back to STOPPING, and
    runs the batches of `journal` (`--state-dir`'s, if any) meanwhile."""
    model_name = served.model_name

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = []
        if settings.stats_interval > 0:
            task = asyncio.create_task(log_stats_forever(engine, metrics, settings.stats_interval),
                                       name="stats-logger")
            tasks.append((task, ledger.acquire(ResourceKind.TASK, "asyncio task stats-logger", task.cancel,
                                               inline=True)))
        state.set(Lifecycle.RUNNING)
        if runner is not None:  # after RUNNING: a batch line is admitted only then
            task = asyncio.create_task(runner.run(), name="batch-runner")
            tasks.append((task, ledger.acquire(ResourceKind.TASK, "asyncio task batch-runner", task.cancel,
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

    app = FastAPI(title="gracelm", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_body_bytes,
                       uploads={"/v1/files": settings.max_upload_bytes})
    hosts = settings.allowed_hosts or default_allowed_hosts(settings.host)
    app.add_middleware(BrowserGuard, allowed_hosts=hosts, allowed_origins=settings.allowed_origins)
    if settings.allowed_origins:  # outside the guard: a preflight is answered before it
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=[request_ids.HEADER])
    app.add_middleware(request_ids.RequestIdHeader)
    limits = RequestLimits(settings.max_stop_strings, settings.max_stop_chars)
    grammars = GrammarChecker.for_engine(engine, ledger)
    chat = ServingChat(engine, state, metrics, served, limits, grammars)
    completion = ServingCompletion(engine, state, metrics, served, limits, grammars)
    runner = None if journal is None else BatchRunner(journal, BatchLines(chat, completion), state,
                                                      engine.config.max_num_seqs)

    @app.get("/health", responses=probe(HealthStatus, "The engine is dead."))
    async def health() -> JSONResponse:
        alive = state.alive and not engine.failed
        return JSONResponse({"status": "ok" if alive else "dead", "state": state.lifecycle.value},
                            status_code=200 if alive else 503)

    @app.get("/ready", responses=probe(Readiness, "Not running: starting, draining, stopping or dead."))
    async def ready() -> JSONResponse:
        ok = state.ready and not engine.failed
        return JSONResponse({"ready": ok, "state": state.lifecycle.value}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response, responses=plain_text(500))
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
        if runner is not None:
            metrics.set_batches(await runner.progress())
        if journal is not None:
            metrics.set_crashed_lines(journal.crash_culprits)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/version", responses=answers(VersionInfo, 500))
    async def version() -> dict:
        return {"version": _version()}

    deps = [Depends(api_key_dependency(settings.api_key))] if settings.api_key else []
    v1 = APIRouter(prefix="/v1", dependencies=deps)

    # What each served name stands for (vLLM's root: the model's path; no adapters, so no parent).
    card_fields = {"max_model_len": engine.config.max_model_len,
                   "root": engine.config.model or engine.model_name}

    @v1.get("/models", responses=answers(ModelList, 401, 500))
    async def models() -> dict:
        cards = [ModelCard(id=name, **card_fields) for name in served.model_names]
        return ModelList(data=cards).model_dump()

    @v1.post("/chat/completions", responses=generation(ChatCompletionResponse, ChatCompletionChunk),
             openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(raw_request: Request) -> Response:
        req = await parse_request(raw_request, ChatCompletionRequest)
        return _answer(await chat.create(req, HttpClient(raw_request)))

    @v1.post("/completions", responses=generation(CompletionResponse, CompletionResponse),
             openapi_extra=json_body(CompletionRequest))
    async def completions(raw_request: Request) -> Response:
        req = await parse_request(raw_request, CompletionRequest)
        return _answer(await completion.create(req, HttpClient(raw_request)))

    v1.include_router(batch_router(journal, runner))
    app.include_router(v1)
    tokens = APIRouter(dependencies=deps)  # vLLM serves these outside /v1

    @tokens.post("/tokenize", responses=answers(TokenizeResponse, 400, 401, 404, 413, 415, 500),
                 openapi_extra=json_body(TokenizeRequest))
    async def tokenize(raw_request: Request) -> dict:
        req = await parse_request(raw_request, TokenizeRequest)
        chat.check_model(req.model)
        answer = await serving_tokenize.tokenize(engine, req, served.template_budget)
        return answer.model_dump(exclude_none=True)

    @tokens.post("/detokenize", responses=answers(DetokenizeResponse, 400, 401, 404, 413, 415, 500),
                 openapi_extra=json_body(DetokenizeRequest))
    async def detokenize(raw_request: Request) -> dict:
        req = await parse_request(raw_request, DetokenizeRequest)
        chat.check_model(req.model)
        return serving_tokenize.detokenize(engine, req).model_dump()

    app.include_router(tokens)
    app.include_router(status_router(engine, settings, state, metrics, model_name,
                                     None if runner is None else runner.progress))
    return app


def _answer(answer: pydantic.BaseModel | Response) -> Response:
    """A generation route's response: the whole answer as JSON, or the SSE response as it is."""
    return answer if isinstance(answer, Response) else JSONResponse(answer.model_dump())


def _version() -> str:
    try:
        return importlib.metadata.version("gracelm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _report_startup(metrics: ServerMetrics) -> None:
    """The start-up is over once the app runs: its timeline, logged once and kept in /metrics."""
    timeline = startup_timeline.current()
    if timeline is None:
        return
    timeline.mark("http")
    logger.info("start-up timeline (ms): %s", timeline.summary())
    metrics.set_startup_phases({**timeline.phases(), "total": timeline.total()})
