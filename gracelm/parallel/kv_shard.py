"""A rank's share of the prefix-cache snapshot (`--kv-cache-dir`) under tensor parallelism: the blocks rank 0
chose, written to and read from this rank's own file (its rank and KV layout in the fingerprint). Rank 0's
side, and the single-rank case, are `engine/kv_persistence.py`'s, which shares the block writer here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from gracelm.model import kv_snapshot as snap
from gracelm.parallel import messages as m

if TYPE_CHECKING:
    from gracelm.parallel.worker import Worker

logger = logging.getLogger(__name__)

# Blocks are copied this many bytes at a time: a periodic save's share of one turn of the loop (a few ms),
# and the memory a restore or a save holds at once.
CHUNK_BYTES = 8 * 2**20
T = TypeVar("T")



def write_blocks(writer: snap.SnapshotWriter, entries: list[tuple[bytes, int]],
                 read: Callable[[list[int]], list[bytes]], per_chunk: int, deadline: float,
                 beat: Callable[[], None]) -> snap.SaveResult:
    """Writes these (hash, block) entries, most recent first, until the deadline; commits."""
    try:
        for chunk in batched(entries, per_chunk):
            if time.monotonic() >= deadline:
                logger.warning("kv snapshot: the stop's deadline cut the save at %d of %d blocks",
                               writer.blocks, len(entries))
                break
            contents = read([block for _, block in chunk])
            for (block_hash, _), data in zip(chunk, contents, strict=True):
                writer.add(block_hash, data)
            beat()
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def shard_fingerprint(worker: Worker, inputs: dict) -> tuple[dict, int]:
    """The rank's fingerprint and block size: rank 0's inputs, with its own rank and KV layout."""
    layout = worker.kv_layout()
    return snap.fingerprint(**inputs, kv_layout=layout, rank=worker.rank), layout["block_bytes"]


def save_shard(worker: Worker, request: m.SaveKVBlocks) -> m.KVBlocksSaved:
    """Writes this rank's shard of the listed blocks to its own file; a failure is replied, not raised."""
    deadline = time.monotonic() + request.seconds
    try:
        fp, block_bytes = shard_fingerprint(worker, request.fingerprint_inputs)
        writer = snap.SnapshotWriter(Path(request.directory), fp, block_bytes, request.bound)
        saved = write_blocks(writer, request.blocks, worker.read_kv_blocks, chunk_blocks(block_bytes),
                              deadline, lambda: None)
    except Exception as e:  # noqa: BLE001 - rank 0 reports it; this rank's blocks are then unused
        logger.exception("kv snapshot: rank %d's save failed", worker.rank)
        return m.KVBlocksSaved(request.directory, 0, 0, f"{type(e).__name__}: {e}")
    logger.info("kv snapshot: rank %d: %d blocks, %d bytes to %s", worker.rank, saved.blocks, saved.bytes,
                saved.path)
    return m.KVBlocksSaved(str(saved.path), saved.blocks, saved.bytes, None)


def restore_shard(worker: Worker, request: m.RestoreKVBlocks) -> m.KVBlocksRestored:
    """Fills the blocks rank 0 placed from this rank's own file; replies with those found and verified."""
    wanted = dict(request.blocks)  # hash -> block id
    filled: list[int] = []
    try:
        fp, block_bytes = shard_fingerprint(worker, request.fingerprint_inputs)
        found = ((wanted[block_hash], data) for block_hash, data in
                 snap.read_snapshot(Path(request.directory), fp, block_bytes, worker.num_kv_blocks)
                 if block_hash in wanted)
        for chunk in batched(found, chunk_blocks(block_bytes)):
            worker.write_kv_blocks([block for block, _ in chunk], [data for _, data in chunk])
            filled.extend(block for block, _ in chunk)
    except Exception:  # noqa: BLE001 - never fatal: no rank uses these blocks, the engine starts colder
        logger.exception("kv snapshot: rank %d's restore failed", worker.rank)
        return m.KVBlocksRestored([])
    return m.KVBlocksRestored(filled)


def chunk_blocks(block_bytes: int) -> int:
    return max(1, CHUNK_BYTES // block_bytes)


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk
