"""The CPU KV cache's background commit (`model/kv_cache_commit.py`): every page mapped, nothing written
meanwhile lost, at idle priority, stopped on demand; a server commits its cache after start."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import psutil
import torch

from gracelm.config import ModelConfig
from gracelm.model.attention import allocate_kv_cache
from gracelm.model.kv_cache_commit import KVCacheCommit
from tests.resident_memory import resident_kb
from tests.server_process import ServerProcess
from tests.tiny_models import make_tiny_model

CONFIG = ModelConfig.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6})
BLOCK_KB = 2 * 2 * 16 * 16 * 2 // 1024  # one layer's K and V of one block: 2 heads x 16 tokens x 16 dims


def commit_thread() -> threading.Thread:
    threads = [t for t in threading.enumerate() if t.name == "kv-cache-commit"]
    assert len(threads) == 1, threads
    return threads[0]


def write_blocks(caches: list[torch.Tensor], blocks: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    written = []
    for cache in caches:
        values = torch.randn(cache[:, :, blocks].shape, generator=generator).to(cache.dtype)
        cache[:, :, blocks] = values
        written.append(values)
    return written


def test_the_commit_maps_every_page_and_keeps_what_was_written() -> None:
    caches = allocate_kv_cache(CONFIG, num_blocks=2048, block_size=16, dtype=torch.bfloat16)  # 8 MiB a layer
    before = write_blocks(caches, [0, 7, 2047], seed=1)
    assert all(resident_kb(cache) < 2048 * BLOCK_KB for cache in caches)
    commit = KVCacheCommit(caches, "test")
    during = write_blocks(caches, [5, 1000], seed=2)  # while the thread maps pages
    # Until every page is mapped (16 MiB may be done before the thread could be looked up by name).
    deadline = time.monotonic() + 60
    while [resident_kb(cache) for cache in caches] != [2048 * BLOCK_KB] * 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    commit.stop()
    assert [resident_kb(cache) for cache in caches] == [2048 * BLOCK_KB] * 2
    for cache, early, late in zip(caches, before, during, strict=True):
        assert torch.equal(cache[:, :, [0, 7, 2047]], early) and torch.equal(cache[:, :, [5, 1000]], late)
        untouched = torch.ones(2048, dtype=torch.bool)
        untouched[[0, 5, 7, 1000, 2047]] = False
        assert not cache[:, :, untouched].any()  # the rest still reads as zeros


def test_the_commit_runs_at_idle_priority_and_stops_on_demand() -> None:
    caches = allocate_kv_cache(CONFIG, num_blocks=131072, block_size=16, dtype=torch.bfloat16)  # 1 GiB
    threads_before = set(threading.enumerate())
    commit = KVCacheCommit(caches, "test")
    thread = commit_thread()
    deadline = time.monotonic() + 30
    while os.sched_getscheduler(thread.native_id) != os.SCHED_IDLE:  # set by the thread as it begins
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.001)
    commit.stop()
    # Nothing maps after the stop: the thread that mapped pages (each call synchronous, in it) has ended,
    # and nothing else of the commit runs.
    assert not thread.is_alive()
    assert set(threading.enumerate()) <= threads_before


def test_a_server_commits_its_kv_cache_after_start(tmp_path: Path) -> None:
    # 1 GiB: several times the rest of the engine's memory (~320 MB with a tiny model), so that the RSS
    # shows the cache committed. (--max-num-seqs: without it the sizing caps the cache to what the default
    # count of full-length requests can use.)
    model, memory_mib = make_tiny_model(tmp_path / "tiny"), 1024
    with ServerProcess(model, "--kv-cache-memory", f"{memory_mib}MiB", "--max-num-seqs", "65536") as server:
        deadline = time.monotonic() + 60
        while (found := re.search(r"KV cache committed, (\d+) MiB", server.log())) is None:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        committed = int(found.group(1))
        assert memory_mib - 1 <= committed <= memory_mib, server.log()[-3000:]
        engine = [p for p in psutil.Process(server.pid).children(recursive=True) if "engine" in p.name()]
        assert len(engine) == 1 and engine[0].memory_info().rss > committed * 2**20
