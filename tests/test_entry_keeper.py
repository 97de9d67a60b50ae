"""Cache entries of converted weights written from the tensors served (`gracelm/model/entry_keeper.py`): a
server's load keeps them after its warm-up, a stop leaves nothing half written, and a process that misses
an entry another is keeping waits for it (a server's load does not)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gracelm.model import entry_keeper
from gracelm.model.entry_keeper import deferred_keeping, start_keeping, stop_keeping
from gracelm.model.weight_cache import cached_tensors, entry_path
from tests.process_checks import wait_until
from tests.server_process import ServerProcess
from tests.test_gguf import gguf_layout, hf_model, write_gguf

EXPECTED = {"w": ((256, 64), torch.float32), "b": ((64,), torch.bfloat16)}
HASH = "4b" * 32


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRACELM_CACHE_DIR", str(tmp_path / "cache"))


def _fill(tensors: dict[str, torch.Tensor]) -> None:
    tensors["w"].copy_(torch.arange(256 * 64, dtype=torch.float32).view(256, 64))
    tensors["b"].fill_(0.5)


def _refuse(tensors: dict[str, torch.Tensor]) -> None:
    pytest.fail("converted where the entry was there to map")


def _folder() -> Path:
    return entry_path(HASH, "test").parent


def _names() -> list[str]:
    folder = _folder()
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_a_servers_load_keeps_its_entry_once_told_to() -> None:
    """Within `deferred_keeping` the load returns the converted tensors with nothing written but the claim's
    lock file; `start_keeping` writes the entry, which a later load maps instead of converting. What the
    loader does to the dict it was given meanwhile (the model's loader adds the blocks' meta stand-ins to
    it) changes nothing of what is written."""
    entry = entry_path(HASH, "test")
    with deferred_keeping():
        served = cached_tensors(HASH, "test", EXPECTED, _fill)
    assert _names() == [f".{entry.name}.lock"]
    kept = dict(served)
    served["stand-in"] = torch.empty(2, device="meta")
    del served["b"]
    start_keeping()
    wait_until(lambda: _names() == [entry.name], 30, lambda: str(_names()))
    mapped = cached_tensors(HASH, "test", EXPECTED, _refuse)
    assert all(torch.equal(mapped[name], kept[name]) for name in EXPECTED)


def test_a_stop_before_the_write_leaves_nothing() -> None:
    with deferred_keeping():
        cached_tensors(HASH, "test", EXPECTED, _fill)
    stop_keeping()
    assert _names() == []
    start_keeping()  # nothing left to write
    time.sleep(0.2)
    assert _names() == []


def test_a_stop_during_the_write_removes_what_it_wrote(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The write is stopped between two chunks: its temporary file and lock file are removed."""
    monkeypatch.setattr(entry_keeper, "_CHUNK", 1024)
    writing, stopped = threading.Event(), threading.Event()
    pwrite = os.pwrite

    def slow_pwrite(fd: int, data: bytes, offset: int) -> int:
        if offset > 0:  # a tensor's chunk, after the header
            writing.set()
            stopped.wait(10)
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    with deferred_keeping():
        cached_tensors(HASH, "test", EXPECTED, _fill)
    start_keeping()
    assert writing.wait(10)
    assert any(name.startswith(f".{entry_path(HASH, 'test').name}.") for name in _names())  # being written
    threading.Timer(0.2, stopped.set).start()
    with caplog.at_level("INFO", logger="gracelm.model.entry_keeper"):
        stop_keeping()
    assert _names() == []
    assert "not kept, the process stops" in caplog.text


_HOLDER = """
import sys, torch
from safetensors.torch import save_file
from gracelm.cache_dir import write_atomic
from gracelm.model.entry_keeper import Claim
from gracelm.model.weight_cache import entry_path
entry = entry_path(sys.argv[1], "test")
entry.parent.mkdir(parents=True, exist_ok=True)
claim = Claim.wait(entry)
print("held", flush=True)
if sys.stdin.readline().strip() == "write":
    tensors = {"w": torch.full((256, 64), 7.0), "b": torch.full((64,), 0.25, dtype=torch.bfloat16)}
    write_atomic(entry, lambda path: save_file(tensors, path))
claim.release()
"""


