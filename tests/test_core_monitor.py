"""The engine core's monitor, alone: every way a core can end gives exactly one event with the right reason.

A fake core stands in for the process (a pipe whose closing is its death, an exit status set by the test)
and for its channel (a ZMQ pair the test speaks through), so the monitor's decisions are checked without
processes; the heartbeat is also checked against a real child that stamps it and then stops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from gracelm.engine import messages as msg
from gracelm.engine.core_monitor import CoreMonitor
from gracelm.lifecycle.heartbeat import Heartbeat
from gracelm.lifecycle.process_end import EndReason, ProcessEnd, describe_exit
from gracelm.lifecycle.processes import ChildProcess, start_process
from tests.process_checks import answers, wait_until

HANG_TIMEOUT_S = 0.6


def drain(monitor: CoreMonitor) -> list:
    """Everything in the monitor's inbox so far, in order."""
    items = []
    while not monitor.inbox.empty():
        items.append(monitor.inbox.get_nowait())
    return items


class FakeProcess:
    """What the monitor reads of a core process: pid, a sentinel that turns readable at death, a status."""

    def __init__(self, pid: int) -> None:
        self.name = "EngineCore"
        self.pid = pid
        self._sentinel_r, self._sentinel_w = os.pipe()
        self.exitcode: int | None = None

    @property
    def sentinel(self) -> int:
        return self._sentinel_r

    def join(self, timeout: float) -> None:
        pass

    def die(self, exitcode: int) -> None:
        self.exitcode = exitcode
        os.close(self._sentinel_w)

    def close(self) -> None:
        os.close(self._sentinel_r)
        if self.exitcode is None:
            os.close(self._sentinel_w)


class FakeCore:
    """A monitor over a fake process; `send` speaks as the core, `events` collects what listeners hear."""

    def __init__(self, tmp_path: Path, hang_timeout: float = HANG_TIMEOUT_S) -> None:
        self.context = zmq.Context()
        self.output = self.context.socket(zmq.PULL)
        address = f"ipc://{tmp_path / 'output.sock'}"
        self.output.bind(address)
        self.core_side = self.context.socket(zmq.PUSH)
        self.core_side.connect(address)
        self.heartbeat = Heartbeat.create(tmp_path / "heartbeat")
        self.writer = Heartbeat.open(self.heartbeat.path)
        self.process = FakeProcess(_dead_pid())
        self.monitor = CoreMonitor(self.output, self.heartbeat, hang_timeout)
        self.events: list[ProcessEnd] = []
        self.monitor.add_listener(self.events.append)
        self.monitor.start(self.process)

    def send(self, message: msg.FromCore) -> None:
        self.core_side.send(msg.encode(message))

    def die(self, exitcode: int) -> None:
        """As a real death: the kernel closes the core's end of the channel, then the status is there."""
        self.core_side.close()
        self.process.die(exitcode)

    def inbox(self) -> list:
        self.monitor.wait_end(5)
        return drain(self.monitor)

    def close(self) -> None:
        self.monitor.close()
        self.core_side.close(linger=0)
        self.output.close(linger=0)
        self.context.term()
        self.writer.close()
        self.heartbeat.close()
        self.process.close()


