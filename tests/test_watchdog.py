"""The hang watchdog over a real child's heartbeat, and the sentinel watch over real children's deaths."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gracelm.lifecycle.stacks import request_stack_dumps
from gracelm.lifecycle.watchdog import HangWatchdog, Heartbeat, ProcessSentinelWatch, describe_exit

HANG_TIMEOUT_S = 0.6

# Steps for 1 s (longer than the timeout), idles for 1 s (no work: not a hang), then hangs in a step.
BEATER = r"""
import sys, time
from gracelm.lifecycle.stacks import install_child_stack_dump
from gracelm.lifecycle.watchdog import Heartbeat
install_child_stack_dump()
heartbeat = Heartbeat.open(sys.argv[1])
end = time.monotonic() + 1.0
while time.monotonic() < end:
    heartbeat.beat(True)
    time.sleep(0.02)
heartbeat.beat(False)
time.sleep(1.0)
heartbeat.beat(True)
print("hanging", flush=True)
time.sleep(30)
"""


def test_a_child_that_stops_stepping_with_work_pending_is_reported_after_the_timeout(tmp_path):
    heartbeat = Heartbeat.create(tmp_path / "heartbeat")
    child = subprocess.Popen([sys.executable, "-c", BEATER, str(heartbeat.path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    hangs: list[tuple[int, float, float]] = []
    reported = threading.Event()

    def on_hang(pid: int, stalled: float) -> None:
        hangs.append((pid, stalled, time.monotonic() - heartbeat.read().stamp))
        request_stack_dumps([pid])
        reported.set()

    watchdog = HangWatchdog(heartbeat, HANG_TIMEOUT_S, on_hang)
    watchdog.start()
    try:
        assert reported.wait(15)
        assert child.stdout.readline().strip() == "hanging"  # not during the steps, nor while idle
        ((pid, stalled, since_last_beat),) = hangs
        assert pid == child.pid
        assert HANG_TIMEOUT_S <= stalled < HANG_TIMEOUT_S + 0.3
        assert since_last_beat < HANG_TIMEOUT_S + 0.3
        time.sleep(0.3)
        assert child.poll() is None  # the stack dump left it running
    finally:
        watchdog.stop()
        child.kill()
        _, err = child.communicate()
        heartbeat.close()
    assert "most recent call first" in err and 'File "<string>"' in err


def test_zero_timeout_disables_the_watchdog(tmp_path):
    heartbeat = Heartbeat.create(tmp_path / "heartbeat")
    writer = Heartbeat.open(heartbeat.path)
    writer.beat(True)
    watchdog = HangWatchdog(heartbeat, 0, lambda pid, stalled: pytest.fail("disabled watchdog fired"))
    watchdog.start()
    watchdog.stop()
    beat = heartbeat.read()
    assert beat.work_pending and beat.steps == 1 and beat.pid == os.getpid()
    writer.close()
    heartbeat.close()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _exit_with(code: int) -> None:
    sys.exit(code)


def _spawn(target, *args) -> mp.Process:
    process = mp.get_context("spawn").Process(target=target, args=args, name="engine core", daemon=True)
    process.start()
    return process


def test_a_child_killed_by_sigkill_is_reported_within_a_second():
    exits: list[tuple[str, int, int | None, float]] = []
    done = threading.Event()

    def on_child_exit(name: str, pid: int, exitcode: int | None) -> None:
        exits.append((name, pid, exitcode, time.monotonic()))
        done.set()

    victim, bystander = _spawn(_sleep, 30), _spawn(_sleep, 30)
    watch = ProcessSentinelWatch(on_child_exit)
    watch.start()
    watch.watch(victim)
    watch.watch(bystander)
    try:
        time.sleep(0.2)
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        assert done.wait(2)
        ((name, pid, exitcode, seen_at),) = exits
        assert (name, pid, exitcode) == ("engine core", victim.pid, -signal.SIGKILL)
        assert seen_at - killed_at < 1.0
        description = describe_exit(name, pid, exitcode)
        assert description.startswith(f"engine core pid {pid} killed by SIGKILL")
        assert "out of memory?" in description
        watch.unwatch(bystander)  # stopped on purpose from here: not news
        bystander.kill()
        bystander.join()
        time.sleep(0.2)
        assert len(exits) == 1
    finally:
        watch.stop()
        for process in (victim, bystander):
            process.kill()
            process.join()


def test_an_exit_code_is_reported_and_described():
    exits = []
    done = threading.Event()
    watch = ProcessSentinelWatch(lambda *args: (exits.append(args), done.set()))
    watch.start()
    child = _spawn(_exit_with, 3)
    watch.watch(child)
    try:
        assert done.wait(10)
    finally:
        watch.stop()
        child.join()
    assert exits == [("engine core", child.pid, 3)]
    assert describe_exit(*exits[0]) == f"engine core pid {child.pid} exited with code 3 (start-up failure)"


def test_describe_exit():
    crash = describe_exit("worker-1", 7, -signal.SIGSEGV)
    assert crash.startswith("worker-1 pid 7 killed by SIGSEGV — a crash")
    assert describe_exit("worker-1", 7, -signal.SIGTERM) == "worker-1 pid 7 killed by SIGTERM"
    assert describe_exit("worker-1", 7, -60) == "worker-1 pid 7 killed by signal 60"
    assert describe_exit("worker-1", 7, 0) == "worker-1 pid 7 exited with code 0"
    assert "unknown" in describe_exit("worker-1", 7, None)


def test_stopping_an_idle_watch_is_prompt_and_idempotent():
    watch = ProcessSentinelWatch(lambda *args: None)
    watch.start()
    started = time.monotonic()
    watch.stop()
    watch.stop()
    assert time.monotonic() - started < 0.5
    ProcessSentinelWatch(lambda *args: None).stop()  # never started


def test_a_process_without_a_stack_dump_handler_is_not_signalled():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert request_stack_dumps([sleeper.pid]) == []
        time.sleep(0.1)
        assert sleeper.poll() is None  # SIGUSR1's default action would have killed it
    finally:
        sleeper.kill()
        sleeper.wait()
