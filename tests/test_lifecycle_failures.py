"""Fail fast, with real processes and signals: a killed, raising or hung engine core stops the server with
exit code 1 and errors for what was in flight; a killed supervisor takes its children with it and the next
start reclaims what it left; a stop while the weights load abandons the start; SIGUSR1 dumps stacks and
the server serves on. Every test ends with nothing of the server left."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest

from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base
from tests.server_process import ServerProcess, start_streams
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


def serve(model: str, *args: str, wait_ready: bool = True, **hooks) -> ServerProcess:
    hooks = {"torch_threads": 1, "test_step_sleep_s": 0.02, **hooks}
    return ServerProcess(model, "--kv-cache-memory", "4MiB", "--stats-interval", "0",
                         "--max-model-len", "512", *args, wait_ready=wait_ready,
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
    following = serve(model)
    assert f"reclaimed stale runtime dir {runtime_dir}" in following.log()
    assert not runtime_dir.exists()
    following.stop()
    following.close_log()


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
