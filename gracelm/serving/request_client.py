"""Who a generation request comes from, as the endpoints (`ServingChat.create`, `ServingCompletion.create`)
need to know it: what the request is named, how it is admitted, and when its sender has left (a plain
answer's request is then aborted). An HTTP client (`HttpClient`) names it by its `X-Request-Id` header or
the body's `request_id`, is admitted by the server's state and leaves when its connection closes; a batch
line (`BatchLineClient`) is named by the line, was admitted by the batch runner before it started (the
runner holds that admission until the line's result is durable), runs at a lower priority than interactive
requests (`LINE_PRIORITY` at least) and never leaves.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from fastapi import Request

from gracelm.batch.objects import LINE_PRIORITY
from gracelm.lifecycle.server_state import ServerState
from gracelm.serving import request_ids


class HeldAdmission(Protocol):
    """What a request does with its admission: `Admission`'s two calls."""

    def started(self) -> None: ...

    def release(self) -> None: ...


class RequestClient(Protocol):
    def request_id(self, body_id: str | None, prefix: str) -> str:
        """The request's id: `prefix-` and the sender's name for it, else a fresh one."""
        ...

    def admit(self, state: ServerState) -> HeldAdmission:
        """The request's admission (raises `AdmissionRefused`)."""
        ...

    def priority(self, requested: int) -> int:
        """The engine priority the request runs at (lower first), given the one its body asks for."""
        ...

    async def disconnected(self) -> None:
        """Returns once the sender has gone (never, for one that cannot go)."""
        ...


class HttpClient:
    """A request of an HTTP client (`raw_request`, whose body has been read)."""

    def __init__(self, raw_request: Request) -> None:
        self._raw = raw_request

    def request_id(self, body_id: str | None, prefix: str) -> str:
        return request_ids.assign(self._raw, body_id, prefix)

    def admit(self, state: ServerState) -> HeldAdmission:
        return state.admit()

    def priority(self, requested: int) -> int:
        return requested

    async def disconnected(self) -> None:
        # The body has been read already, so the next message the server gives us is the disconnect.
        while (await self._raw.receive())["type"] != "http.disconnect":
            pass


class BatchLineClient:
    """A batch line's request: named `prefix-` and the body's `request_id` or else the line's own id; its
    admission is the runner's."""

    def __init__(self, line_id: str) -> None:
        self._line_id = line_id

    def request_id(self, body_id: str | None, prefix: str) -> str:
        return f"{prefix}-{request_ids.checked(body_id, 'request_id') if body_id else self._line_id}"

    def admit(self, state: ServerState) -> HeldAdmission:
        return _RunnersAdmission()

    def priority(self, requested: int) -> int:
        # Never ahead of an interactive request at the default 0; a line may ask to run later still.
        return max(requested, LINE_PRIORITY)

    async def disconnected(self) -> None:
        await asyncio.get_running_loop().create_future()  # a batch line has no connection to lose


class _RunnersAdmission:
    """The runner took the line's admission and releases it once the line's result is committed: the drain,
    which waits for every admission, then waits for that commit too."""

    def started(self) -> None:
        pass

    def release(self) -> None:
        pass
