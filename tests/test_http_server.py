"""`HttpServer` (server/http_server.py) against the uvicorn installed.

The subclass replaces two of `uvicorn.Server`'s methods and relies on the rest: that `serve()` enters
`capture_signals()` and awaits `main_loop()`, that `on_tick(counter)` says when to stop (from `should_exit`)
and refreshes the Date header at counter 0, and that shutdown reads `config.timeout_graceful_shutdown` when it
runs (the supervisor lowers it while serving). These tests pin those internals, then check on a real socket
that the server serves, stops at once on `request_exit()`, closes its listener and installs no signal
handler. A failure here means uvicorn changed under the subclass: re-check http_server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import signal
import socket
import textwrap
import time
from collections.abc import AsyncIterator, Callable

import fastapi
import httpx
import pytest
import uvicorn

from gracelm.server.http_server import HttpServer

RECHECK = "uvicorn changed under gracelm/server/http_server.py: re-check its overrides against it"
# The signals uvicorn's capture_signals takes over on Linux (uvicorn.server.HANDLED_SIGNALS).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# capture_signals appeared in 0.29 (cooperative signal handling, encode/uvicorn#1600); checked on 0.54.0.
# The upper bound is loose because the source pins below fail on any change to the replaced methods.
CHECKED_FROM = (0, 29)
CHECKED_BELOW = (1, 0)

# The bodies of the two methods the subclass replaces, as checked (comments and blank lines aside): if
# uvicorn adds anything to them, the overrides silently drop it.
UVICORN_MAIN_LOOP = """
counter = 0
should_exit = await self.on_tick(counter)
while not should_exit:
    counter += 1
    counter = counter % 864000
    await asyncio.sleep(0.1)
    should_exit = await self.on_tick(counter)
"""
UVICORN_CAPTURE_SIGNALS = """
if threading.current_thread() is not threading.main_thread():
    yield
    return
original_handlers = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
try:
    yield
finally:
    for sig, handler in original_handlers.items():
        signal.signal(sig, handler)
for captured_signal in reversed(self._captured_signals):
    signal.raise_signal(captured_signal)
"""


def _body(function: Callable) -> str:
    """A method's body, dedented, without its signature, comments and blank lines."""
    lines = textwrap.dedent(inspect.getsource(function)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(("def ", "async def ")))
    end_of_signature = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith(":"))
    body = textwrap.dedent("\n".join(lines[end_of_signature + 1:])).splitlines()
    return "\n".join(line.rstrip() for line in body if line.strip() and not line.strip().startswith("#"))


# -- the internals the subclass relies on ----------------------------------------------------------------


def test_uvicorn_is_a_version_the_subclass_was_checked_against():
    major, minor = (int(part) for part in uvicorn.__version__.split(".")[:2])
    assert CHECKED_FROM <= (major, minor) < CHECKED_BELOW, f"uvicorn {uvicorn.__version__}: {RECHECK}"


def test_capture_signals_is_still_a_context_manager_method():
    method = uvicorn.Server.capture_signals
    # contextlib.contextmanager keeps the generator function it wraps as __wrapped__.
    assert inspect.isgeneratorfunction(getattr(method, "__wrapped__", None)), RECHECK
    assert list(inspect.signature(method).parameters) == ["self"], RECHECK
    assert HttpServer.capture_signals is not method


def test_main_loop_and_on_tick_are_still_coroutines_with_the_same_parameters():
    assert inspect.iscoroutinefunction(uvicorn.Server.main_loop), RECHECK
    assert list(inspect.signature(uvicorn.Server.main_loop).parameters) == ["self"], RECHECK
    assert inspect.iscoroutinefunction(uvicorn.Server.on_tick), RECHECK
    assert list(inspect.signature(uvicorn.Server.on_tick).parameters) == ["self", "counter"], RECHECK


