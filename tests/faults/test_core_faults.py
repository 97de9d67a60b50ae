"""Fail fast, with real processes and signals: a killed, raising or hung engine core stops the server with
exit code 1 and errors for what was in flight; a killed supervisor takes its children with it and the next
start reclaims what it left; a stop while the weights load abandons the start; SIGUSR1 dumps stacks and
the server serves on. Every test ends with nothing of the server left."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest

from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base
from tests.process_checks import leftover_children
from tests.server_process import ServerProcess, Stream, start_streams
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


def serve(model: str, *args: str, wait_ready: bool = True, **hooks) -> ServerProcess:
    hooks = {"test_step_sleep_s": 0.02, **hooks}
    return ServerProcess(model, "--kv-cache-memory", "4MiB", "--stats-interval", "0",
                         "--max-model-len", "512", "--num-threads", "1", *args, wait_ready=wait_ready,
                         env={"GRACELM_TEST_HOOKS": json.dumps(hooks)})


def core_of(server: ServerProcess) -> psutil.Process:
    return next(p for p in server.children if "engine-core" in " ".join(p.cmdline()))


def finish(server: ServerProcess, code: int, within: float) -> str:
    assert server.wait_exit(within) == code, server.log()[-5000:]
    server.assert_nothing_left()
    log = server.log()
    server.close_log()
    return log


def plain_request(url: str, result: list) -> threading.Thread:
    def run() -> None:
        body = {"prompt": "a dog", "max_tokens": 400, "ignore_eos": True}
        result.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def health_once_failure_known(url: str, within: float = 2.0) -> int | str:
    """`/health` as soon as it stops answering 200: it must turn 503 before the server goes away."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{url}/health", timeout=1.0).status_code
        except httpx.TransportError as e:
            return f"unreachable: {e!r}"
        if status != 200:
            return status
        time.sleep(0.01)
    return 200


def test_kill_9_of_the_engine_core_under_load_is_fatal_within_2_s(model):
    server = serve(model)
    streams = start_streams(server.url, 2, max_tokens=400)
    plain: list[httpx.Response] = []
    plain_thread = plain_request(server.url, plain)
    time.sleep(0.3)
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
    time.sleep(0.5)
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
    assert "RuntimeError: failure injected by the test hook" in log
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
    assert "made no step progress" in log and "most recent call first" in log and "_test_hooks" in log


def test_kill_9_of_the_supervisor_takes_every_child_and_the_next_start_reclaims(model):
    server = serve(model)
    server.capture()
    (runtime_dir,) = server.runtime_dirs
    killed = time.monotonic()
    server.process.kill()
    server.wait_exit(5)
    _, alive = psutil.wait_procs(server.children, timeout=1.0)
    # A zombie is dead: only its parent (gone) or init may still reap it.
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"children outlived their parent by 1 s: {alive}"
    assert time.monotonic() - killed < 1.5
    assert runtime_dir.exists()  # SIGKILL leaves it; the next start reclaims it
    server.close_log()
    with serve(model) as following:  # stopped, or killed if an assertion fails: nothing outlives the test
        assert f"reclaimed stale runtime dir {runtime_dir}" in following.log()
        assert not runtime_dir.exists()


def test_sigterm_while_the_weights_load_abandons_the_start(model):
    server = serve(model, wait_ready=False, test_slow_load_s=60)
    deadline = time.monotonic() + 60
    while "delaying the model load" not in server.log():
        assert time.monotonic() < deadline and server.process.poll() is None, server.log()
        time.sleep(0.1)
    server.capture()
    assert any("engine-core" in " ".join(p.cmdline()) for p in server.children)
    server.process.send_signal(signal.SIGTERM)
    log = finish(server, 0, within=15)
    assert "start-up abandoned: SIGTERM" in log
    assert not list(runtime_base().glob(f"{PREFIX}{server.pid}-*"))


@contextlib.contextmanager
def full_filesystem(tmp_path):
    """A tmpfs of 64 KiB, filled up: a runtime directory where no byte can be written."""
    mount_point = tmp_path / "full"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        with contextlib.suppress(OSError), (mount_point / "filler").open("wb") as filler:
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_runtime_filesystem_at_start_up_exits_3_naming_the_path(model, tmp_path):
    with full_filesystem(tmp_path) as full:
        server = ServerProcess(model, "--kv-cache-memory", "4MiB", "--num-threads", "1", wait_ready=False,
                               env={"XDG_RUNTIME_DIR": str(full)})
        assert server.wait_exit(60) == 3, server.log()
        log = server.log()
        server.close_log()
        assert "No space left on device" in log and f"heartbeat slot {full}/gracelm-" in log, log
        assert sorted(p.name for p in full.iterdir()) == ["filler"]  # the runtime directory is gone
    assert leftover_children() == []


ENDED = re.compile(r"engine core ended \((\w+)\): (.*)$")


def ended_lines(log: str) -> list[tuple[str, str, str]]:
    """Every `engine core ended (<reason>): <message>` line of the log: (reason, message, the whole line)."""
    found = []
    for line in log.splitlines():
        m = ENDED.search(line)
        if m:
            found.append((m.group(1), m.group(2), line))
    return found


def assert_one_end(log: str, reason: str) -> str:
    """Exactly one end line in the log, with `reason` (and no other reason's); returns its message. A fatal
    end is logged at ERROR, a requested stop at INFO."""
    ends = ended_lines(log)
    assert [r for r, _, _ in ends] == [reason], f"end lines: {[line for _, _, line in ends]}\n{log[-5000:]}"
    (_, message, line), = ends
    level = "INFO" if reason == "stopped" else "ERROR"
    assert f" {level} " in line, line
    return message


def leave_nothing_behind(server: ServerProcess, core: psutil.Process) -> None:
    """After a test that failed early: resumes and kills the core (stopped, it might outlive everything
    else) and then the whole server, by pid."""
    with contextlib.suppress(psutil.Error):
        core.resume()
        core.kill()
    if server.process.poll() is None:
        server.kill()


def wait_stopped(process: psutil.Process, within: float = 2.0) -> None:
    """SIGSTOP takes effect asynchronously: a process running on another CPU stops a moment later."""
    deadline = time.monotonic() + within
    while process.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"pid {process.pid} not stopped: {process.status()}"
        time.sleep(0.01)


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
    time.sleep(0.3)
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
                 "RuntimeError: failure injected by the test hook", id="raised"),
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
