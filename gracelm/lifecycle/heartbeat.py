"""The engine core's heartbeat: a 24-byte slot in a file of the runtime directory, mapped in both processes.

The core's loop stamps it (a few aligned 8-byte stores, ~1 µs) whenever it takes in messages and after each
step; the frontend's monitor reads it. Whether the core *should* be making progress is judged on the
frontend's side, which knows what it has sent and not yet seen answered: a core frozen while idle never
stamps, so a flag of its own could never say it is stuck. CLOCK_MONOTONIC is one clock for every process
of the machine, so the stamp of one process compares with the clock of the other.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import time
from pathlib import Path

# Slot layout, int64 each: last stamp (CLOCK_MONOTONIC ns), stamps so far, writer pid.
_STAMP, _COUNT, _PID = range(3)
_SLOT_BYTES = 3 * 8


@dataclasses.dataclass(frozen=True)
class Beat:
    stamp: float  # time.monotonic() of the last stamp; 0.0 if never stamped
    count: int
    pid: int


class Heartbeat:
    """The frontend `create`s the slot (in the runtime directory) and passes the path to the core, which
    `open`s it and calls `beat()`; both `close()` it (the file goes with the directory)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        try:
            self._map = mmap.mmap(fd, _SLOT_BYTES)
        finally:
            os.close(fd)
        self._slot = (ctypes.c_int64 * 3).from_buffer(self._map)

    @classmethod
    def create(cls, path: str | Path) -> Heartbeat:
        """Reserves the slot's bytes on disk now: a stamp into a sparse page of a full filesystem would kill
        the writer with SIGBUS; a full one is an `OSError` here, at start-up, naming the path."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, _SLOT_BYTES)
        except OSError as e:
            os.close(fd)
            raise OSError(e.errno, f"cannot reserve the heartbeat slot {path}: {e.strerror}") from None
        return cls(Path(path), fd)

    @classmethod
    def open(cls, path: str | Path) -> Heartbeat:
        """The writer's side: also records the writer's pid, for the monitor to name a hung process."""
        heartbeat = cls(Path(path), os.open(path, os.O_RDWR | os.O_CLOEXEC))
        heartbeat._slot[_PID] = os.getpid()
        return heartbeat

    def beat(self) -> None:
        self._slot[_STAMP] = time.monotonic_ns()
        self._slot[_COUNT] += 1

    def read(self) -> Beat:
        return Beat(self._slot[_STAMP] / 1e9, self._slot[_COUNT], self._slot[_PID])

    def close(self) -> None:
        if self._map.closed:
            return
        del self._slot  # the ctypes view pins the map's buffer; it must go first
        self._map.close()
