"""Bounds on the connections a client may hold, against slowloris: its headers within `--header-timeout` s,
no pause longer than `--body-timeout` s while its body comes, and no more connections at once than the
process's descriptor limit leaves room for (`connection_cap`).

uvicorn bounds the idle time between requests of a kept-alive connection (`timeout_keep_alive`) but not the
time a client takes to send a request's headers, nor a new connection that sends nothing, nor a body that
never ends: a client that dribbles a byte now and then, or stops sending, holds its connection, and its file
descriptor, for ever (280 such under a limit of 300 descriptors once took `/health` down). This
`H11Protocol` (the protocol uvicorn uses without httptools) arms a timer when a connection is made and when
the first bytes of each later request arrive, and closes the connection if h11 has not read the whole head
when it fires; then, while the request's body is due, a timer that each of its bytes re-arms (as nginx's
`client_body_timeout`): it is not the client's fault while uvicorn itself has paused reading because the
app has not taken what came. Each closing is logged.

A connection beyond the cap is closed as soon as it is made (logged, at most every few seconds): held, each
takes a descriptor, and a process out of descriptors can open nothing, a model file or a socket to its
engine included. uvicorn's own `limit_concurrency` (the same cap) answers 503 to a request beyond it.
Pinned by `tests/test_request_limits.py`, which fails if uvicorn changes under it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import resource
import time
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# Descriptors left for what the server opens besides its connections while serving (a file upload, the
# journal's, a log's), above those it holds when the cap is computed.
_SPARE_FDS = 32
# Connections refused beyond the cap are logged at most this often.
_REFUSAL_LOG_S = 5.0
_last_refusal_log = 0.0


class LimitedProtocol(H11Protocol):
    def __init__(self, *args, header_timeout: float, body_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout
        self._body_timeout = body_timeout
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.config.limit_concurrency
        if cap is not None and len(self.connections) > cap:
            _log_refusal(len(self.connections), cap)
            self.transport.close()
            return
        self._arm(self._header_timeout, self._headers_late)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.SEND_BODY:
            self._arm(self._body_timeout, self._body_late)  # the body moves on
        elif self._timer is None and self.conn.their_state is h11.IDLE:
            self._arm(self._header_timeout, self._headers_late)  # a later request on a kept-alive one
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.conn.their_state
        super().handle_events()
        state = self.conn.their_state
        if state is h11.SEND_BODY and before is not h11.SEND_BODY:  # h11 produced the request's head
            self._arm(self._body_timeout, self._body_late)
        elif state is not h11.IDLE and state is not h11.SEND_BODY:  # the whole request is in
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, late: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        self._close(f"no complete request headers within {self._header_timeout:g} s (--header-timeout)")

    def _body_late(self) -> None:
        self._timer = None
        if self.flow.read_paused:  # uvicorn waits for the app to take the body: not the client's delay
            self._arm(self._body_timeout, self._body_late)
            return
        self._close(f"no byte of the request body for {self._body_timeout:g} s (--body-timeout)")

    def _close(self, why: str) -> None:
        if not self.transport.is_closing():
            logger.info("closing the connection of %s: %s", _client(self.client), why)
            self.transport.close()


def limited_protocol(header_timeout: float, body_timeout: float) -> Callable[..., LimitedProtocol]:
    """What `uvicorn.Config(http=...)` takes: it builds one protocol per connection."""
    return functools.partial(LimitedProtocol, header_timeout=header_timeout, body_timeout=body_timeout)


def connection_cap() -> int | None:
    """The most connections served at once (`uvicorn.Config.limit_concurrency`): what the descriptor limit
    leaves after those this process holds now and a spare few; None where the limit is infinite."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    cap = max(1, soft - len(os.listdir("/proc/self/fd")) - _SPARE_FDS)
    logger.info("at most %d connections at once (RLIMIT_NOFILE %d); more are closed as they come", cap, soft)
    return cap


def _log_refusal(connections: int, cap: int) -> None:
    global _last_refusal_log
    now = time.monotonic()
    if now - _last_refusal_log >= _REFUSAL_LOG_S:
        _last_refusal_log = now
        logger.warning("%d connections at once, above the cap of %d (the descriptor limit): closing the new "
                       "ones as they come", connections, cap)


def _client(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
