"""Two watchdogs of the supervisor over its children: one for a child that hangs, one for a child that dies.

`Heartbeat` is a 32-byte slot in a file of the runtime directory, mapped in both processes: the engine loop
stamps it (a few aligned 8-byte stores, ~1 µs) and the supervisor reads it. `HangWatchdog` is a supervisor
thread that calls `on_hang(pid, stalled_s)` once when the slot says work is pending and has not been
stamped for `hang_timeout` seconds. CLOCK_MONOTONIC is one clock for every process of the machine, so the
stamp of one process compares with the clock of the other.

`ProcessSentinelWatch` is a supervisor thread blocked in `multiprocessing.connection.wait` on the children's
sentinels (and a wake-up pipe): a child's death wakes it at once, with no polling interval to wait out.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import mmap
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Protocol

from gracelm.lifecycle.exit_codes import ExitCode

logger = logging.getLogger(__name__)

# Slot layout, int64 each: last stamp (CLOCK_MONOTONIC ns), steps stamped, work pending (0/1), writer pid.
_STAMP, _STEPS, _PENDING, _PID = range(4)
_SLOT_BYTES = 4 * 8
# How soon after the timeout a hang is noticed, as a share of the timeout (capped at one second).
_CHECK_SHARE = 0.1
# After a sentinel fires the child may take a moment more to become reapable.
_REAP_WAIT_S = 1.0
_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})


@dataclasses.dataclass(frozen=True)
class Beat:
    stamp: float  # time.monotonic() of the last stamp; 0.0 if never stamped
    steps: int
    work_pending: bool
    pid: int


class Heartbeat:
    """The shared slot. The supervisor `create`s it (in the runtime directory) and passes the path to the
    child, which `open`s it and calls `beat()`; both `close()` it (the file goes with the directory)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        try:
            self._map = mmap.mmap(fd, _SLOT_BYTES)
        finally:
            os.close(fd)
        self._slot = (ctypes.c_int64 * 4).from_buffer(self._map)

    @classmethod
    def create(cls, path: str | Path) -> Heartbeat:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(fd, _SLOT_BYTES)
        return cls(Path(path), fd)

    @classmethod
    def open(cls, path: str | Path) -> Heartbeat:
        """The writer's side: also records the writer's pid, for the watchdog to name the hung process."""
        heartbeat = cls(Path(path), os.open(path, os.O_RDWR | os.O_CLOEXEC))
        heartbeat._slot[_PID] = os.getpid()
        return heartbeat

    def beat(self, work_pending: bool) -> None:
        """Once per loop iteration: after taking in new work and after each step (so that going idle is
        stamped too). The stamp is written before the flag and read after it, so that a reader never
        pairs a fresh `pending` with a stale stamp."""
        self._slot[_STAMP] = time.monotonic_ns()
        self._slot[_STEPS] += 1
        self._slot[_PENDING] = int(work_pending)

    def read(self) -> Beat:
        pending = bool(self._slot[_PENDING])
        return Beat(self._slot[_STAMP] / 1e9, self._slot[_STEPS], pending, self._slot[_PID])

    def close(self) -> None:
        if self._map.closed:
            return
        del self._slot  # the ctypes view pins the map's buffer; it must go first
        self._map.close()


class HangWatchdog:
    """Calls `on_hang(pid, stalled_s)` once, from its own thread, when work is pending and the heartbeat is
    older than `hang_timeout` s; `hang_timeout` 0 disables it (start() then does nothing)."""

    def __init__(self, heartbeat: Heartbeat, hang_timeout: float,
                 on_hang: Callable[[int, float], None]) -> None:
        self.heartbeat = heartbeat
        self.hang_timeout = hang_timeout
        self.on_hang = on_hang
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gracelm-hang-watchdog", daemon=True)

    def start(self) -> None:
        if self.hang_timeout > 0:
            self._thread.start()

    def stop(self) -> None:
        """Idempotent; also safe when never started, and from within `on_hang`."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        interval = min(1.0, self.hang_timeout * _CHECK_SHARE)
        while not self._stop.wait(interval):
            beat = self.heartbeat.read()
            stalled = time.monotonic() - beat.stamp
            if beat.work_pending and stalled >= self.hang_timeout:
                logger.error("pid %d made no step progress for %.1f s with work pending "
                             "(hang timeout %.1f s)", beat.pid, stalled, self.hang_timeout)
                self.on_hang(beat.pid, stalled)
                return


class WatchedProcess(Protocol):
    """`lifecycle.processes.ChildProcess` and `multiprocessing.Process` both fit."""

    @property
    def name(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    @property
    def exitcode(self) -> int | None: ...


class ProcessSentinelWatch:
    """Calls `on_child_exit(name, pid, exitcode)` from its thread as soon as a watched child ends, whatever
    the cause; `exitcode` follows multiprocessing (-N: killed by signal N; None: could not be reaped).

    Unwatch a child (or `stop()` the whole watch) before stopping it on purpose: every end it sees is news.
    """

    def __init__(self, on_child_exit: Callable[[str, int, int | None], None]) -> None:
        self.on_child_exit = on_child_exit
        self._lock = threading.Lock()
        self._watched: dict[int, WatchedProcess] = {}  # by sentinel
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gracelm-child-watch", daemon=True)

    def watch(self, child: WatchedProcess) -> None:
        with self._lock:
            self._watched[child.sentinel] = child
            self._wake()

    def unwatch(self, child: WatchedProcess) -> None:
        with self._lock:
            self._watched.pop(child.sentinel, None)
            self._wake()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the watch (idempotent; callable from `on_child_exit` too): later ends are not reported."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._wake()
        if self._thread.ident is None:
            self._close_pipe()
        elif self._thread is not threading.current_thread():
            self._thread.join()

    def _wake(self) -> None:
        """Interrupts the wait so that the watched set is read again; call with the lock held."""
        if not self._closed:
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

    def _close_pipe(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    sentinels = list(self._watched)
                ready = wait([self._wake_r, *sentinels])
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                for sentinel in ready:
                    self._report(sentinel)
        finally:
            self._close_pipe()

    def _report(self, sentinel: int) -> None:
        with self._lock:
            child = None if self._stopping else self._watched.pop(sentinel, None)
        if child is None:
            return
        exitcode = _reaped_exitcode(child)
        assert child.pid is not None
        self.on_child_exit(child.name, child.pid, exitcode)


def _reaped_exitcode(child: WatchedProcess) -> int | None:
    deadline = time.monotonic() + _REAP_WAIT_S
    while child.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return child.exitcode


def describe_exit(name: str, pid: int, exitcode: int | None) -> str:
    """"engine core pid 12 killed by SIGKILL — out of memory? ..." and the like, for the log."""
    if exitcode is None:
        return f"{name} pid {pid} ended; its exit status is unknown"
    if exitcode >= 0:
        meaning = {ExitCode.FATAL: " (fatal error; its report should be in the log above)",
                   ExitCode.STARTUP_FAILURE: " (start-up failure)"}.get(exitcode, "")
        return f"{name} pid {pid} exited with code {exitcode}{meaning}"
    try:
        sig = signal.Signals(-exitcode)
    except ValueError:
        return f"{name} pid {pid} killed by signal {-exitcode}"
    if sig is signal.SIGKILL:
        hint = " — out of memory? (the kernel's OOM killer sends SIGKILL; see `dmesg`)"
    elif sig in _CRASH_SIGNALS:
        hint = " — a crash; its faulthandler traceback should be in the log above"
    else:
        hint = ""
    return f"{name} pid {pid} killed by {sig.name}{hint}"
