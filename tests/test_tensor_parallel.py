"""Tensor parallelism over torch.distributed (gloo): outputs equal to one rank, one node or two, and the
workers' lifecycle — clean stop with a teardown report, death noticed at once, bad sizes refused."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import psutil
import pytest

from gracelm import Engine, SamplingParams
from gracelm.config import EngineConfig
from gracelm.lifecycle.ledger import Outcome, ResourceKind
from gracelm.parallel.executor import Executor
from gracelm.parallel.layout import ShardingError, check_parallel_config
from tests.process_checks import assert_nothing_left
from tests.server_process import ServerProcess
from tests.tiny_models import make_tiny_model
from tests.two_nodes import TwoNodes

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


def test_executor_shutdown_reports_each_ranks_teardown(models, monkeypatch):
    """Rank 0 runs in this process: its group is made, torn down, reported, and leaves this process's
    environment as it found it (gloo's interface, once left set, sent the servers that the suite starts later
    across two hosts to their own loopback)."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
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
    assert "GLOO_SOCKET_IFNAME" not in os.environ


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