def test_the_replaced_methods_are_unchanged():
    assert _body(uvicorn.Server.main_loop) == UVICORN_MAIN_LOOP.strip(), RECHECK
    assert _body(uvicorn.Server.capture_signals.__wrapped__) == UVICORN_CAPTURE_SIGNALS.strip(), RECHECK


def test_serve_still_enters_capture_signals_and_awaits_main_loop_before_shutdown():
    serve = inspect.getsource(uvicorn.Server.serve)
    assert "with self.capture_signals():" in serve, RECHECK
    # uvicorn 0.54 runs the rest in `_serve`: main_loop may be awaited in either.
    inner = getattr(uvicorn.Server, "_serve", None)
    source = serve + (inspect.getsource(inner) if inner is not None else "")
    main_loop = source.find("await self.main_loop()")
    assert main_loop >= 0, RECHECK
    assert source.find("await self.shutdown(", main_loop) > main_loop, RECHECK


def test_shutdown_reads_timeout_graceful_shutdown_when_it_runs():
    assert "timeout_graceful_shutdown" in inspect.signature(uvicorn.Config).parameters, RECHECK
    # Read from the config at shutdown, not copied at start: the supervisor lowers it while serving.
    assert "self.config.timeout_graceful_shutdown" in inspect.getsource(uvicorn.Server.shutdown), RECHECK


def test_on_tick_honours_should_exit_and_refreshes_the_date_header_at_counter_0():
    server = uvicorn.Server(_config(_app(Probe())))
    server.config.load()
    server.server_state.default_headers = []
    assert asyncio.run(server.on_tick(0)) is False
    # HttpServer ticks with counter 0 only, once a second: each tick must refresh the header.
    assert b"date" in [name for name, _ in server.server_state.default_headers], RECHECK
    server.should_exit = True
    assert asyncio.run(server.on_tick(7)) is True, RECHECK


# -- on a real socket ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Probe:
    """What the app saw: the signal handlers while serving, its lifespan, a request entered or cancelled."""

    handlers: dict | None = None
    lifespan: str = "not started"
    entered: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    cancelled: bool = False


def _handlers() -> dict:
    return {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}


def _app(probe: Probe) -> fastapi.FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
        probe.lifespan = "started"
        yield
        probe.lifespan = "shut down"

    app = fastapi.FastAPI(lifespan=lifespan)

    @app.get("/signals")
    async def signals() -> dict:
        probe.handlers = _handlers()
        return {"ok": True}

    @app.get("/sleep/{seconds}")
    async def sleep(seconds: float) -> dict:
        probe.entered.set()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            probe.cancelled = True
            raise
        return {"slept": seconds}

    return app


def _config(app: fastapi.FastAPI, timeout_graceful_shutdown: float | None = None) -> uvicorn.Config:
    # As api_server.py builds it: no logging configuration of uvicorn's own.
    return uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=timeout_graceful_shutdown)


async def _start(server: uvicorn.Server) -> tuple[asyncio.Task, str, socket.socket]:
    """Serves on a fresh 127.0.0.1 socket handed to serve(), as api_server.py does; returns once listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 10
    while not server.started:
        assert not task.done() and time.monotonic() < deadline, "the server did not start"
        await asyncio.sleep(0.01)
    host, port = sock.getsockname()
    return task, f"http://{host}:{port}", sock


def _client() -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment must not stand between the test and 127.0.0.1.
    return httpx.AsyncClient(trust_env=False, timeout=10)


def test_serves_stops_at_once_on_request_exit_and_leaves_the_signals_alone():
    probe = Probe()

    async def main() -> tuple[dict, dict, tuple[str, int], socket.socket]:
        # Read inside the loop: asyncio.run has put its SIGINT handler in place by now.
        before = _handlers()
        server = HttpServer(_config(_app(probe)))
        task, url, sock = await _start(server)
        address = sock.getsockname()
        async with _client() as client:
            response = await client.get(f"{url}/signals")
        assert (response.status_code, response.json()) == (200, {"ok": True})
        server.request_exit()
        await asyncio.wait_for(task, 2.0)  # TimeoutError here: it did not stop on request_exit
        return before, _handlers(), address, sock

    before, after, address, sock = asyncio.run(main())
    assert probe.handlers == before == after  # serve() installed no SIGINT/SIGTERM handler
    assert probe.lifespan == "shut down"
    assert sock.fileno() == -1
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=2).close()


def test_uvicorns_own_serve_still_takes_the_stop_signals():
    """The control for the test above: without the override, serve() installs uvicorn's handler."""
    probe = Probe()

    async def main() -> tuple[uvicorn.Server, dict, dict]:
        before = _handlers()
        server = uvicorn.Server(_config(_app(probe)))
        task, url, _ = await _start(server)
        async with _client() as client:
            assert (await client.get(f"{url}/signals")).status_code == 200
        server.should_exit = True
        await asyncio.wait_for(task, 5.0)
        return server, before, _handlers()

    server, before, after = asyncio.run(main())
    assert probe.handlers == {sig: server.handle_exit for sig in STOP_SIGNALS}, RECHECK
    assert after == before


