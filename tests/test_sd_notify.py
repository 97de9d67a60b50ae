"""systemd's notification protocol, against a real `AF_UNIX` datagram socket set up as systemd sets it up
(`NOTIFY_SOCKET`, a path or an abstract name, and `WATCHDOG_USEC` in a real `gracelm serve`'s environment;
each datagram's sender checked by its credentials, as `NotifyAccess=main` does): READY only once `/ready`
answers 200, the status lines, watchdog pings at the asked rate while healthy and none once the core is
frozen while idle (whereupon the hang path ends the server, exit code 1), STOPPING and the drain's
extension at SIGTERM, and a server that serves on when the socket is gone."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from gracelm.lifecycle.sd_notify import SdNotify
from gracelm.lifecycle.supervisor import STOP_MARGIN_S
from tests.process_checks import core_stamps, wait_until
from tests.server_process import ServerProcess, start_streams
from tests.tiny_models import tiny_model

WATCHDOG_USEC = 1_000_000  # pings every 0.5 s
_UCRED = struct.Struct("3i")  # pid, uid, gid


class NotifySocket:
    """What systemd listens on: a datagram socket that receives with the sender's credentials. `messages`:
    (time.monotonic(), sender pid, fields) in arrival order; `on_ready(pid)` runs in the receiving thread
    before the next datagram is read."""

    def __init__(self, abstract: bool, on_ready=None) -> None:
        name = f"gracelm-test-notify-{os.getpid()}-{secrets.token_hex(4)}"
        if abstract:
            self.env_value, bind_to = f"@{name}", "\0" + name
            self.path: Path | None = None
        else:
            self.path = Path(tempfile.gettempdir()) / name
            self.env_value = bind_to = str(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind_to)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, int, dict[str, str]]] = []
        self.on_ready = on_ready
        self.errors: list[str] = []  # what `on_ready` raised
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
            except TimeoutError:
                continue
            except OSError:
                return
            pid = next(_UCRED.unpack(bytes(d[:_UCRED.size]))[0] for level, kind, d in ancillary
                       if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            if "READY" in fields and self.on_ready is not None:
                try:
                    self.on_ready(pid)
                except Exception as e:  # kept for the test's assertion message; the thread reads on
                    self.errors.append(repr(e))
            self.messages.append((time.monotonic(), pid, fields))

    def env(self, watchdog: bool) -> dict[str, str]:
        env = {"NOTIFY_SOCKET": self.env_value}
        if watchdog:
            env["WATCHDOG_USEC"] = str(WATCHDOG_USEC)
        return env

    def times(self, key: str, since: float = 0.0) -> list[float]:
        return [t for t, _, fields in self.messages if key in fields and t >= since]

    def statuses(self) -> list[str]:
        return [fields["STATUS"] for _, _, fields in self.messages if "STATUS" in fields]

    def wait_for(self, predicate, timeout: float = 30.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, _, fields in list(self.messages):
                if predicate(fields):
                    return fields
            time.sleep(0.02)
        raise AssertionError(f"no such notification within {timeout} s: {self.messages}")

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        self.sock.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


def serve(model: str, notify: NotifySocket, *args: str, watchdog: bool = True, **hooks) -> ServerProcess:
    env = notify.env(watchdog)
    if hooks:
        env["GRACELM_TEST_HOOKS"] = json.dumps(hooks)
    return ServerProcess(model, "--kv-cache-memory", "4MiB", "--stats-interval", "0", "--max-model-len",
                         "512", "--num-threads", "1", *args, env=env)


def core_of(server: ServerProcess) -> psutil.Process:
    return next(p for p in server.children if "engine-core" in " ".join(p.cmdline()))


def test_parsing_the_environment_as_sd_notify_does():
    assert SdNotify.from_env({}).enabled is False
    abstract = SdNotify.from_env({"NOTIFY_SOCKET": "@name", "WATCHDOG_USEC": "3000000"})
    assert abstract.address == b"\0name" and abstract.watchdog_usec == 3_000_000
    path = SdNotify.from_env({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "5",
                              "WATCHDOG_PID": str(os.getpid())})
    assert path.address == "/run/x" and path.watchdog_usec == 5
    assert SdNotify.from_env({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "5",
                              "WATCHDOG_PID": "1"}).watchdog_usec is None  # another process's watchdog
    assert SdNotify.from_env({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "soon"}).watchdog_usec is None
    assert SdNotify.from_env({"NOTIFY_SOCKET": "vsock:2:9"}).enabled is False
    assert SdNotify.from_env({"WATCHDOG_USEC": "5"}).watchdog_usec is None  # nobody to ping
    assert SdNotify("/nonexistent/notify.sock", None).notify(READY=1) is False  # logged, never raised


def ready_answer(pid: int) -> int:
    """`/ready` of the server `pid`, asked the moment its READY=1 arrives (at the port it listens on)."""
    port = next(c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                if c.status == psutil.CONN_LISTEN)
    return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code


def test_ready_after_ready_route_pings_while_healthy_and_none_once_the_idle_core_is_frozen(model):
    ready_answers: list[int] = []
    notify = NotifySocket(abstract=False, on_ready=lambda pid: ready_answers.append(ready_answer(pid)))
    hang_timeout = 3.0
    server = core = None
    try:
        server = serve(model, notify, "--engine-hang-timeout", str(hang_timeout))
        # The server may look ready to `serve` before the receiving thread has handled READY=1 (a busy
        # machine): READY is recorded once `on_ready` has run.
        notify.wait_for(lambda fields: "READY" in fields)
        assert ready_answers == [200], (ready_answers, notify.errors)
        ready_at = notify.times("READY")[0]
        first_pid, first = notify.messages[0][1], notify.messages[0][2]
        assert first["MAINPID"] == str(server.pid) and first["STATUS"].startswith("loading "), first
        assert {pid for _, pid, _ in notify.messages} == {server.pid}  # NotifyAccess=main would take each
        assert first_pid == server.pid
        # Healthy: a ping every WatchdogSec/2, measured over four of them.
        wait_until(lambda: len(notify.times("WATCHDOG", since=ready_at)) >= 4, 30,
                   lambda: f"four watchdog pings: {notify.messages}")
        pings = notify.times("WATCHDOG", since=ready_at)
        intervals = [b - a for a, b in zip(pings, pings[1:], strict=False)]
        # Generous bounds: the machine running the tests is shared and loaded.
        assert len(pings) >= 3 and all(i < 2.0 for i in intervals), intervals
        assert 0.3 < sum(intervals) / len(intervals) < 1.0, intervals
        assert all(fields["WATCHDOG"] == "1" for _, _, fields in notify.messages if "WATCHDOG" in fields)
        status = notify.wait_for(lambda f: f.get("STATUS", "").startswith("serving: "))
        assert status["STATUS"] == "serving: 0 requests (0 waiting)", status
        # Frozen while idle: no request is pending, yet the pings stop within a period and the liveness
        # probe left waiting makes the monitor judge a hang after the hang timeout.
        core = core_of(server)
        core.suspend()
        frozen = time.monotonic()
        code = server.wait_exit(hang_timeout + 20)
        assert code == 1, server.log()[-5000:]
        late = [t - frozen for t in notify.times("WATCHDOG", since=frozen)]
        assert len(late) <= 1 and all(t < 1.5 for t in late), late  # at most the one already on its way
        failed = notify.wait_for(lambda f: f.get("STATUS", "").startswith("failed: "))
        assert "hung" in failed["STATUS"], failed
        log = server.log()
        assert "watchdog pings withheld" in log and f"engine core pid {core.pid} hung" in log, log[-5000:]
        server.assert_nothing_left()
    finally:
        _cleanup(server, core)
        notify.close()


def test_a_slow_load_extends_the_start_then_sigterm_notifies_stopping_with_the_drains_bound(model):
    notify = NotifySocket(abstract=True)
    grace, timeout = 1.0, 20.0
    server = serve(model, notify, "--drain-grace-period", str(grace), "--shutdown-timeout", str(timeout),
                   test_step_sleep_s=0.05, test_slow_load_s=10.5)
    try:
        assert notify.env_value.startswith("@")
        (ready_at,) = notify.times("READY")
        assert notify.times("EXTEND_TIMEOUT_USEC")[0] < ready_at  # while loading: every 10 s
        loading = next(f for _, _, f in notify.messages if "EXTEND_TIMEOUT_USEC" in f)
        assert loading["EXTEND_TIMEOUT_USEC"] == "30000000", loading
        assert loading["STATUS"].startswith("loading "), loading
        (stream,) = start_streams(server.url, 1, max_tokens=60)
        notify.wait_for(lambda f: f.get("STATUS") == "serving: 1 requests (0 waiting)")
        signalled = time.monotonic()
        server.stop()  # SIGTERM: the running request finishes, exit code 0, nothing left
        stream.join()
        assert stream.finish_reasons == ["length"] and stream.completion_tokens == 60
        stopping = notify.wait_for(lambda f: "STOPPING" in f)
        assert stopping["STOPPING"] == "1"
        assert int(stopping["EXTEND_TIMEOUT_USEC"]) == int((grace + timeout + STOP_MARGIN_S) * 1_000_000)
        assert stopping["STATUS"] == ("draining: 1 requests left, 21 s to the deadline, still accepting "
                                      "(grace period)"), stopping
        assert notify.times("STOPPING")[0] >= signalled
        statuses = notify.statuses()
        assert statuses[-1] == "stopping", statuses
        assert any(s.startswith("draining: 1 requests left") and "accepting" not in s for s in statuses)
        assert {pid for _, pid, _ in notify.messages} == {server.pid}
    finally:
        _cleanup(server, None)
        notify.close()


def test_the_server_serves_on_when_the_notify_socket_is_gone(model):
    notify = NotifySocket(abstract=False)
    server = serve(model, notify)
    try:
        notify.wait_for(lambda f: "READY" in f)
        notify.close()  # the socket file is gone: every later notification fails
        wait_until(lambda: "not delivered to" in server.log(), 30, "the first notification that failed")
        # Pings go on failing. The core answers a liveness probe before each ping, and nothing else asks it
        # anything while idle: three more of its stamps are at least two more pings tried (and failed).
        stamps = core_stamps(server.pid)
        wait_until(lambda: core_stamps(server.pid) >= stamps + 3, 30, "three more liveness probes")
        for _ in range(3):
            answer = httpx.post(f"{server.url}/v1/completions",
                                json={"prompt": "the cat", "max_tokens": 5, "ignore_eos": True}, timeout=60)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/ready").status_code == 200
        server.stop()
        log = server.log()
        assert log.count("not delivered to") == 1, log[-5000:]  # said once, not at every ping
    finally:
        _cleanup(server, None)


def _cleanup(server: ServerProcess | None, core: psutil.Process | None) -> None:
    """After a failure: resume and kill the frozen core, then the server, by pid."""
    if core is not None:
        with contextlib.suppress(psutil.Error):
            core.resume()
            core.kill()
    if server is not None:
        if server.process.poll() is None:
            server.kill()
        with contextlib.suppress(FileNotFoundError):
            server.close_log()
