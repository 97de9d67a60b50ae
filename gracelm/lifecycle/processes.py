"""Starting and stopping the server's child processes, the one way every child is run.

A child is started with the `spawn` context (no forked copy of the parent's threads, locks or device state)
and, before its target runs: ignores SIGINT, SIGTERM and SIGHUP (the supervisor alone interprets signals —
Ctrl-C reaches the whole process group), names itself with setproctitle, enables faulthandler, and arms two
independent ways to die with its parent: `PR_SET_PDEATHSIG` and a death pipe whose write end only the parent
holds (EOF on it means the parent is gone, whatever killed it). SIGUSR1 dumps its stacks (faulthandler) and it
carries on. The stop signals are blocked while the child starts, so that none reaches it before its
dispositions are set.

Stopping is: ask (the caller's stop message) → join with a timeout → SIGTERM (only useful before the
child's entry has set its signal dispositions) → SIGKILL; then any descendant it left behind is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import NoReturn, Protocol

import psutil

from gracelm.lifecycle.process_end import describe_exit
from gracelm.lifecycle.signals import STOP_SIGNALS, signals_blocked_for_child, unblock_child_signals
from gracelm.lifecycle.stacks import install_child_stack_dump

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_TERM_GRACE_S = 0.5
_KILL_WAIT_S = 5.0
# After a sentinel fires the child may take a moment more to become reapable.
_REAP_WAIT_S = 1.0
# How often a status lost to a concurrent reaper is asked for again.
_REAP_POLL_S = 0.02


class ChildProcess:
    """A started child: its `multiprocessing` process plus the parent's end of its death pipe."""

    def __init__(self, name: str, process: BaseProcess, death_pipe: Connection) -> None:
        self.name = name
        self.process = process
        self._death_pipe = death_pipe
        self.outcome: str | None = None  # after stop(): "exited", "terminated" or "killed"

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the child ends (for select/poll)."""
        return self.process.sentinel

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.outcome is None and self.process.is_alive()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def describe_exit(self) -> str:
        """How the child ended, e.g. "Worker-1 pid 7 killed by SIGKILL — out of memory? ..."."""
        return describe_exit(self.name, self.pid, reaped_exitcode(self))

    def stop(self, timeout: float) -> str:
        """Waits up to `timeout` s for the child to exit, then forces it; idempotent. Returns how it ended."""
        if self.outcome is not None:
            return self.outcome
        descendants = _descendants(self.pid)
        self.process.join(timeout)
        outcome = "exited"
        # A join that lost the reaping race to another thread (the core monitor's `reaped_exitcode`) sees a
        # child still "alive" although it has exited: ask again before signalling a pid that may be reused.
        if self.process.is_alive() and mp.connection.wait([self.sentinel], 0):
            reaped_exitcode(self.process)
        if self.process.is_alive():
            logger.warning("%s (pid %d) did not exit within %.1f s; sending SIGTERM",
                           self.name, self.pid, timeout)
            self.process.terminate()
            self.process.join(_TERM_GRACE_S)
            outcome = "terminated"
        if self.process.is_alive():
            logger.warning("%s (pid %d) ignored SIGTERM; sending SIGKILL", self.name, self.pid)
            self.process.kill()
            self.process.join(_KILL_WAIT_S)
            outcome = "killed"
        _kill_leftovers(descendants)
        self._death_pipe.close()
        self.outcome = outcome
        return outcome


def start_process(name: str, title: str, target: str, args: tuple = (),
                  env: dict[str, str] | None = None) -> ChildProcess:
    """Starts `target(*args)` in a spawned child named `title` (e.g. "gracelm::engine-core"). `target` is
    "module:function", imported in the child only: the parent never imports what the child runs (the
    HTTP process must not load torch for a core that does). `env`: variables set in the child before it
    imports `target` (torch reads some once, as it loads), inherited by its own children."""
    ctx = mp.get_context("spawn")
    death_reader, death_writer = ctx.Pipe(duplex=False)
    # Not a daemon: daemonic processes may not start children of their own (tensor-parallel workers).
    # PR_SET_PDEATHSIG fires when the *thread* that started the child ends, not the process: arm it only
    # when that thread is the main one. The death pipe covers the other case.
    pdeathsig = threading.current_thread() is threading.main_thread()
    process = ctx.Process(target=_child_main, name=name, daemon=False,
                          args=(title, os.getpid(), pdeathsig, death_reader, target, args, env or {}))
    # Blocked across the start, the child inherits the stop signals and SIGUSR1 deferred until its entry
    # has set their dispositions: a Ctrl-C while it imports torch must not kill it.
    with _main_module_hidden(), signals_blocked_for_child():
        process.start()
    death_reader.close()
    logger.debug("started %s (pid %d)", name, process.pid)
    return ChildProcess(name, process, death_writer)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Keeps `spawn` from re-running the caller's script in the child.

    Spawn re-imports the parent's `__main__` in the child so that functions defined there can be
    unpickled; our targets all live in gracelm, and re-running a user's script without an
    `if __name__ == "__main__"` guard would start a second engine from inside the first. So the child is
    prepared while `__main__` is an empty module.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _child_main(title: str, parent_pid: int, pdeathsig: bool, death_reader: Connection,
                target: str, args: tuple, env: dict[str, str]) -> None:
    # The title first: setproctitle takes over the memory of argv and of the environment as the process
    # started with it, and an environment changed before (a variable of `env` the parent also has) left the
    # title unset.
    _set_title(title)
    os.environ.update(env)
    for sig in STOP_SIGNALS:  # the supervisor alone acts on them
        signal.signal(sig, signal.SIG_IGN)
    faulthandler.enable()
    install_child_stack_dump()
    unblock_child_signals()
    _die_with_parent(parent_pid, pdeathsig, death_reader)
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(*args)


def _set_title(title: str) -> None:
    import setproctitle

    setproctitle.setproctitle(title)


def set_parent_death_signal(signum: int) -> int:
    """Has the kernel send this process `signum` when the thread that started it ends; 0, or the errno of
    the failed `prctl(PR_SET_PDEATHSIG)`."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return ctypes.get_errno()
    return 0


