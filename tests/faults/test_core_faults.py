"""Faults of the engine core, with real processes and signals: killed (busy or idle), stopped by SIGSTOP
(busy or idle), raising or hanging by an injected fault, each gives exactly one end with its reason, exit code
1 and errors for what was in flight; SIGUSR1 dumps stacks and the server serves on. Every test ends with
nothing of the server left."""

from __future__ import annotations

import signal
import time

import httpx
import psutil
import pytest

from tests.faults.helpers import (
    assert_one_end,
    core_of,
    ended_lines,
    finish,
    health_once_failure_known,
    kill_9_when_idle,
    leave_nothing_behind,
    plain_request,
    serve,
    wait_stopped,
)
from tests.process_checks import wait_until
from tests.server_process import ServerProcess, Stream, metric_value, start_streams


def requests_in_engine(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return (metric_value(text, "gracelm_num_requests_running")
            + metric_value(text, "gracelm_num_requests_waiting"))


def test_kill_9_of_the_engine_core_under_load_is_fatal_within_2_s(model):
    server = serve(model)
    streams = start_streams(server.url, 2, max_tokens=400)
    plain: list[httpx.Response] = []
    plain_thread = plain_request(server.url, plain)
    wait_until(lambda: requests_in_engine(server) == 3, 30, "the plain request in the engine")
    core = core_of(server)
    killed = time.monotonic()
    core.kill()
    health = health_once_failure_known(server.url)
    assert server.wait_exit(5) == 1, server.log()[-5000:]
    assert time.monotonic() - killed < 2.0
    for stream in streams:
        stream.join()
        assert stream.events[-1] == "[DONE]" and stream.errors[0]["code"] == "engine_dead"
        assert "SIGKILL" in stream.errors[0]["message"]
    plain_thread.join(10)
    assert plain[0].status_code == 500 and plain[0].json()["error"]["code"] == "engine_dead"
    log = finish(server, 1, within=5)
    assert health == 503
    assert f"engine core pid {core.pid} killed by SIGKILL — out of memory?" in log


def test_sigusr1_dumps_every_stack_then_an_injected_exception_is_fatal(model):
    server = serve(model, test_raise_after_steps=30)
    core = core_of(server)
    server.process.send_signal(signal.SIGUSR1)
    wait_until(lambda: f"Python stacks of pid {server.pid} (SIGUSR1)" in (log := server.log())
               and "most recent call first" in log, 30, lambda: f"both dumps in the log:\n{server.log()}")
    short = httpx.post(f"{server.url}/v1/completions",
                       json={"prompt": "x", "max_tokens": 4, "ignore_eos": True})
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    log = server.log()
    assert f"Python stacks of pid {server.pid} (SIGUSR1)" in log
    assert "most recent call first" in log  # the engine core's faulthandler dump
    assert core.is_running()
    (stream,) = start_streams(server.url, 1, max_tokens=400)
    stream.join()
    assert stream.errors and stream.events[-1] == "[DONE]"
    log = finish(server, 1, within=10)
    assert "RuntimeError: failure injected by the test fault" in log
    assert "Traceback (most recent call last)" in log
    assert "SIGQUIT received" in log


def test_injected_hang_dumps_stacks_and_is_fatal_after_the_hang_timeout(model):
    server = serve(model, "--engine-hang-timeout", "1", test_hang_after_steps=5)
    hung_at = time.monotonic()
    (stream,) = start_streams(server.url, 1, max_tokens=100)
    stream.join()
    assert stream.errors and "hung" in stream.errors[0]["message"]
    log = finish(server, 1, within=10)
    assert 1.0 < time.monotonic() - hung_at < 8
    assert "made no step progress" in log and "most recent call first" in log and "after_core_step" in log



def test_sigstop_of_an_idle_core_then_a_request_is_fatal_within_the_hang_timeout(model):
    hang_timeout = 2.0
    server = serve(model, "--engine-hang-timeout", str(hang_timeout))
    core = core_of(server)
    try:
        core.suspend()  # SIGSTOP, while no request is pending
        wait_stopped(core)
        # Idle, a frozen core is nobody's concern: for longer than the hang timeout nothing happens.
        idle_until = time.monotonic() + hang_timeout + 1.0
        while time.monotonic() < idle_until:
            assert httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200, server.log()[-5000:]
            assert server.process.poll() is None, server.log()[-5000:]
            time.sleep(0.1)
        assert not ended_lines(server.log()), server.log()[-5000:]
        assert core.status() == psutil.STATUS_STOPPED
        # Work sent to it makes it due: no progress for the hang timeout is a hang.
        sent = time.monotonic()
        stream = Stream(server.url, max_tokens=50)
        plain: list[httpx.Response] = []
        plain_thread = plain_request(server.url, plain)
        health = health_once_failure_known(server.url, within=hang_timeout + 5)
        failed_after = time.monotonic() - sent
        stream.join(15)
        plain_thread.join(15)
        answered_after = time.monotonic() - sent
        assert health == 503
        assert hang_timeout - 0.1 < failed_after < hang_timeout + 3, failed_after
        assert answered_after < hang_timeout + 4, answered_after
        assert stream.error is None, stream.error
        assert stream.events[-1] == "[DONE]" and len(stream.errors) == 1, stream.events
        assert stream.errors[0]["code"] == "engine_dead" and "hung" in stream.errors[0]["message"]
        assert plain and plain[0].status_code == 500, plain
        error = plain[0].json()["error"]
        assert error["code"] == "engine_dead" and error["type"] == "server_error", error
        assert "hung" in error["message"], error
        log = finish(server, 1, within=10)  # the stopped core must have been killed
        assert not core.is_running()
        message = assert_one_end(log, "hung")
        assert f"engine core pid {core.pid} hung: no step finished for" in message
        assert error["message"] == f"the engine is dead: {message}"
    finally:
        leave_nothing_behind(server, core)


def _drive_by_request(server: ServerProcess) -> Stream:
    stream = Stream(server.url, max_tokens=400)
    return stream.join(30)


def _drive_by_kill(server: ServerProcess) -> Stream:
    (stream,) = start_streams(server.url, 1, max_tokens=400)
    wait_until(lambda: len(stream.events) >= 5, 30, "tokens of the stream")  # the core in mid-generation
    core_of(server).kill()
    return stream.join(30)


def _drive_by_sigterm(server: ServerProcess) -> Stream:
    (stream,) = start_streams(server.url, 1, max_tokens=40)
    server.process.send_signal(signal.SIGTERM)  # the running request finishes, then the core stops
    return stream.join(30)


@pytest.mark.parametrize(("args", "hooks", "drive", "code", "reason", "says"), [
    pytest.param((), {"test_exit_after_steps": 5}, _drive_by_request, 1, "exited", "exited with code 5",
                 id="exited"),
    pytest.param((), {}, _drive_by_kill, 1, "killed", "killed by SIGKILL", id="killed"),
    pytest.param((), {"test_raise_after_steps": 5}, _drive_by_request, 1, "raised",
                 "RuntimeError: failure injected by the test fault", id="raised"),
    pytest.param(("--engine-hang-timeout", "1"), {"test_hang_after_steps": 5}, _drive_by_request, 1, "hung",
                 "hung: no step finished", id="hung"),
    pytest.param((), {}, _drive_by_sigterm, 0, "stopped", "stopped on request", id="stopped"),
])
def test_each_end_of_the_core_gives_one_event_with_its_reason(model, args, hooks, drive, code, reason, says):
    server = serve(model, *args, **hooks)
    core = core_of(server)
    try:
        stream = drive(server)
        log = finish(server, code, within=15)
        message = assert_one_end(log, reason)
        assert says in message, message
        if reason in ("exited", "killed", "hung", "stopped"):
            assert f"engine core pid {core.pid} " in message, message
        assert stream.error is None, stream.error
        assert stream.events[-1] == "[DONE]", stream.events
        if code == 0:
            assert not stream.errors and stream.finish_reasons == ["length"], stream.events
            assert stream.completion_tokens == 40
        else:  # the in-flight request failed, with the one end's message
            assert [e["code"] for e in stream.errors] == ["engine_dead"], stream.events
            assert stream.errors[0]["message"] == f"the engine is dead: {message}"
    finally:
        leave_nothing_behind(server, core)


def test_kill_9_of_an_idle_core_is_fatal_within_2_s(model):
    server = serve(model)
    core = core_of(server)
    try:
        log = kill_9_when_idle(server, core)
        assert f"engine core pid {core.pid} killed by SIGKILL" in assert_one_end(log, "killed")
    finally:
        leave_nothing_behind(server, core)


def test_sigstop_of_a_busy_core_is_fatal_within_the_hang_timeout(model):
    hang_timeout = 2.0
    server = serve(model, "--engine-hang-timeout", str(hang_timeout))
    core = core_of(server)
    try:
        streams = start_streams(server.url, 2, max_tokens=400)
        stopped = time.monotonic()
        core.suspend()
        wait_stopped(core)
        health = health_once_failure_known(server.url, within=hang_timeout + 5)
        failed_after = time.monotonic() - stopped
        for stream in streams:
            stream.join(15)
            assert stream.error is None and stream.events[-1] == "[DONE]", stream.events
            assert [e["code"] for e in stream.errors] == ["engine_dead"], stream.events
            assert "hung" in stream.errors[0]["message"]
        log = finish(server, 1, within=10)  # the stopped core must have been killed
        assert health == 503
        assert hang_timeout - 0.1 < failed_after < hang_timeout + 3, failed_after
        assert not core.is_running()
        assert f"engine core pid {core.pid} hung: no step finished for" in assert_one_end(log, "hung")
    finally:
        leave_nothing_behind(server, core)
