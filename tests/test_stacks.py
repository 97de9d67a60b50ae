"""`request_stack_dumps` against real processes: only a process that catches SIGUSR1 is sent it, since the
signal's default action would kill any other."""

from __future__ import annotations

import subprocess
import sys
import time

from gracelm.lifecycle.stacks import request_stack_dumps

# A child that installs the handler the server's children install, then says so and waits.
WITH_HANDLER = r"""
import time
from gracelm.lifecycle.stacks import install_child_stack_dump
install_child_stack_dump()
print("ready", flush=True)
time.sleep(30)
"""


def _wait_for_exec(pid: int, name: str) -> None:
    """Until `pid` runs `name`: before its exec it is a copy of this process, with this process's handlers."""
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/comm") as comm:
            if comm.read().strip() == name:
                return
        assert time.monotonic() < deadline, f"pid {pid} never became {name}"
        time.sleep(0.01)


def test_a_process_without_a_stack_dump_handler_is_not_signalled():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        _wait_for_exec(sleeper.pid, "sleep")
        assert request_stack_dumps([sleeper.pid]) == []
        time.sleep(0.2)
        assert sleeper.poll() is None  # SIGUSR1's default action would have killed it
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_process_with_the_handler_is_signalled_dumps_its_stacks_and_carries_on():
    """The control for the test above: the same call does signal a process that catches SIGUSR1."""
    child = subprocess.Popen([sys.executable, "-c", WITH_HANDLER], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert request_stack_dumps([child.pid]) == [child.pid]
        time.sleep(0.3)
        assert child.poll() is None
    finally:
        child.kill()
        _, err = child.communicate()
    assert "most recent call first" in err and 'File "<string>"' in err
