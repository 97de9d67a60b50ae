"""The resource ledger: reverse-order release, per-resource deadlines, failures reported, the report."""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
import threading
import time

import pytest

from gracelm.lifecycle.ledger import Ledger, LedgerClosedError, Outcome, ResourceKind
from gracelm.lifecycle.processes import reaped_exitcode


def test_releases_in_reverse_order_of_acquisition():
    ledger, order = Ledger(), []
    for name in ("dir", "context", "socket"):
        ledger.acquire(ResourceKind.SOCKET, name, lambda name=name: order.append(name))
    report = ledger.release_all()
    assert order == ["socket", "context", "dir"]
    assert [r.name for r in report.resources] == order
    assert all(r.outcome is Outcome.RELEASED for r in report.resources)
    assert report.ok


def test_hung_release_is_forced_within_its_timeout():
    ledger, forced = Ledger(), threading.Event()
    never = threading.Event()
    ledger.acquire(ResourceKind.PROCESS, "stuck", never.wait, timeout=0.2, force=forced.set)
    started = time.monotonic()
    report = ledger.release_all()
    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 1.0
    (entry,) = report.resources
    assert entry.outcome is Outcome.FORCED and forced.is_set()
    assert "0.2 s" in entry.error
    assert 200 <= entry.ms < 1000
    assert report.ok
    never.set()


def test_hung_release_without_force_fails_and_the_stop_goes_on():
    ledger, never, after = Ledger(), threading.Event(), []
    ledger.acquire(ResourceKind.DIRECTORY, "first", lambda: after.append("first"))
    ledger.acquire(ResourceKind.THREAD, "stuck", never.wait, timeout=0.1)
    report = ledger.release_all()
    assert [r.outcome for r in report.resources] == [Outcome.FAILED, Outcome.RELEASED]
    assert after == ["first"]
    assert not report.ok
    never.set()


def test_failures_are_reported_not_raised():
    def boom():
        raise OSError("device busy")

    ledger, forced = Ledger(), []
    ledger.acquire(ResourceKind.SHARED_MEMORY, "seg-a", boom)
    ledger.acquire(ResourceKind.SHARED_MEMORY, "seg-b", boom, force=lambda: forced.append(1))
    report = ledger.release_all()
    by_name = {r.name: r for r in report.resources}
    assert by_name["seg-b"].outcome is Outcome.FORCED and forced == [1]
    assert by_name["seg-a"].outcome is Outcome.FAILED
    assert by_name["seg-a"].error == "OSError: device busy"
    assert "FAILED" in report.as_table()


def test_failing_force_is_failed_with_both_errors():
    def boom():
        raise RuntimeError("release broke")

    def force_boom():
        raise RuntimeError("force broke")

    ledger = Ledger()
    ledger.acquire(ResourceKind.MODEL, "weights", boom, force=force_boom)
    (entry,) = ledger.release_all().resources
    assert entry.outcome is Outcome.FAILED
    assert "release broke" in entry.error and "force broke" in entry.error


def test_early_release_is_reported_once_at_its_time():
    ledger, calls = Ledger(), []
    first = ledger.acquire(ResourceKind.TASK, "stats", lambda: calls.append("stats"))
    ledger.acquire(ResourceKind.SOCKET, "listener", lambda: calls.append("listener"))
    early = ledger.release(first)
    assert early.outcome is Outcome.RELEASED and ledger.release(first) is early
    assert [h.name for h in ledger.held] == ["listener"]
    report = ledger.release_all()
    assert calls == ["stats", "listener"]
    assert [r.name for r in report.resources] == ["stats", "listener"]
    assert report.resources[0].released_at <= report.resources[1].released_at