def _dead_pid() -> int:
    """A pid no process has (any more): stack dumps asked of it are skipped, never sent to a stranger."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def core(tmp_path):
    fake = FakeCore(tmp_path)
    yield fake
    fake.close()


def watching_ended(monitor: CoreMonitor) -> None:
    """Waits for the monitor's thread to end, as it does once it has announced the end to every listener:
    from then on no event can come, so the events heard so far are all there will be."""
    monitor._thread.join(5)
    assert not monitor._thread.is_alive(), "the monitor still watches after the end"


def _only_event(core: FakeCore) -> ProcessEnd:
    core.monitor.wait_end(5)
    watching_ended(core.monitor)
    assert len(core.events) == 1, core.events
    return core.events[0]


def test_exit_with_a_status_of_its_own(core):
    core.die(3)
    end = _only_event(core)
    assert (end.reason, end.exitcode, end.fatal) == (EndReason.EXITED, 3, True)
    assert end.message == f"engine core pid {core.process.pid} exited with code 3 (start-up failure)"


def test_killed_by_a_signal(core):
    core.die(-signal.SIGKILL)
    end = _only_event(core)
    assert end.reason is EndReason.KILLED and end.fatal
    assert end.message.startswith(f"engine core pid {core.process.pid} killed by SIGKILL — out of memory?")


def test_a_fatal_report_ends_it_at_once_and_the_exit_that_follows_adds_nothing(core):
    core.send(msg.FatalError("RuntimeError: boom", "Traceback (most recent call last): ..."))
    end = core.monitor.wait_end(5)
    assert end is not None and end.reason is EndReason.RAISED and "RuntimeError: boom" in end.message
    assert end.traceback.startswith("Traceback")
    core.die(1)
    assert _only_event(core) is end


def test_a_requested_stop_is_not_a_failure_and_its_report_is_kept(core):
    core.monitor.record_stop_requested()
    report = {"kind": "model", "name": "the model", "outcome": "released", "ms": 1.0, "error": None,
              "released_at": 0.0}
    core.send(msg.Stopped([report]))
    wait_until(lambda: core.monitor.core_report, 5, "the monitor to read the Stopped report")
    core.die(0)
    end = _only_event(core)
    assert (end.reason, end.fatal) == (EndReason.STOPPED, False)
    assert [r.name for r in core.monitor.core_report] == ["the model"]


def test_exit_0_unasked_is_a_failure(core):
    core.die(0)
    assert _only_event(core).reason is EndReason.EXITED


def test_what_the_core_said_before_it_died_comes_first(core):
    batch = msg.OutputsBatch([msg.TokenOutput("r/0", 7)])
    core.send(batch)
    core.die(-signal.SIGSEGV)
    items = core.inbox()
    assert items[0] == batch and isinstance(items[1], ProcessEnd) and len(items) == 2
    assert items[1].reason is EndReason.KILLED and "a crash" in items[1].message


def test_no_hang_while_nothing_is_expected(core):
    assert core.monitor.wait_end(HANG_TIMEOUT_S * 2) is None  # no stamp at all, but nothing was sent


def test_a_core_frozen_while_idle_hangs_once_work_is_sent(core):
    core.writer.beat()
    assert core.monitor.wait_end(HANG_TIMEOUT_S * 1.5) is None  # idle: an old stamp is no hang
    sent = time.monotonic()
    core.monitor.set_busy(True)  # a request goes to a core that never stamps again
    core.monitor.wait_end(5)
    elapsed = time.monotonic() - sent
    end = _only_event(core)
    assert end.reason is EndReason.HUNG and "hung: no step finished" in end.message
    assert HANG_TIMEOUT_S <= elapsed < HANG_TIMEOUT_S + 0.5


def test_stamps_keep_a_busy_core_alive_and_a_stall_ends_it(core):
    core.monitor.set_busy(True)
    until = time.monotonic() + HANG_TIMEOUT_S * 2
    while time.monotonic() < until:  # steps, each well within the timeout
        core.writer.beat()
        time.sleep(0.05)
    assert core.monitor.end is None
    stalled_from = core.heartbeat.read().stamp  # the last step's stamp (time.monotonic)
    end = _only_event(core)
    assert end.reason is EndReason.HUNG
    assert HANG_TIMEOUT_S <= time.monotonic() - stalled_from


def test_idle_again_after_work_cancels_the_deadline(core):
    core.monitor.set_busy(True)
    core.monitor.set_busy(False)
    assert core.monitor.wait_end(HANG_TIMEOUT_S * 2) is None


def test_zero_hang_timeout_never_hangs(tmp_path):
    fake = FakeCore(tmp_path, hang_timeout=0)
    try:
        fake.monitor.set_busy(True)
        assert fake.monitor.wait_end(0.5) is None
    finally:
        fake.close()


def test_a_listener_added_after_the_end_hears_it_at_once(core):
    core.die(-signal.SIGTERM)
    end = core.monitor.wait_end(5)
    heard = []
    core.monitor.add_listener(heard.append)
    assert heard == [end] and end.message.endswith("killed by SIGTERM")


# A real child, moved on by the test's lines: steps (a stamp every 20 ms) until the first, idles until the
# second, then hangs in a step without stamping, where it still echoes what it reads (to show it runs on).
BEATER = r"""
import select, sys
from gracelm.lifecycle.stacks import install_child_stack_dump
from gracelm.lifecycle.heartbeat import Heartbeat
install_child_stack_dump()
heartbeat = Heartbeat.open(sys.argv[1])
while not select.select([sys.stdin], [], [], 0.02)[0]:
    heartbeat.beat()
