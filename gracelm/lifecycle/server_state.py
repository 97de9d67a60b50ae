"""The server's lifecycle state and its admission of new requests, consulted by every route and driven by
the supervisor. It knows nothing of HTTP: a refusal is an `AdmissionRefused` that the routes answer as 503.

STARTING → RUNNING → DRAINING → STOPPING, and DEAD from anywhere once the engine is gone. RUNNING takes new
work, and so does DRAINING during its grace period (`accepting`, for load balancers to notice the readiness
change); liveness (`/health`) holds until DEAD, readiness (`/ready`) only while RUNNING. `num_active` counts
the admitted requests not yet answered, which the drain waits for (`wait_idle()`: woken by the last answer,
not by polling).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

logger = logging.getLogger(__name__)


class Lifecycle(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPING = "stopping"
    DEAD = "dead"


class AdmissionRefused(Exception):
    """No new request now: `code` names why; `close`: the client should not reuse the connection (the
    server is going away), so a load balancer moves it to another instance."""

    def __init__(self, message: str, code: str, close: bool) -> None:
        super().__init__(message)
        self.code = code
        self.close = close


class ServerState:
    """What the routes consult: the lifecycle state and how many admitted requests still wait to start.

    A request counts as waiting from admission until its first output, i.e. while it queues in the engine;
    `max_waiting` bounds that queue (None: no bound) so an overloaded server answers 503 at once instead of
    piling up work it will serve too late.
    """

    def __init__(self, max_waiting: int | None) -> None:
        self.lifecycle = Lifecycle.STARTING
        # Wall-clock time each state began, by name: the status page's uptime and drain, the last shutdown's
        # timeline.
        self.entered: dict[str, float] = {Lifecycle.STARTING.value: time.time()}
        self.max_waiting = max_waiting
        self.num_waiting = 0
        self.num_active = 0
        self.accepting = True  # during DRAINING: still within the grace period
        self._idle = asyncio.Event()  # set while num_active is 0
        self._idle.set()

    def set(self, lifecycle: Lifecycle) -> None:
        if lifecycle is not self.lifecycle:
            logger.info("server state %s -> %s", self.lifecycle.value, lifecycle.value)
            self.lifecycle = lifecycle
            self.entered[lifecycle.value] = time.time()

    @property
    def alive(self) -> bool:
        return self.lifecycle is not Lifecycle.DEAD

    @property
    def ready(self) -> bool:
        return self.lifecycle is Lifecycle.RUNNING

    async def wait_idle(self) -> None:
        """Returns once no admitted request is left unanswered."""
        await self._idle.wait()

    def _enter(self, waiting: bool) -> None:
        self.num_waiting += waiting
        self.num_active += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.num_active -= 1
        if self.num_active == 0:
            self._idle.set()

    def admit(self, *, background: bool = False) -> Admission:
        """Admits one request or raises `AdmissionRefused`; the caller releases the admission when the
        request leaves. A `background` request (a batch line) is admitted only while RUNNING: a drain stops
        background work at once, grace period or not. Its runner bounds how many it starts, so it neither
        counts as waiting nor is refused for the waiting requests of others (`max_waiting` is for clients
        who wait for an answer)."""
        if background and not self.ready:
            raise AdmissionRefused(f"the server is {self.lifecycle.value} and starts no background work",
                                   "server_unavailable", close=False)
        if not (self.ready or (self.lifecycle is Lifecycle.DRAINING and self.accepting)):
            raise AdmissionRefused(f"the server is {self.lifecycle.value} and takes no new requests",
                                   "server_unavailable", close=True)
        if not background and self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise AdmissionRefused(f"too many waiting requests ({self.num_waiting}); try again later",
                                   "queue_full", close=False)
        return Admission(self, waiting=not background)


class Admission:
    """One admitted request's place in the waiting count, held until its first output or its end."""

    def __init__(self, state: ServerState, waiting: bool = True) -> None:
        self._state = state
        self._waiting = waiting
        self._active = True
        state._enter(waiting)

    def started(self) -> None:
        if self._waiting:
            self._waiting = False
            self._state.num_waiting -= 1

    def release(self) -> None:
        self.started()
        if self._active:
            self._active = False
            self._state._leave()
