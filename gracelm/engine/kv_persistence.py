"""The prefix cache kept across restarts (`--kv-cache-dir`): restored into the KV cache before the core says
`Ready`, saved at a graceful stop and, with `--kv-cache-save-interval`, while serving. The file format and
its checks are `kv_snapshot.py`'s; this module moves blocks between it, the `KVCacheManager` and the
executor's KV tensors.

Choices, where the issue is silent (as vLLM/SGLang users would expect of a prefix cache):
- Restored blocks are ordinary cached blocks, evictable, in their saved LRU order behind nothing: a new
  request's blocks evict the least recently used restored ones first. Restoring never evicts.
- The stop's save runs after the last request, before the executor is released, within the drain's
  deadline plus `_SAVE_GRACE_S`; cut by the deadline, it keeps the most recently used blocks it copied.
  A fatal stop saves nothing: the cache may hold the work of a failed step.
- The periodic save snapshots the list of cached blocks when it starts, then copies `_CHUNK_BYTES` of them
  out of the KV tensors per turn of the engine loop (between steps, so no step writes them meanwhile), and a
  thread writes them. A block evicted and reused before its turn is checked (`KVCacheManager.holds`) and
  left out. The save starts only if steps ran since the last one, so an idle server stays asleep.
- Tensor parallelism is refused by `EngineConfig` for now (each rank would save its own shard).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from gracelm.config import EngineConfig, parse_size
from gracelm.engine import kv_snapshot as snap
from gracelm.engine.kv_cache_manager import _ROOT_HASH, KVCacheManager
from gracelm.lifecycle.ledger import Outcome, ResourceKind, ResourceReport, ShutdownReport
from gracelm.lifecycle.test_hooks import active_test_hooks
from gracelm.model.file_hash import content_hash
from gracelm.model.model_files import resolve_model_path

if TYPE_CHECKING:
    from gracelm.model.tokenizer import Tokenizer
    from gracelm.parallel.executor import Executor

logger = logging.getLogger(__name__)

# Blocks are copied this many bytes at a time: a periodic save's share of one turn of the loop (a few ms),
# and the memory a restore or a save holds at once.
_CHUNK_BYTES = 8 * 2**20
# The stop's save may run this long past the drain's deadline: within the frontend's exit grace
# (core_client._EXIT_GRACE_S), leaving it room for the rest of the teardown.
_SAVE_GRACE_S = 2.0
# A periodic save's loop turns poll this often while its writer catches up.
_SAVE_POLL_MS = 10

T = TypeVar("T")


class KVPersistence:
    def __init__(self, config: EngineConfig, executor: Executor, kv: KVCacheManager,
                 tokenizer: Tokenizer) -> None:
        assert config.kv_cache_dir is not None
        self.directory = Path(config.kv_cache_dir).expanduser()
        self.bound = parse_size(config.kv_cache_dir_size)
        self.interval = config.kv_cache_save_interval
        self.executor = executor
        self.kv = kv
        layout = executor.kv_layout()
        self.block_bytes: int = layout["block_bytes"]
        self.chunk_blocks = max(1, _CHUNK_BYTES // self.block_bytes)
        self.fingerprint = snap.fingerprint(
            weights_hash=content_hash(resolve_model_path(config.model)),
            tokenizer_hash=hashlib.sha256(tokenizer.to_dict()["backend"].encode()).hexdigest(),
            kv_layout=layout, hash_scheme=_ROOT_HASH.decode(),
            tensor_parallel_size=config.tensor_parallel_size, rank=0)
        delay = active_test_hooks().get("test_kv_snapshot_block_sleep_s")
        self._block_delay = (lambda: time.sleep(delay)) if delay else None
        self._job: _PeriodicSave | None = None
        self._next_due = time.monotonic() + self.interval
        self._steps_at_save = 0  # the loop's step count when the last periodic save began
        self._steps_seen = 0

    # -- start ---------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Fills the empty cache with the snapshot's blocks, most recent first, as far as they fit."""
        started = time.monotonic()
        entries = snap.read_snapshot(self.directory, self.fingerprint, self.block_bytes,
                                     self.kv.num_total_blocks)
        try:
            for chunk in _batched(entries, self.chunk_blocks):
                placed = [(self.kv.restore_block(block_hash), data) for block_hash, data in chunk]
                placed = [(block, data) for block, data in placed if block is not None]
                if placed:
                    self.executor.write_kv_blocks([b for b, _ in placed], [d for _, d in placed])
        except Exception:  # a snapshot must never stop the engine from starting: start cold instead
            logger.exception("kv snapshot: restore failed; starting with an empty prefix cache")
            self.kv.reset_prefix_cache()
            self.kv.num_restored_blocks = 0
            return
        if self.kv.num_restored_blocks:
            logger.info("kv snapshot: restored %d blocks from %s in %.0f ms", self.kv.num_restored_blocks,
                        self.directory, (time.monotonic() - started) * 1000)

    # -- stop ----------------------------------------------------------------------------------------

    def save_at_stop(self, deadline: float, beat: Callable[[], None]) -> ShutdownReport:
        """The graceful stop's save, as an entry of the shutdown report (blocks, bytes, ms)."""
        self.cancel_periodic()
        started = time.monotonic()
        name, outcome, error = f"kv snapshot to {self.directory}", Outcome.RELEASED, None
        try:
            saved = self._save(deadline + _SAVE_GRACE_S, beat)
            name = f"kv snapshot: {saved.blocks} blocks, {saved.bytes} bytes to {saved.path}"
            logger.info("%s in %.0f ms", name, (time.monotonic() - started) * 1000)
        except Exception as e:  # noqa: BLE001 - reported; the stop goes on to release everything
            logger.exception("kv snapshot: save failed")
            outcome, error = Outcome.FAILED, f"{type(e).__name__}: {e}"
        ms = (time.monotonic() - started) * 1000
        entry = ResourceReport(ResourceKind.KV_SNAPSHOT, name, outcome, ms, error, time.time())
        return ShutdownReport([entry])

    def _save(self, deadline: float, beat: Callable[[], None]) -> snap.SaveResult:
        writer = self.writer()
        try:
            entries = self.kv.cached_blocks_by_recency()[:writer.max_blocks]
            for chunk in _batched(entries, self.chunk_blocks):
                if time.monotonic() >= deadline:
                    logger.warning("kv snapshot: the stop's deadline cut the save at %d of %d blocks",
                                   writer.blocks, len(entries))
                    break
                contents = self.executor.read_kv_blocks([block for _, block in chunk])
                for (block_hash, _), data in zip(chunk, contents, strict=True):
                    writer.add(block_hash, data)
                beat()
            return writer.commit()
        except BaseException:
            writer.abort()
            raise

    def writer(self) -> snap.SnapshotWriter:
        return snap.SnapshotWriter(self.directory, self.fingerprint, self.block_bytes, self.bound,
                                   self._block_delay)

    # -- while serving -------------------------------------------------------------------------------

    def poll_timeout_ms(self, block: bool) -> int | None:
        """How long the engine loop may wait for messages: not past the next periodic save's turn."""
        if not block:
            return 0
        if self._job is not None:
            return _SAVE_POLL_MS
        if self.interval <= 0 or self._steps_at_save == self._steps_seen:
            return None
        return max(0, int((self._next_due - time.monotonic()) * 1000))

    def tick(self, steps: int) -> None:
        """One turn of the engine loop: starts a due periodic save, or copies its next chunk."""
        self._steps_seen = steps
        if self.interval <= 0:
            return
        if self._job is None:
            if steps != self._steps_at_save and time.monotonic() >= self._next_due:
                self._steps_at_save = steps
                self._job = _PeriodicSave(self)
            return
        if self._job.step():
            self._job = None
            self._next_due = time.monotonic() + self.interval

    def cancel_periodic(self) -> None:
        if self._job is not None:
            self._job.cancel()
            self._job = None


