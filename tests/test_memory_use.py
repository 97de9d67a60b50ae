"""`/metrics` reports the engine core's memory by part (`gracelm_memory_bytes`): its weights as the files
hold them, its KV cache as the blocks allocated, and the rest of its resident memory as workspace."""

from __future__ import annotations

import json
import struct

import httpx
import pytest

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


def _file_tensor_bytes(path) -> dict[str, int]:
    from gracelm.model.gguf_reader import read_gguf

    return {name: info.nbytes for name, info in read_gguf(path).tensors.items()}


def test_the_default_model_is_held_in_its_files_blocks_without_a_dense_copy():
    """On a CPU whose blocks kernel serves the file's 4/8-bit blocks (AVX-512 VNNI), the default start holds
    the file's tensors and nothing dense beside them: the weights on /metrics are the file's tensor bytes
    but the token embedding's, whose lookups read the file's rows, mapped, resident only as read (they count
    in workspace), plus, the model's embeddings being tied, the logits head's own packed copy of the
    embedding, read whole at every step."""
    from gracelm.model.block_linear import record_bytes, serves
    from gracelm.model.model_files import default_model_path

    if not serves():
        pytest.skip("the blocks kernel does not serve on this CPU (AVX-512 VNNI): the dense copy is kept")
    stored = _file_tensor_bytes(default_model_path())
    with ServerProcess(None, "--enforce-eager", "--kv-cache-memory", "64MiB") as server:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        weights = metric_value(text, "gracelm_memory_bytes", part="weights")
        linear = next(line for line in text.splitlines() if line.startswith("gracelm_kernel_path{")
                      and 'part="linear"' in line and line.endswith(" 1.0"))
    # The head's 8-bit records hold 512 weights in record_bytes(8) bytes, the file's Q8_0 blocks in 16 x 34.
    embedding = stored.pop("token_embd.weight")
    head = embedding * record_bytes(8) / (16 * 34)
    held = sum(stored.values()) + head
    # Within 1 %: the float32 norms are held in bfloat16; the embedding counted whole would add 30 %.
    assert held * 0.99 <= weights <= held * 1.01, (weights, held)
    assert "dense" not in linear, linear