def test_main_loop_ticks_once_a_second_and_wakes_at_once_on_request_exit():
    async def main() -> tuple[list[int], float]:
        server = HttpServer(_config(_app(Probe())))
        server.config.load()
        ticks: list[int] = []
        ticked = asyncio.Event()
        on_tick = server.on_tick

        async def counted(counter: int) -> bool:
            ticks.append(counter)
            ticked.set()
            return await on_tick(counter)

        server.on_tick = counted
        loop = asyncio.create_task(server.main_loop())
        await asyncio.wait_for(ticked.wait(), 5.0)  # its first tick: the next one is a second away
        ticked.clear()
        with pytest.raises(TimeoutError):  # half of that second passes without a tick
            await asyncio.wait_for(ticked.wait(), 0.5)
        assert not loop.done()
        asked = time.monotonic()
        server.request_exit()
        await asyncio.wait_for(loop, 2.0)
        return ticks, time.monotonic() - asked

    ticks, took = asyncio.run(main())
    # One tick at the start, one on waking: polling (uvicorn's every 0.1 s) would have ticked 5 times more.
    assert ticks == [0, 0]
    # Waiting for the next tick would take 0.5 s; the event wakes it within milliseconds.
    assert took < 0.3


def test_an_answer_in_flight_when_exit_is_requested_is_still_given():
    probe = Probe()

    async def main() -> httpx.Response:
        server = HttpServer(_config(_app(probe), timeout_graceful_shutdown=30))
        task, url, _ = await _start(server)
        async with _client() as client:
            request = asyncio.create_task(client.get(f"{url}/sleep/0.5"))
            await asyncio.wait_for(probe.entered.wait(), 5.0)
            server.request_exit()
            response = await asyncio.wait_for(request, 5.0)
        await asyncio.wait_for(task, 5.0)
        return response

    response = asyncio.run(main())
    assert (response.status_code, response.json()) == (200, {"slept": 0.5})
    assert not probe.cancelled


def test_timeout_graceful_shutdown_lowered_while_serving_cuts_a_request_short():
    probe = Probe()

    async def main() -> float:
        server = HttpServer(_config(_app(probe), timeout_graceful_shutdown=30))
        task, url, _ = await _start(server)
        server.config.timeout_graceful_shutdown = 0.5  # as the supervisor does on an immediate stop
        async with _client() as client:
            request = asyncio.create_task(client.get(f"{url}/sleep/30"))
            await asyncio.wait_for(probe.entered.wait(), 5.0)
            asked = time.monotonic()
            server.request_exit()
            await asyncio.wait_for(task, 5.0)  # TimeoutError here: it waited the 30 s it was built with
            took = time.monotonic() - asked
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await request
        return took

    took = asyncio.run(main())
    assert 0.5 <= took < 2.0
    assert probe.cancelled