class _PeriodicSave:
    """One periodic save: the main loop copies chunks (`step`), a thread writes and commits them."""

    def __init__(self, owner: KVPersistence) -> None:
        self.owner = owner
        self.writer = owner.writer()
        self.pending = owner.kv.cached_blocks_by_recency()[:self.writer.max_blocks]
        self.queue: queue.Queue[list[tuple[bytes, bytes]] | None] = queue.Queue(maxsize=4)
        self.cancelled = threading.Event()
        self.handed_over = False
        self.thread = threading.Thread(target=self._write, name="kv-snapshot-writer", daemon=True)
        self.thread.start()

    def step(self) -> bool:
        """Hands the writer the next chunk, unless it is behind; True once the save has ended."""
        if self.handed_over:
            return not self.thread.is_alive()
        if self.queue.full():  # never wait for the disk in the engine loop
            return False
        chunk, self.pending = self.pending[:self.owner.chunk_blocks], self.pending[self.owner.chunk_blocks:]
        chunk = [(block_hash, block) for block_hash, block in chunk if self.owner.kv.holds(block, block_hash)]
        if chunk:
            contents = self.owner.executor.read_kv_blocks([block for _, block in chunk])
            self.queue.put_nowait([(block_hash, data) for (block_hash, _), data in zip(chunk, contents,
                                                                                        strict=True)])
        elif not self.pending:
            self.queue.put_nowait(None)  # the end: commit
            self.handed_over = True
        return False

    def cancel(self) -> None:
        self.cancelled.set()
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(None)
        self.thread.join()

    def _write(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if self.cancelled.is_set():
                    self.writer.abort()
                    return
                if item is None:
                    saved = self.writer.commit()
                    logger.info("kv snapshot (periodic): %d blocks, %d bytes to %s", saved.blocks,
                                saved.bytes, saved.path)
                    return
                for block_hash, data in item:
                    if self.cancelled.is_set():
                        break
                    self.writer.add(block_hash, data)
        except Exception:  # noqa: BLE001 - a failed periodic save loses only itself
            logger.exception("kv snapshot: periodic save failed")
            self.writer.abort()


def _batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk
