"""The prefix cache kept across restarts (`--kv-cache-dir`): the snapshot file and its checks, the cache
manager's side, and restarts of a real engine (offline `Engine`, and `gracelm serve` stopped by SIGTERM).

A restored prefix must give exactly what the same prefix cached in memory gives (same logprobs, bit for bit:
the same KV bytes), and a snapshot of another model, dtype or format, or a damaged one, must never be used.
"""

from __future__ import annotations

import json
import logging
import os
import random
import zlib
from pathlib import Path

import httpx
import psutil
import pytest

from gracelm import Engine, SamplingParams
from gracelm.config import EngineConfig
from gracelm.engine.kv_cache_manager import KVCacheManager
from gracelm.engine.request import Request
from gracelm.model import kv_snapshot as snap
from tests.process_checks import assert_nothing_left, wait_until
from tests.server_process import ServerProcess, metric_value
from tests.tiny_models import tiny_model

BASE = {"max_model_len": 256, "num_threads": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
PREFIX_TOKENS = 150  # 9 full blocks of 16 tokens, then a partial one
# A block of the tiny model's KV cache: layers x (K, V) x tokens x heads x dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def _prompt(seed: int, length: int = PREFIX_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def _run(llm: Engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
    completion = out.outputs[0]
    return completion.token_ids, [entry[t].logprob for t, entry in zip(completion.token_ids,
                                                                        completion.logprobs, strict=True)]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


@pytest.fixture
def kv_dir(tmp_path) -> Path:
    return tmp_path / "kv"


def _saved(model: str, kv_dir: Path, prompt: list[int], **options) -> tuple[tuple, tuple]:
    """Runs the prompt cold then warm (its prefix cached in memory) and stops, saving the snapshot."""
    with Engine(model, kv_cache_dir=str(kv_dir), **BASE, **options) as llm:
        cold = _run(llm, prompt)
        warm = _run(llm, prompt)
        assert llm.stats()["prefix_cache_hits"] > 0
    assert_nothing_left()
    return cold, warm


def _restarted(model: str, kv_dir: Path, prompt: list[int], **options) -> tuple[tuple, dict, dict]:
    """The first request after a start with `kv_dir`, and the stats before and after it."""
    with Engine(model, kv_cache_dir=str(kv_dir), **BASE, **options) as llm:
        before = llm.stats()
        result = _run(llm, prompt)
        after = llm.stats()
    assert_nothing_left()
    return result, before, after


def _snapshot_file(kv_dir: Path) -> Path:
    [path] = kv_dir.glob("kv-*.snap")
    return path


# -- the file, without an engine ---------------------------------------------------------------------

FP = snap.fingerprint(weights_hash="w", tokenizer_hash="t", kv_layout={"block_bytes": 64}, hash_scheme="h",
                      tensor_parallel_size=1, rank=0)


def _blocks(count: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    return [(rng.randbytes(32), rng.randbytes(64)) for _ in range(count)]


def _write(directory: Path, blocks, bound: int = 1 << 20, fp=FP) -> snap.SaveResult:
    writer = snap.SnapshotWriter(directory, fp, 64, bound)
    for block_hash, data in blocks:
        writer.add(block_hash, data)
    return writer.commit()


def test_snapshot_round_trip_and_damage(tmp_path):
    blocks = _blocks(5)
    saved = _write(tmp_path, blocks)
    assert saved.blocks == 5 and saved.bytes == saved.path.stat().st_size
    assert list(snap.read_snapshot(tmp_path, FP, 64, 100)) == blocks
    assert list(snap.read_snapshot(tmp_path, FP, 64, 2)) == blocks[:2]
    other = {**FP, "weights": "another"}
    assert list(snap.read_snapshot(tmp_path, other, 64, 100)) == []  # another file name: none

    data = bytearray(saved.path.read_bytes())
    data[-10] ^= 0xFF  # in the last block's data: that block alone is skipped
    saved.path.write_bytes(bytes(data))
    assert list(snap.read_snapshot(tmp_path, FP, 64, 100)) == blocks[:4]
    saved.path.write_bytes(bytes(data[:-30]))  # truncated: the whole file is skipped
    assert list(snap.read_snapshot(tmp_path, FP, 64, 100)) == []
    data[20] ^= 0xFF  # in the header
    saved.path.write_bytes(bytes(data))
    assert list(snap.read_snapshot(tmp_path, FP, 64, 100)) == []


def test_a_fifo_at_the_snapshot_path_is_skipped_at_once(tmp_path, caplog):
    """Opened for reading, a FIFO blocks until a writer comes: a start would hang there for ever."""
    os.mkfifo(snap.snapshot_path(tmp_path, FP))
    with caplog.at_level(logging.WARNING, logger=snap.__name__):
        assert list(snap.read_snapshot(tmp_path, FP, 64, 100)) == []
    assert "skipped: not a regular file" in caplog.text


def test_a_torn_write_leaves_the_previous_snapshot(tmp_path):
    _write(tmp_path, _blocks(3))
    writer = snap.SnapshotWriter(tmp_path, FP, 64, 1 << 20)
    for block_hash, data in _blocks(4, seed=1):
        writer.add(block_hash, data)
    # Never committed, as after a kill -9: the previous snapshot is read, the temporary file is left.
    assert list(snap.read_snapshot(tmp_path, FP, 64, 100)) == _blocks(3)
    writer._file.close()
    dead = writer._temporary.with_name(writer._temporary.name.replace(f".{_own_pid()}.", ".999999999."))
    writer._temporary.rename(dead)
    snap.remove_dead_temporaries(tmp_path)
    assert not dead.exists()


def _own_pid() -> int:
    return psutil.Process().pid


def _until_the_clock_passes(path: Path) -> None:
    """Until a file written now gets a later modification time than `path`: a filesystem's clock is coarse
    (a few ms, a second on some), and the bound tells the oldest snapshot by its modification time."""
    tick = path.with_name("clock-tick")  # not a snapshot's name: the bound does not count it

    def later() -> bool:
        tick.touch()
        return tick.stat().st_mtime_ns > path.stat().st_mtime_ns

    wait_until(later, 10, "the filesystem's clock to move on", interval=0.001)
    tick.unlink()


def test_the_bound_cuts_the_snapshot_and_drops_the_oldest_files(tmp_path):
    record = snap.record_size(64)
    bound = snap.prefix_size(FP, 64) + 10 * record
    assert _write(tmp_path, _blocks(20), bound).blocks == 10  # the most recent 10
    older = {**FP, "weights": "older"}
    _write(tmp_path, _blocks(4), bound, fp=older)
    _until_the_clock_passes(snap.snapshot_path(tmp_path, older))
    newer = {**FP, "weights": "newer"}
    _write(tmp_path, _blocks(4), bound, fp=newer)
    files = snap.snapshot_files(tmp_path)
    assert sum(p.stat().st_size for p in files) <= bound
    assert snap.snapshot_path(tmp_path, newer) in files and snap.snapshot_path(tmp_path, FP) not in files


def test_manager_lists_by_recency_and_restores_in_lru_order():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = Request("a", list(range(3, 12)), SamplingParams(), ())  # 2 full blocks, then 1 token
    assert kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.cache_full_blocks(first)
    kv.free(first)
    listed = kv.cached_blocks_by_recency()
    assert [h for h, _ in listed] == first.block_hashes[:2]  # the prefix's first block most recent

    restored = KVCacheManager(num_blocks=8, block_size=4)
    ids = [restored.restore_block(h) for h, _ in listed]
    assert None not in ids and restored.num_restored_blocks == 2
    assert restored.restore_block(listed[0][0]) is None  # cached already
    assert [h for h, _ in restored.cached_blocks_by_recency()] == [h for h, _ in listed]
    again = Request("b", list(range(3, 12)), SamplingParams(), ())
    blocks, tokens = restored.get_computed_blocks(again)
    assert tokens == 8 and restored.allocate_slots(again, 1, blocks)
    assert restored.restored_block_hits == 2


# -- restarts of a real engine -------------------------------------------------------------------------

@pytest.mark.parametrize("speculation", ["off", "ngram", "draft"])
def test_restart_restores_the_prefix_cache(model, kv_dir, speculation):
    """Speculating too: with a draft model the restored blocks hold the target's KV alone (the draft
    model's cache there is empty), which costs drafts, never tokens (deterministic mode: the same bits)."""
    options = {"off": {}, "ngram": {"speculative": "ngram", "prompt_lookup_min": 1},
               "draft": {"speculative_model": model, "deterministic": True}}[speculation]
    prompt = _prompt(1)
    cold, warm = _saved(model, kv_dir, prompt, **options)
    assert snap.snapshot_files(kv_dir) == [_snapshot_file(kv_dir)]
    result, before, after = _restarted(model, kv_dir, prompt, **options)
    if speculation == "draft":
        assert after["spec_decode"]["num_draft_tokens"] > 0
    assert before["kv_restored_blocks"] >= PREFIX_TOKENS // 16
    assert after["kv_restored_block_hits"] == PREFIX_TOKENS // 16
    assert after["prefix_cache_hits"] == (PREFIX_TOKENS // 16) * 16
    assert result == warm  # the same KV bytes as the prefix cached in memory: the same logprobs
    assert result[0] == cold[0]


def _flip_first_block(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[8:12], "little")
    first_data = 8 + 4 + header_len + 4 + 8 + 36  # the first record's data: the prefix's first block
    data[first_data + 5] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _older_format(path: Path) -> None:
    """The same file as an older format version would have written it, header checksum included."""
    data = path.read_bytes()
    header_len = int.from_bytes(data[8:12], "little")
    header = json.loads(data[12:12 + header_len])
    header["fingerprint"]["format_version"] = snap.FORMAT_VERSION - 1
    new = json.dumps(header, sort_keys=True).encode()
    rest = data[12 + header_len + 4:]
    path.write_bytes(data[:8] + len(new).to_bytes(4, "little") + new + zlib.crc32(new).to_bytes(4, "little")
                     + rest)


@pytest.mark.parametrize("damage, options", [
    pytest.param(_flip_first_block, {}, id="corrupt-block"),
    pytest.param(_flip_header, {}, id="corrupt-header"),
    pytest.param(_truncate, {}, id="truncated"),
    pytest.param(_older_format, {}, id="format-version"),
    pytest.param(None, {"dtype": "bfloat16"}, id="other-dtype"),
    pytest.param(None, {"model": "other"}, id="other-model"),
])
def test_a_snapshot_that_does_not_match_is_never_used(model, kv_dir, damage, options):
    prompt = _prompt(2)
    cold, _ = _saved(model, kv_dir, prompt)
    if damage is not None:
        damage(_snapshot_file(kv_dir))
    restart_model = str(tiny_model("llama", rms_norm_eps=1e-5)) if options.get("model") else model
    restart_options = {k: v for k, v in options.items() if k != "model"}
    result, before, after = _restarted(restart_model, kv_dir, prompt, **restart_options)
    assert after["kv_restored_block_hits"] == 0 and after["prefix_cache_hits"] == 0
    if damage is not _flip_first_block:  # a bad block alone is skipped; the rest of the file is read
        assert before["kv_restored_blocks"] == 0
    if not options:
        assert result == cold  # computed from scratch, as the first time


def test_kill_during_a_periodic_save_keeps_the_previous_snapshot(model, kv_dir, monkeypatch):
    first, second = _prompt(3), _prompt(4)
    _saved(model, kv_dir, first)
    previous = _snapshot_file(kv_dir).read_bytes()
    monkeypatch.setenv("GRACELM_TEST_HOOKS", json.dumps({"test_kv_snapshot_block_sleep_s": 0.3}))
    llm = Engine(model, kv_cache_dir=str(kv_dir), kv_cache_save_interval=0.1, **BASE)
    monkeypatch.delenv("GRACELM_TEST_HOOKS")
    try:
        _run(llm, second)  # new blocks: a periodic save starts 0.1 s later, one block every 0.3 s
        (temporary,) = wait_until(lambda: list(kv_dir.glob(".kv-*.tmp")), 30, "a periodic save to begin",
                                  interval=0.02)
        wait_until(lambda: temporary.stat().st_size > BLOCK_BYTES, 30, "a block of the save written",
                   interval=0.02)
        [core] = [p for p in psutil.Process().children(recursive=True)
                  if "engine-core" in " ".join(p.cmdline())]
        core.kill()
        core.wait(10)
        assert _snapshot_file(kv_dir).read_bytes() == previous
    finally:
        llm.shutdown()
    assert_nothing_left()
    result, before, after = _restarted(model, kv_dir, first)
    assert before["kv_restored_blocks"] == PREFIX_TOKENS // 16  # the first snapshot's blocks
    assert after["kv_restored_block_hits"] == PREFIX_TOKENS // 16
    assert not list(kv_dir.glob(".kv-*.tmp")), "the dead writer's temporary file was left"


def test_the_size_bound_holds_across_restarts(model, kv_dir):
    bound = 20 * (BLOCK_BYTES + 36)  # about two prompts' prefixes
    other = str(tiny_model("llama", rms_norm_eps=1e-5))
    for restart in range(5):
        with Engine(other if restart == 2 else model, kv_cache_dir=str(kv_dir), kv_cache_dir_size=bound,
                    **BASE) as llm:
            _run(llm, _prompt(10 + restart))
        assert_nothing_left()
        total = sum(p.stat().st_size for p in kv_dir.iterdir())
        assert total <= bound, f"restart {restart}: {total} bytes in the directory, bound {bound}"
    # The last snapshot keeps the most recent blocks: the last prompt's prefix is restored.
    result, before, after = _restarted(model, kv_dir, _prompt(14), kv_cache_dir_size=bound)
    assert after["kv_restored_block_hits"] == PREFIX_TOKENS // 16


def test_serve_restart_after_sigterm_hits_the_restored_cache(kv_dir):
    # A long shared prefix, as the case: ~1,500 tokens (93 full blocks of 16).
    prefix_tokens = 1500
    model = tiny_model("llama", max_position_embeddings=2048)
    args = ("--kv-cache-dir", str(kv_dir), "--max-model-len", "2048", "--num-threads", "1",
            "--stats-interval", "0")
    body = {"prompt": _prompt(5, prefix_tokens), "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with ServerProcess(model, *args) as server:
        before = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert _snapshot_file(kv_dir).exists()
    with ServerProcess(model, *args) as server:
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert metric_value(metrics, "gracelm_kv_restored_blocks") >= prefix_tokens // 16
        after = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert metric_value(metrics, "gracelm_kv_restored_block_hits") == prefix_tokens // 16
        assert metric_value(metrics, "gracelm_prefix_cache_hit_rate") > 0
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert_nothing_left()


def test_a_restore_that_kills_the_core_is_skipped_at_the_next_start(kv_dir):
    """A snapshot whose restore kills the engine core would kill every start after it: the start after one
    that died restoring skips the restore once, says so, and serves; the one after restores again."""
    model = tiny_model("llama")
    args = ("--kv-cache-dir", str(kv_dir), "--num-threads", "1", "--stats-interval", "0")
    body = {"prompt": _prompt(5, 100), "max_tokens": 2, "temperature": 0.0}
    with ServerProcess(model, *args) as server:
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    crashing = ServerProcess(model, *args, wait_ready=False,
                             env={"GRACELM_TEST_HOOKS": json.dumps({"test_exit_in_kv_restore": True})})
    try:
        assert crashing.wait_exit(60) == 3, crashing.log()[-3000:]  # a start-up failure
    finally:
        crashing.close_log()
    with ServerProcess(model, *args) as server:
        assert "the last start died while restoring" in server.log()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert metric_value(metrics, "gracelm_kv_restored_blocks") == 0
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    with ServerProcess(model, *args) as server:
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert metric_value(metrics, "gracelm_kv_restored_blocks") > 0
    assert_nothing_left()


# -- tensor parallelism: each rank its own shard, a block used only if every rank has it ------------------

TP2 = {"tensor_parallel_size": 2, "kv_cache_memory": "4MiB"}


def _rank_file(kv_dir: Path, rank: int) -> Path:
    [path] = kv_dir.glob(f"kv-*-rank{rank}.snap")
    return path


def _block_count(path: Path) -> int:
    data = path.read_bytes()
    header_len = int.from_bytes(data[8:12], "little")
    return int.from_bytes(data[12 + header_len + 4:12 + header_len + 12], "little")


def test_tp2_restart_restores_every_ranks_shard(model, kv_dir):
    prompt = _prompt(6)
    cold, warm = _saved(model, kv_dir, prompt, **TP2)
    assert len(snap.snapshot_files(kv_dir)) == 2
    assert _block_count(_rank_file(kv_dir, 0)) == _block_count(_rank_file(kv_dir, 1)) >= PREFIX_TOKENS // 16
    result, before, after = _restarted(model, kv_dir, prompt, **TP2)
    assert before["kv_restored_blocks"] == _block_count(_rank_file(kv_dir, 0))
    assert after["kv_restored_block_hits"] == PREFIX_TOKENS // 16
    assert result == warm and result[0] == cold[0]


def test_tp2_a_block_damaged_on_rank1_is_used_on_no_rank(model, kv_dir):
    prompt = _prompt(7)
    cold, _ = _saved(model, kv_dir, prompt, **TP2)
    _flip_first_block(_rank_file(kv_dir, 1))  # the prefix's first block, intact on rank 0
    result, before, after = _restarted(model, kv_dir, prompt, **TP2)
    # Rank 0 placed it, rank 1 could not fill it: taken back, while the others are restored on both.
    assert before["kv_restored_blocks"] == _block_count(_rank_file(kv_dir, 0)) - 1
    assert after["kv_restored_block_hits"] == 0 and after["prefix_cache_hits"] == 0
    assert result == cold


def test_tp2_refuses_the_periodic_save(model, kv_dir):
    assert EngineConfig(model=model, kv_cache_dir=str(kv_dir), tensor_parallel_size=2).kv_cache_dir
    with pytest.raises(ValueError, match=r"--kv-cache-save-interval.*tensor_parallel_size > 1"):
        EngineConfig(model=model, kv_cache_dir=str(kv_dir), tensor_parallel_size=2, kv_cache_save_interval=5)
