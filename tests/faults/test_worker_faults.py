"""Faults of the tensor-parallel workers, each kind: a worker of node 0 (a child of the engine core) killed
while busy or idle, raising or hanging by an injected fault; a worker of a headless node killed. Each is
fatal on node 0 at once (or within the hang timeout), exit code 1, and nothing is left."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

from gracelm import Engine, SamplingParams
from gracelm.engine.errors import EngineDeadError
from tests.faults.helpers import (
    assert_one_end,
    finish,
    kill_9_when_idle,
    leave_nothing_behind,
    serve,
)
from tests.process_checks import assert_nothing_left, core_stamps, wait_until
from tests.server_process import ServerProcess, start_streams
from tests.two_nodes import TwoNodes

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]


def _engine(model: str, tp: int) -> Engine:
    return Engine(model, tensor_parallel_size=tp, kv_cache_memory="4MiB", num_threads=1)


def _worker_pids(root: int) -> list[int]:
    return [p.pid for p in psutil.Process(root).children(recursive=True)
            if "gracelm::worker" in " ".join(p.cmdline())]


def test_worker_killed_under_load_is_fatal_at_once(tp_model):
    engine = _engine(tp_model, 2)
    try:
        errors: list[BaseException] = []
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        thread = threading.Thread(target=lambda: _record(errors, engine.generate, PROMPTS * 4, long))
        stamps = core_stamps(os.getpid())
        thread.start()
        # Under load: the core steps (idle, sent nothing, it never stamps).
        wait_until(lambda: core_stamps(os.getpid()) >= stamps + 10, 60, "the core to step")
        (worker,) = _worker_pids(os.getpid())
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive()
        elapsed = time.monotonic() - killed
        assert errors and isinstance(errors[0], EngineDeadError), errors
        assert elapsed < 2.0, elapsed
        assert "worker rank 1" in str(errors[0]) and "SIGKILL" in str(errors[0])
    finally:
        engine.shutdown()
    assert_nothing_left()


def _record(errors: list[BaseException], function, *args) -> None:
    try:
        function(*args, use_tqdm=False)
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        errors.append(e)


def test_node1_worker_killed_is_fatal_on_node0_within_2s(tp_model):
    nodes = TwoNodes(tp_model)
    try:
        (worker,) = [p.pid for p in nodes.node1_procs[1:] if "gracelm::worker" in " ".join(p.cmdline())]
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        code = nodes.node0.wait_exit(timeout=10)
        assert time.monotonic() - killed < 2.0
        assert code == 1, nodes.node0.log()[-3000:]
        assert "worker rank 1" in nodes.node0.log()
        nodes.node0.assert_nothing_left()
        node1_code, out = nodes.node1_output(timeout=10)
        assert node1_code == 1, out
    finally:
        nodes.kill_all()


def serve_tp2(model: str, *args: str, **hooks) -> ServerProcess:
    return serve(model, "--tensor-parallel-size", "2", *args, **hooks)


def worker_of(server: ServerProcess) -> psutil.Process:
    return next(p for p in server.children if "gracelm::worker" in " ".join(p.cmdline()))


def test_kill_9_of_an_idle_worker_is_fatal_within_2_s(tp_model):
    server = serve_tp2(tp_model)
    worker = worker_of(server)
    try:
        log = kill_9_when_idle(server, worker)
        message = assert_one_end(log, "raised")
        expected = f"tensor-parallel worker rank 1: Worker-1 pid {worker.pid} killed by SIGKILL"
        assert expected in message, message
    finally:
        leave_nothing_behind(server, worker)


def test_an_exception_injected_in_a_worker_is_fatal(tp_model):
    server = serve_tp2(tp_model, test_worker_raise_after_steps=5)
    worker = worker_of(server)
    try:
        (stream,) = start_streams(server.url, 1, max_tokens=100)
        stream.join(30)
        assert stream.events[-1] == "[DONE]" and [e["code"] for e in stream.errors] == ["engine_dead"]
        log = finish(server, 1, within=15)
        assert "RuntimeError: failure injected by the test fault in worker rank 1 after 5 steps" in log
        message = assert_one_end(log, "raised")
        assert "worker rank 1" in message, message
    finally:
        leave_nothing_behind(server, worker)


def test_a_hang_injected_in_a_worker_is_fatal_within_the_hang_timeout(tp_model):
    server = serve_tp2(tp_model, "--engine-hang-timeout", "1", test_worker_hang_after_steps=5)
    worker = worker_of(server)
    try:
        hung_at = time.monotonic()
        (stream,) = start_streams(server.url, 1, max_tokens=100)
        stream.join(30)
        assert stream.events[-1] == "[DONE]" and "hung" in stream.errors[0]["message"], stream.events
        log = finish(server, 1, within=15)
        assert time.monotonic() - hung_at < 10
        assert "worker rank 1 hanging on purpose (test fault) after 5 steps" in log
        assert "no step finished" in assert_one_end(log, "hung")
    finally:
        leave_nothing_behind(server, worker)


def test_node1_worker_killed_under_load_is_fatal_on_both_nodes_within_2s(tp_model):
    nodes = TwoNodes(tp_model)
    try:
        streams = start_streams(nodes.node0.url, 2, max_tokens=400)
        (worker,) = [p.pid for p in nodes.node1_procs[1:] if "gracelm::worker" in " ".join(p.cmdline())]
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        assert nodes.node0.wait_exit(timeout=10) == 1, nodes.node0.log()[-3000:]
        assert time.monotonic() - killed < 2.0
        for stream in streams:
            stream.join(10)
            assert stream.events[-1] == "[DONE]" and [e["code"] for e in stream.errors] == ["engine_dead"]
            assert "worker rank 1" in stream.errors[0]["message"]
        nodes.node0.assert_nothing_left()
        node1_code, out = nodes.node1_output(timeout=10)
        assert node1_code == 1, out
        assert f"worker rank 1 failed: Worker-1 pid {worker} killed by SIGKILL" in out, out
        _, alive = psutil.wait_procs(nodes.node1_procs, timeout=2)
        assert not alive, alive
    finally:
        nodes.kill_all()
