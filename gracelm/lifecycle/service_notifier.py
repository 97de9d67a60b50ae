"""What `gracelm serve` tells systemd as it goes (docs/deployment.md, "systemd"), through `SdNotify`;
nothing at all when `$NOTIFY_SOCKET` is unset.

- Start-up: `MAINPID=` and `STATUS=loading MODEL`; while the engine core loads, `EXTEND_TIMEOUT_USEC=` every
  10 s for 30 s more, so a load slower than `TimeoutStartSec` is not killed while the supervisor waits on
  it (a core that dies or fails while loading ends the start itself, exit code 3).
- `READY=1` once uvicorn listens and the server is RUNNING: from then on `/ready` answers 200.
- `STATUS=` at each phase (serving N requests, draining N left, stopping, failed), refreshed every 2 s when
  it changed.
- `STOPPING=1` when the drain starts, with `EXTEND_TIMEOUT_USEC=` covering the drain's whole bound (grace
  period, shutdown timeout and the supervisor's margin), so a long drain is not killed early.
- `WATCHDOG=1` every `WatchdogSec`/2 while the engine is healthy as `/health` judges it (the server alive,
  the core not ended by its monitor) *and* the core answers a liveness probe. The probe is one `stats`
  utility call per period: the core answers it between steps, or at once when idle. The monitor judges a
  hang only while work is pending, so a core frozen while idle would otherwise go unnoticed; an unanswered
  probe is pending work: no ping is sent while it is unanswered, it is never cancelled or resent, and after
  `--engine-hang-timeout` the monitor ends the core as HUNG (stacks, errors, exit 1) as for any request. So
  a frozen core stops the pings within one period, the server's own hang path acts next, and systemd's
  watchdog is the second line (`gracelm deploy systemd` sets `WatchdogSec` above the hang path's time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

from gracelm.lifecycle.sd_notify import SdNotify
from gracelm.lifecycle.server_state import Lifecycle, ServerState
from gracelm.lifecycle.signals import HANDLED_SIGNALS

logger = logging.getLogger(__name__)

# While loading: how often the start timeout is extended, and by how much from each message.
_LOAD_EXTEND_EVERY_S = 10.0
_LOAD_EXTEND_WINDOW_S = 30.0
# How often the status line is rebuilt (sent only when it changed).
_STATUS_EVERY_S = 2.0


def _usec(seconds: float) -> int:
    return int(seconds * 1_000_000)


class ServiceNotifier:
    def __init__(self, sd: SdNotify, state: ServerState) -> None:
        self.sd = sd
        self.state = state
        self._sent_status: str | None = None
        self._failure: str | None = None
        self._drain_deadline: float | None = None  # time.monotonic() of the drain's deadline
        self._probe: asyncio.Future | None = None  # the liveness probe not yet answered

    # -- start-up ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def loading(self, model: str) -> Iterator[None]:
        """Around the engine's start: extends systemd's start timeout while it lasts."""
        self.sd.notify(MAINPID=os.getpid(), STATUS=f"loading {model}")
        if not self.sd.enabled:
            yield
            return
        done = threading.Event()
        thread = threading.Thread(target=self._extend_while_loading, args=(model, done),
                                  name="sd-notify-loading", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _extend_while_loading(self, model: str, done: threading.Event) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)  # the main thread handles them
        started = time.monotonic()
        while not done.wait(_LOAD_EXTEND_EVERY_S):
            self.sd.notify(EXTEND_TIMEOUT_USEC=_usec(_LOAD_EXTEND_WINDOW_S),
                           STATUS=f"loading {model} ({time.monotonic() - started:.0f} s)")

    def start(self, serving: asyncio.Event, ready: Callable[[], bool], healthy: Callable[[], bool],
              probe: Callable[[], Awaitable[object]]) -> list[asyncio.Task]:
        """Once the engine runs: READY when `serving` is set and `ready()`; the status line; the watchdog
        (pinging while `healthy()` and `probe()` answers). Returns the tasks, for the caller to cancel."""
        if not self.sd.enabled:
            return []
        tasks = [asyncio.create_task(self._announce_ready(serving, ready), name="sd-notify-status")]
        if self.sd.watchdog_usec is not None:
            tasks.append(asyncio.create_task(self._watchdog(self.sd.watchdog_usec / 2e6, healthy, probe),
                                             name="sd-notify-watchdog"))
        return tasks

    async def _announce_ready(self, serving: asyncio.Event, ready: Callable[[], bool]) -> None:
        await serving.wait()
        if ready():
            self._sent_status = self._status()
            self.sd.notify(READY=1, STATUS=self._sent_status)
        while True:
            self.update()
            await asyncio.sleep(_STATUS_EVERY_S)

    # -- phases, from the supervisor -----------------------------------------------------------------

    def draining(self, deadline_s: float, bound_s: float) -> None:
        """The drain starts: requests end within `deadline_s`, the process within `bound_s`."""
        self._drain_deadline = time.monotonic() + deadline_s
        self._sent_status = self._status()
        self.sd.notify(STOPPING=1, EXTEND_TIMEOUT_USEC=_usec(bound_s), STATUS=self._sent_status)

    def failed(self, reason: str) -> None:
        self._failure = reason
        self.update()

    def update(self) -> None:
        """Sends the status line if it changed."""
        status = self._status()
        if status != self._sent_status:
            self._sent_status = status
            self.sd.notify(STATUS=status)

    def _status(self) -> str:
        state = self.state
        lifecycle = state.lifecycle
        if lifecycle is Lifecycle.RUNNING:
            return f"serving: {state.num_active} requests ({state.num_waiting} waiting)"
        if lifecycle is Lifecycle.DRAINING:
            left = max(0.0, (self._drain_deadline or time.monotonic()) - time.monotonic())
            accepting = ", still accepting (grace period)" if state.accepting else ""
            return f"draining: {state.num_active} requests left, {left:.0f} s to the deadline{accepting}"
        if lifecycle is Lifecycle.DEAD:
            return f"failed: {self._failure or 'the engine is dead'}"
        return lifecycle.value

    # -- the watchdog --------------------------------------------------------------------------------

    async def _watchdog(self, period: float, healthy: Callable[[], bool],
                        probe: Callable[[], Awaitable[object]]) -> None:
        loop = asyncio.get_running_loop()
        withheld = False
        while True:
            began = loop.time()
            alive = healthy() and await self._core_answers(probe, period) and healthy()
            if alive:
                self.sd.notify(WATCHDOG=1)
            if alive == withheld:  # a change: say it once
                withheld = not alive
                if withheld:
                    logger.warning("watchdog pings withheld: the engine is not healthy or its core did not "
                                   "answer a liveness probe within %.1f s", period)
                else:
                    logger.info("watchdog pings resumed: the engine core answers again")
            await asyncio.sleep(max(0.0, began + period - loop.time()))

    async def _core_answers(self, probe: Callable[[], Awaitable[object]], period: float) -> bool:
        """Whether the core answered the probe within `period`; an unanswered probe stays pending (the
        monitor counts it as due work) and is awaited again at the next period instead of a new one."""
        if self._probe is None:
            self._probe = asyncio.ensure_future(probe())
        done, _ = await asyncio.wait({self._probe}, timeout=period)
        if not done:
            return False
        answered, self._probe = self._probe, None
        return answered.exception() is None
