"""The supervisor's signal handling, in real processes with real signals, and its policy alone."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import time
from multiprocessing.synchronize import Event

import pytest

from gracelm.lifecycle.signals import Action, SignalPolicy, signals_blocked_for_child, unblock_child_signals

# A supervisor in miniature: installs the handler, prints each decision, stops on immediate_stop / fatal,
# then uninstalls and says whether the previous handlers are back.
CHILD = r"""
import asyncio, logging, signal, sys, time
from gracelm.lifecycle.signals import HANDLED_SIGNALS, SignalHandler, SignalPolicy, StartupInterrupted
from gracelm.lifecycle.stacks import dump_all_stacks

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
mode, window = sys.argv[1], float(sys.argv[2])

def say(*words):
    print(*words, flush=True)

class Target:
    done = False
    def graceful_stop(self, d): say("graceful_stop", d.signal.name)
    def immediate_stop(self, d): say("immediate_stop", d.signal.name); self.done = True
    def fatal(self, d): say("fatal", d.reason); self.done = True
    def dump_stacks(self, d): dump_all_stacks("SIGUSR1"); say("dumped")

# Some handler of the program's own, which the supervisor's must leave as it found it.
signal.signal(signal.SIGUSR1, lambda *a: None)
before = {s: signal.getsignal(s) for s in HANDLED_SIGNALS}
target = Target()
handler = SignalHandler(target, SignalPolicy(repeat_window_s=window))

def report_ignored(decisions):
    for d in decisions:
        if d.action == "ignore":
            say("ignore", d.signal.name)

if mode == "thread":
    handler.install()
    say("ready")
    while not target.done:
        if handler.wait(5):
            report_ignored(handler.dispatch_pending())
elif mode == "asyncio":
    async def main():
        handler.install(loop=asyncio.get_running_loop())
        say("ready")
        while not target.done:
            await asyncio.sleep(0.01)
        handler.uninstall()  # in the loop: asyncio.run restores its own SIGINT handler after this
    asyncio.run(main())
elif mode == "startup":
    handler.install()
    try:
        with handler.abandoning_startup():
            say("ready")
            time.sleep(30)
    except StartupInterrupted as e:
        say("startup interrupted by", e.signal.name)
        sys.stdin.readline()  # a clean-up, until the test has sent a second signal, which must not raise
        say("cleaned up")
    say("recorded", len(handler.dispatch_pending()))
