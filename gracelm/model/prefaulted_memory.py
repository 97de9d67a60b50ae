"""Memory a cold start converts its weights into, its pages touched beforehand beside torch's import.

The first write to a page of new memory costs the kernel a fault; on some virtual machines a cold start's
faults take longer than its conversion's own work (about half a second a GB, `weight_cache._converted`).
The engine core's first second is torch's import, on one CPU. Where the cache holds no converted entry of
the model file (a cold start) and the memory is available, a thread beside that import maps as many bytes
as the file has and writes them, at the lowest priority: it takes only what the import and the frontend
leave of the CPUs. The load's conversion then takes its tensors from there (`take`), and what it did not
take is given back once the load ends (`release`).

One mapping per process, begun by the engine core's entry (`engine/core_entry.py`) and owned by this module
until the load ends; the tensors taken from it hold it from then on, and the last of them to go unmaps it.
A process that begins nothing (a tool, the decode-graph compiler, a tensor-parallel rank) takes nothing:
`take` gives None, and the conversion allocates as before. A failure here costs the speed-up, never the
start.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gracelm.background_priority import lower_this_thread
from gracelm.cache_dir import cache_dir
from gracelm.memory_budget import available_memory, gib
from gracelm.model import file_hash

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Memory left to everything else when the file's size is touched: the KV cache and the load's own come
# after it, and the load's check (`loader._check_weights_fit`) is the one that refuses what does not fit.
MARGIN = 1 << 30
# Written this much at a time, so that `take` waits at most one chunk for the thread to stop.
CHUNK = 64 << 20
# Each tensor's offset, as torch's own allocator aligns them.
ALIGNMENT = 64


class Arena:
    """A private anonymous mapping, written from its start by a thread, handed out from its start."""

    def __init__(self, size: int) -> None:
        self.mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.size = size
        self.used = 0
        self.touched = 0
        view = ctypes.c_char.from_buffer(self.mapping)
        self.address = ctypes.addressof(view)
        del view  # no buffer export left: an arena nothing took can be closed

    def touch(self, stop: threading.Event) -> None:
        """Faults the pages in by writing them, a chunk at a time, until all are or `stop` is set. ctypes
        calls run without the GIL: the import beside goes on. Written, not `MADV_POPULATE_WRITE`d: that
        holds the process's memory map through each call, and every mapping the import makes waits for it,
        where a write's faults take no lock the import needs."""
        while self.touched < self.size and not stop.is_set():
            length = min(CHUNK, self.size - self.touched)
            ctypes.memset(self.address + self.touched, 0, length)
            self.touched += length

    def take(self, nbytes: int) -> int | None:
        """The offset of `nbytes` not handed out yet, or None where they do not fit."""
        begin = -(-self.used // ALIGNMENT) * ALIGNMENT
        if nbytes == 0 or begin + nbytes > self.size:
            return None
        self.used = begin + nbytes
        return begin

    def give_back_rest(self) -> None:
        """Unmaps an arena nothing took, else frees the pages after the last byte taken (the mapping itself
        stays until the last tensor taken goes)."""
        if self.used == 0:
            self.mapping.close()
            return
        begin = -(-self.used // mmap.PAGESIZE) * mmap.PAGESIZE
        if begin < self.size:
            self.mapping.madvise(mmap.MADV_DONTNEED, begin, self.size - begin)


@dataclass
class _Begun:
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    arena: Arena | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_begun = _Begun()


def begin(path: Path) -> None:
    """Starts the thread that maps and writes as many bytes as the model file `path` has, where the weights
    cache holds none of its entries, and the memory available holds them and `MARGIN`."""
    global _begun
    release()
    begun = _begun = _Begun()
    begun.thread = threading.Thread(target=_prefault, args=(begun, path), name="prefault", daemon=True)
    begun.thread.start()


def _prefault(begun: _Begun, path: Path) -> None:
    try:
        if not lower_this_thread():  # at the import's own priority, it would slow the import as much
            return
        model_hash = file_hash.prefetched(path)
        if model_hash is None or _cache_holds(model_hash):
            return
        size = path.stat().st_size
        available = available_memory()
        if size + MARGIN > available.bytes:
            logger.info("weights memory: none written ahead (the file's %s and a margin of %s; %s available)",
                        gib(size), gib(MARGIN), gib(available.bytes))
            return
        arena = Arena(size)
        with begun.lock:
            if begun.stop.is_set():
                arena.mapping.close()
                return
            begun.arena = arena
        arena.touch(begun.stop)
    except (OSError, ValueError) as e:  # the load allocates as before
        logger.info("weights memory: none written ahead: %s", e)


def _cache_holds(model_hash: str) -> bool:
    """Whether the weights cache has an entry of the model: their names begin with its hash
    (`weight_cache.entry_path`)."""
    with contextlib.suppress(OSError):
        return any(entry.name.startswith(f"{model_hash}-") for entry in os.scandir(cache_dir("weights")))
    return False


def take(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor of `shape` and `dtype` in the written memory (what it holds is undefined), or None where
    none was begun or what is left is too small. The first call stops the writing."""
    import torch

    arena = _stopped()
    if arena is None:
        return None
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    offset = arena.take(nbytes)
    if offset is None:
        return None
    flat = torch.frombuffer(arena.mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(shape)


def held() -> int:
    """The bytes written ahead and not taken yet: counted used, they are the conversion's to take."""
    arena = _begun.arena
    return 0 if arena is None else max(0, arena.touched - arena.used)


def release() -> None:
    """Ends the writing and gives back what the load did not take; `take` gives None from then on."""
    begun = _begun
    arena = _stopped()
    with begun.lock:
        begun.arena = None
    if arena is None:
        return
    logger.info("weights memory: %.1f MiB written ahead beside the imports, %.1f MiB of it taken by the "
                "conversion", arena.touched / 2**20, arena.used / 2**20)
    arena.give_back_rest()


def _stopped() -> Arena | None:
    """The arena, once its writer has stopped (within a chunk). A thread that has made none yet makes none
    from then on: it is not waited for (it may be waiting for the file's hash)."""
    begun = _begun
    with begun.lock:
        begun.stop.set()
        arena = begun.arena
    if arena is not None and begun.thread is not None:
        begun.thread.join()
    return arena