def _holder() -> subprocess.Popen[str]:
    """Another process holding the entry's claim until it is told to write it (or not)."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, HASH], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=os.environ)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_load_waits_for_the_entry_another_process_keeps() -> None:
    holder = _holder()
    loads: list[dict[str, torch.Tensor]] = []
    try:
        waiting = threading.Thread(target=lambda: loads.append(cached_tensors(HASH, "test", EXPECTED,
                                                                              _refuse)))
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and not loads  # waiting for the claim
        assert holder.stdin is not None
        holder.stdin.write("write\n")
        holder.stdin.flush()
        waiting.join(30)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
    [mapped] = loads
    assert torch.equal(mapped["w"], torch.full((256, 64), 7.0))
    assert _names() == [entry_path(HASH, "test").name]


def test_a_servers_load_converts_at_once_beside_another_process_keeping_it() -> None:
    """A server's tensor-parallel ranks load the same entries: one that waited for another's write, which
    comes after a warm-up they all take part in, would wait for good. It converts, and leaves the keeping to
    the holder."""
    holder = _holder()
    try:
        with deferred_keeping():
            served = cached_tensors(HASH, "test", EXPECTED, _fill)
        assert torch.equal(served["b"], torch.full((64,), 0.5, dtype=torch.bfloat16))
        start_keeping()  # nothing to write: the holder keeps it
        time.sleep(0.2)
        assert _names() == [f".{entry_path(HASH, 'test').name}.lock"]  # the holder's, nothing of this process
    finally:
        assert holder.stdin is not None
        holder.stdin.write("no\n")
        holder.stdin.flush()
        holder.wait(30)
    assert _names() == []


def test_a_load_of_an_entry_this_process_defers_writes_it_first() -> None:
    """Waiting for its own deferred write's claim would wait for good: the write is done first."""
    with deferred_keeping():
        served = cached_tensors(HASH, "test", EXPECTED, _fill)
    mapped = cached_tensors(HASH, "test", EXPECTED, _refuse)
    assert all(torch.equal(mapped[name], served[name]) for name in EXPECTED)
    assert _names() == [entry_path(HASH, "test").name]


def test_a_servers_cold_start_keeps_its_entries_after_ready_and_the_next_start_maps_them(tmp_path: Path
                                                                                        ) -> None:
    """A real server's first start: ready before its entries are kept, which they are afterwards (the log
    says so), each whole; a stop at once leaves no temporary or lock file either way. The next start
    converts nothing: it maps the same files."""
    gguf = write_gguf(tmp_path / "m.gguf", gguf_layout(hf_model("llama", seed=31), "llama"), Q.Q4_1)
    env = {"GRACELM_CACHE_DIR": str(tmp_path / "cache")}
    args = ("--num-threads", "1", "--enforce-eager", "--kv-cache-memory", "8MiB")
    folder = tmp_path / "cache" / "weights"
    with ServerProcess(gguf, *args, env=env):  # stopped at once: kept or abandoned, never half written
        pass
    assert all(not p.name.startswith(".") for p in folder.iterdir()), list(folder.iterdir())
    shutil.rmtree(folder)
    with ServerProcess(gguf, *args, env=env) as server:
        wait_until(lambda: "weights cache: kept" in server.log(), 60, server.log)
        wait_until(lambda: not any(p.name.startswith(".") for p in folder.iterdir()), 60,
                   lambda: str(list(folder.iterdir())))
        kept = {p.name: p.stat().st_ino for p in folder.iterdir()}
        assert server.log().count("weights cache: kept") == len(kept) >= 1, server.log()
        # converted into memory written beside the core's imports (`prefaulted_memory`)
        [taken] = re.findall(r"written ahead beside the imports, ([\d.]+) MiB of it taken", server.log())
        assert float(taken) > 0
    with ServerProcess(gguf, *args, env=env) as again:
        assert "weights cache: kept" not in again.log() and "written ahead" not in again.log()
        assert {p.name: p.stat().st_ino for p in folder.iterdir()} == kept
