"""`gracelm serve`: the process that runs the OpenAI-compatible HTTP server (`app.py`, FastAPI on uvicorn)
in front of an `AsyncEngine`.

This process is the supervisor: its `SignalHandler` is installed before anything else starts (a stop during
start-up abandons it), the `Supervisor` acts on signals and on the engine core's end and runs the drain,
and every resource is recorded in one `Ledger` whose release at the end gives the shutdown report (logged;
`--shutdown-report` writes it as JSON). Exit codes are `ExitCode`'s: 0 clean stop, 1 fatal failure, 2 usage
error, 3 start-up failure. This process never loads torch: the engine core does (docs/architecture.md).

Fast start: this module imports only what starts the engine core, so the core is spawned sooner; the HTTP
stack (FastAPI, pydantic, uvicorn) and the serving code are imported in a thread once the core's process has
started, while it loads (`_http_stack_import`), and HTTP is served only once the engine is ready.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import socket
import threading
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, NoReturn

import uvloop

import gracelm.startup_timeline as startup_timeline
from gracelm.config import EngineConfig
from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.messages import CoreState
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.last_shutdown import save_last_shutdown
from gracelm.lifecycle.ledger import Ledger, ResourceKind, ShutdownReport
from gracelm.lifecycle.processes import exit_process
from gracelm.lifecycle.sd_notify import SdNotify
from gracelm.lifecycle.server_state import Lifecycle, ServerState
from gracelm.lifecycle.service_notifier import ServiceNotifier
from gracelm.lifecycle.signals import HANDLED_SIGNALS, SignalHandler, SignalPolicy, StartupInterrupted
from gracelm.lifecycle.startup_objects import freeze_startup_objects, pause_collection
from gracelm.lifecycle.supervisor import Supervisor
from gracelm.model.model_files import resolve_model_path
from gracelm.serving.chat_template_option import read_chat_template
from gracelm.serving.server_config import ServerConfig

if TYPE_CHECKING:  # opened with --state-dir only
    from gracelm.batch.journal import Journal

logger = logging.getLogger("gracelm.server")


def run_server(config: EngineConfig, settings: ServerConfig) -> NoReturn:
    """Runs `gracelm serve` to the end, then ends the process with its exit code (see the module
    docstring) once every resource is released. A fatal signal of its own (SIGSEGV, SIGBUS, SIGABRT, SIGFPE
    in native code) writes every thread's stack to the log (faulthandler); its children then follow it by
    their death pipe, and the next start reclaims its runtime directory."""
    faulthandler.enable()
    pause_collection()  # until the start is over (`freeze_startup_objects`)
    startup_timeline.begin().mark("boot")
    code = _run(config, settings)
    logger.info("exiting with code %d", code)
    exit_process(code)


def _run(config: EngineConfig, settings: ServerConfig) -> ExitCode:
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return ExitCode.STARTUP_FAILURE
    startup_timeline.mark("bind")
    with sock:
        # uvloop's event loop: at 32 streams of ~1,000 tok/s on 2 cores, the HTTP process took 10-15 % less
        # CPU than on asyncio's own, and the engine core beside it streamed 8-24 % more tokens a second
        # (three alternating runs of `bench/serve.py run --concurrency 32 --max-tokens 128`).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_serve(config, settings, sock))


def _bind(host: str, port: int) -> socket.socket:
    """Binds before the model loads, so a taken port fails in milliseconds, not after the weights.

    The protocol is named (IPPROTO_TCP, not the default 0): asyncio sets TCP_NODELAY only on sockets that
    say they are TCP, and without it every request after the first on a kept-alive connection waited
    ~40 ms (Nagle's algorithm against the client's delayed ACK)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


