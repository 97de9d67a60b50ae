"""The start-up timeline of a process: when each phase of its start ended, on the system-wide monotonic
clock, so that the engine core's marks (sent in its `Ready` message) and the supervisor's make one timeline.

A process that wants one calls `begin()` first; `mark(phase)` anywhere below (the model loader, the core)
is a no-op elsewhere, so loading a model in a test or a notebook records nothing. A phase lasts from the
previous mark (the first one: from the process's creation) to its own mark.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

Mark = tuple[str, float]
# The phases of a model's load that are work on the model (the others are the process's own start): read
# (headers, weights mapped or read), verify (content hash, compiled graphs checked), repack (weights converted
# to the kernels' forms, fused), compile (compiled graphs loaded; a compile runs beside the server) and warmup
# (its first steps, run before the server is ready: `parallel/warmup.py`).
LOAD_WORK = ("read", "verify", "repack", "compile", "warmup")


class StartupTimeline:
    def __init__(self) -> None:
        self.origin = process_created()
        self.marks: list[Mark] = []

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.monotonic()))

    def extend(self, marks: Iterable[Mark]) -> None:
        """Marks another process made (on the same clock), in the order they happened."""
        self.marks.extend((phase, at) for phase, at in marks)

    def phases(self) -> dict[str, float]:
        """Seconds each phase took, in order; a phase marked twice adds up. Never negative: a mark of
        another process may precede the previous one by the 10 ms grain of a process's creation time."""
        durations: dict[str, float] = {}
        previous = self.origin
        for phase, at in self.marks:
            durations[phase] = durations.get(phase, 0.0) + max(0.0, at - previous)
            previous = max(previous, at)
        return durations

    def total(self) -> float:
        return max((at for _, at in self.marks), default=self.origin) - self.origin

    def load_split(self) -> str:
        """How the model's load split (`LOAD_WORK`), as "read 0.4 s, verify 1.1 s, repack 8.2 s, ..."."""
        phases = self.phases()
        return ", ".join(f"{work} {phases.get(work, 0.0):.1f} s" for work in LOAD_WORK)

    def summary(self) -> str:
        """One line: each phase in ms, then the total (e.g. "boot 640, bind 0, ..., total 5120")."""
        parts = [f"{phase} {seconds * 1000:.0f}" for phase, seconds in self.phases().items()]
        return ", ".join([*parts, f"total {self.total() * 1000:.0f}"])


_current: StartupTimeline | None = None


def begin() -> StartupTimeline:
    """Starts this process's timeline (from its creation)."""
    global _current
    _current = StartupTimeline()
    return _current


def current() -> StartupTimeline | None:
    return _current


def mark(phase: str) -> None:
    if _current is not None:
        _current.mark(phase)


def process_created() -> float:
    """When this process was created, on the monotonic clock. The kernel counts a process's start in clock
    ticks since boot (`/proc/self/stat`, field 22; 10 ms ticks); its age is read against CLOCK_BOOTTIME,
    the clock that count follows."""
    stat = Path("/proc/self/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    return time.monotonic() - age