def test_release_all_is_idempotent_and_closes_the_ledger():
    ledger, calls = Ledger(), []
    ledger.acquire(ResourceKind.ZMQ_CONTEXT, "ctx", lambda: calls.append(1))
    report = ledger.release_all()
    assert ledger.release_all() is report
    assert calls == [1]
    with pytest.raises(LedgerClosedError):
        ledger.acquire(ResourceKind.SOCKET, "late", lambda: None)


def test_concurrent_release_and_release_all_release_once():
    ledger, calls, lock = Ledger(), [], threading.Lock()

    def slow_release(name):
        time.sleep(0.01)
        with lock:
            calls.append(name)

    handles = [ledger.acquire(ResourceKind.SOCKET, f"s{i}", lambda i=i: slow_release(f"s{i}"))
               for i in range(20)]
    threads = [threading.Thread(target=ledger.release, args=(h,)) for h in handles[::2]]
    for thread in threads:
        thread.start()
    report = ledger.release_all()
    for thread in threads:
        thread.join()
    assert sorted(calls) == sorted(f"s{i}" for i in range(20))
    assert len(report.resources) == 20


def test_inline_release_runs_on_the_calling_thread():
    ledger, threads = Ledger(), []
    ledger.acquire(ResourceKind.SIGNAL_HANDLERS, "handlers",
                   lambda: threads.append(threading.current_thread()), inline=True)
    ledger.release_all()
    assert threads == [threading.current_thread()]


def _ignore_term_and_sleep():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def test_a_real_child_that_will_not_exit_is_killed():
    child = mp.get_context("spawn").Process(target=_ignore_term_and_sleep, daemon=True)
    child.start()
    ledger = Ledger()
    ledger.acquire(ResourceKind.PROCESS, f"sleeper pid {child.pid}", child.join,
                   timeout=0.3, force=lambda: (child.kill(), child.join(2)))
    (entry,) = ledger.release_all().resources
    assert entry.outcome is Outcome.FORCED
    # The timed-out release thread may still be joining the child too: read the status as the monitor does.
    assert reaped_exitcode(child) == -signal.SIGKILL


def test_report_table_and_json(tmp_path):
    ledger = Ledger()
    ledger.acquire(ResourceKind.KV_CACHE, "kv cache (64 blocks)", lambda: None)
    ledger.acquire(ResourceKind.PROCESS_GROUP, "tp group", lambda: 1 / 0)
    report = ledger.release_all()
    table = report.as_table().splitlines()
    assert table[0].split() == ["kind", "name", "outcome", "ms", "error"]
    assert "tp group" in table[1] and "failed" in table[1] and "ZeroDivisionError" in table[1]
    assert "kv cache (64 blocks)" in table[2] and "released" in table[2]
    assert table[-1].startswith("2 resources") and table[-1].endswith("FAILED")
    path = tmp_path / "report.json"
    report.to_json(path)
    data = json.loads(path.read_text())
    assert data["ok"] is False
    assert [(r["kind"], r["outcome"]) for r in data["resources"]] == [("process group", "failed"),
                                                                       ("kv cache", "released")]
    assert all(isinstance(r["ms"], float) for r in data["resources"])


def test_a_stop_that_had_to_force_anything_exits_with_the_fatal_code():
    from gracelm.lifecycle.exit_codes import ExitCode
    from gracelm.server.api_server import stop_exit_code

    clean = Ledger()
    clean.acquire(ResourceKind.SOCKET, "listener", lambda: None)
    assert stop_exit_code(ExitCode.CLEAN_STOP, clean.release_all()) is ExitCode.CLEAN_STOP
    forced = Ledger()
    forced.acquire(ResourceKind.PROCESS, "a child that will not stop", lambda: time.sleep(1), timeout=0.1,
                   force=lambda: None)
    report = forced.release_all()
    assert [r.outcome for r in report.not_released] == [Outcome.FORCED]
    assert stop_exit_code(ExitCode.CLEAN_STOP, report) is ExitCode.FATAL
    assert stop_exit_code(ExitCode.FATAL, clean.release_all()) is ExitCode.FATAL
