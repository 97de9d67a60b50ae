"""Python stack dumps of every thread of every process of the server, on SIGUSR1 or when a hang is found.

The supervisor formats its own stacks from `sys._current_frames()` and logs them (its SIGUSR1 handler only
records the signal; the dump runs in its loop). Children dump theirs with `faulthandler`, whose SIGUSR1
handler runs at C level inside the signal itself: it works even while the child's main thread is stuck in
a long C call (a matmul, a collective), which is exactly when a dump is wanted, and the child carries on.

A child must not receive SIGUSR1 before it has installed that handler: the default action of SIGUSR1 is to
terminate. `request_stack_dumps` therefore checks, in /proc, that each target catches the signal.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterable
from typing import TextIO

logger = logging.getLogger(__name__)


def format_all_stacks(reason: str) -> str:
    """Every thread's current Python stack in this process, newest call last, under a header."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = [f"Python stacks of pid {os.getpid()} ({reason}):"]
    for ident, frame in sys._current_frames().items():
        parts.append(f'\nThread {names.get(ident, "<unknown>")} (ident {ident}):\n')
        parts.append("".join(traceback.format_stack(frame)).rstrip("\n"))
    return "\n".join(parts)


def dump_all_stacks(reason: str, level: int = logging.WARNING) -> str:
    """Logs `format_all_stacks(reason)` and returns it."""
    text = format_all_stacks(reason)
    logger.log(level, "%s", text)
    return text


def install_child_stack_dump(file: TextIO | None = None) -> None:
    """In a child, before anything else: SIGUSR1 dumps every thread's stack to `file` (stderr by default,
    which children share with the supervisor's log) and the process carries on."""
    faulthandler.register(signal.SIGUSR1, file=file or sys.stderr, all_threads=True, chain=False)


def catches_signal(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (so sending it does not kill the process)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    except OSError:
        pass
    return False


def request_stack_dumps(pids: Iterable[int], sig: signal.Signals = signal.SIGUSR1) -> list[int]:
    """Sends `sig` to each process that catches it; returns the pids signalled. A process that does not
    (not yet started, or already gone) is skipped and logged, never killed by the signal."""
    signalled = []
    for pid in pids:
        if not catches_signal(pid, sig):
            logger.warning("pid %d has no %s handler (yet); its stacks are not dumped", pid, sig.name)
            continue
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        signalled.append(pid)
    return signalled
