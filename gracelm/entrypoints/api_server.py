"""`gracelm serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of an `AsyncEngine`.

This process is the supervisor: its `SignalHandler` is installed before anything else starts (a stop during
start-up abandons it), the `Supervisor` acts on signals and failures and runs the drain, and every resource
is recorded in one `Ledger` whose release at the end gives the shutdown report (logged; `--shutdown-report`
writes it as JSON). Exit codes are `ExitCode`'s: 0 clean stop, 1 fatal failure, 2 usage error, 3 start-up
failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from multiprocessing import resource_tracker
from typing import NoReturn

import pydantic
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gracelm.engine.errors import EngineDeadError
from gracelm.entrypoints.api_errors import from_validation_error, install_error_handlers
from gracelm.entrypoints.cli import engine_config_from_args
from gracelm.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gracelm.entrypoints.request_guards import BodySizeLimit, api_key_dependency
from gracelm.entrypoints.server_state import Lifecycle, ServerState
from gracelm.entrypoints.serving_chat import ServingChat
from gracelm.entrypoints.serving_completion import ServingCompletion
from gracelm.entrypoints.stats_logger import log_stats_forever
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.signals import SignalHandler, SignalPolicy, StartupInterrupted
from gracelm.lifecycle.supervisor import Supervisor
from gracelm.metrics import ServerMetrics

logger = logging.getLogger("gracelm.server")

API_KEY_ENV = "GRACELM_API_KEY"
# While the HTTP server stops: how often it looks whether its last connections have closed.
_CLOSE_POLL_S = 0.005


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own options; the engine options come from `cli.add_engine_arguments`."""
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="a Hugging Face model directory or a .gguf file (same as --model)")
    group = parser.add_argument_group("HTTP server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0: any free)")
    group.add_argument("--api-key", default=None,
                       help=f"require `Authorization: Bearer KEY` on /v1 routes (or set {API_KEY_ENV})")
    group.add_argument("--served-model-name", default=None, help="the model name clients use")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 503 when this many admitted requests wait to start (default: no limit)")
    group.add_argument("--max-request-body-bytes", type=int, default=1 << 20,
                       help="answer 413 to larger request bodies (default 1 MiB)")
    group.add_argument("--stats-interval", type=float, default=10.0,
                       help="seconds between stats log lines; 0 turns them off (default 10)")


class ServerSettings(pydantic.BaseModel):
    host: str = "127.0.0.1"
    port: int = pydantic.Field(8000, ge=0, le=65535)
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting_requests: int | None = pydantic.Field(None, ge=1)
    max_request_body_bytes: int = pydantic.Field(1 << 20, ge=1)
    stats_interval: float = pydantic.Field(10.0, ge=0)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        fields = {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)}
        fields["api_key"] = fields.get("api_key") or os.environ.get(API_KEY_ENV) or None
        return cls(**fields)