sys.stdin.readline()
print("idle", flush=True)
sys.stdin.readline()
heartbeat.beat()
print("hanging", flush=True)
for line in sys.stdin:
    print(line, end="", flush=True)
"""


class PopenProcess:
    """A `subprocess.Popen` child as the monitor sees a process: its pidfd is the sentinel."""

    def __init__(self, child: subprocess.Popen) -> None:
        self.child = child
        self.pid = child.pid
        self.sentinel = os.pidfd_open(child.pid)

    @property
    def exitcode(self) -> int | None:
        return self.child.poll()

    def join(self, timeout: float) -> None:
        try:
            self.child.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def test_a_real_child_that_stops_stamping_with_work_pending_is_reported_after_the_timeout(tmp_path):
    heartbeat = Heartbeat.create(tmp_path / "heartbeat")
    context = zmq.Context()
    output = context.socket(zmq.PULL)
    output.bind(f"ipc://{tmp_path / 'out.sock'}")
    child = subprocess.Popen([sys.executable, "-c", BEATER, str(heartbeat.path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process = PopenProcess(child)
    monitor = CoreMonitor(output, heartbeat, HANG_TIMEOUT_S)
    events: list[ProcessEnd] = []
    monitor.add_listener(events.append)
    monitor.start(process)
    try:
        monitor.set_busy(True)  # it steps: work is pending
        # 50 stamps, 20 ms apart: a second of steps, longer than the timeout, each step within it.
        wait_until(lambda: heartbeat.read().count >= 50, 30, "the child's steps")
        monitor.set_busy(False)
        assert _told(child, "done") == "idle"
        assert monitor.wait_end(HANG_TIMEOUT_S * 1.5) is None  # idle: an old stamp is no hang
        assert _told(child, "work") == "hanging"
        monitor.set_busy(True)
        busy_at = time.monotonic()
        end = monitor.wait_end(15)
        assert end is not None and end.reason is EndReason.HUNG and end.pid == child.pid
        assert HANG_TIMEOUT_S <= time.monotonic() - busy_at < HANG_TIMEOUT_S + 1.5  # dump wait included
        assert events == [end]  # not during the steps, nor while idle: once, at the hang
        assert answers(child)  # the stack dump left it running
    finally:
        monitor.close()
        child.kill()
        _, err = child.communicate()
        os.close(process.sentinel)
        output.close(linger=0)
        context.term()
        heartbeat.close()
    assert "most recent call first" in err and 'File "<string>"' in err


def _told(child: subprocess.Popen, line: str) -> str:
    """Sends `line` to the child; its answer."""
    child.stdin.write(line + "\n")
    child.stdin.flush()
    return child.stdout.readline().strip()


def test_describe_exit():
    crash = describe_exit("worker-1", 7, -signal.SIGSEGV)
    assert crash.startswith("worker-1 pid 7 killed by SIGSEGV — a crash")
    assert describe_exit("worker-1", 7, -signal.SIGTERM) == "worker-1 pid 7 killed by SIGTERM"
    assert describe_exit("worker-1", 7, -60) == "worker-1 pid 7 killed by signal 60"
    assert describe_exit("worker-1", 7, 0) == "worker-1 pid 7 exited with code 0"
    assert "unknown" in describe_exit("worker-1", 7, None)


def test_stopping_an_idle_monitor_is_prompt_and_idempotent(core):
    started = time.monotonic()
    core.monitor.close()
    core.monitor.close()
    assert time.monotonic() - started < 0.5
    assert core.monitor.end is None and not core.events


# -- real children, started as the engine core is (`start_process`), so that the monitor reads a real
# `ChildProcess`: its sentinel, and the exit status that becomes reapable a moment after it.

OUTPUT_BATCH = msg.OutputsBatch([msg.TokenOutput("r/0", 7)])


def speak_and_sleep(address: str) -> None:
    """A core's stand-in in a real child: connects its channel, says one thing, then waits to be killed."""
    context = zmq.Context()
    channel = context.socket(zmq.PUSH)
    channel.connect(address)
    channel.send(msg.encode(OUTPUT_BATCH))
    time.sleep(30)