handler.uninstall()
say("restored", all(signal.getsignal(s) == before[s] for s in HANDLED_SIGNALS))
"""


class Child:
    def __init__(self, mode: str, window: float = 0.5) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(window)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.line() == "ready"

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def line(self, timeout: float = 10.0) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "no output from the child in time"
        return self.proc.stdout.readline().strip()

    def kill(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def finish(self) -> str:
        _, err = self.proc.communicate(timeout=10)
        assert self.proc.returncode == 0, err
        return err


@pytest.fixture
def children():
    started: list[Child] = []
    yield lambda *args: started.append(Child(*args)) or started[-1]
    for child in started:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def test_first_stop_is_graceful_a_repeat_is_ignored_a_second_is_immediate(children):
    child = children("thread", 1.0)
    child.kill(signal.SIGTERM)
    assert child.line() == "graceful_stop SIGTERM"
    sent = time.monotonic()
    child.kill(signal.SIGINT)  # the same request, delivered again (Ctrl-C to the group, say)
    assert child.line() == "ignore SIGINT"
    time.sleep(max(0.0, 1.0 - (time.monotonic() - sent)) + 0.1)
    child.kill(signal.SIGTERM)  # the operator insists
    assert child.line() == "immediate_stop SIGTERM"
    assert child.line() == "restored True"
    assert "taken for a repeated delivery" in child.finish()


def test_sigquit_is_immediate_and_sigusr1_dumps_stacks_and_carries_on(children):
    child = children("asyncio")
    child.kill(signal.SIGUSR1)
    assert child.line() == "dumped"
    child.kill(signal.SIGUSR1)
    assert child.line() == "dumped"
    child.kill(signal.SIGQUIT)
    assert child.line() == "immediate_stop SIGQUIT"
    assert child.line() == "restored True"
    err = child.finish()
    assert err.count(f"Python stacks of pid {child.proc.pid} (SIGUSR1)") == 2
    assert "Thread MainThread" in err and "in dispatch_pending" in err


def test_a_stop_signal_abandons_the_startup_once(children):
    child = children("startup")
    child.kill(signal.SIGTERM)
    assert child.line() == "startup interrupted by SIGTERM"
    child.kill(signal.SIGINT)
    # The clean-up ends now: the signal, sent before, is handled before the child reads on.
    child.send("the clean-up is over")
    assert child.line() == "cleaned up"
    assert child.line() == "graceful_stop SIGINT"  # recorded during the clean-up, dispatched after it
    assert child.line() == "recorded 1"
    assert child.line() == "restored True"
    child.finish()


def test_policy_repeat_window_is_anchored_at_the_first_request():
    policy = SignalPolicy(repeat_window_s=0.5)
    assert policy.decide(signal.SIGINT, 10.0).action is Action.GRACEFUL_STOP
    assert policy.decide(signal.SIGTERM, 10.2).action is Action.IGNORE
    assert policy.decide(signal.SIGINT, 10.45).action is Action.IGNORE
    assert policy.decide(signal.SIGINT, 10.5).action is Action.IMMEDIATE_STOP
    assert policy.decide(signal.SIGTERM, 20.0).action is Action.IGNORE
    assert policy.decide(signal.SIGUSR1, 20.1).action is Action.DUMP_STACKS


def test_policy_sighup_is_a_stop_request_like_sigterm():
    policy = SignalPolicy(repeat_window_s=0.5)
    assert policy.decide(signal.SIGHUP, 10.0).action is Action.GRACEFUL_STOP
    assert policy.decide(signal.SIGTERM, 10.1).action is Action.IGNORE  # the same stop, delivered again
    assert policy.decide(signal.SIGHUP, 11.0).action is Action.IMMEDIATE_STOP


def test_policy_sigquit_with_a_child_report_is_fatal():
    reports: list[str] = []
    policy = SignalPolicy(fatal_report=lambda: reports[0] if reports else None)
    assert policy.decide(signal.SIGTERM, 1.0).action is Action.GRACEFUL_STOP
    reports.append("engine core failed: ValueError: boom")
    decision = policy.decide(signal.SIGQUIT, 2.0)
    assert decision.action is Action.FATAL and decision.reason == reports[0]
    assert policy.decide(signal.SIGQUIT, 2.1).action is Action.IGNORE  # a second child reporting
    assert policy.decide(signal.SIGINT, 3.0).action is Action.IGNORE


def test_policy_sigquit_without_a_report_is_immediate():
    policy = SignalPolicy(fatal_report=lambda: None)
    assert policy.decide(signal.SIGQUIT, 1.0).action is Action.IMMEDIATE_STOP
    assert policy.decide(signal.SIGTERM, 5.0).action is Action.IGNORE


def _slow_child_entry(signalled: Event) -> None:
    # A slow start (an import of torch, say) before the entry sets the dispositions: it lasts until the test
    # has sent its signals, so that they come before the dispositions however the machine is loaded.
    assert signalled.wait(60)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A signal still pending is discarded, being ignored, or else delivered as this returns, before any
    # later code: nothing is left to come after it.
    unblock_child_signals()


@pytest.mark.parametrize("blocked", [True, False])
def test_a_stop_signal_during_a_childs_start_does_not_kill_it_when_blocked(blocked):
    context = mp.get_context("spawn")
    signalled = context.Event()
    child = context.Process(target=_slow_child_entry, args=(signalled,), daemon=True)
    with signals_blocked_for_child() if blocked else contextlib.nullcontext():
        child.start()
    os.kill(child.pid, signal.SIGTERM)
    os.kill(child.pid, signal.SIGINT)
    signalled.set()
    child.join(60)
    assert child.exitcode == (0 if blocked else -signal.SIGTERM)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()
