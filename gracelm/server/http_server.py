"""uvicorn, as the supervisor drives it: a small subclass of `uvicorn.Server` with three documented changes,
pinned by `tests/test_http_server.py`, which fails if uvicorn changes under them.

1. `capture_signals` does nothing. uvicorn installs its own SIGINT/SIGTERM handlers around `serve()` and
   re-raises a caught signal once it has stopped, which would kill the process before the engine is shut
   down; the supervisor owns this process's signals (`lifecycle/signals.py`).
2. `main_loop` wakes as soon as `request_exit()` is called. uvicorn looks at `should_exit` every 0.1 s;
   here the wait is on an event, so a stop costs no polling interval. It still ticks once a second, which
   refreshes uvicorn's `Date` header.
3. `serving` is an event set once `main_loop` begins: the listener accepts and the app's lifespan has
   started, so `/ready` answers (systemd's `READY=1` waits for it).

Everything else, shutdown included (stop listening, close idle connections, wait for the rest up to
`timeout_graceful_shutdown`, lifespan shutdown), is uvicorn's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn

# How often the main loop ticks when nothing asks it to stop: uvicorn's `Date` header has 1 s resolution.
_TICK_S = 1.0


class HttpServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exit_requested = asyncio.Event()
        self.serving = asyncio.Event()

    def request_exit(self) -> None:
        """Stop serving: uvicorn's graceful shutdown begins at once."""
        self.should_exit = True
        self._exit_requested.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        self.serving.set()
        # A tick counter of 0 refreshes the Date header at every tick: uvicorn does it at every tenth of
        # its 0.1 s ticks, once a second as here.
        while not await self.on_tick(0):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_requested.wait(), _TICK_S)
