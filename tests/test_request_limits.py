"""Bounded request cost: stop strings beyond `--max-stop-strings` or `--max-stop-chars` are a 400 naming the
option (chat and completions, plain and streaming); `/health` answers while the costliest request the
limits allow runs; `--header-timeout` closes a connection whose request headers do not come in time, and
`--body-timeout` one whose body stops coming; connections beyond the descriptor limit's room are closed as
they come, and the server serves again once the timeouts have freed them."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time

import httpx
import pytest

from tests.costly_requests import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, costliest_completion
from tests.server_process import ServerProcess, metric_value
from tests.tiny_models import tiny_model

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server():
    # Default request limits; room for all 128 choices of the costliest request at once.
    with ServerProcess(tiny_model("llama"), "--kv-cache-memory", "32MiB", "--max-model-len", "512",
                       "--max-num-seqs", str(MAX_N), "--num-threads", "1", "--stats-interval", "0",
                       "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)
                       ) as server:
        yield server


def _post(server, route: str, body: dict, stream: bool) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={**body, "stream": stream}, timeout=60)


@pytest.mark.parametrize("stop,option", [
    ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "--max-stop-strings"),
    (["x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)], "--max-stop-chars"),
])
@pytest.mark.parametrize("route,body", [("completions", {"prompt": "the cat"}),
                                        ("chat/completions", {"messages": USER})])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_beyond_the_limits_are_refused_naming_the_option(server, stop, option, route, body,
                                                                      stream):
    refused = _post(server, route, {**body, "stop": stop, "max_tokens": 2}, stream)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "stop" and error["code"] == "limit_exceeded" and option in error["message"]
    at_limit = _post(server, route, {**body, "stop": stop[:-1], "max_tokens": 2}, stream)
    assert at_limit.status_code == 200, at_limit.text


def _probe_while_costliest_runs(server, probes: list[float]) -> list[str]:
    """Streams the costliest request while `/health` is probed again and again; returns its SSE events."""
    events: list[str] = []
    started = threading.Event()

    def run() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=costliest_completion(60),
                          timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    started.set()
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(120), "the costly request never started"
    while thread.is_alive():
        begun = time.monotonic()
        # A probe that waits more than a second (far more than the loop ever should) raises here.
        assert httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200
        probes.append(time.monotonic() - begun)
        time.sleep(0.02)
    thread.join()
    return events


def test_health_answers_while_the_costliest_allowed_request_runs(server):
    probes: list[float] = []
    for _ in range(10):  # on a fast machine one request may end before five probes: another is sent
        events = _probe_while_costliest_runs(server, probes)
        assert events[-1] == "[DONE]", events[-3:]
        choices = [c for event in events[:-1] for c in json.loads(event)["choices"]]
        reasons = [c["finish_reason"] for c in choices if c["finish_reason"]]
        assert reasons == ["length"] * MAX_N
        if len(probes) >= 5:
            break
    assert len(probes) >= 5, probes
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert metric_value(metrics, "gracelm_kv_cache_usage_perc") == 0


def _read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response with a Content-Length (its head and body may come in separate reads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _closed_within(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closed `sock`, reading (and discarding) whatever it sent before."""
    sock.settimeout(limit)
    begun = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        while sock.recv(65536):
            pass
    return time.monotonic() - begun


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        elapsed = _closed_within(sock, 30)
    assert HEADER_TIMEOUT * 0.9 <= elapsed < HEADER_TIMEOUT + 10


def test_headers_dribbled_byte_by_byte_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        begun = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while time.monotonic() - begun < HEADER_TIMEOUT + 10:
                sock.sendall(b"X")  # a header that never ends: a byte now and then keeps nothing open
                time.sleep(0.1)
                sock.setblocking(False)
                try:
                    if sock.recv(1) == b"":
                        break
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
        elapsed = time.monotonic() - begun
    assert HEADER_TIMEOUT * 0.9 <= elapsed < HEADER_TIMEOUT + 10


def test_a_kept_alive_connection_serves_whole_requests_and_cuts_off_a_slow_one(server):
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for _ in range(2):
            time.sleep(HEADER_TIMEOUT * 0.6)  # together longer than the timeout: each request has its own
            sock.sendall(request)
            answer = _read_response(sock)
            assert answer.startswith(b"HTTP/1.1 200"), answer
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # and the rest never comes
        elapsed = _closed_within(sock, 30)
    assert HEADER_TIMEOUT * 0.9 <= elapsed < HEADER_TIMEOUT + 10
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


BODY_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n")


def test_a_body_that_stops_coming_is_cut_off_after_the_body_timeout(server):
    body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(BODY_HEAD % len(body) + body[:5])  # and the rest never comes
        elapsed = _closed_within(sock, 30)
    assert BODY_TIMEOUT * 0.9 <= elapsed < BODY_TIMEOUT + 10
    assert "no byte of the request body for 1.5 s (--body-timeout)" in server.log()


def test_a_body_that_comes_slowly_but_on_is_served(server):
    """Each byte of the body re-arms the timeout: only a pause longer than it cuts the connection."""
    body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(BODY_HEAD % len(body))
        for part in (body[:10], body[10:20], body[20:]):
            time.sleep(BODY_TIMEOUT * 0.6)  # together longer than the timeout
            sock.sendall(part)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")


def test_connections_beyond_the_descriptor_limit_are_closed_and_the_server_serves_on(tmp_path):
    """Under a limit of 200 descriptors, 260 connections that send nothing: the server closes those beyond
    its cap at once (logged), keeps its own files, and serves again once the header timeout has closed the
    others."""
    with ServerProcess(tiny_model("llama"), "--kv-cache-memory", "4MiB", "--num-threads", "1",
                       "--stats-interval", "0", "--header-timeout", "3", prefix=("prlimit", "--nofile=200")
                       ) as server:
        assert re.search(r"at most \d+ connections at once \(RLIMIT_NOFILE 200\)", server.log())
        held = []
        try:
            for _ in range(260):
                held.append(socket.create_connection(("127.0.0.1", server.port)))
            deadline = time.monotonic() + 30
            while "above the cap of" not in server.log():
                assert time.monotonic() < deadline, server.log()[-3000:]
                time.sleep(0.1)
            # The server closes every one held: those beyond the cap at once, the rest at the header timeout.
            deadline = time.monotonic() + 30
            for sock in held:
                _closed_within(sock, max(0.1, deadline - time.monotonic()))
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        finally:
            for sock in held:
                sock.close()
        assert "Too many open files" not in server.log()
