"""The supervisor's signals: handlers that only record, a policy that decides, a dispatch in the owner's loop.

Only the supervisor (the process that runs `gracelm serve`) installs these; children ignore SIGINT and
SIGTERM (see `processes.py`), so Ctrl-C to the whole process group, or systemd's SIGTERM to every process of
the unit, reaches the supervisor as one stop request and never cuts a drain short from below. The offline
`Engine` installs nothing either: it runs in the user's program, whose signals are the user's, and Ctrl-C
inside `generate()` must stay a plain `KeyboardInterrupt` (the engine cleans up on the way out).

As in gunicorn's arbiter, a handler does nothing but record: it appends the signal and the time to a queue
and writes one byte to a self-pipe. The owner's loop sees the pipe readable (an asyncio reader, or `wait()`
in a plain thread), and `dispatch_pending()` asks the policy what each signal means and calls the target's
method of that name, in the loop, where acting is safe.

Policy (`SignalPolicy`):
    first SIGTERM, SIGINT or SIGHUP      -> graceful_stop
    one of them during that drain        -> immediate_stop, unless it is a repeat (below)
    SIGQUIT                              -> fatal when a child has reported a fatal error (children send
                                            SIGQUIT after their report, as SGLang's do), else immediate_stop
    SIGUSR1                              -> dump_stacks, and serving carries on
Repeat rule: a SIGTERM, SIGINT or SIGHUP that arrives less than `repeat_window_s` (0.5 s) after the one that
began the drain is the same request delivered again (to the group and to the process, by systemd and by a
shell that forwards it) and is ignored, with a log line that says so. An operator who wants the immediate stop
sends it again; humans take longer than half a second to decide that, machines much less to repeat.

Why not `loop.add_signal_handler`: its handlers run only when the loop runs, and the supervisor blocks its
loop while the engine core loads the weights (the core must be started from the main thread for its
parent-death signal); and `remove_signal_handler` resets the default instead of restoring the previous
handler. A Python-level handler runs on the main thread even then, so that a stop during start-up can
abandon it (`abandoning_startup()`), and `uninstall()` puts back exactly what was there, as uvicorn does.
Under `asyncio.run()`, uninstall inside the loop: the runner restores its own SIGINT handler as it ends.

Children: between its start and the moment its entry sets its dispositions (ignore SIGINT and SIGTERM,
faulthandler on SIGUSR1), a spawned child is an interpreter importing modules (torch: seconds) in which
those signals still have their default, lethal, effect: a Ctrl-C or a systemd SIGTERM to everyone at that
moment would kill it, and the stop would be reported as a crash. `signals_blocked_for_child()` around the
start makes the child inherit them blocked (the mask survives fork and exec); the child's entry calls
`unblock_child_signals()` once its dispositions are set, and what was pending is then ignored or handled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from select import select
from types import FrameType
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# SIGHUP is a stop request too: its default action would kill the supervisor with no drain (a closed
# terminal, a session's end, `kill -HUP` from a script that expects a reload), cutting every stream.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
CHILD_DEFERRED_SIGNALS = frozenset({*STOP_SIGNALS, signal.SIGUSR1})
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
REPEAT_WINDOW_S = 0.5


class Action(enum.StrEnum):
    GRACEFUL_STOP = "graceful_stop"
    IMMEDIATE_STOP = "immediate_stop"
    FATAL = "fatal"
    DUMP_STACKS = "dump_stacks"
    IGNORE = "ignore"


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    signal: signal.Signals
    reason: str


class SignalTarget(Protocol):
    """What the owner implements; each method runs in the owner's loop, never in a signal handler."""

    def graceful_stop(self, decision: Decision) -> None: ...
    def immediate_stop(self, decision: Decision) -> None: ...
    def fatal(self, decision: Decision) -> None: ...
    def dump_stacks(self, decision: Decision) -> None: ...


