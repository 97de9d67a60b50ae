"""The resource ledger: every resource an instance acquires is recorded with its release, and the stop
releases them all, newest first, each within its own deadline, into a shutdown report.

A release runs in a helper thread joined with the resource's timeout, so that one that hangs (a join on a
child that will not exit, a socket close stuck in the kernel) cannot hang the stop: at the deadline the
resource's `force` runs instead (SIGKILL after a join, say) and the resource is reported `forced`. A release
that raises is reported `failed` with the error text (or `forced`, if a `force` then succeeded); nothing is
raised to the caller, since a stop must go on to release everything else. A helper thread that hangs is a
daemon and is abandoned, never waited for again.

Releases that must run on the caller's thread (restoring signal handlers, which only the main thread may
do; cancelling an asyncio task from its loop) are acquired with `inline=True`: they run directly, unbounded,
and must therefore never block.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
# A force is the last resort (SIGKILL, unlink): it either completes at once or the resource is lost.
DEFAULT_FORCE_TIMEOUT_S = 5.0


class ResourceKind(enum.StrEnum):
    PROCESS = "process"
    THREAD = "thread"
    TASK = "task"
    SOCKET = "socket"
    ZMQ_CONTEXT = "zmq context"
    DIRECTORY = "directory"
    SHARED_MEMORY = "shared memory"
    PROCESS_GROUP = "process group"
    MODEL = "model"
    KV_CACHE = "kv cache"
    KV_SNAPSHOT = "kv snapshot"
    DATABASE = "database"
    SIGNAL_HANDLERS = "signal handlers"


class Outcome(enum.StrEnum):
    RELEASED = "released"
    FORCED = "forced"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class ResourceReport:
    kind: ResourceKind
    name: str
    outcome: Outcome
    ms: float
    error: str | None = None
    released_at: float = 0.0  # wall-clock time (time.time()) the release ended


@dataclasses.dataclass
class ShutdownReport:
    """What became of each resource, in the order they were released."""

    resources: list[ResourceReport] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing leaked: every resource was released, if only by force."""
        return all(r.outcome is not Outcome.FAILED for r in self.resources)

    @property
    def not_released(self) -> list[ResourceReport]:
        """What had to be forced or could not be freed: a stop with any is not a clean one."""
        return [r for r in self.resources if r.outcome is not Outcome.RELEASED]

    @property
    def total_ms(self) -> float:
        return sum(r.ms for r in self.resources)

    def as_table(self) -> str:
        rows = [("kind", "name", "outcome", "ms", "error")]
        rows += [(r.kind.value, r.name, r.outcome.value, f"{r.ms:.1f}", r.error or "")
                 for r in self.resources]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True))
                 + "  " + row[4] for row in rows]
        verdict = "ok" if self.ok else "FAILED"
        lines.append(f"{len(self.resources)} resources, {self.total_ms:.1f} ms, {verdict}")
        return "\n".join(line.rstrip() for line in lines)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "total_ms": round(self.total_ms, 3),
                "resources": [{**dataclasses.asdict(r), "kind": r.kind.value, "outcome": r.outcome.value,
                               "ms": round(r.ms, 3)} for r in self.resources]}

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def publish(self, path: str | Path | None) -> None:
        """The one way a stop reports: the table in the log and, given a path, the JSON file."""
        logger.info("shutdown report:\n%s", self.as_table())
        if path:
            self.to_json(path)


# A release's bound in seconds, or a function that says it when the release begins.
Timeout = float | Callable[[], float]


class LedgerClosedError(RuntimeError):
    """`acquire` after `release_all` began: the caller still owns the resource and must release it."""


class Handle:
    """One recorded resource; returned by `Ledger.acquire`, passed back to `Ledger.release`."""

    def __init__(self, kind: ResourceKind, name: str, release: Callable[[], object], timeout: Timeout,
                 force: Callable[[], object] | None, force_timeout: float, inline: bool) -> None:
        self.kind = kind
        self.name = name
        self._release = release
        self._timeout = timeout
        self._force = force
        self._force_timeout = force_timeout
        self._inline = inline
        self._claimed = False  # guarded by the ledger's lock: the first releaser claims the handle
        self._done = threading.Event()
        self.report: ResourceReport | None = None

    def __repr__(self) -> str:
        return f"Handle({self.kind.value}, {self.name!r})"


