"""The frontend's side of the engine core: starts the process, talks to it over ZMQ, stops it.

Two ipc sockets in the instance's runtime directory, both bound here: PUSH for requests to the core, PULL
for its outputs. Waiting for outputs also waits on the process sentinel, so a core that dies is noticed
at once, not at the next timeout. Sends never block on a dead core.

Every resource made here is recorded in the owner's `Ledger` as it is made (runtime directory, ZMQ context
and sockets, the heartbeat slot, the process), so that the stop releases them newest first with a timeout
each. Stale runtime directories of dead instances are reclaimed before this one's is made.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import zmq
import zmq.asyncio

from gracelm.config import EngineConfig
from gracelm.engine import messages as msg
from gracelm.engine.core import run_engine_core
from gracelm.engine.errors import EngineDeadError, EngineStartupError
from gracelm.lifecycle.ledger import Ledger, Outcome, ResourceKind, ResourceReport
from gracelm.lifecycle.processes import ChildProcess, start_process
from gracelm.lifecycle.runtime_dir import RuntimeDir
from gracelm.lifecycle.stale import reclaim_stale
from gracelm.lifecycle.watchdog import Heartbeat

logger = logging.getLogger(__name__)

PROCESS_TITLE = "gracelm::engine-core"
# Beyond the drain itself, how long the core may take to stop its executor and exit before it is forced.
_EXIT_GRACE_S = 5.0
# ChildProcess.stop's own escalation (SIGTERM, then SIGKILL and its wait) on top of the join.
_STOP_ESCALATION_S = 6.0
_SEND_RETRY_MS = 100


class EngineCoreClient:
    """Owns one engine-core process for its whole life. Usable from sync code and, via the `*_async`
    methods, from one asyncio event loop (not both at once)."""

    def __init__(self, config: EngineConfig, ledger: Ledger) -> None:
        self.config = config
        self.ledger = ledger
        reclaim_stale()
        self.runtime_dir = RuntimeDir()
        ledger.acquire(ResourceKind.DIRECTORY, f"runtime dir {self.runtime_dir.path}",
                       self.runtime_dir.remove)
        self._context = zmq.Context()
        ledger.acquire(ResourceKind.ZMQ_CONTEXT, "zmq context", self._context.term)
        self._input = self._socket(zmq.PUSH, "input.sock")
        self._output = self._socket(zmq.PULL, "output.sock")
        self._async_output: zmq.asyncio.Socket | None = None
        self.heartbeat = Heartbeat.create(self.runtime_dir.path / "heartbeat")
        ledger.acquire(ResourceKind.SHARED_MEMORY, f"heartbeat slot {self.heartbeat.path.name} (mmap)",
                       self.heartbeat.close)
        self._call_ids = itertools.count()
        self.process: ChildProcess | None = None
        self.dead_reason: str | None = None
        self.stop_requested = False
        self.core_report: list[ResourceReport] = []
        self._stop_wait = 0.0
        self._closed = False
        try:
            args = (config, self.runtime_dir.ipc_address("input.sock"),
                    self.runtime_dir.ipc_address("output.sock"), str(self.heartbeat.path),
                    logging.getLogger().getEffectiveLevel())
            self.process = start_process("EngineCore", PROCESS_TITLE, run_engine_core, args)
            process = self.process
            ledger.acquire(ResourceKind.PROCESS, f"engine core pid {process.pid}", self._stop_process,
                           timeout=_EXIT_GRACE_S + _STOP_ESCALATION_S, force=process.process.kill)
            self.ready = self._wait_ready()
        except EngineStartupError:
            self._stop_wait = _EXIT_GRACE_S  # the core reported its failure and is exiting on its own
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _socket(self, kind: int, name: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        self.ledger.acquire(ResourceKind.SOCKET, f"zmq socket {name}", lambda: sock.close(linger=0))
        sock.bind(self.runtime_dir.ipc_address(name))
        return sock

    def _wait_ready(self) -> msg.Ready:
        reply = self.get_output(timeout=None, startup=True)
        if isinstance(reply, msg.StartupFailed):
            logger.debug("engine core start-up traceback:\n%s", reply.traceback)
            raise EngineStartupError(f"engine core failed to start: {reply.error}")
        if not isinstance(reply, msg.Ready):
            raise EngineStartupError(f"engine core sent {type(reply).__name__} instead of its ready message")
        return reply

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.process is not None and self.process.is_alive()

    # -- sending -------------------------------------------------------------------------------------

    def send(self, message: msg.ToCore) -> None:
        """Sends without ever blocking on a dead core; raises `EngineDeadError` if it is dead."""
        data = msg.encode(message)
        while True:
            self._check_alive()
            try:
                self._input.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self._input.poll(_SEND_RETRY_MS, zmq.POLLOUT)

    def add_request(self, request: msg.AddRequest) -> None:
        self.send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive:
            self.send(msg.AbortRequests(request_ids))

    def new_utility_call(self, method: str, *args) -> msg.UtilityCall:
        return msg.UtilityCall(next(self._call_ids), method, list(args))

    def request_stop(self, timeout: float) -> None:
        """Asks the core to finish its requests within `timeout` s, then abort the rest and exit; a later
        call may only shorten the deadline. Returns at once; the core's outputs keep coming meanwhile."""
        self.stop_requested = True
        if self.is_alive:
            try:
                self.send(msg.Shutdown(timeout))
            except EngineDeadError:
                pass

    # -- receiving (sync) ----------------------------------------------------------------------------

    def get_output(self, timeout: float | None, startup: bool = False) -> msg.FromCore | None:
        """The next message from the core, or None after `timeout` seconds (None: wait for ever).

        Raises `EngineDeadError` (or `EngineStartupError` during start-up) when the core has died.
        """
        assert self.process is not None
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        # Messages sent before the core died are still read: they come first.
        events = dict(poller.poll(None if timeout is None else int(timeout * 1000)))
        if self._output in events:
            return self._decode(self._output.recv(copy=False).buffer)
        if events:
            self._core_died(startup)
        return None

    def _decode(self, data) -> msg.FromCore:
        message = msg.decode_from_core(data)
        if isinstance(message, msg.FatalError):
            self._mark_dead(f"engine core failed: {message.error}")
            logger.error("engine core failed:\n%s", message.traceback)
        elif isinstance(message, msg.Stopped):
            self.core_report = [ResourceReport(**{**r, "kind": ResourceKind(r["kind"]),
                                                  "outcome": Outcome(r["outcome"])})
                                for r in message.resources]
        return message

    def drain_nowait(self) -> list[msg.FromCore]:
        """Every message already received, without waiting."""
        messages = []
        while not self._closed and self._output.poll(0):
            messages.append(self._decode(self._output.recv(copy=False).buffer))
        return messages

    # -- receiving (asyncio) -------------------------------------------------------------------------

    async def get_output_async(self) -> msg.FromCore:
        if self._async_output is None:
            self._async_output = zmq.asyncio.Socket.shadow(self._output.underlying)
        return self._decode(await self._async_output.recv(copy=False))

    def watch_process(self, loop: asyncio.AbstractEventLoop, on_death) -> None:
        """Calls `on_death()` in `loop` as soon as the core process ends."""
        assert self.process is not None
        loop.add_reader(self.process.sentinel, on_death)

    def unwatch_process(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.process is not None:
            loop.remove_reader(self.process.sentinel)

    # -- death and shutdown --------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if not self.is_alive:
            self._mark_dead(self.dead_reason or self.process_exit_description())
            raise EngineDeadError(self.dead_reason)

    def _core_died(self, startup: bool) -> None:
        reason = self.process_exit_description()
        self._mark_dead(reason)
        if startup:
            raise EngineStartupError(f"engine core died during start-up: {reason}")
        raise EngineDeadError(reason)

    def process_exit_description(self) -> str:
        if self._closed:
            return "the engine has been shut down"
        assert self.process is not None
        return self.process.describe_exit()

    def mark_dead(self, reason: str) -> None:
        """Declares the core dead (a hang, say) although its process may still run: nothing more is sent."""
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            if not self._closed:
                logger.error("engine core is dead: %s", reason)

    def wait_exit(self, timeout: float) -> bool:
        """Waits up to `timeout` s for the core to exit (after `request_stop`); True if it did."""
        if self.process is None:
            return True
        self.process.process.join(timeout)
        return self.process.exitcode is not None

    def shutdown(self, timeout: float) -> None:
        """Asks the core to finish within `timeout` s, then stops it and releases everything; idempotent."""
        if self._closed:
            return
        if self.is_alive:
            self.request_stop(timeout)
            self._stop_wait = timeout + _EXIT_GRACE_S
        self.close()

    def set_stop_wait(self, seconds: float) -> None:
        """How long the process release waits for the core to exit on its own before forcing it."""
        self._stop_wait = seconds

    def close(self) -> None:
        """Releases everything in the ledger, newest first (the client's own resources and whatever its
        owner recorded around them); idempotent."""
        self.ledger.release_all()

    def _stop_process(self) -> None:
        assert self.process is not None
        self._closed = True
        self._mark_dead("the engine has been shut down")
        started = time.monotonic()
        outcome = self.process.stop(self._stop_wait)
        logger.debug("engine core %s after %.2f s", outcome, time.monotonic() - started)
        # The core's last message, what it released itself, is in the socket by now.
        while self._output.poll(0):
            self._decode(self._output.recv(copy=False).buffer)
        if self._async_output is not None:
            self._async_output.close(linger=0)
        if outcome != "exited":
            raise RuntimeError(f"the engine core had to be {outcome}")
