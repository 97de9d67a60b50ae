"""A bound on how long a client may take to send a request's headers (`--header-timeout`), against slowloris.

uvicorn bounds the idle time between requests of a kept-alive connection (`timeout_keep_alive`) but not the
time a client takes to send a request's headers, nor a new connection that sends nothing: a client that
dribbles a header byte now and then holds its connection, and its file descriptor, for ever. This
`H11Protocol` (the protocol uvicorn uses without httptools) arms a timer when a connection is made and when
the first bytes of each later request arrive, cancels it once h11 has read the whole head, and closes the
connection if it fires first. The body is not covered: it is read by the app, bounded in size by
`BodySizeLimit`. Pinned by `tests/test_request_limits.py`, which fails if uvicorn changes under it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeaderTimeoutProtocol(H11Protocol):
    def __init__(self, *args, header_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of a later request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # h11 produced the request's head
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self._header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            logger.info("closing the connection of %s: no complete request headers within %g s (--header-"
                        "timeout)", _client(self.client), self._header_timeout)
            self.transport.close()


def header_timeout_protocol(seconds: float) -> Callable[..., HeaderTimeoutProtocol]:
    """What `uvicorn.Config(http=...)` takes: it builds one protocol per connection."""
    return functools.partial(HeaderTimeoutProtocol, header_timeout=seconds)


def _client(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