class Ledger:
    """Thread-safe; `release` and `release_all` may race, each resource is still released exactly once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[Handle] = []
        self._closing = False
        self._report = ShutdownReport()
        self._all_done = threading.Event()

    def acquire(self, kind: ResourceKind, name: str, release: Callable[[], object], *,
                timeout: Timeout = DEFAULT_TIMEOUT_S, force: Callable[[], object] | None = None,
                force_timeout: float = DEFAULT_FORCE_TIMEOUT_S, inline: bool = False) -> Handle:
        """Records a resource just acquired. `release` frees it within `timeout` s (a number, or a function
        asked at release time when the bound depends on what happens meanwhile, such as a drain's
        deadline); if it does not (or raises), `force` (if any) gets `force_timeout` s to free it the hard
        way."""
        handle = Handle(kind, name, release, timeout, force, force_timeout, inline)
        with self._lock:
            if self._closing:
                raise LedgerClosedError(f"cannot record {kind.value} {name!r}: the stop has begun")
            self._held.append(handle)
        return handle

    def release(self, handle: Handle) -> ResourceReport:
        """Releases one resource now (before the stop); idempotent, and safe to race with `release_all`."""
        with self._lock:
            claimed = _claim(handle)
        if claimed:
            self._run(handle)
        handle._done.wait()
        assert handle.report is not None
        return handle.report

    def release_all(self) -> ShutdownReport:
        """Releases every resource still held, newest first; idempotent: later calls return the same report
        (waiting for the first to finish)."""
        with self._lock:
            first = not self._closing
            self._closing = True
            pending = [handle for handle in reversed(self._held) if _claim(handle)]
        if not first:
            self._all_done.wait()
            return self._report
        for handle in pending:
            self._run(handle)
        # An early release that was still running when the stop began finishes before the report does.
        for handle in self._held:
            handle._done.wait()
        self._all_done.set()
        return self._report

    @property
    def held(self) -> list[Handle]:
        """The resources not yet released, oldest first."""
        with self._lock:
            return [handle for handle in self._held if not handle._claimed]

    def _run(self, handle: Handle) -> None:
        started = time.monotonic()
        outcome, error = _release(handle)
        report = ResourceReport(handle.kind, handle.name, outcome, (time.monotonic() - started) * 1000,
                                error, time.time())
        if outcome is not Outcome.RELEASED:
            logger.warning("%s %s %s: %s", handle.kind.value, handle.name, outcome.value, error)
        with self._lock:
            self._report.resources.append(report)
        handle.report = report
        handle._done.set()


def _claim(handle: Handle) -> bool:
    """Marks the handle as being released; False if someone already did. Call with the ledger's lock."""
    if handle._claimed:
        return False
    handle._claimed = True
    return True


def _release(handle: Handle) -> tuple[Outcome, str | None]:
    if handle._inline:
        error = _call(handle._release)
    else:
        timeout = handle._timeout() if callable(handle._timeout) else handle._timeout
        error = _bounded(handle._release, timeout, f"release did not finish within {timeout:g} s")
    if error is None:
        return Outcome.RELEASED, None
    if handle._force is None:
        return Outcome.FAILED, error
    force_error = _bounded(handle._force, handle._force_timeout,
                           f"force did not finish within {handle._force_timeout} s")
    if force_error is None:
        return Outcome.FORCED, error
    return Outcome.FAILED, f"{error}; {force_error}"


def _call(function: Callable[[], object]) -> str | None:
    """Runs `function`; the text of what it raised, or None."""
    try:
        function()
    except BaseException as e:  # noqa: BLE001 - a stop reports every failure and carries on
        return f"{type(e).__name__}: {e}"
    return None


def _bounded(function: Callable[[], object], timeout: float, late: str) -> str | None:
    """Runs `function` in a daemon thread for at most `timeout` s; the error text, `late`, or None."""
    errors: list[str | None] = []
    thread = threading.Thread(target=lambda: errors.append(_call(function)), daemon=True,
                              name=f"ledger-release-{getattr(function, '__name__', 'callable')}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return late
    return errors[0]
