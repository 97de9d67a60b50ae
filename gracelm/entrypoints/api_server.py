"""`gracelm serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of an `AsyncEngine`.

This process is the supervisor: its `SignalHandler` is installed before anything else starts (a stop during
start-up abandons it), the `Supervisor` acts on signals and on the engine core's end and runs the drain,
and every resource is recorded in one `Ledger` whose release at the end gives the shutdown report (logged;
`--shutdown-report` writes it as JSON). Exit codes are `ExitCode`'s: 0 clean stop, 1 fatal failure, 2 usage
error, 3 start-up failure. This process never loads torch: the engine core does (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import socket
from collections.abc import AsyncIterator
from multiprocessing import resource_tracker
from typing import NoReturn

import pydantic
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gracelm.config import EngineConfig
from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.errors import EngineDeadError
from gracelm.engine.messages import CoreState
from gracelm.entrypoints.api_errors import from_validation_error, install_error_handlers
from gracelm.entrypoints.http_server import HttpServer
from gracelm.entrypoints.metrics import ServerMetrics
from gracelm.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gracelm.entrypoints.request_guards import BodySizeLimit, api_key_dependency
from gracelm.entrypoints.server_config import ServerConfig
from gracelm.entrypoints.serving_chat import ServingChat
from gracelm.entrypoints.serving_completion import ServingCompletion
from gracelm.entrypoints.stats_logger import log_stats_forever
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.processes import exit_process
from gracelm.lifecycle.server_state import Lifecycle, ServerState
from gracelm.lifecycle.signals import SignalHandler, SignalPolicy, StartupInterrupted
from gracelm.lifecycle.supervisor import Supervisor

logger = logging.getLogger("gracelm.server")


def build_app(engine: AsyncEngine, settings: ServerConfig, state: ServerState, metrics: ServerMetrics,
              ledger: Ledger) -> FastAPI:
    """The FastAPI app serving `engine`; its lifespan moves `state` to RUNNING and back to STOPPING."""
    model_name = settings.served_model_name or engine.model_name

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = []
        if settings.stats_interval > 0:
            task = asyncio.create_task(log_stats_forever(engine, metrics, settings.stats_interval),
                                       name="stats-logger")
            tasks.append((task, ledger.acquire(ResourceKind.TASK, "asyncio task stats-logger", task.cancel,
                                               inline=True)))
        state.set(Lifecycle.RUNNING)
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
    app.add_middleware(BodySizeLimit, limit=settings.max_request_body_bytes)
    chat = ServingChat(engine, state, metrics, model_name)
    completion = ServingCompletion(engine, state, metrics, model_name)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = state.alive and not engine.failed
        return JSONResponse({"status": "ok" if alive else "dead", "state": state.lifecycle.value},
                            status_code=200 if alive else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = state.ready and not engine.failed
        return JSONResponse({"ready": ok, "state": state.lifecycle.value}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if engine.is_running:
            # The engine may end while we ask; the scrape still answers, with the lifecycle state saying so.
            with contextlib.suppress(EngineDeadError):
                metrics.set_engine_stats(await engine.stats())
        else:
            metrics.set_core_state(None)
        metrics.set_lifecycle(state.lifecycle.value)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    deps = [Depends(api_key_dependency(settings.api_key))] if settings.api_key else []
    v1 = APIRouter(prefix="/v1", dependencies=deps)

    @v1.get("/models")
    async def models() -> dict:
        card = ModelCard(id=model_name, max_model_len=engine.config.max_model_len)
        return ModelList(data=[card]).model_dump()

    @v1.post("/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        return await chat.create(await _parse(raw_request, ChatCompletionRequest), raw_request)

    @v1.post("/completions")
    async def completions(raw_request: Request) -> Response:
        return await completion.create(await _parse(raw_request, CompletionRequest), raw_request)

    app.include_router(v1)
    return app


async def _parse(raw_request: Request, model: type[pydantic.BaseModel]):
    try:
        return model.model_validate_json(await raw_request.body())
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


def _version() -> str:
    try:
        return importlib.metadata.version("gracelm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run_server(config: EngineConfig, settings: ServerConfig) -> NoReturn:
    """Runs `gracelm serve` to the end, then ends the process with its exit code (see the module
    docstring) once every resource is released."""
    code = _run(config, settings)
    logger.info("exiting with code %d", code)
    exit_process(code)


def _run(config: EngineConfig, settings: ServerConfig) -> ExitCode:
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return ExitCode.STARTUP_FAILURE
    with sock:
        return asyncio.run(_serve(config, settings, sock))


def _bind(host: str, port: int) -> socket.socket:
    """Binds before the model loads, so a taken port fails in milliseconds, not after the weights."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


