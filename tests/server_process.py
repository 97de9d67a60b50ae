"""A real `gracelm serve` process for tests: started on a free 127.0.0.1 port in a session of its own (so a
test may signal its whole process group), waited on until `/ready`, and stopped by pid with SIGTERM, after
which nothing of it may remain (process, port, runtime directory, shared-memory segment)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base

GRACELM = Path(sys.executable).parent / "gracelm"


# The logs of the servers a test starts, in TMPDIR: the test's own files, removed by `close_log`.
LOG_PREFIX = "gracelm-serve-"


def temp_entries() -> list[str]:
    """The names in TMPDIR (the system's temporary directory) that a server could have left: all but the
    servers' logs, and the runtime directories of this test process's own engines (checked apart)."""
    own = f"{PREFIX}{os.getpid()}-"
    return [name for name in os.listdir(tempfile.gettempdir())
            if not name.startswith((LOG_PREFIX, own))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Nothing listens on the port and a new server could bind it. (Connections the old server closed may
    linger in TIME_WAIT; SO_REUSEADDR, which servers set, is what lets a new one bind despite them.)"""
    listening = any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                    for c in psutil.net_connections(kind="tcp"))
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return not listening


def _of_another_live_server(entry: str, pid: int) -> bool:
    """A runtime directory of another server that still runs (one started beside this one): not this
    server's to have left."""
    m = re.match(rf"{PREFIX}(\d+)-", entry)
    return m is not None and int(m.group(1)) != pid and psutil.pid_exists(int(m.group(1)))


class ServerProcess:
    """`with ServerProcess(model, "--api-key", "k") as server:` … `server.url`; `stop()` does the checks."""

    def __init__(self, model: str | Path | None, *args: str, env: dict[str, str | None] | None = None,
                 startup_timeout: float = 180.0, wait_ready: bool = True,
                 prefix: tuple[str, ...] = (), port: int | None = None) -> None:
        self.port = port or free_port()  # a given port: a restart in the place of an earlier server
        self.url = f"http://127.0.0.1:{self.port}"
        self._temp_before = set(temp_entries())
        self._log = tempfile.NamedTemporaryFile(prefix=LOG_PREFIX, suffix=".log", delete=False)
        # `prefix`: a command that execs the server (same pid), e.g. one that drops capabilities.
        command = [*prefix, str(GRACELM), "serve", *([str(model)] if model is not None else []),
                   "--port", str(self.port), *args]
        environment = {**os.environ, **(env or {})}  # a value of None: unset
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={k: v for k, v in environment.items() if v is not None},
                                        start_new_session=True)
        self.children: list[psutil.Process] = []
        self.runtime_dirs: list[Path] = []
        self.exit_code: int | None = None
        if wait_ready:
            try:
                self.wait_ready(startup_timeout)
            except BaseException:
                self.kill()
                raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float, peers: tuple[ServerProcess, ...] = ()) -> None:
        """Until `/ready` answers 200, then `capture()`. Fails at once if the server, or one of `peers` (the
        other nodes of its group, which must stay up meanwhile), exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for server in (self, *peers):
                if server.process.poll() is not None:
                    code = server.process.returncode
                    raise RuntimeError(f"gracelm serve exited with {code}:\n{server.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError(f"gracelm serve not ready after {timeout} s:\n{self.log()}")
        self.capture()

    def capture(self) -> None:
        """Records what must be gone after the stop (children, runtime directories), while it runs."""
        self.children = psutil.Process(self.pid).children(recursive=True)
        self.runtime_dirs = sorted(runtime_base().glob(f"{PREFIX}{self.pid}-*"))

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Waits for the server to exit on its own; returns (and records) its exit code."""
        try:
            self.exit_code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"gracelm serve did not exit within {timeout} s:\n{self.log()}") from None
        return self.exit_code

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then asserts: exit code 0, no process of the server left, its port free, its runtime
        directory gone, nothing left for the resource tracker to clean up. Returns the exit code."""
        self.process.send_signal(signal.SIGTERM)
        self.wait_exit(timeout)
        assert self.exit_code == 0, f"exit code {self.exit_code}:\n{self.log()[-5000:]}"
        self.assert_nothing_left()
        # multiprocessing's resource tracker cleans up what a process of the server registered and never
        # released, and says so: a clean stop leaves it nothing.
        assert "resource_tracker: There appear to be" not in self.log(), self.log()[-5000:]
        return self.exit_code

    def assert_nothing_left(self) -> None:
        _, alive = psutil.wait_procs(self.children, timeout=2)
        assert not alive, f"processes left behind: {alive}"
        assert port_is_free(self.port), f"port {self.port} still in use"
        left = [d for d in self.runtime_dirs if d.exists()]
        left += list(runtime_base().glob(f"{PREFIX}{self.pid}-*"))
        assert not left, f"runtime directories left behind: {left}"
        segments = list(Path("/dev/shm").glob(f"{PREFIX}{self.pid}-*"))
        assert not segments, f"shared-memory segments left behind: {segments}"
        new = [entry for entry in temp_entries()
               if entry not in self._temp_before and not _of_another_live_server(entry, self.pid)]
        assert not new, f"left behind in TMPDIR: {new}"

    def kill(self) -> None:
        """Last resort after a failure: SIGKILL the server and each of its processes, by pid."""
        procs = list(self.children)
        if self.process.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True), *procs]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        self.process.wait(10)

    def close_log(self) -> None:
        self._log.close()
        os.unlink(self._log.name)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type, *_) -> None:
        try:
            if exc_type is None:
                self.stop()
            else:
                self.kill()
        finally:
            self.close_log()


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text, matched by name and the labels given."""
    for line in metrics_text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise KeyError(f"no sample {name}{labels} in the metrics")


class Stream:
    """One streaming completion read in a thread of its own: `events` (the SSE data payloads, `[DONE]`
    included), `started` once the first token arrived, `ended_at` (monotonic) once it ended."""

    def __init__(self, url: str, max_tokens: int, prompt: str = "the cat",
                 headers: dict[str, str | bytes] | None = None) -> None:
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self._first = threading.Event()
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        self._thread = threading.Thread(target=self._run, args=(url, body, headers or {}), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict, headers: dict[str, str | bytes]) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                              timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self._first.set()
        except BaseException as e:  # noqa: BLE001 - reported to the test through `error`
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self._first.set()

    def wait_started(self, timeout: float = 60) -> None:
        assert self._first.wait(timeout), "the stream never started"

    def join(self, timeout: float = 120) -> Stream:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self

    @property
    def payloads(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    @property
    def finish_reasons(self) -> list[str]:
        choices = [c for p in self.payloads for c in p.get("choices", [])]
        return [c["finish_reason"] for c in choices if c.get("finish_reason")]

    @property
    def completion_tokens(self) -> int | None:
        usage = [p["usage"] for p in self.payloads if p.get("usage")]
        return usage[-1]["completion_tokens"] if usage else None

    @property
    def errors(self) -> list[dict]:
        return [p["error"] for p in self.payloads if "error" in p]


def start_streams(url: str, count: int, max_tokens: int,
                  headers: dict[str, str | bytes] | None = None) -> list[Stream]:
    streams = [Stream(url, max_tokens, headers=headers) for _ in range(count)]
    for stream in streams:
        stream.wait_started()
    return streams
