"""How a child process of the server ended, as one event: the reason and a sentence for the log.

The engine core's monitor (`engine/core_monitor.py`) turns every sign of the core's end into exactly one
`ProcessEnd`; the engines, the server state and the supervisor all react to that one event (see
docs/architecture.md, "The core's end"). `describe_exit` is the one wording of an exit status, used for the
core, the tensor-parallel workers and the headless nodes alike.
"""

from __future__ import annotations

import dataclasses
import enum
import signal

from gracelm.lifecycle.exit_codes import ExitCode

_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})


class EndReason(enum.StrEnum):
    EXITED = "exited"  # exited with a status of its own, unasked
    KILLED = "killed"  # killed by a signal
    RAISED = "raised"  # reported a fatal error, with its traceback
    HUNG = "hung"  # made no progress for the hang timeout while work was pending
    STOPPED = "stopped"  # stopped on request: exit status 0 after a stop was asked for


@dataclasses.dataclass(frozen=True)
class ProcessEnd:
    reason: EndReason
    message: str  # for the log and for the errors in-flight requests get
    pid: int
    exitcode: int | None = None
    traceback: str | None = None

    @property
    def fatal(self) -> bool:
        """Every end but a requested stop is a failure of the server."""
        return self.reason is not EndReason.STOPPED

    def __str__(self) -> str:
        return self.message


def end_of_exit(name: str, pid: int, exitcode: int | None, stop_requested: bool) -> ProcessEnd:
    """The end of a process whose exit status is `exitcode` (multiprocessing's: -N is signal N)."""
    if stop_requested and exitcode == 0:
        return ProcessEnd(EndReason.STOPPED, f"{name} pid {pid} stopped on request", pid, exitcode)
    reason = EndReason.KILLED if exitcode is not None and exitcode < 0 else EndReason.EXITED
    return ProcessEnd(reason, describe_exit(name, pid, exitcode), pid, exitcode)


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