class StartupInterrupted(KeyboardInterrupt):
    """Raised in the main thread by a stop signal while `abandoning_startup()` is active."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(sig.name)
        self.signal = sig


class SignalPolicy:
    """What each received signal means, given those before it. Pure: no handler, no clock of its own.

    `fatal_report` is asked on SIGQUIT: the text of a child's fatal error if one has arrived (the owner may
    read its channel from the child there, since the report is sent before the signal), else None.
    """

    def __init__(self, repeat_window_s: float = REPEAT_WINDOW_S,
                 fatal_report: Callable[[], str | None] | None = None) -> None:
        self.repeat_window_s = repeat_window_s
        self._fatal_report = fatal_report
        self._stop_at: float | None = None
        self._immediate = False
        self._fatal = False

    def decide(self, sig: signal.Signals, at: float) -> Decision:
        if sig is signal.SIGUSR1:
            return Decision(Action.DUMP_STACKS, sig, "stack dump requested")
        if sig is signal.SIGQUIT:
            return self._decide_quit(sig)
        return self._decide_stop(sig, at)

    def _decide_quit(self, sig: signal.Signals) -> Decision:
        report = self._fatal_report() if self._fatal_report is not None else None
        if report is not None and not self._fatal:
            self._fatal = self._immediate = True
            return Decision(Action.FATAL, sig, report)
        if self._immediate:
            return Decision(Action.IGNORE, sig, "an immediate stop is already under way")
        self._immediate = True
        return Decision(Action.IMMEDIATE_STOP, sig, "SIGQUIT: immediate stop")

    def _decide_stop(self, sig: signal.Signals, at: float) -> Decision:
        if self._immediate:
            return Decision(Action.IGNORE, sig, "an immediate stop is already under way")
        if self._stop_at is None:
            self._stop_at = at
            return Decision(Action.GRACEFUL_STOP, sig, f"{sig.name}: graceful stop")
        since = at - self._stop_at
        if since < self.repeat_window_s:
            return Decision(Action.IGNORE, sig,
                            f"{sig.name} {since:.2f} s after the stop request: taken for a repeated delivery "
                            f"of it; send it again to stop at once")
        self._immediate = True
        return Decision(Action.IMMEDIATE_STOP, sig, f"second stop request ({sig.name}) during the drain")


class SignalHandler:
    """Installs the recording handlers and dispatches what they recorded to a `SignalTarget`."""

    def __init__(self, target: SignalTarget, policy: SignalPolicy | None = None,
                 signals: tuple[signal.Signals, ...] = HANDLED_SIGNALS) -> None:
        self.target = target
        self.policy = policy or SignalPolicy()
        self.signals = signals
        self._received: collections.deque[tuple[signal.Signals, float]] = collections.deque()
        self._previous: dict[signal.Signals, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._interrupt_startup = False

    # -- installation (main thread only) -------------------------------------------------------------

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Installs the handlers; with `loop`, signals are dispatched in that loop as they come, otherwise
        the owner's thread calls `wait()` and `dispatch_pending()`."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        if self._pipe is not None:
            raise RuntimeError("signal handlers are already installed")
        self._pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._record)
        if loop is not None:
            self._loop = loop
            loop.add_reader(self._pipe[0], self.dispatch_pending)

    def uninstall(self) -> None:
        """Restores the handlers that were there before `install()`; idempotent."""
        if self._pipe is None:
            return
        for sig, previous in self._previous.items():
            # None: the previous handler was not set from Python; the default is the best we can restore.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        if self._loop is not None:
            self._loop.remove_reader(self._pipe[0])
            self._loop = None
        for fd in self._pipe:
            os.close(fd)
        self._pipe = None

    def __enter__(self) -> SignalHandler:
        self.install()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()

    @contextlib.contextmanager
    def abandoning_startup(self) -> Iterator[None]:
        """While the start-up blocks the main thread, a stop signal (SIGTERM, SIGINT, SIGQUIT) raises
        `StartupInterrupted` there, once: a later one is only recorded, so that it cannot interrupt the
        clean-up of the abandoned start."""
        self._interrupt_startup = True
        try:
            yield
        finally:
            self._interrupt_startup = False

    # -- the handler: record, wake, nothing else -----------------------------------------------------

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self._interrupt_startup and sig is not signal.SIGUSR1:
            self._interrupt_startup = False
            raise StartupInterrupted(sig)
        self._received.append((sig, time.monotonic()))
        if self._pipe is not None:
            with contextlib.suppress(BlockingIOError):
                os.write(self._pipe[1], b"\0")

    # -- the owner's side ----------------------------------------------------------------------------

    def wait(self, timeout: float | None) -> bool:
        """Blocks until a signal is recorded or `timeout` s pass; True if one is waiting for dispatch."""
        if self._received:
            return True
        assert self._pipe is not None, "install() first"
        select([self._pipe[0]], [], [], timeout)
        return bool(self._received)

    def dispatch_pending(self) -> list[Decision]:
        """Decides and acts on every recorded signal, in arrival order; returns the decisions."""
        if self._pipe is not None:
            with contextlib.suppress(BlockingIOError):
                os.read(self._pipe[0], 4096)
        decisions = []
        while self._received:
            sig, at = self._received.popleft()
            decision = self.policy.decide(sig, at)
            decisions.append(decision)
            self._act(decision)
        return decisions

    def _act(self, decision: Decision) -> None:
        if decision.action is Action.IGNORE:
            logger.info("%s ignored: %s", decision.signal.name, decision.reason)
            return
        level = logging.ERROR if decision.action is Action.FATAL else logging.INFO
        logger.log(level, "%s received: %s", decision.signal.name, decision.reason)
        getattr(self.target, decision.action.value)(decision)


@contextlib.contextmanager
def signals_blocked_for_child() -> Iterator[None]:
    """Around starting a child: it begins life with `CHILD_DEFERRED_SIGNALS` blocked. Only the calling
    thread blocks them here, and only for the start: one sent to this process meanwhile is delivered to
    another thread, or when the block ends; none is lost."""
    # The first spawn also starts multiprocessing's resource tracker, which unblocks SIGINT and SIGTERM in
    # the calling thread when it is done: start it first, or the block would be gone before the fork.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_DEFERRED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_child_signals() -> None:
    """In the child, once SIGINT/SIGTERM are ignored and SIGUSR1 handled: lets the deferred signals in."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_DEFERRED_SIGNALS)
