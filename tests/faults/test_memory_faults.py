"""A start that would not fit in memory (`gracelm/memory_budget.py`): weights larger than the memory
available, or a KV cache larger than what the weights leave, within the host's memory or a memory cgroup's
limit the test sets. Each start fails at once with exit 3, says what it needed, what was available and what
would fit, and leaves nothing; nothing is allocated first."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import psutil

from tests.faults.helpers import memory_cgroup
from tests.server_process import ServerProcess

# The tiny model's KV cache takes 512 bytes a token: with its 512-token context, 200,000 sequences' worth
# is about 49 GiB, more than any machine that runs the suite has, so `--kv-cache-memory` is the bound.
_MANY_SEQUENCES = ("--max-num-seqs", "200000")


def _serve_exit(model: str | Path, *args: str, prefix: tuple[str, ...] = ()) -> tuple[int, str]:
    """A start that must fail: its exit code and log, once nothing of it is left."""
    server = ServerProcess(model, *args, wait_ready=False, prefix=prefix)
    try:
        code = server.wait_exit(120)
        server.assert_nothing_left()
        return code, server.log()
    finally:
        server.close_log()


def _gib(text: str, label: str) -> float:
    found = re.search(rf"{label} (\d+\.\d+) GiB", text)
    assert found, f"no {label!r} figure in: {text}"
    return float(found.group(1))


def test_a_kv_cache_larger_than_the_host_fails_the_start_saying_what_fits(model):
    code, log = _serve_exit(model, "--kv-cache-memory", "64GiB", *_MANY_SEQUENCES)
    assert code == 3, log
    refusal = next(line for line in log.splitlines() if "MemoryBudgetError" in line)
    assert "(the host)" in refusal, refusal
    fits = _gib(refusal, "--kv-cache-memory of at most")
    assert 0 < fits * 2**30 < psutil.virtual_memory().total, refusal
    assert "KV cache (" in refusal and "workspace" in refusal


def test_a_kv_cache_that_fits_starts(model):
    """The check refuses what would not fit, not what would: the same model and options with a cache the
    host holds start and serve."""
    with ServerProcess(model, "--kv-cache-memory", "64MiB", *_MANY_SEQUENCES) as server:
        assert "the KV cache (0.06 GiB) and a step's workspace" in server.log()


def _sparse_safetensors(path: Path, name: str, shape: list[int]) -> int:
    """A safetensors file holding one float32 tensor of `shape`, its data a hole: the file takes no disk, so
    its size can exceed the host's memory. Returns the tensor's bytes."""
    nbytes = 4
    for size in shape:
        nbytes *= size
    header = json.dumps({name: {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(header)) + header)
        file.truncate(8 + len(header) + nbytes)
    return nbytes


def test_weights_larger_than_the_host_fail_the_start_before_loading(model, tmp_path):
    """Three extra files of 0.4 times the host's memory each: one file as large as the host would be
    refused by the kernel's own mapping (overcommit) before the check could speak."""
    huge = tmp_path / "huge-model"
    shutil.copytree(model, huge)
    columns = (psutil.virtual_memory().total >> 20) // 10
    declared = sum(_sparse_safetensors(huge / f"extra-{i}.safetensors", f"model.layers.{i}.extra.weight",
                                       [1 << 20, columns]) for i in range(3))
    assert declared > psutil.virtual_memory().total
    code, log = _serve_exit(huge)
    assert code == 3, log
    refusal = next(line for line in log.splitlines() if "MemoryBudgetError" in line)
    assert "the model's weights" in refusal and "(the host)" in refusal, refusal
    assert _gib(refusal, "need") * 2**30 > declared


def test_a_cgroup_limit_bounds_the_kv_cache(model):
    """Inside a container's (or a systemd unit's) memory limit, the limit is what is available, however much
    the host has: a KV cache above it fails the start naming the cgroup, instead of an OOM kill later."""
    with memory_cgroup(3 << 30) as (folder, prefix):
        code, log = _serve_exit(model, "--kv-cache-memory", "4GiB", *_MANY_SEQUENCES, prefix=prefix)
        assert not (folder / "cgroup.procs").read_text().split()  # every process of the start is gone
    assert code == 3, log
    refusal = next(line for line in log.splitlines() if "MemoryBudgetError" in line)
    assert f"memory cgroup {folder}" in refusal, refusal
    assert _gib(refusal, "--kv-cache-memory of at most") < 3, refusal
