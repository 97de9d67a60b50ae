"""`gracelm fleet [serve options] --replicas N`: N local `gracelm serve` workers behind vllm-router (or
sglang-router) on one host, for a try-out and for tests. The router is the field's own, from PyPI, run
with the flags `gracelm deploy router` writes (`router.py`); the workers get the grace period it needs.

The fleet listens on `--host`/`--port` (the router); worker i on 127.0.0.1, port + 1 + i. Each child is
in a session of its own, so that a terminal's Ctrl-C reaches the fleet alone, which stops them in order,
and dies with the fleet (PR_SET_PDEATHSIG) if the fleet is killed.
- SIGTERM / SIGINT: every worker drains at once (the router keeps serving through their grace period),
  then the router stops. Exit 0 when every worker exited 0.
- SIGHUP: a rolling restart, one worker at a time: drained, started again on its port, back in the
  router's rotation, then the next. No request is lost (docs/deployment.md, "Behind a router").
- A worker or the router that exits on its own ends the fleet with exit code 1: it fails whole, loudly.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from gracelm.deploy import router
from gracelm.lifecycle.processes import set_parent_death_signal

logger = logging.getLogger("gracelm.fleet")

_POLL_S = 0.2


def _die_with_fleet() -> None:
    # Between fork and exec nothing may log; the prctl fails only for an invalid signal.
    set_parent_death_signal(signal.SIGTERM)


def _spawn(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_fleet)


def _executable(name: str) -> str:
    """A command installed beside this Python (the routers come with gracelm's environment), else on PATH."""
    found = shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise FileNotFoundError(f"{name} is not installed: pip install vllm-router (or sglang-router)")
    return found


class Fleet:
    def __init__(self, serve_flags: list[str], replicas: int, host: str, port: int, which: str,
                 policy: str, load_time: float) -> None:
        self.ports = [port + 1 + i for i in range(replicas)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.serve_flags = serve_flags
        self.load_time = load_time
        words = router.command(which, router.router_flags(host, port, router.listed(self.urls), policy))
        self.router_command = [_executable(words[0]), *words[1:]]
        self.router_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        self.workers: list[subprocess.Popen] = []
        self.router: subprocess.Popen | None = None
        self.stopping = threading.Event()

    def _worker(self, port: int) -> subprocess.Popen:
        return _spawn([_executable("gracelm"), "serve", *self.serve_flags, "--host", "127.0.0.1",
                       "--port", str(port)])

    def start(self) -> None:
        self.workers = [self._worker(port) for port in self.ports]
        for worker, url in zip(self.workers, self.urls, strict=True):
            self._wait(worker, f"{url}/ready", self.load_time)
        if self.stopping.is_set():  # a signal during the workers' start: no router to start, then stop
            return
        self.router = _spawn(self.router_command)
        self._wait(self.router, f"{self.router_url}/health", self.load_time)
        logger.info("fleet ready: %s in front of %s", self.router_url, " ".join(self.urls))

    def _wait(self, child: subprocess.Popen, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping.is_set():
            if child.poll() is not None:
                raise RuntimeError(f"{child.args[0]} exited with {child.returncode} while starting")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(_POLL_S)
        if not self.stopping.is_set():
            raise TimeoutError(f"{url} did not answer 200 within {timeout:g} s")

    def run(self) -> int:
        """Starts the fleet and serves until a signal ends it or a child fails; the exit code."""
        hangups: list[int] = []
        wake = threading.Event()

        def on_signal(signum: int, _frame: object) -> None:
            if signum == signal.SIGHUP:
                hangups.append(signum)
            else:
                self.stopping.set()
            wake.set()

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, on_signal)
        try:
            self.start()
            while not self.stopping.is_set():
                wake.wait(_POLL_S)
                wake.clear()
                if hangups:
                    hangups.clear()
                    # In this thread: a child's PR_SET_PDEATHSIG follows the thread that started it.
                    self.restart_rolling()
                problem = self._failed_child()
                if problem is not None:
                    raise RuntimeError(problem)
        except (RuntimeError, TimeoutError) as exc:
            logger.error("fleet failed: %s; stopping the rest", exc)
            self.stop()
            return 1
        return self.stop()

    def restart_rolling(self) -> None:
        for i, port in enumerate(self.ports):
            if self.stopping.is_set():
                return
            self._stop(self.workers[i])
            self.workers[i] = self._worker(port)
            self._wait(self.workers[i], f"{self.urls[i]}/ready", self.load_time)
            # Back in the router's rotation before the next worker leaves it.
            self.stopping.wait(router.readmission_time())
            logger.info("worker %d restarted on port %d", i, port)
        logger.info("rolling restart done")

    def _failed_child(self) -> str | None:
        named = [(f"worker {i}", w) for i, w in enumerate(self.workers)]
        named += [("router", self.router)] if self.router is not None else []
        return next((f"{name} exited with {c.returncode}" for name, c in named if c.poll() is not None),
                    None)

    def stop(self) -> int:
        """Workers first (they drain while the router still carries their streams), then the router."""
        logger.info("fleet stopping: the workers drain, then the router stops")
        self.stopping.set()
        codes = [self._stop(worker) for worker in self.workers]
        if self.router is not None:
            self._stop(self.router)
        return 0 if all(code == 0 for code in codes) else 1

    @staticmethod
    def _stop(child: subprocess.Popen) -> int:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        return child.wait()
