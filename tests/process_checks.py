"""Checks that a test left nothing of an engine behind: no child process, no runtime directory."""

from __future__ import annotations

import os
import time

import psutil

from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base


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