async def _serve(config: EngineConfig, settings: ServerConfig, sock: socket.socket) -> ExitCode:
    state = ServerState(max_queue_wait=settings.max_queue_wait)  # its bound comes with the engine
    notifier = ServiceNotifier(SdNotify.from_env(), state)
    supervisor = Supervisor(state, config.shutdown_timeout, settings.drain_grace_period, notifier)
    ledger = Ledger()
    signals = SignalHandler(supervisor, SignalPolicy(fatal_report=lambda: _fatal_report(supervisor)))
    # Installed before anything starts, and restored (inline: main thread, inside the loop) last of all.
    signals.install(asyncio.get_running_loop())
    ledger.acquire(ResourceKind.SIGNAL_HANDLERS, " ".join(s.name for s in signals.signals), signals.uninstall,
                   inline=True)
    host, port = sock.getsockname()[:2]
    ledger.acquire(ResourceKind.SOCKET, f"listener {host}:{port}", sock.close)
    http_stack = _http_stack_import()
    journal = None  # held, the state directory is this server's to write into
    try:
        with signals.abandoning_startup(), notifier.loading(config.model or "the default model"):
            _record_resource_tracker(ledger)
            journal = _open_journal(settings.state_dir, ledger)  # before the model: a held DIR fails fast
            engine = AsyncEngine.from_config(config, ledger=ledger, on_fatal=supervisor.on_engine_fatal,
                                             beside_load=http_stack.start)
            if settings.chat_template is not None:  # the frontend's tokenizer renders the messages
                engine.tokenizer.chat_template = read_chat_template(settings.chat_template)
            startup_timeline.mark("frontend")
            http_stack.join()  # done already, unless the core was ready before FastAPI was imported
            import uvicorn

            from gracelm.observability.metrics import ServerMetrics
            from gracelm.observability.metrics_files import reserve_metric_files
            from gracelm.server.access_log import quiet_endpoints
            from gracelm.server.app import build_app
            from gracelm.server.connection_limits import connection_cap, limited_protocol
            from gracelm.server.http_server import HttpServer
            from gracelm.serving.admission_control import max_in_flight
            from gracelm.serving.serving_options import serving_options
            startup_timeline.mark("http_import")
    except StartupInterrupted as interrupt:
        logger.info("start-up abandoned: %s received while the engine was starting", interrupt.signal.name)
        return _stopped(ledger.release_all(), ExitCode.CLEAN_STOP, config, _held(settings, journal), state)
    except Exception as exc:
        logger.error("start-up failed: %s", exc)
        return _stopped(ledger.release_all(), ExitCode.STARTUP_FAILURE, config, _held(settings, journal),
                        state)
    try:
        served = serving_options(settings, engine.model_name, resolve_model_path(config.model),
                                 engine.tokenizer)
    except ValueError as exc:  # what the model's files say does not fit an option (--reasoning-parser)
        logger.error("start-up failed: %s", exc)
        return _stopped(engine.shutdown(), ExitCode.STARTUP_FAILURE, config, _held(settings, journal), state)
    supervisor.engine = engine
    state.max_in_flight = max_in_flight(settings.max_num_queued_reqs, engine)
    logger.info("admission control: --max-num-queued-reqs %s, --max-queue-wait %s",
                state.max_in_flight or "none", settings.max_queue_wait or "none")
    # A metrics file that finds its filesystem full while serving is a clean fatal stop naming it.
    loop = asyncio.get_running_loop()
    reserve_metric_files(lambda error: loop.call_soon_threadsafe(supervisor.fail, str(error)))
    try:
        try:
            metrics = ServerMetrics(engine.runtime_dir / "prometheus", served.model_name,
                                    tuple(s.value for s in Lifecycle), tuple(s.value for s in CoreState),
                                    vllm_names=settings.metrics_names == "vllm",
                                    max_model_len=engine.config.max_model_len)
        except OSError as exc:  # no room for its first files
            logger.error("start-up failed: %s", exc)
            return _stopped(engine.shutdown(timeout=0), ExitCode.STARTUP_FAILURE, config, settings.state_dir,
                            state)
        ledger.acquire(ResourceKind.DIRECTORY, f"prometheus dir {metrics.directory}", metrics.close)
        quiet_endpoints(settings.quiet_paths)
        app = build_app(engine, settings, state, metrics, ledger, served, journal)
        http = limited_protocol(settings.header_timeout, settings.body_timeout)
        server = HttpServer(uvicorn.Config(app, log_config=None, log_level=settings.uvicorn_log_level,
                                           timeout_graceful_shutdown=5, http=http,
                                           limit_concurrency=connection_cap()))
        supervisor.server = server
        _start_notifier(notifier, server, state, engine, ledger)
        logger.info("serving %s on http://%s:%d", engine.model_name, host, port)
        freeze_startup_objects()
        await server.serve(sockets=[sock])
        logger.info("HTTP server stopped")
    finally:
        # The drain is over (or was cut short): the core has nothing left to finish.
        report = engine.shutdown(timeout=0)
    code = stop_exit_code(supervisor.exit_code, report)
    save_last_shutdown(settings.state_dir, report, code, state.entered)
    return code


