"""`gracelm serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of an `AsyncEngine`.

Exit codes, for supervisors (systemd, Kubernetes) to tell a crash from a stop:
    0  clean stop (SIGTERM / SIGINT)
    1  fatal failure while serving (the engine died)
    2  usage error (bad command line or option values)
    3  start-up failure (port in use, model not loadable, engine core failed to start)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator

import pydantic
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gracelm.engine.errors import EngineDeadError
from gracelm.entrypoints.api_errors import from_validation_error, install_error_handlers
from gracelm.entrypoints.cli import EXIT_FATAL, EXIT_OK, EXIT_STARTUP, EXIT_USAGE, engine_config_from_args
from gracelm.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gracelm.entrypoints.request_guards import BodySizeLimit, api_key_dependency
from gracelm.entrypoints.server_state import Lifecycle, ServerState
from gracelm.entrypoints.serving_chat import ServingChat
from gracelm.entrypoints.serving_completion import ServingCompletion
from gracelm.entrypoints.stats_logger import log_stats_forever
from gracelm.metrics import ServerMetrics

logger = logging.getLogger("gracelm.server")

API_KEY_ENV = "GRACELM_API_KEY"
_ENGINE_WATCH_INTERVAL_S = 0.2
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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


def build_app(engine, settings: ServerSettings, state: ServerState, metrics: ServerMetrics) -> FastAPI:
    """The FastAPI app serving `engine`; its lifespan moves `state` to RUNNING and back to STOPPING."""
    model_name = settings.served_model_name or engine.model_name

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(_watch_engine(engine, state), name="engine-watch")]
        if settings.stats_interval > 0:
            tasks.append(asyncio.create_task(log_stats_forever(engine, metrics, settings.stats_interval),
                                             name="stats-logger"))
        state.set(Lifecycle.RUNNING)
        try:
            yield
        finally:
            if state.alive:
                state.set(Lifecycle.STOPPING)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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


async def _watch_engine(engine, state: ServerState) -> None:
    """Turns the state DEAD as soon as the engine is gone, so /health says so and the server stops."""
    while not _engine_dead(engine):
        await asyncio.sleep(_ENGINE_WATCH_INTERVAL_S)
    logger.error("the engine died; stopping the server")
    state.set(Lifecycle.DEAD)


def _engine_dead(engine) -> bool:
    # A core that reported a fatal error may not have exited yet: its report counts as death already.
    return engine.errored or engine.dead_error is not None


def _version() -> str:
    try:
        return importlib.metadata.version("gracelm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run_server(args: argparse.Namespace) -> int:
    """Runs `gracelm serve` to the end; returns the process exit code (see the module docstring)."""
    try:
        _merge_model_argument(args)
        settings = ServerSettings.from_args(args)
        config = engine_config_from_args(args)
    except (ValueError, pydantic.ValidationError) as exc:
        logger.error("invalid options: %s", exc)
        return EXIT_USAGE
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return EXIT_STARTUP
    with sock:
        return asyncio.run(_serve(config, settings, sock))


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


async def _serve(config, settings: ServerSettings, sock: socket.socket) -> int:
    from gracelm.engine.engine import AsyncEngine

    state = ServerState(settings.max_waiting_requests)
    try:
        with _interrupt_on_sigterm():
            engine = AsyncEngine.from_config(config)
    except KeyboardInterrupt:
        logger.info("start-up abandoned: stop requested while the engine was starting")
        return EXIT_OK
    except Exception as exc:
        logger.error("start-up failed: %s", exc)
        return EXIT_STARTUP
    metrics: ServerMetrics | None = None
    server: _Server | None = None
    try:
        # The engine owns the instance's runtime directory (a public accessor is pending); metrics live in it.
        metrics = ServerMetrics(engine._client.runtime_dir.path / "prometheus",
                                settings.served_model_name or engine.model_name,
                                tuple(s.value for s in Lifecycle))
        server = _Server(uvicorn.Config(build_app(engine, settings, state, metrics), log_config=None,
                                        timeout_graceful_shutdown=5))
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d", engine.model_name, host, port)
        with _stop_signals(server):
            stop_on_death = asyncio.create_task(_stop_when_dead(state, server))
            await server.serve(sockets=[sock])
            stop_on_death.cancel()
        return EXIT_OK if state.alive else EXIT_FATAL
    finally:
        if metrics is not None:
            metrics.close()
        # A forced stop (a second signal) gives the engine no time to let requests finish either.
        engine.shutdown(timeout=0 if server is not None and server.force_exit else None)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it re-raises a caught signal once it has stopped, which
    would kill this process before the engine is shut down. `_stop_signals` asks it to stop instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.contextmanager
def _stop_signals(server: uvicorn.Server) -> Iterator[None]:
    """SIGTERM / SIGINT stop the server; a second one forces the stop."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if server.should_exit:
            logger.warning("%s again: forcing the stop", sig.name)
            server.force_exit = True
        else:
            logger.info("%s received: stopping", sig.name)
            server.should_exit = True

    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    """While the engine starts (blocking the loop), SIGTERM interrupts it like Ctrl-C does, so the start
    is abandoned and what it made so far is cleaned up."""

    def interrupt(signum: int, _frame) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def _stop_when_dead(state: ServerState, server: uvicorn.Server) -> None:
    while state.alive:
        await asyncio.sleep(_ENGINE_WATCH_INTERVAL_S)
    server.should_exit = True
