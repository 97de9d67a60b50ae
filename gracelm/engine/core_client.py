"""The frontend's side of the engine core: starts the process, sends to it, stops it.

Two ipc sockets in the instance's runtime directory, both bound here: PUSH for requests to the core, PULL
for its outputs. Everything the core says is read by its monitor (`core_monitor.py`), which also decides,
once, how the core ended; sends never block on a dead core and fail with that end's message.

Every resource made here is recorded in the owner's `Ledger` as it is made (runtime directory, ZMQ context
and sockets, the heartbeat slot, the monitor, the process), so that the stop releases them newest first
with a timeout each: the process before its monitor, which is still there to read the core's last report.
Stale runtime directories of dead instances are reclaimed before this one's is made.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator

import zmq

import gracelm.cpu_features as cpu_features
import gracelm.startup_timeline as startup_timeline
from gracelm.config import EngineConfig
from gracelm.engine import messages as msg
from gracelm.engine.core_monitor import CoreMonitor
from gracelm.engine.errors import EngineDeadError, EngineStartupError
from gracelm.lifecycle.faults import faults
from gracelm.lifecycle.heartbeat import Heartbeat
from gracelm.lifecycle.ledger import Ledger, ResourceKind, ResourceReport
from gracelm.lifecycle.process_end import ProcessEnd
from gracelm.lifecycle.processes import ChildProcess, start_process
from gracelm.lifecycle.runtime_dir import RuntimeDir
from gracelm.lifecycle.stale import reclaim_stale

logger = logging.getLogger(__name__)

PROCESS_TITLE = "gracelm::engine-core"
# Named, not imported: the frontend never loads what the core runs (torch).
CORE_ENTRY = "gracelm.engine.core_entry:run_engine_core"
# Beyond the drain itself, how long the core may take to stop its executor and exit before it is forced.
_EXIT_GRACE_S = 5.0
# ChildProcess.stop's own escalation (SIGTERM, then SIGKILL and its wait) on top of the join.
_STOP_ESCALATION_S = 6.0
# A core that failed (reported an error, hung) gets this long to exit before it is forced.
_FAILED_CORE_WAIT_S = 0.5
# After the process is gone, how long its monitor may take to read the last report.
_LAST_REPORT_WAIT_S = 1.0
_SEND_RETRY_MS = 100


class EngineCoreClient:
    """Owns one engine-core process for its whole life; its methods may be called from any one thread.
    Constructing it starts the core; `wait_ready()`, inside `starting()`, waits until the core has loaded."""

    def __init__(self, config: EngineConfig, ledger: Ledger) -> None:
        self.config = config
        self.ledger = ledger
        faults()  # the core reads them too: a wrong one fails here, naming it, before anything starts
        reclaim_stale()
        self.runtime_dir = RuntimeDir()
        ledger.acquire(ResourceKind.DIRECTORY, f"runtime dir {self.runtime_dir.path}",
                       self.runtime_dir.remove)
        self._context = zmq.Context()
        ledger.acquire(ResourceKind.ZMQ_CONTEXT, "zmq context", self._context.term)
        self._input = self._socket(zmq.PUSH, "input.sock")
        output = self._socket(zmq.PULL, "output.sock")
        heartbeat = Heartbeat.create(self.runtime_dir.path / "heartbeat")
        ledger.acquire(ResourceKind.SHARED_MEMORY, f"heartbeat slot {heartbeat.path.name} (mmap)",
                       heartbeat.close)
        self.monitor = CoreMonitor(output, heartbeat, config.engine_hang_timeout)
        ledger.acquire(ResourceKind.THREAD, "engine core monitor", self.monitor.close, timeout=2)
        self._call_ids = itertools.count()
        self._stop_wait = 0.0  # how long the core may take to exit on its own once its stop begins
        self.stop_requested = False
        self.stop_deadline: float | None = None  # time.monotonic() of the drain's deadline, once asked
        self._released = False
        args = (config, self.runtime_dir.ipc_address("input.sock"),
                self.runtime_dir.ipc_address("output.sock"), str(heartbeat.path),
                logging.getLogger().getEffectiveLevel())
        try:
            startup_timeline.mark("prepare")
            env = {**cpu_features.environment(config.mask_cpu_features),
                   "TMPDIR": str(self.runtime_dir.temp_dir())}
            self.process: ChildProcess = start_process("EngineCore", PROCESS_TITLE, CORE_ENTRY, args, env)
            ledger.acquire(ResourceKind.PROCESS, f"engine core pid {self.process.pid}", self._stop_process,
                           timeout=self._stop_process_bound, force=self.process.process.kill)
            self.monitor.start(self.process)
        except BaseException:
            ledger.release_all()
            raise

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Until the core is ready: a failure inside (its own, or the caller's work beside its load) stops it
        and releases everything before it is raised."""
        try:
            yield
        except BaseException:
            self.ledger.release_all()
            raise

    def _socket(self, kind: int, name: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        self.ledger.acquire(ResourceKind.SOCKET, f"zmq socket {name}", lambda: sock.close(linger=0))
        sock.bind(self.runtime_dir.ipc_address(name))
        return sock

    def wait_ready(self) -> msg.Ready:
        """The core's Ready message, once it has loaded; raises `EngineStartupError` if it failed to."""
        reply = self.monitor.inbox.get()
        if isinstance(reply, msg.StartupFailed):
            logger.debug("engine core start-up traceback:\n%s", reply.traceback)
            self._stop_wait = _EXIT_GRACE_S  # the core reported its failure and is exiting on its own
            raise EngineStartupError(f"engine core failed to start: {reply.error}")
        if isinstance(reply, ProcessEnd):
            raise EngineStartupError(f"engine core died during start-up: {reply.message}")
        if not isinstance(reply, msg.Ready):
            raise EngineStartupError(f"engine core sent {type(reply).__name__} instead of its ready message")
        timeline = startup_timeline.current()
        if timeline is not None:  # the core's phases take their place in this process's timeline
            timeline.extend(reply.startup_marks)
            timeline.mark("handoff")
        return reply

    @property
    def end(self) -> ProcessEnd | None:
        """How the core ended; None while it lives (the monitor's one state)."""
        return self.monitor.end

    @property
    def core_report(self) -> list[ResourceReport]:
        return self.monitor.core_report

    # -- sending -------------------------------------------------------------------------------------

    def send(self, message: msg.ToCore) -> None:
        """Sends without ever blocking on a dead core; raises `EngineDeadError` once it has ended."""
        data = msg.encode(message)
        while True:
            end = self.monitor.end
            if end is not None:
                raise EngineDeadError(end.message)
            try:
                self._input.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self._input.poll(_SEND_RETRY_MS, zmq.POLLOUT)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Best effort: a core that has ended has nothing left to abort."""
        if request_ids and self.monitor.end is None:
            self.send(msg.AbortRequests(request_ids))

    def call(self, method: str, *args) -> int:
        """Sends a utility call; its `UtilityReply` comes through the inbox with the returned id."""
        call = msg.UtilityCall(next(self._call_ids), method, list(args))
        self.send(call)
        return call.call_id

    def request_stop(self, timeout: float) -> None:
        """Asks the core to finish its requests within `timeout` s, then abort the rest and exit; a later
        call may only shorten the deadline. Returns at once; the core's outputs keep coming meanwhile."""
        self.stop_requested = True
        deadline = time.monotonic() + timeout
        self.stop_deadline = deadline if self.stop_deadline is None else min(self.stop_deadline, deadline)
        self.monitor.record_stop_requested()
        self.monitor.set_busy(True)  # progress is due: the drain, then the exit
        self._stop_wait = max(self._stop_wait, timeout + _EXIT_GRACE_S)
        if self.monitor.end is None:
            try:
                self.send(msg.Shutdown(timeout))
            except EngineDeadError:
                pass

    # -- stopping ------------------------------------------------------------------------------------

    def shutdown(self, timeout: float) -> None:
        """Asks the core to finish within `timeout` s (a drain already under way may only end sooner), then
        stops it and releases everything; idempotent."""
        if not self._released and self.monitor.end is None:
            self.request_stop(timeout)
        self._released = True
        self.ledger.release_all()

    def _exit_wait(self) -> float:
        """How long the core may still take to exit on its own: its drain's deadline and exit, or a moment
        after a failure."""
        end = self.monitor.end
        return _FAILED_CORE_WAIT_S if end is not None and end.fatal else self._stop_wait

    def _stop_process_bound(self) -> float:
        """The ledger's bound on `_stop_process`, asked when the stop begins (a drain may have set it)."""
        return self._exit_wait() + _STOP_ESCALATION_S + _LAST_REPORT_WAIT_S

    def _stop_process(self) -> None:
        wait = self._exit_wait()
        started = time.monotonic()
        outcome = self.process.stop(wait)
        logger.debug("engine core %s after %.2f s", outcome, time.monotonic() - started)
        self.monitor.wait_end(_LAST_REPORT_WAIT_S)  # it reads the core's last report, then decides
        if outcome != "exited":
            raise RuntimeError(f"the engine core had to be {outcome}")
