"""Checks on an engine's processes: that a test left nothing behind (no child process, no runtime directory),
and waits for what they do (`wait_until` an event, `core_stamps` a core at work, `answers` a child alive)."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

import psutil

from gracelm.lifecycle.heartbeat import Heartbeat
from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base

T = TypeVar("T")


def _is_resource_tracker(proc: psutil.Process) -> bool:
    # multiprocessing's resource tracker: one helper per interpreter, started by the first `spawn`, that
    # ends with the interpreter; it is not one of ours.
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def leftover_children(wait: float = 2.0) -> list[psutil.Process]:
    """Children (recursively) of this process still alive after up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        alive = [p for p in psutil.Process().children(recursive=True)
                 if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not _is_resource_tracker(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def own_runtime_dirs() -> list[str]:
    return [p.name for p in runtime_base().glob(f"{PREFIX}{os.getpid()}-*")]


def assert_nothing_left() -> None:
    assert leftover_children() == [], "child processes outlived their engine"
    assert own_runtime_dirs() == [], "runtime directories outlived their engine"


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05) -> T:
    """`predicate()`'s first truthy value, asked every `interval` s; fails naming `what` (a text, or a
    function that gives one then, such as a log's tail) after `timeout` s. A test waits for the event
    itself: a fixed sleep is either too short on a loaded machine or longer than needed."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what if isinstance(what, str) else what()}")
        time.sleep(interval)
    return value


def core_stamps(owner_pid: int) -> int:
    """How often the engine core of the engine that process `owner_pid` owns has stamped its heartbeat:
    twice a step, and once for each message it takes in while idle (engine/core.py). Idle and sent nothing,
    a core never stamps: a count that moves is a core at work, or answering calls."""
    (path,) = runtime_base().glob(f"{PREFIX}{owner_pid}-*/heartbeat")
    heartbeat = Heartbeat(path, os.open(path, os.O_RDWR | os.O_CLOEXEC))  # as the reader: writes nothing
    try:
        return heartbeat.read().count
    finally:
        heartbeat.close()


def answers(child: subprocess.Popen, timeout: float = 10.0) -> bool:
    """Whether `child`, which echoes each line of its stdin (text mode), echoes a line sent now. A signal sent
    to it before this call is delivered before it next runs code of its own (a fatal one ends it at once), so
    an answer shows that it runs on after every signal sent so far: no need to wait and see."""
    try:
        child.stdin.write("ping\n")
        child.stdin.flush()
    except BrokenPipeError:
        return False
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    return bool(ready) and child.stdout.readline() == "ping\n"
