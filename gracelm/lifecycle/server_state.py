"""The server's lifecycle state and its admission of new requests, consulted by every route and driven by
the supervisor. It knows nothing of HTTP: a refusal is an `AdmissionRefused` that the routes answer as 503,
or a `QueueFull` (the server is healthy but has enough work) that they answer as 429.

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


class QueueFull(Exception):
    """No new request now, for load alone: `max_in_flight` sequences are in flight already."""


class ServerState:
    """What the routes consult: the lifecycle state, and the admitted requests not yet answered.

    Admission control, for requests whose client waits for the answer (a batch line's runner bounds its own):
    `max_in_flight` bounds the sequences in flight, running or waiting, as vLLM's `--max-num-queued-reqs`
    does (None: no bound; a request of `n` choices is `n` sequences), so that an overloaded server refuses at
    once what it would serve too late; `max_queue_wait` bounds the seconds a request may wait for its first
    output (`Admission.queue_wait_left`; None: no bound). `num_waiting` counts the requests admitted and
    without an output yet, for the service's status line.
    """

    def __init__(self, max_in_flight: int | None = None, max_queue_wait: float | None = None) -> None:
        self.lifecycle = Lifecycle.STARTING
        # Wall-clock time each state began, by name: the status page's uptime and drain, the last shutdown's
        # timeline.
        self.entered: dict[str, float] = {Lifecycle.STARTING.value: time.time()}
        self.max_in_flight = max_in_flight
        self.max_queue_wait = max_queue_wait
        self.num_in_flight = 0
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

    def _enter(self, waiting: bool, slots: int) -> None:
        self.num_waiting += waiting
        self.num_in_flight += slots
        self.num_active += 1
        self._idle.clear()

    def _leave(self, slots: int) -> None:
        self.num_in_flight -= slots
        self.num_active -= 1
        if self.num_active == 0:
            self._idle.set()

    def admit(self, *, background: bool = False, slots: int = 1) -> Admission:
        """Admits one request of `slots` sequences or raises `AdmissionRefused` or `QueueFull`; the caller
        releases the admission when the request leaves. A `background` request (a batch line) is admitted
        only while RUNNING: a drain stops background work at once, grace period or not. Its runner bounds how
        many it starts, so it is outside admission control: neither counted nor refused nor timed by it. A
        request larger than `max_in_flight` is admitted into an empty server, so that it is not refused for
        ever."""
        if background and not self.ready:
            raise AdmissionRefused(f"the server is {self.lifecycle.value} and starts no background work",
                                   "server_unavailable", close=False)
        if not (self.ready or (self.lifecycle is Lifecycle.DRAINING and self.accepting)):
            raise AdmissionRefused(f"the server is {self.lifecycle.value} and takes no new requests",
                                   "server_unavailable", close=True)
        if background:
            return Admission(self, waiting=False, slots=0)
        bound = self.max_in_flight
        if bound is not None and self.num_in_flight and self.num_in_flight + slots > bound:
            raise QueueFull(f"the server is at its bound of {bound} sequences in flight "
                            f"(--max-num-queued-reqs); retry later or elsewhere")
        return Admission(self, waiting=True, slots=slots, queue_wait=self.max_queue_wait)


class Admission:
    """One admitted request's place: its `slots` in flight until its end, in the waiting count until its
    first output or its end, and the time it may wait for that first output (`queue_wait`, seconds)."""

    def __init__(self, state: ServerState, waiting: bool = True, slots: int = 1,
                 queue_wait: float | None = None) -> None:
        self._state = state
        self._waiting = waiting
        self._slots = slots
        self._active = True
        self._wait_until = None if queue_wait is None else time.monotonic() + queue_wait
        state._enter(waiting, slots)

    def queue_wait_left(self) -> float | None:
        """Seconds left for the first output to come (None: no bound)."""
        return None if self._wait_until is None else self._wait_until - time.monotonic()

    def started(self) -> None:
        if self._waiting:
            self._waiting = False
            self._state.num_waiting -= 1

    def release(self) -> None:
        self.started()
        if self._active:
            self._active = False
            self._state._leave(self._slots)