def build_app(engine, settings: ServerSettings, state: ServerState, metrics: ServerMetrics,
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
        alive = state.alive and not _engine_dead(engine)
        return JSONResponse({"status": "ok" if alive else "dead", "state": state.lifecycle.value},
                            status_code=200 if alive else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = state.ready and not _engine_dead(engine)
        return JSONResponse({"ready": ok, "state": state.lifecycle.value}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if engine.is_running:
            # The engine may die while we ask; the scrape still answers, with the lifecycle state saying so.
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


def _engine_dead(engine) -> bool:
    # A core that reported a fatal error may not have exited yet: its report counts as death already. A
    # core that exited at the end of a drain is not dead: it was told to stop.
    return engine.dead_error is not None or (engine.errored and not engine.stop_requested)


def _version() -> str:
    try:
        return importlib.metadata.version("gracelm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run_server(args: argparse.Namespace) -> NoReturn:
    """Runs `gracelm serve` to the end, then ends the process with its exit code (see the module
    docstring)."""
    _exit_now(_run(args))


def _run(args: argparse.Namespace) -> ExitCode:
    try:
        _merge_model_argument(args)
        settings = ServerSettings.from_args(args)
        config = engine_config_from_args(args)
    except (ValueError, pydantic.ValidationError) as exc:
        logger.error("invalid options: %s", exc)
        return ExitCode.USAGE
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return ExitCode.STARTUP_FAILURE
    with sock:
        return asyncio.run(_serve(config, settings, sock))


def _exit_now(code: int) -> NoReturn:
    """Ends the process without the interpreter's teardown, once every resource has been released (the
    ledger's report says so): with torch and transformers loaded (the tokenizer, the model config) that
    teardown takes a second or more (measured 1.0-1.7 s) and frees nothing the kernel does not."""
    logger.info("exiting with code %d", code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _merge_model_argument(args: argparse.Namespace) -> None:
    """`gracelm serve MODEL` and `gracelm serve --model MODEL` mean the same; both at once must agree."""
    positional = getattr(args, "model_path", None)
    if positional is None:
        return
    if args.model is not None and args.model != positional:
        raise ValueError(f"two different models given: {positional!r} and --model {args.model!r}")
    args.model = positional


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


async def _serve(config, settings: ServerSettings, sock: socket.socket) -> ExitCode:
    from gracelm.engine.core import CoreState
    from gracelm.engine.engine import AsyncEngine

    state = ServerState(settings.max_waiting_requests)
    supervisor = Supervisor(state, config.shutdown_timeout, config.drain_grace_period)
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
        _finish(ledger.release_all(), config.shutdown_report)
        return ExitCode.CLEAN_STOP
    except Exception as exc:
        logger.error("start-up failed: %s", exc)
        _finish(ledger.release_all(), config.shutdown_report)
        return ExitCode.STARTUP_FAILURE
    supervisor.engine = engine
    try:
        metrics = ServerMetrics(engine.runtime_dir / "prometheus",
                                settings.served_model_name or engine.model_name,
                                tuple(s.value for s in Lifecycle), tuple(s.value for s in CoreState))
        ledger.acquire(ResourceKind.DIRECTORY, f"prometheus dir {metrics.directory}", metrics.close)
        server = _Server(uvicorn.Config(build_app(engine, settings, state, metrics, ledger), log_config=None,
                                        timeout_graceful_shutdown=5))
        supervisor.server = server
        logger.info("serving %s on http://%s:%d", engine.model_name, host, port)
        await server.serve(sockets=[sock])
        logger.info("HTTP server stopped")
        if not state.alive:
            supervisor.fail(state.lifecycle.value)  # a route saw the engine die before a watcher did
    finally:
        # The drain is over (or was cut short): the core has nothing left to finish.
        engine.shutdown(timeout=0)
    return supervisor.exit_code


def _fatal_report(supervisor: Supervisor) -> str | None:
    """On SIGQUIT: the child's fatal report if it has been read, or the failure already known."""
    engine = supervisor.engine
    if supervisor.failure is not None:
        return supervisor.failure
    if engine is not None and engine.dead_error is not None:
        return str(engine.dead_error)
    return None


def _record_resource_tracker(ledger: Ledger) -> None:
    """multiprocessing's resource tracker (started by the first spawn) is a child of this process too."""
    resource_tracker.ensure_running()
    tracker = resource_tracker._resource_tracker
    ledger.acquire(ResourceKind.PROCESS, f"multiprocessing resource tracker pid {tracker._pid}",
                   tracker._stop)


def _finish(report, path: str | None) -> None:
    logger.info("shutdown report:\n%s", report.as_table())
    if path:
        report.to_json(path)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it re-raises a caught signal once it has stopped, which
    would kill this process before the engine is shut down. The supervisor asks it to stop instead.

    Nor its waits: uvicorn looks at `should_exit` every 0.1 s, pauses 0.1 s after closing the connections
    and polls them every 0.1 s. Here the stop request wakes the main loop at once, and the connections are
    watched closely: by the time the supervisor stops the server every request has been answered, so what
    is left is idle keep-alive connections, which close at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_requested = asyncio.Event()
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit_requested.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit_requested.set()
        else:
            self._exit_requested.clear()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        # on_tick(0) refreshes the Date header (so once a second here) and answers whether to stop.
        while not await self.on_tick(0):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_requested.wait(), 1.0)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        try:
            await asyncio.wait_for(self._connections_closed(), self.config.timeout_graceful_shutdown)
        except TimeoutError:
            logger.error("cancelling %d connection tasks still running after %.1f s",
                         len(self.server_state.tasks), self.config.timeout_graceful_shutdown)
            for task in self.server_state.tasks:
                task.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _connections_closed(self) -> None:
        # uvicorn keeps its connections in a plain set, with no event on removal: a short poll, only for
        # the moment the stop lasts.
        while self.server_state.connections or self.server_state.tasks:
            await asyncio.sleep(_CLOSE_POLL_S)
        for server in self.servers:
            await server.wait_closed()
