"""The server's supervisor: the one place that acts on signals and on the engine core's end, and that runs
the drain (docs/architecture.md, "Lifecycle").

It is the `SignalTarget` of the server's `SignalHandler`; every method runs in the server's event loop
(a fatal end announced by the core's monitor, from its thread, is handed over with `call_soon_threadsafe`).

Graceful stop, in order: the state turns DRAINING (`/ready` 503 at once, `/health` 200); new requests are
still admitted for the grace period, then refused with 503; the engine core is told to finish its running
requests within the shutdown timeout (counted from the end of the grace period) and to abort the rest at
that deadline, each of which ends explicitly (a stream with its abort chunk and an error event); once every
admitted request is answered and the core has exited, uvicorn is asked to stop (listener and idle
connections closed), and the caller releases the ledger. An immediate stop (a second signal, SIGQUIT)
brings the core's deadline to now. A fatal end of the core turns the state DEAD (`/health` 503) — the
engine has already failed what was in flight (its streams raise, the routes answer 500 or an error
event) — and stops with exit code 1. A child that fails sends its report, then SIGQUIT: whichever the
supervisor hears first, the core's end decides, so the stop is a failure either way. Every wait here is
woken by its event (the last answer, the core's end, a failure), never by a polling interval. Under systemd
its `ServiceNotifier` says each phase (`STOPPING=1` and the drain's bound at its start, the failure).
"""

from __future__ import annotations

import asyncio
import logging
import time

import psutil

from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.process_end import ProcessEnd
from gracelm.lifecycle.server_state import Lifecycle, ServerState
from gracelm.lifecycle.service_notifier import ServiceNotifier
from gracelm.lifecycle.signals import Decision
from gracelm.lifecycle.stacks import dump_all_stacks, request_stack_dumps

logger = logging.getLogger("gracelm.supervisor")

# Beyond the shutdown timeout, how long the drain waits for the answers and the core's exit.
_DRAIN_SLACK_S = 10.0
# Beyond the grace period and the shutdown timeout, how long a graceful stop may take at most: the drain's
# slack, uvicorn's close of open connections (5 s) and the releases that follow. systemd's and Kubernetes's
# stop timeouts are made at least that long (`deploy/units.py`), and so is the notified extension.
STOP_MARGIN_S = _DRAIN_SLACK_S + 10.0
# How long uvicorn waits for open connections once asked to stop after an immediate stop or a failure.
_FAST_CLOSE_S = 1.0
# After a fatal failure, how long the server still answers (`/health` 503, new requests 503) before its
# listener closes: whoever polls it sees the failure stated, not only a refused connection. The in-flight
# requests get their errors meanwhile.
_DEAD_ANSWER_S = 0.25


class Supervisor:
    def __init__(self, state: ServerState, shutdown_timeout: float, drain_grace_period: float,
                 notifier: ServiceNotifier) -> None:
        self.state = state
        self.notifier = notifier  # systemd's view of the phases (does nothing outside systemd)
        self.shutdown_timeout = shutdown_timeout
        self.drain_grace_period = drain_grace_period
        self.engine = None  # the AsyncEngine, once started
        self.server = None  # the HTTP server (`server/http_server.py`), once built
        self.failure: str | None = None
        self._immediate = asyncio.Event()
        self._failed = asyncio.Event()
        self._drain: asyncio.Task | None = None
        self._loop = asyncio.get_running_loop()

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.FATAL if self.failure is not None else ExitCode.CLEAN_STOP

    # -- SignalTarget --------------------------------------------------------------------------------

    def graceful_stop(self, decision: Decision) -> None:
        self._start_drain()

    def immediate_stop(self, decision: Decision) -> None:
        self._immediate.set()
        if self.engine is not None:
            self.engine.begin_shutdown(0)
        if self.server is not None:
            self.server.config.timeout_graceful_shutdown = _FAST_CLOSE_S
        self._start_drain()

    def fatal(self, decision: Decision) -> None:
        self.fail(decision.reason)

    def dump_stacks(self, decision: Decision) -> None:
        dump_all_stacks("SIGUSR1")
        children = [p.pid for p in psutil.Process().children(recursive=True)]
        request_stack_dumps(children)

    # -- failures ------------------------------------------------------------------------------------

    def on_engine_fatal(self, end: ProcessEnd) -> None:
        """The engine's `on_fatal`: called from the core monitor's thread."""
        self._loop.call_soon_threadsafe(self.fail, end.message)

    def fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        logger.error("fatal: %s; failing in-flight requests and stopping (exit code %d)", reason,
                     ExitCode.FATAL)
        self.state.set(Lifecycle.DEAD)
        self.notifier.failed(reason)
        self._failed.set()
        self._immediate.set()
        if self.server is not None:
            self.server.config.timeout_graceful_shutdown = _FAST_CLOSE_S
            self._loop.call_later(_DEAD_ANSWER_S, self.server.request_exit)

    # -- the drain -----------------------------------------------------------------------------------

    def _start_drain(self) -> None:
        if self._drain is None and self.failure is None:
            self._drain = self._loop.create_task(self._run_drain(), name="drain")

    async def _run_drain(self) -> None:
        started = time.monotonic()
        self.state.set(Lifecycle.DRAINING)
        deadline = 0.0 if self._immediate.is_set() else self.drain_grace_period + self.shutdown_timeout
        self.notifier.draining(deadline, deadline + STOP_MARGIN_S)
        if self.drain_grace_period > 0 and not self._immediate.is_set():
            logger.info("draining: still accepting requests for %.1f s (grace period)",
                        self.drain_grace_period)
            try:
                await asyncio.wait_for(self._immediate.wait(), self.drain_grace_period)
            except TimeoutError:
                pass
        self.state.accepting = False
        self.notifier.update()
        timeout = 0.0 if self._immediate.is_set() else self.shutdown_timeout
        logger.info("draining: %d requests in flight, %.1f s to finish", self.state.num_active, timeout)
        assert self.engine is not None
        self.engine.begin_shutdown(timeout)
        if not await self._drained_or_failed(timeout + _DRAIN_SLACK_S):
            return
        if self.state.num_active:
            logger.warning("drain deadline passed with %d requests still answering", self.state.num_active)
        logger.info("drain done in %.2f s", time.monotonic() - started)
        if self.state.alive:
            self.state.set(Lifecycle.STOPPING)
            self.notifier.update()
        if self.server is not None:
            self.server.request_exit()

    async def _drained_or_failed(self, timeout: float) -> bool:
        """Waits until every admitted request is answered and the core has exited, or `timeout` s pass;
        False if a failure came first (the failure path then stops the server)."""
        assert self.engine is not None
        drained = asyncio.ensure_future(asyncio.gather(self.state.wait_idle(), self.engine.wait_end()))
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({drained, failed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (drained, failed):
                waiter.cancel()
        return self.failure is None
