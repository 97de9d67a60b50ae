"""The prefix cache kept across restarts (`--kv-cache-dir`): restored into the KV cache before the core says
`Ready`, saved at a graceful stop and, with `--kv-cache-save-interval`, while serving. The file format and
its checks are `model/kv_snapshot.py`'s, a worker rank's side `parallel/kv_shard.py`'s; this module moves
blocks between it, the `KVCacheManager` and the executor's KV tensors.

Choices, where the issue is silent (as vLLM/SGLang users would expect of a prefix cache):
- Restored blocks are ordinary cached blocks, evictable, in their saved LRU order behind nothing: a new
  request's blocks evict the least recently used restored ones first. Restoring never evicts.
- The stop's save runs after the last request, before the executor is released, within the drain's
  deadline plus `_SAVE_GRACE_S`; cut by the deadline, it keeps the most recently used blocks it copied.
  A fatal stop saves nothing: the cache may hold the work of a failed step.
- The periodic save snapshots the list of cached blocks when it starts, then copies `CHUNK_BYTES` of them
  out of the KV tensors per turn of the engine loop (between steps, so no step writes them meanwhile), and a
  thread writes them. A block evicted and reused before its turn is checked (`KVCacheManager.holds`) and
  left out. The save starts only if steps ran since the last one, so an idle server stays asleep.
- With tensor parallelism rank 0, which owns the `KVCacheManager`, decides: at the stop it lists the blocks
  (hash, id) and every rank writes its shard of them to its own file (`save_shard` on the workers, in
  parallel with rank 0); at start rank 0 places the blocks of its file, the workers fill the same ids from
  theirs (`restore_shard`), and a block that any rank could not fill (missing, damaged) is taken back on
  rank 0: no rank ever uses a block whose KV is incomplete. Each rank's file gets 1/N of
  `--kv-cache-dir-size`, so the directory (or all nodes' together) stays within it. `EngineConfig` refuses
  the periodic save with N > 1: the workers would have to copy blocks between the same steps.
- A restore that kills the core must not come back at every start: `RESTORING` marks the directory while
  one runs; a start that finds the mark (its predecessor died restoring) skips the restore once, says so,
  and removes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gracelm.config import EngineConfig, parse_size
from gracelm.engine.kv_cache_manager import BLOCK_HASH_ROOT, KVCacheManager
from gracelm.lifecycle.faults import faults
from gracelm.lifecycle.ledger import Outcome, ResourceKind, ResourceReport, ShutdownReport
from gracelm.model import kv_snapshot as snap
from gracelm.model.file_hash import content_hash
from gracelm.model.model_files import resolve_model_path
from gracelm.parallel import messages as m
from gracelm.parallel.kv_shard import batched, chunk_blocks, write_blocks

if TYPE_CHECKING:
    from gracelm.model.tokenizer import Tokenizer
    from gracelm.parallel.executor import Executor

logger = logging.getLogger(__name__)

# The stop's save may run this long past the drain's deadline: within the frontend's exit grace
# (core_client._EXIT_GRACE_S), leaving it room for the rest of the teardown.
_SAVE_GRACE_S = 2.0
# A periodic save's loop turns poll this often while its writer catches up.
_SAVE_POLL_MS = 10
# A worker's save may end this long after the stop's cut: its commit (fsync, rename) comes after the cut.
_WORKER_COMMIT_S = 5.0
# The workers' part of a restore at start: reading and checking their files, as long as rank 0's took.
_WORKER_RESTORE_S = 300.0
# In the directory while a restore runs (`restore`).
RESTORING = "restoring"


class KVPersistence:
    def __init__(self, config: EngineConfig, executor: Executor, kv: KVCacheManager,
                 tokenizer: Tokenizer) -> None:
        assert config.kv_cache_dir is not None
        self.directory = Path(config.kv_cache_dir).expanduser()
        # Every rank writes its own file: its share keeps them all within the bound.
        self.bound = parse_size(config.kv_cache_dir_size) // config.tensor_parallel_size
        self.interval = config.kv_cache_save_interval
        self.executor = executor
        self.kv = kv
        layout = executor.kv_layout()
        self.block_bytes: int = layout["block_bytes"]
        self.chunk_blocks = chunk_blocks(self.block_bytes)
        # What every rank's fingerprint shares; each adds its own rank and KV layout.
        self.fingerprint_inputs = {
            "weights_hash": content_hash(resolve_model_path(config.model)),
            "tokenizer_hash": hashlib.sha256(tokenizer.backend_json().encode()).hexdigest(),
            "hash_scheme": BLOCK_HASH_ROOT.decode(), "tensor_parallel_size": config.tensor_parallel_size}
        self.fingerprint = snap.fingerprint(**self.fingerprint_inputs, kv_layout=layout, rank=0)
        self._block_delay = faults().kv_block_delay()
        self._job: _PeriodicSave | None = None
        self._next_due = time.monotonic() + self.interval
        self._steps_at_save = 0  # the loop's step count when the last periodic save began
        self._steps_seen = 0

    # -- start ---------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Fills the empty cache with the snapshot's blocks, most recent first, as far as they fit; skipped
        once where the last start died restoring (`RESTORING`)."""
        mark = self.directory / RESTORING
        if mark.exists():
            logger.error("kv snapshot: the last start died while restoring from %s; starting with an empty "
                         "prefix cache this once", self.directory)
            mark.unlink(missing_ok=True)
            return
        started = time.monotonic()
        self.directory.mkdir(parents=True, exist_ok=True)
        mark.touch()
        faults().in_kv_restore()
        placed = self._restore_own()
        if placed and self.executor.worker_ranks:
            self._keep_complete(placed)
        mark.unlink(missing_ok=True)
        if self.kv.num_restored_blocks:
            logger.info("kv snapshot: restored %d blocks from %s in %.0f ms", self.kv.num_restored_blocks,
                        self.directory, (time.monotonic() - started) * 1000)

    def _restore_own(self) -> list[tuple[bytes, int]]:
        """Rank 0's file: its blocks placed in the cache and filled; (hash, block) of each."""
        entries = snap.read_snapshot(self.directory, self.fingerprint, self.block_bytes,
                                     self.kv.num_total_blocks)
        restored: list[tuple[bytes, int]] = []
        try:
            for chunk in batched(entries, self.chunk_blocks):
                placed = [(self.kv.restore_block(h), h, data) for h, data in chunk]
                placed = [(block, h, data) for block, h, data in placed if block is not None]
                if placed:
                    self.executor.write_kv_blocks([b for b, _, _ in placed], [d for _, _, d in placed])
                    restored.extend((h, block) for block, h, _ in placed)
        except Exception:  # a snapshot must never stop the engine from starting: start cold instead
            logger.exception("kv snapshot: restore failed; starting with an empty prefix cache")
            self.kv.reset_prefix_cache()
            self.kv.num_restored_blocks = 0
            return []
        return restored

    def _keep_complete(self, placed: list[tuple[bytes, int]]) -> None:
        """The workers fill the blocks rank 0 placed from their own files; a block that some rank could not
        fill is taken back, so that no rank computes on it."""
        self.executor.send_to_workers(m.RestoreKVBlocks(str(self.directory), self.fingerprint_inputs, placed))
        replies = self.executor.gather_from_workers(m.KVBlocksRestored, time.monotonic() + _WORKER_RESTORE_S)
        complete = set.intersection(*(set(reply.block_ids) for reply in replies.values()))
        incomplete = [block for _, block in placed if block not in complete]
        for block in incomplete:
            self.kv.forget_restored(block)
        if incomplete:
            logger.warning("kv snapshot: %d of %d blocks left out: missing or damaged on another rank",
                           len(incomplete), len(placed))

    # -- stop ----------------------------------------------------------------------------------------

    def save_at_stop(self, deadline: float, beat: Callable[[], None]) -> ShutdownReport:
        """The graceful stop's save, as entries of the shutdown report (blocks, bytes, ms): rank 0's, then,
        with tensor parallelism, each worker's, which writes its shard meanwhile."""
        self.cancel_periodic()
        cut = deadline + _SAVE_GRACE_S
        entries = self.kv.cached_blocks_by_recency()[:snap.max_blocks(self.fingerprint, self.block_bytes,
                                                                      self.bound)]
        started = time.monotonic()
        if self.executor.worker_ranks:
            self._start_workers_save(entries, cut)
        report = ShutdownReport([_report_entry(started, f"kv snapshot to {self.directory}",
                                               lambda: self._save(entries, cut, beat))])
        if self.executor.worker_ranks:
            report.resources.extend(self._workers_saved(started, cut, beat))
        return report

    def _save(self, entries: list[tuple[bytes, int]], deadline: float, beat: Callable[[], None]) -> str:
        started = time.monotonic()
        saved = write_blocks(self.writer(), entries, self.executor.read_kv_blocks, self.chunk_blocks,
                              deadline, beat)
        name = f"kv snapshot: {saved.blocks} blocks, {saved.bytes} bytes to {saved.path}"
        logger.info("%s in %.0f ms", name, (time.monotonic() - started) * 1000)
        return name

    def _start_workers_save(self, entries: list[tuple[bytes, int]], cut: float) -> None:
        try:
            seconds = max(0.0, cut - time.monotonic())
            self.executor.send_to_workers(m.SaveKVBlocks(str(self.directory), self.fingerprint_inputs,
                                                         self.bound, entries, seconds))
        except Exception:  # noqa: BLE001 - a dead worker: the gather that follows reports it
            logger.exception("kv snapshot: could not ask the workers to save")

    def _workers_saved(self, started: float, cut: float, beat: Callable[[], None]) -> list[ResourceReport]:
        """Each worker's save, as an entry of the report; one failed entry if some worker never answers."""
        try:
            replies = self.executor.gather_from_workers(m.KVBlocksSaved, cut + _WORKER_COMMIT_S, beat)
        except Exception as e:  # noqa: BLE001 - a shard missing only costs its blocks at the next start
            logger.exception("kv snapshot: the workers' save failed")
            return [ResourceReport(ResourceKind.KV_SNAPSHOT, "kv snapshot of the worker ranks",
                                   Outcome.FAILED, (time.monotonic() - started) * 1000,
                                   f"{type(e).__name__}: {e}", time.time())]
        ms = (time.monotonic() - started) * 1000
        return [ResourceReport(ResourceKind.KV_SNAPSHOT,
                               f"rank {rank}: kv snapshot: {r.blocks} blocks, {r.bytes} bytes to {r.path}",
                               Outcome.FAILED if r.error else Outcome.RELEASED, ms, r.error, time.time())
                for rank, r in replies.items()]

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


def _report_entry(started: float, name: str, save: Callable[[], str]) -> ResourceReport:
    """`save` (which names what it saved) as an entry of the shutdown report; a failure is reported there."""
    outcome, error = Outcome.RELEASED, None
    try:
        name = save()
    except Exception as e:  # noqa: BLE001 - reported; the stop goes on to release everything
        logger.exception("kv snapshot: save failed")
        outcome, error = Outcome.FAILED, f"{type(e).__name__}: {e}"
    return ResourceReport(ResourceKind.KV_SNAPSHOT, name, outcome, (time.monotonic() - started) * 1000, error,
                          time.time())
