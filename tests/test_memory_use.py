"""`/metrics` reports the engine core's memory by part (`gracelm_memory_bytes`): its weights as the files
hold them, its KV cache as the blocks allocated, and the rest of its resident memory as workspace."""

from __future__ import annotations

import json
import struct

import httpx

from tests.server_process import ServerProcess, metric_value
from tests.tiny_models import tiny_model


def _safetensors_data_bytes(path) -> int:
    """The bytes of the tensors a safetensors file holds, read from its header."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return sum(end - start for name, (start, end) in
               ((name, entry["data_offsets"]) for name, entry in header.items() if name != "__metadata__"))


def test_metrics_split_the_cores_memory_into_weights_kv_cache_and_workspace():
    model = tiny_model("llama")
    with ServerProcess(model, "--kv-cache-memory", "8MiB", "--block-size", "16") as server:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        core = next(p for p in server.children if "engine-core" in " ".join(p.cmdline()))
        resident = core.memory_info().rss
        weights, kv_cache, workspace = (metric_value(text, "gracelm_memory_bytes", part=part)
                                        for part in ("weights", "kv_cache", "workspace"))
        blocks = metric_value(text, "gracelm_kv_cache_blocks_total")
    # A float32 model on the CPU is held as the file holds it (no oneDNN copy: that is for bfloat16), plus
    # rope's frequencies.
    assert 0 <= weights - _safetensors_data_bytes(model / "model.safetensors") <= 1024, weights
    # 2 layers, keys and values, 2 KV heads of 16 dimensions in float32, 16 tokens a block
    assert kv_cache == blocks * 2 * 2 * 2 * 16 * 4 * 16 > 0, (kv_cache, blocks)
    assert workspace > 0
    # The parts add up to the core's resident memory (read a moment later: within a few MiB).
    assert abs(weights + kv_cache + workspace - resident) < 16 << 20, (weights, kv_cache, workspace, resident)
