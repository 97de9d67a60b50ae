"""Tensor parallelism over torch.distributed (gloo): outputs equal to one rank, one node or two, and the
workers' lifecycle — clean stop with a teardown report, death noticed at once, bad sizes refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from gracelm import Engine, SamplingParams
from gracelm.config import EngineConfig
from gracelm.engine.errors import EngineDeadError
from gracelm.lifecycle.ledger import Outcome, ResourceKind
from gracelm.parallel.executor import Executor
from gracelm.parallel.layout import ShardingError, check_parallel_config
from tests.process_checks import assert_nothing_left
from tests.server_process import ServerProcess, free_port
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ONE_THREAD = {"num_threads": 1}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {"llama": make_tiny_model(root / "llama", "llama", num_attention_heads=8, num_key_value_heads=4),
            "qwen3": make_tiny_model(root / "qwen3", "qwen3", num_attention_heads=4, num_key_value_heads=4)}


def _engine(model: Path, tp: int, **kwargs) -> Engine:
    return Engine(str(model), tensor_parallel_size=tp, kv_cache_memory="4MiB", **ONE_THREAD,
                  **kwargs)


def _generate(model: Path, tp: int) -> list[tuple[list[int], str]]:
    """Each prompt's greedy continuation: token ids and text."""
    with _engine(model, tp) as engine:
        return [(list(o.outputs[0].token_ids), o.outputs[0].text)
                for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tp1_outputs(models) -> dict[str, list[tuple[list[int], str]]]:
    return {arch: _generate(path, 1) for arch, path in models.items()}


def _worker_pids(root: int) -> list[int]:
    return [p.pid for p in psutil.Process(root).children(recursive=True)
            if "gracelm::worker" in " ".join(p.cmdline())]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_greedy_equals_tp1(models, tp1_outputs, arch):
    assert _generate(models[arch], 2) == tp1_outputs[arch]
    assert_nothing_left()


def test_indivisible_heads_are_refused_before_any_process(models):
    config = EngineConfig(model=str(models["qwen3"]), tensor_parallel_size=3)
    with pytest.raises(ShardingError, match="num_attention_heads=4, num_key_value_heads=4"):
        check_parallel_config(config)
    with pytest.raises(ShardingError, match="does not divide"):
        _engine(models["qwen3"], 3)
    assert_nothing_left()


def test_executor_shutdown_reports_each_ranks_teardown(models):
    config = EngineConfig(model=str(models["llama"]), tensor_parallel_size=2, kv_cache_memory="1MiB",
                          **ONE_THREAD)
    executor = Executor(config)
    executor.load_model()
    blocks = executor.available_kv_blocks()
    executor.init_kv_cache(blocks)
    report = executor.shutdown()
    assert report.ok, report.as_table()
    released = {(r.kind, r.name) for r in report.resources if r.outcome is Outcome.RELEASED}
    for rank in (0, 1):
        prefix = "rank 1: " if rank else ""
        assert (ResourceKind.PROCESS_GROUP, f"{prefix}gloo rank {rank}/2") in released
        assert (ResourceKind.KV_CACHE, f"{prefix}{blocks} blocks, rank {rank}") in released
    assert any(kind is ResourceKind.PROCESS and name.startswith("worker rank 1 (pid")
               for kind, name in released)
    assert executor.shutdown() is not None  # idempotent
    assert_nothing_left()


def test_worker_killed_under_load_is_fatal_at_once(models):
    engine = _engine(models["llama"], 2)
    try:
        errors: list[BaseException] = []
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        thread = threading.Thread(target=lambda: _record(errors, engine.generate, PROMPTS * 4, long))
        thread.start()
        time.sleep(0.5)
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


def test_serve_tp2_equals_tp1(models, tp1_outputs):
    with ServerProcess(models["llama"], "--tensor-parallel-size", "2", "--kv-cache-memory", "4MiB",
                       "--num-threads", "1") as server:
        assert len([c for c in server.children if "gracelm::worker" in " ".join(c.cmdline())]) == 1
        assert _completions(server.url) == [text for _, text in tp1_outputs["llama"]]


def _completions(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        reply = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": "llama", "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
    return texts


class TwoNodes:
    """Node 0: `gracelm serve` with rank 0; node 1: `gracelm serve --node-rank 1`, headless, with rank 1."""

    def __init__(self, model: Path) -> None:
        self.addr = f"127.0.0.1:{free_port()}"
        common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", self.addr,
                  "--num-threads", "1"]
        self.node1 = subprocess.Popen(
            [str(Path(sys.executable).parent / "gracelm"), "serve", "--model", str(model), *common,
             "--node-rank", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            self.node0 = ServerProcess(model, *common, "--node-rank", "0", "--kv-cache-memory", "4MiB")
        except BaseException:
            self.node1.kill()
            self.node1.wait()
            raise
        self.node1_procs = [psutil.Process(self.node1.pid), *psutil.Process(self.node1.pid).children(True)]

    def node1_output(self, timeout: float) -> tuple[int, str]:
        out, _ = self.node1.communicate(timeout=timeout)
        return self.node1.returncode, out

    def kill_all(self) -> None:
        self.node0.kill()
        self.node0.close_log()
        for proc in self.node1_procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.node1.wait(10)


def test_two_nodes_equal_tp1_and_sigterm_on_node0_stops_node1(models, tp1_outputs):
    nodes = TwoNodes(models["llama"])
    try:
        assert _completions(nodes.node0.url) == [text for _, text in tp1_outputs["llama"]]
        nodes.node0.stop()  # SIGTERM: drain, then the workers' stop message
        code, out = nodes.node1_output(timeout=20)
        assert code == 0, out
        assert "process group  gloo rank 1/2" in out and "released" in out
        _, alive = psutil.wait_procs(nodes.node1_procs, timeout=2)
        assert not alive
    finally:
        nodes.kill_all()


def test_node1_worker_killed_is_fatal_on_node0_within_2s(models):
    nodes = TwoNodes(models["llama"])
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
