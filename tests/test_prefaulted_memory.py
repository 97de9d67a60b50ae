"""Memory written ahead of a cold start's conversion (`gracelm/model/prefaulted_memory.py`): made only where
the cache holds nothing of the model and the memory is there, taken by the conversion, what it did not take
given back, and unmapped with the last tensor that took from it."""

from __future__ import annotations

import gc
import logging
import os
import re
import threading
from pathlib import Path

import pytest
import torch

from gracelm.memory_budget import Available, MemoryBudgetError
from gracelm.model import file_hash, prefaulted_memory
from gracelm.model.weight_cache import cached_tensors, entry_path

SIZE = 8 << 20


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRACELM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(SIZE))
    return path


@pytest.fixture(autouse=True)
def nothing_left() -> None:
    yield
    prefaulted_memory.release()


def _begun(path: Path) -> prefaulted_memory.Arena | None:
    """Begun as the engine core's entry begins it (the hash prefetched first), once the writer is done."""
    file_hash.prefetch(path)
    prefaulted_memory.begin(path)
    begun = prefaulted_memory._begun  # the writer's own thread: waited for here, as `take` would stop it
    begun.thread.join(timeout=60)
    return begun.arena


def _mapping(address: int) -> dict[str, int] | None:
    """This process's mapping that begins at `address`: its size and resident bytes, or None."""
    with open("/proc/self/smaps") as smaps:
        text = smaps.read()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        begin, end = (int(part, 16) for part in block.split(None, 1)[0].split("-"))
        if begin == address:
            return {"size": end - begin, "rss": int(re.search(r"^Rss:\s+(\d+) kB", block, re.M)[1]) << 10}
    return None


def test_a_first_start_converts_into_memory_written_ahead_and_gives_back_the_rest(model_file: Path) -> None:
    arena = _begun(model_file)
    assert arena is not None and arena.touched == SIZE
    assert _mapping(arena.address) == {"size": SIZE, "rss": SIZE}
    weights = prefaulted_memory.take((1000, 1000), torch.bfloat16)
    bias = prefaulted_memory.take((3,), torch.float32)
    assert weights.data_ptr() == arena.address and weights.shape == (1000, 1000)
    assert bias.data_ptr() == arena.address + 2_000_000 and bias.dtype == torch.float32
    weights.fill_(1.5)
    bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert prefaulted_memory.take((SIZE,), torch.uint8) is None  # what is left is too small
    prefaulted_memory.release()
    assert prefaulted_memory.take((4,), torch.uint8) is None  # released: nothing more taken
    pages = -(-(2_000_000 + 12) // os.sysconf("SC_PAGE_SIZE")) * os.sysconf("SC_PAGE_SIZE")
    assert _mapping(arena.address) == {"size": SIZE, "rss": pages}  # the rest given back
    assert torch.equal(bias, torch.tensor([1.0, 2.0, 3.0])) and bool((weights == 1.5).all())
    address = arena.address
    del arena, weights, bias
    gc.collect()
    assert _mapping(address) is None  # unmapped with the last tensor


def test_an_arena_nothing_took_is_unmapped_at_the_release(model_file: Path) -> None:
    arena = _begun(model_file)
    assert arena is not None
    prefaulted_memory.release()
    assert _mapping(arena.address) is None


def test_nothing_is_written_ahead_of_a_model_the_cache_holds(model_file: Path) -> None:
    entry_path(file_hash.content_hash(model_file), "bfloat16").write_bytes(b"")
    assert _begun(model_file) is None
    assert prefaulted_memory.take((4,), torch.uint8) is None


def test_nothing_is_written_ahead_where_the_memory_is_not_there(
        model_file: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefaulted_memory, "available_memory", lambda: Available(SIZE, "a test's limit"))
    with caplog.at_level(logging.INFO, logger=prefaulted_memory.__name__):
        assert _begun(model_file) is None
    said = "none written ahead (the file's 0.01 GiB and a margin of 1.00 GiB; 0.01 GiB available)"
    assert said in caplog.text


def test_nothing_is_taken_where_nothing_was_begun() -> None:
    prefaulted_memory.release()
    assert prefaulted_memory.take((4,), torch.uint8) is None


def test_a_conversion_into_memory_written_ahead_is_the_same_conversion(model_file: Path) -> None:
    """The tensors a fill writes, and the entry kept from them, whatever memory they are in."""
    expected = {"w": ((256, 64), torch.float32), "b": ((64,), torch.bfloat16), "q": ((100, 36), torch.uint8)}

    def fill(tensors: dict[str, torch.Tensor]) -> None:
        tensors["w"].copy_(torch.arange(256 * 64, dtype=torch.float32).view(256, 64))
        tensors["b"].fill_(0.5)
        tensors["q"].copy_((torch.arange(3600) % 251).to(torch.uint8).view(100, 36))

    arena = _begun(model_file)
    assert arena is not None
    ahead = cached_tensors("5c" * 32, "test", expected, fill)
    assert all(arena.address <= t.data_ptr() < arena.address + SIZE for t in ahead.values())
    prefaulted_memory.release()
    fresh = cached_tensors("5d" * 32, "test", expected, fill)
    kept = cached_tensors("5c" * 32, "test", expected, lambda tensors: pytest.fail("converted again"))
    for name in expected:
        assert torch.equal(ahead[name], fresh[name]) and torch.equal(kept[name], fresh[name])


def test_the_weights_check_counts_the_memory_written_ahead_as_theirs(
        model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written ahead, the memory is counted used, yet it is what the conversion takes: the load's check of
    the weights' size adds it back, and refuses the same model once it is given back."""
    import gracelm.model.loader as loader

    assert _begun(model_file) is not None
    shapes = [(SIZE // 4,)]  # SIZE bytes in float32, twice as many while converting
    need = SIZE + 2 * SIZE + loader._LOAD_MARGIN
    monkeypatch.setattr(loader, "available_memory", lambda: Available(need - SIZE, "a test's limit"))
    loader._check_weights_fit(shapes, 0, torch.float32, torch.device("cpu"))
    prefaulted_memory.release()
    with pytest.raises(MemoryBudgetError, match="a test's limit"):
        loader._check_weights_fit(shapes, 0, torch.float32, torch.device("cpu"))


def test_a_release_does_not_wait_for_the_files_hash(model_file: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that fails before it has hashed the file releases at once, and the writer, once the hash
    comes, makes no arena."""
    hashed = threading.Event()
    real = file_hash.prefetched

    def slow(path: Path) -> str | None:
        hashed.wait(60)
        return real(path)

    monkeypatch.setattr(file_hash, "prefetched", slow)
    prefaulted_memory.begin(model_file)
    releasing = threading.Thread(target=prefaulted_memory.release)
    releasing.start()
    releasing.join(timeout=30)
    released = not releasing.is_alive()  # it waited for the hash, held back until now
    hashed.set()
    assert released
    begun = prefaulted_memory._begun
    begun.thread.join(timeout=60)
    assert not begun.thread.is_alive() and begun.arena is None