def _stopped(report: ShutdownReport, code: ExitCode, config: EngineConfig, state_dir: str | None,
             state: ServerState) -> ExitCode:
    """A start-up that ended early: its report published, and kept in `state_dir` (where this server held
    it) like a stop's."""
    report.publish(config.shutdown_report)
    save_last_shutdown(state_dir, report, code, state.entered)
    return code


def _held(settings: ServerConfig, journal: Journal | None) -> str | None:
    """The state directory where this server holds it (its journal open): a start refused because another
    server holds it must not write the other's records."""
    return settings.state_dir if journal is not None else None


def _start_notifier(notifier: ServiceNotifier, server, state: ServerState, engine: AsyncEngine,
                    ledger: Ledger) -> None:
    """systemd's READY, status line and watchdog (nothing outside systemd). Ready and healthy as `/ready`
    and `/health` judge; the watchdog's liveness probe is a `stats` call, which the core answers."""
    tasks = notifier.start(server.serving, ready=lambda: state.ready and not engine.failed,
                           healthy=lambda: state.alive and not engine.failed, probe=engine.stats)
    for task in tasks:
        ledger.acquire(ResourceKind.TASK, f"asyncio task {task.get_name()}", task.cancel, inline=True)


def stop_exit_code(code: ExitCode, report: ShutdownReport) -> ExitCode:
    """A stop that had to force a resource (a child killed, a release timed out) or failed to free one is
    not a clean stop: systemd and Kubernetes must be able to tell, so it exits with the fatal code."""
    forced = report.not_released
    if code is ExitCode.CLEAN_STOP and forced:
        names = ", ".join(f"{r.name} ({r.outcome.value})" for r in forced)
        logger.error("the stop was not clean: %s; exiting with code %d", names, ExitCode.FATAL)
        return ExitCode.FATAL
    return code


def _fatal_report(supervisor: Supervisor) -> str | None:
    """On SIGQUIT: the failure already known, if any (a child sends its report before the signal)."""
    engine = supervisor.engine
    if supervisor.failure is not None:
        return supervisor.failure
    if engine is not None and engine.failed:
        return engine.core_end.message
    return None


def _http_stack_import() -> threading.Thread:
    """A thread, not started, that imports the app, uvicorn, prometheus_client and the serving code (about a
    second), to overlap the core's load; the imports in `_serve` then find the modules ready, or wait for
    this thread's import to end (a failure there is raised again by them). The thread blocks the signals the
    supervisor handles, so that they reach the main thread as they would without it."""

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
        try:
            # prometheus_client too: `ServerMetrics` re-reads its multiprocess setting after the import. The
            # modules imported at a first use, after Ready otherwise: pydantic.v1, as FastAPI declares the
            # app's routes; anyio's asyncio backend, as a streamed response (the serving warm-up's) starts.
            import anyio._backends._asyncio  # noqa: F401
            import prometheus_client  # noqa: F401
            import pydantic.v1  # noqa: F401

            import gracelm.observability.metrics_files  # noqa: F401
            import gracelm.server.access_log  # noqa: F401
            import gracelm.server.app  # noqa: F401
            import gracelm.server.connection_limits  # noqa: F401
            import gracelm.server.http_server  # noqa: F401
            import gracelm.serving.serving_options  # noqa: F401
        except Exception:  # raised again, and reported, by the same imports in the main thread
            logger.debug("importing the HTTP stack in the background failed", exc_info=True)

    return threading.Thread(target=run, name="import-http-stack", daemon=True)


def _open_journal(state_dir: str | None, ledger: Ledger) -> Journal | None:
    """The batch journal of the state directory (none without one), released after the batch runner."""
    if state_dir is None:
        return None
    from gracelm.batch.journal import Journal

    journal = Journal(state_dir)
    ledger.acquire(ResourceKind.DATABASE, f"batch journal {journal.path}", journal.close)
    return journal


def _record_resource_tracker(ledger: Ledger) -> None:
    """multiprocessing's resource tracker (started by the first spawn) is a child of this process too."""
    resource_tracker.ensure_running()
    tracker = resource_tracker._resource_tracker
    ledger.acquire(ResourceKind.PROCESS, f"multiprocessing resource tracker pid {tracker._pid}",
                   tracker._stop)
