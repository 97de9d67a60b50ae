"""The one owner of the engine core's end: a thread that reads everything the core says and watches every
sign that it is gone or stuck, and decides, once, how it ended.

As in gunicorn's arbiter, signs are only recorded where they arrive; this one loop decides and acts. It
waits (no polling interval) on:
- the output channel: outputs and replies are put, in order, into the owner's inbox; a `FatalError` report
  (with its traceback) ends the core as RAISED at once, even before the process has exited; `Stopped` carries
  what the core released, for the shutdown report;
- the process sentinel: the exit status says EXITED, KILLED or STOPPED (status 0 after a stop request);
  messages the core sent before it died are read first: the channel's end (the kernel closes a dead
  process's connection) is awaited, so that nothing still in flight is lost;
- the channel's end (a ZMQ disconnect): a core that closed its channel must exit within a second;
- the heartbeat, judged from this side: the owner says when it expects progress (`set_busy`: requests sent
  and not finished, a call not answered, a stop not completed); no stamp for `hang_timeout` seconds since
  the later of the last stamp and the moment work began is a hang (HUNG, after a stack dump). A core frozen
  while idle is caught the moment work is sent to it.

The end (a `ProcessEnd`) goes into the inbox after every message that preceded it, and to each listener,
exactly once. See docs/architecture.md, "The core's end".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from gracelm.engine import messages as msg
from gracelm.lifecycle.heartbeat import Heartbeat
from gracelm.lifecycle.ledger import Outcome, ResourceKind, ResourceReport
from gracelm.lifecycle.process_end import EndReason, ProcessEnd, end_of_exit
from gracelm.lifecycle.processes import ChildProcess, reaped_exitcode
from gracelm.lifecycle.stacks import request_stack_dumps

logger = logging.getLogger(__name__)

NAME = "engine core"
# After asking a hung core for its stacks, how long to give it to write them.
_HANG_DUMP_WAIT_S = 0.5
# A core that closed its channel has this long to exit before it counts as stuck.
_CLOSED_CHANNEL_EXIT_S = 1.0
# After the core's exit, how long its last messages may take to arrive, up to the channel's end.
_LAST_MESSAGES_S = 0.5

Inbox = queue.SimpleQueue  # of msg.FromCore, then one ProcessEnd last
EndListener = Callable[[ProcessEnd], None]


class CoreMonitor:
    def __init__(self, output: zmq.Socket, heartbeat: Heartbeat, hang_timeout: float) -> None:
        self.process: ChildProcess | None = None
        self.inbox: Inbox = queue.SimpleQueue()
        self.core_report: list[ResourceReport] = []  # what the core released itself, from `Stopped`
        self._output = output
        self._heartbeat = heartbeat
        self._hang_timeout = hang_timeout
        self._lock = threading.Lock()
        self._end: ProcessEnd | None = None
        self._ended = threading.Event()
        self._listeners: list[EndListener] = []
        self._waker: Callable[[], None] | None = None
        self._busy_since: float | None = None
        self._stop_requested = False
        self._connections = 0  # of the core's channel: it connects once, and the end closes it
        self._channel_closed_at: float | None = None
        self._closing = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._channel_events = output.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._thread = threading.Thread(target=self._run, name="gracelm-core-monitor", daemon=True)

    # -- the owner's side ----------------------------------------------------------------------------

    def start(self, process: ChildProcess) -> None:
        """Begins watching the core, right after its process started (its start-up messages included)."""
        self.process = process
        self._thread.start()

    @property
    def end(self) -> ProcessEnd | None:
        """None while the core lives; then how it ended (set once, never changed)."""
        return self._end

    def wait_end(self, timeout: float | None) -> ProcessEnd | None:
        self._ended.wait(timeout)
        return self._end

    def add_listener(self, listener: EndListener) -> None:
        """`listener(end)` is called once, from the monitor's thread (at once if the core has ended)."""
        with self._lock:
            if self._end is None:
                self._listeners.append(listener)
                return
        listener(self._end)

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """Called from the monitor's thread after each item put into the inbox (an asyncio owner schedules
        the inbox's reading in its loop with it)."""
        self._waker = waker
        if waker is not None and not self.inbox.empty():
            waker()

    def set_busy(self, busy: bool) -> None:
        """Whether the owner now expects progress from the core (work it sent is not finished)."""
        with self._lock:
            if not busy:
                self._busy_since = None
                return
            if self._busy_since is not None:
                return
            self._busy_since = time.monotonic()
        self._wake()  # the wait gets a deadline now

    def record_stop_requested(self) -> None:
        """The owner asked the core to stop: an exit with status 0 is now a requested stop."""
        self._stop_requested = True

    def close(self) -> None:
        """Stops watching (idempotent); the end, if decided, stays."""
        self._closing = True
        self._wake()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with contextlib.suppress(OSError):
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._output.disable_monitor()
        self._channel_events.close(linger=0)

    # -- the one loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        assert self.process is not None
        poller = zmq.Poller()
        for source in (self._output, self._channel_events, self._wake_r, self.process.sentinel):
            poller.register(source, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(self._timeout_ms()))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if self._closing:
                    return
                end = self._decide(events)
                if end is not None:
                    self._announce(end)
                    return
        except Exception as e:  # a bug here must not leave the owner waiting for ever
            logger.exception("the engine core's monitor failed")
            self._announce(ProcessEnd(EndReason.RAISED, f"the engine core's monitor failed: {e}", self._pid))

    @property
    def _pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def _decide(self, events: dict) -> ProcessEnd | None:
        if self._output in events:
            reported = self._read_messages()
            if reported is not None:
                return reported
        if self._channel_events in events:
            self._read_channel_events()
        assert self.process is not None
        if self.process.sentinel in events:
            return self._exit_end()
        return self._stall_end()

    def _read_messages(self) -> ProcessEnd | None:
        """Everything the core has sent so far; its fatal report, if one came."""
        while self._output.poll(0):
            message = msg.decode_from_core(self._output.recv(copy=False).buffer)
            if isinstance(message, msg.FatalError):
                logger.error("engine core failed:\n%s", message.traceback)
                return ProcessEnd(EndReason.RAISED, f"engine core failed: {message.error}", self._pid,
                                  traceback=message.traceback)
            if isinstance(message, msg.Stopped):
                self.core_report = [_resource_report(r) for r in message.resources]
                continue
            self._put(message)
        return None

    def _read_channel_events(self) -> None:
        while self._channel_events.poll(0):
            event = recv_monitor_message(self._channel_events)["event"]
            self._connections += 1 if event == zmq.EVENT_ACCEPTED else -1
            if self._connections == 0:
                self._channel_closed_at = time.monotonic()

    def _exit_end(self) -> ProcessEnd:
        assert self.process is not None
        reported = self._read_last_messages()  # what it sent before it died comes first
        exitcode = reaped_exitcode(self.process)
        if reported is not None:
            return dataclasses.replace(reported, exitcode=exitcode)
        return end_of_exit(NAME, self._pid, exitcode, self._stop_requested)

    def _read_last_messages(self) -> ProcessEnd | None:
        """After the exit: everything the core sent, read up to its channel's end (bounded)."""
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._channel_events, zmq.POLLIN)
        deadline = time.monotonic() + _LAST_MESSAGES_S
        # Until the channel's end is seen, not merely while connections are counted: the count lags the
        # channel's own events, and a core that connected just before it died may not be counted yet.
        self._read_channel_events()
        while self._channel_closed_at is None and (remaining := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(remaining * 1000) + 1))
            reported = self._read_messages() if self._output in events else None
            if reported is not None:
                return reported
            if self._channel_events in events:
                self._read_channel_events()
        return self._read_messages()

    def _stall_end(self) -> ProcessEnd | None:
        now = time.monotonic()
        pid = self._pid
        if self._channel_closed_at is not None and now - self._channel_closed_at >= _CLOSED_CHANNEL_EXIT_S:
            return ProcessEnd(EndReason.HUNG, f"{NAME} pid {pid} closed its channel but did not exit", pid)
        stalled = self._stalled(now)
        if stalled is None or stalled < self._hang_timeout:
            return None
        logger.error("pid %d made no step progress for %.1f s with work pending (hang timeout %.1f s)",
                     pid, stalled, self._hang_timeout)
        if request_stack_dumps([pid]):
            time.sleep(_HANG_DUMP_WAIT_S)  # the dump is written by the hung process itself
        message = f"{NAME} pid {pid} hung: no step finished for {stalled:.1f} s with work pending"
        return ProcessEnd(EndReason.HUNG, message, pid)

    def _stalled(self, now: float) -> float | None:
        """Seconds without a stamp since work was pending; None when nothing is expected of the core."""
        busy_since = self._busy_since
        if busy_since is None or self._hang_timeout <= 0:
            return None
        return now - max(busy_since, self._heartbeat.read().stamp)

    def _timeout_ms(self) -> int | None:
        now = time.monotonic()
        deadlines = []
        if self._channel_closed_at is not None:
            deadlines.append(self._channel_closed_at + _CLOSED_CHANNEL_EXIT_S - now)
        stalled = self._stalled(now)
        if stalled is not None:
            deadlines.append(self._hang_timeout - stalled)
        if not deadlines:
            return None  # nothing is expected: wait for a sign, without a timer
        return max(1, int(min(deadlines) * 1000) + 1)

    # -- announcing ----------------------------------------------------------------------------------

    def _put(self, item: msg.FromCore | ProcessEnd) -> None:
        self.inbox.put(item)
        waker = self._waker
        if waker is not None:
            waker()

    def _announce(self, end: ProcessEnd) -> None:
        with self._lock:
            if self._end is not None:
                return
            self._end = end
            listeners, self._listeners = self._listeners, []
        if end.fatal:
            logger.error("engine core ended (%s): %s", end.reason.value, end.message)
        else:
            logger.info("engine core ended (%s): %s", end.reason.value, end.message)
        self._ended.set()
        self._put(end)
        for listener in listeners:
            try:
                listener(end)
            except Exception:  # one listener's bug must not keep the others from hearing of the end
                logger.exception("a listener of the engine core's end failed")

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")


def _resource_report(entry: dict) -> ResourceReport:
    return ResourceReport(**{**entry, "kind": ResourceKind(entry["kind"]),
                             "outcome": Outcome(entry["outcome"])})