async def _serve(config: EngineConfig, settings: ServerConfig, sock: socket.socket) -> ExitCode:
    state = ServerState(settings.max_waiting_requests)
    supervisor = Supervisor(state, config.shutdown_timeout, settings.drain_grace_period)
    ledger = Ledger()
    signals = SignalHandler(supervisor, SignalPolicy(fatal_report=lambda: _fatal_report(supervisor)))
    # Installed before anything starts, and restored (inline: main thread, inside the loop) last of all.
    signals.install(asyncio.get_running_loop())
    ledger.acquire(ResourceKind.SIGNAL_HANDLERS, "SIGTERM SIGINT SIGQUIT SIGUSR1", signals.uninstall,
                   inline=True)
    host, port = sock.getsockname()[:2]
    ledger.acquire(ResourceKind.SOCKET, f"listener {host}:{port}", sock.close)
    try:
        with signals.abandoning_startup():
            _record_resource_tracker(ledger)
            engine = AsyncEngine.from_config(config, ledger=ledger, on_fatal=supervisor.on_engine_fatal)
    except StartupInterrupted as interrupt:
        logger.info("start-up abandoned: %s received while the engine was starting", interrupt.signal.name)
        ledger.release_all().publish(config.shutdown_report)
        return ExitCode.CLEAN_STOP
    except Exception as exc:
        logger.error("start-up failed: %s", exc)
        ledger.release_all().publish(config.shutdown_report)
        return ExitCode.STARTUP_FAILURE
    supervisor.engine = engine
    try:
        metrics = ServerMetrics(engine.runtime_dir / "prometheus",
                                settings.served_model_name or engine.model_name,
                                tuple(s.value for s in Lifecycle), tuple(s.value for s in CoreState))
        ledger.acquire(ResourceKind.DIRECTORY, f"prometheus dir {metrics.directory}", metrics.close)
        server = HttpServer(uvicorn.Config(build_app(engine, settings, state, metrics, ledger),
                                           log_config=None, timeout_graceful_shutdown=5))
        supervisor.server = server
        logger.info("serving %s on http://%s:%d", engine.model_name, host, port)
        await server.serve(sockets=[sock])
        logger.info("HTTP server stopped")
    finally:
        # The drain is over (or was cut short): the core has nothing left to finish.
        engine.shutdown(timeout=0)
    return supervisor.exit_code


def _fatal_report(supervisor: Supervisor) -> str | None:
    """On SIGQUIT: the failure already known, if any (a child sends its report before the signal)."""
    engine = supervisor.engine
    if supervisor.failure is not None:
        return supervisor.failure
    if engine is not None and engine.failed:
        return engine.core_end.message
    return None


def _record_resource_tracker(ledger: Ledger) -> None:
    """multiprocessing's resource tracker (started by the first spawn) is a child of this process too."""
    resource_tracker.ensure_running()
    tracker = resource_tracker._resource_tracker
    ledger.acquire(ResourceKind.PROCESS, f"multiprocessing resource tracker pid {tracker._pid}",
                   tracker._stop)