def _die_with_parent(parent_pid: int, pdeathsig: bool, death_reader: Connection) -> None:
    if pdeathsig and (errno := set_parent_death_signal(signal.SIGKILL)):
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", errno)
    # The parent may have died before the prctl above: then we were already re-parented.
    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=_watch_death_pipe, args=(death_reader,), name="death-pipe", daemon=True).start()


def _watch_death_pipe(death_reader: Connection) -> None:
    try:
        death_reader.recv_bytes()
    except (EOFError, OSError):
        pass
    # The parent never writes: any return means its end was closed, i.e. the parent is gone.
    os._exit(1)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_leftovers(processes: list[psutil.Process]) -> None:
    for proc in processes:
        try:
            if proc.is_running():
                logger.warning("killing leftover descendant pid %d (%s)", proc.pid, proc.name())
                proc.kill()
        except psutil.Error:
            pass


class Reapable(Protocol):
    @property
    def exitcode(self) -> int | None: ...
    def join(self, timeout: float) -> None: ...


def reaped_exitcode(child: Reapable) -> int | None:
    """The child's exit status once it has ended; the sentinel closes a moment before the kernel makes the
    status available, so this waits up to a second for it (None: still not reapable). Another thread may
    be reaping the same child (its `stop`): a join that loses that race sees no status, so this asks again
    until the winner has recorded it."""
    deadline = time.monotonic() + _REAP_WAIT_S
    while (exitcode := child.exitcode) is None and (left := deadline - time.monotonic()) > 0:
        child.join(min(left, _REAP_POLL_S))
    return exitcode


def exit_process(code: int) -> NoReturn:
    """Ends this process once everything it owns has been released (its ledger says so), without the
    interpreter's teardown: with torch loaded that takes a second or more (measured 1.0-1.7 s) and frees
    nothing the kernel does not. The log is flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