class RealCore:
    """A monitor over a real child; `heard` is what its listener got, each with the time it came."""

    def __init__(self, tmp_path: Path) -> None:
        self.context = zmq.Context()
        self.output = self.context.socket(zmq.PULL)
        self.address = f"ipc://{tmp_path / 'output.sock'}"
        self.output.bind(self.address)
        self.heartbeat = Heartbeat.create(tmp_path / "heartbeat")
        self.monitor = CoreMonitor(self.output, self.heartbeat, HANG_TIMEOUT_S)
        self.heard: list[tuple[ProcessEnd, float]] = []
        self.monitor.add_listener(lambda end: self.heard.append((end, time.monotonic())))
        self.child: ChildProcess | None = None

    def start(self, target: str, *args: object) -> ChildProcess:
        self.child = start_process("engine core", "gracelm::test-core", target, args)
        self.monitor.start(self.child)
        return self.child

    def only_end(self) -> tuple[ProcessEnd, float]:
        assert self.monitor.wait_end(10) is not None
        watching_ended(self.monitor)
        assert len(self.heard) == 1, self.heard
        return self.heard[0]

    def inbox(self) -> list:
        return drain(self.monitor)

    def close(self) -> None:
        self.monitor.close()
        if self.child is not None:
            self.child.process.kill()  # it ignores SIGTERM, and a failed test may leave it running
            self.child.stop(5)
        self.output.close(linger=0)
        self.context.term()
        self.heartbeat.close()


@pytest.fixture
def real_core(tmp_path):
    real = RealCore(tmp_path)
    yield real
    real.close()


def test_a_real_child_killed_by_sigkill_is_reported_within_a_second_once(real_core):
    child = real_core.start("tests.test_core_monitor:speak_and_sleep", real_core.address)
    deadline = time.monotonic() + 20
    while real_core.monitor.inbox.empty():  # it runs and its channel is connected
        assert time.monotonic() < deadline and real_core.monitor.end is None, "the child never spoke"
        time.sleep(0.01)
    killed_at = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    end, heard_at = real_core.only_end()
    assert heard_at - killed_at < 1.0
    assert (end.reason, end.pid, end.exitcode, end.fatal) == (EndReason.KILLED, child.pid, -signal.SIGKILL,
                                                              True)
    assert end.message.startswith(f"engine core pid {child.pid} killed by SIGKILL")
    assert "out of memory?" in end.message
    assert real_core.inbox() == [OUTPUT_BATCH, end]  # what it said first, then its one end


def test_a_real_childs_exit_code_3_is_reported_as_a_startup_failure(real_core):
    child = real_core.start("sys:exit", 3)
    end, _ = real_core.only_end()
    assert (end.reason, end.pid, end.exitcode, end.fatal) == (EndReason.EXITED, child.pid, 3, True)
    assert end.message == f"engine core pid {child.pid} exited with code 3 (start-up failure)"
    assert real_core.inbox() == [end]


def write_environment(path: str) -> None:
    """A child that writes what its environment says, and the vector level torch chose as it loaded."""
    import torch

    Path(path).write_text(json.dumps({"TMPDIR": os.environ.get("TMPDIR"),
                                      "capability": torch.backends.cpu.get_cpu_capability()}))


def test_a_child_gets_the_variables_it_is_started_with_before_it_loads_torch(tmp_path):
    """As the engine core gets its TMPDIR and its masked CPU features' variables (`start_process`'s env)."""
    out = tmp_path / "environment.json"
    child = start_process("probe", "gracelm::test-env", "tests.test_core_monitor:write_environment",
                          (str(out),), {"TMPDIR": str(tmp_path), "ATEN_CPU_CAPABILITY": "default"})
    child.join(60)
    assert child.stop(5) == "exited" and child.exitcode == 0
    assert json.loads(out.read_text()) == {"TMPDIR": str(tmp_path), "capability": "DEFAULT"}
    assert "ATEN_CPU_CAPABILITY" not in os.environ  # the parent's own is untouched
