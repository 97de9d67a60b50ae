"""`request_stack_dumps` against real processes: only a process that catches SIGUSR1 is sent it, since the
signal's default action would kill any other."""

from __future__ import annotations

import subprocess
import sys

from gracelm.lifecycle.stacks import request_stack_dumps
from tests.process_checks import answers

# A child that says it runs, then echoes each line it reads: its answer after a signal was sent shows that
# the signal did not end it (`answers`).
ECHO = r"""
import sys
print("ready", flush=True)
for line in sys.stdin:
    print(line, end="", flush=True)
"""
# The same, with the handler the server's children install.
WITH_HANDLER = r"""
from gracelm.lifecycle.stacks import install_child_stack_dump
install_child_stack_dump()
""" + ECHO


def _child(source: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", source], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    # Python runs: the child has exec'd, and no longer has this process's handlers.
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_process_without_a_stack_dump_handler_is_not_signalled():
    child = _child(ECHO)  # Python leaves SIGUSR1 at its default action
    try:
        assert request_stack_dumps([child.pid]) == []
        assert answers(child)  # SIGUSR1's default action would have killed it
    finally:
        child.kill()
        child.communicate()


def test_a_process_with_the_handler_is_signalled_dumps_its_stacks_and_carries_on():
    """The control for the test above: the same call does signal a process that catches SIGUSR1."""
    child = _child(WITH_HANDLER)
    try:
        assert request_stack_dumps([child.pid]) == [child.pid]
        assert answers(child)  # the handler ran (its dump is written by then) and the child went on
    finally:
        child.kill()
        _, err = child.communicate()
    assert "most recent call first" in err and 'File "<string>"' in err
