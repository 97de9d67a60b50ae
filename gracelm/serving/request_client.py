"""Who a generation request comes from, as the endpoints (`ServingChat.create`, `ServingCompletion.create`)
need to know it: what the request is named, how it is admitted, and when its sender has left (a plain
answer's request is then aborted). An HTTP client (`HttpClient`) names it by its `X-Request-Id` header or
the body's `request_id`, is admitted by the server's state and leaves when its connection closes; a batch
line (`BatchLineClient`) is named by the line, was admitted by the batch runner before it started (the
runner holds that admission until the line's result is durable), runs at a lower priority than interactive
requests (`LINE_PRIORITY` at least) and never leaves.

Request ids and the `X-Request-Id` header: a client (or a proxy) that sends one gets its requests named
by it, and every answer carries the header — the client's value, or the id the server gave the request.

An id goes into the log and into a response header, so a client's is refused (a 400 naming it) unless it is
printable ASCII of a bounded length (`checked_id`): a newline in it forged log lines, and an answer whose
header it broke never reached the client.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Protocol

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gracelm.batch.objects import LINE_PRIORITY
from gracelm.lifecycle.server_state import ServerState
from gracelm.serving.api_errors import APIError

ID_HEADER = "X-Request-Id"
MAX_CHARS = 256
_STATE_KEY = "request_id"


def checked_id(value: str, param: str) -> str:
    """`value`, a client's id given as `param`, where it is safe in a log line and a header."""
    if len(value) > MAX_CHARS or not (value.isascii() and value.isprintable()):
        raise APIError(400, f"{param} must be at most {MAX_CHARS} printable ASCII characters (no control "
                            f"characters), got {len(value)} characters", param=param, code="invalid_value")
    return value


def assign_id(raw_request: Request, body_id: str | None, prefix: str) -> str:
    """The id of a generation request: `prefix-` then the client's header, else the body's `request_id`
    (vLLM's field), else a fresh one (each client's `checked_id`). It is also the answer's header when the
    client sent none."""
    header = raw_request.headers.get(ID_HEADER)
    if header:
        base = checked_id(header, ID_HEADER)
    else:
        base = checked_id(body_id, "request_id") if body_id else uuid.uuid4().hex
    request_id = f"{prefix}-{base}"
    raw_request.scope.setdefault("state", {})[_STATE_KEY] = request_id
    return request_id


class RequestIdHeader:
    """Pure ASGI middleware (streams pass through untouched): sets `X-Request-Id` on every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(ID_HEADER.lower().encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                value = sent or str(scope.get("state", {}).get(_STATE_KEY) or uuid.uuid4().hex).encode()
                message["headers"] = [*message.get("headers", []), (ID_HEADER.lower().encode(), value)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class HeldAdmission(Protocol):
    """What a request does with its admission: `Admission`'s calls."""

    def queue_wait_left(self) -> float | None: ...

    def started(self) -> None: ...

    def release(self) -> None: ...


class RequestClient(Protocol):
    def request_id(self, body_id: str | None, prefix: str) -> str:
        """The request's id: `prefix-` and the sender's name for it, else a fresh one."""
        ...

    def admit(self, state: ServerState, slots: int) -> HeldAdmission:
        """The admission of a request of `slots` sequences (raises `AdmissionRefused`, `QueueFull`)."""
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
        return assign_id(self._raw, body_id, prefix)

    def admit(self, state: ServerState, slots: int) -> HeldAdmission:
        return state.admit(slots=slots)

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
        return f"{prefix}-{checked_id(body_id, 'request_id') if body_id else self._line_id}"

    def admit(self, state: ServerState, slots: int) -> HeldAdmission:
        return _RunnersAdmission()

    def priority(self, requested: int) -> int:
        # Never ahead of an interactive request at the default 0; a line may ask to run later still.
        return max(requested, LINE_PRIORITY)

    async def disconnected(self) -> None:
        await asyncio.get_running_loop().create_future()  # a batch line has no connection to lose


class _RunnersAdmission:
    """The runner took the line's admission and releases it once the line's result is committed: the drain,
    which waits for every admission, then waits for that commit too. A line may wait in the engine as long
    as interactive requests keep it from running."""

    def queue_wait_left(self) -> float | None:
        return None

    def started(self) -> None:
        pass

    def release(self) -> None:
        pass
