"""Commits the CPU KV cache's memory in the background, at idle priority: serving does not fault it in.

`allocate_kv_cache` maps a CPU cache lazily, which keeps the start fast (no memset of a gigabyte). But then
each page is faulted in when a step first writes it, inside the model's parallel loops, where the other
threads wait for the faulting one at the next barrier; and the allocator hands out every fresh block before
it reuses one (`KVCacheManager`), so a server pays this until its whole cache has been written once
(bench/RESULTS.md, "The serving processes").

A thread asks the kernel to map the pages as if written, without writing them (MADV_POPULATE_WRITE, Linux
5.14+), so blocks the model fills meanwhile keep their contents. It runs at SCHED_IDLE, only when a CPU has
nothing else to do, in the allocator's order (lowest block ids first, every layer), 64 KB per call. It starts
once the rest of the start is done (`Worker.commit_kv_cache`): its calls hold the memory-map lock that loading
the decode graphs' libraries waits for, which would lengthen the start. The memory is then held soon after
start, as vLLM and llama-server hold theirs: an overcommitted host shows within seconds of start, not hours
later when the cache first fills. Where the kernel lacks the call, pages are mapped on first write, as a plain
mapping's are (logged).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator

import torch

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # linux/mman.h
# Of one layer's K or V plane of one head, per call: the call holds the process's memory-map lock (for
# reading), and an idle-priority thread may be preempted inside; a stop waits for one call at most.
_BYTES_PER_CALL = 64 << 10


class KVCacheCommit:
    """The background commit of one worker's CPU caches (each [2, kv_heads, blocks, block_size, head_dim],
    contiguous); `stop` before the caches are freed."""

    def __init__(self, caches: list[torch.Tensor], label: str) -> None:
        self._ranges = _block_order_ranges(caches)  # walked by the thread
        self._bytes = sum(cache.numel() * cache.element_size() for cache in caches)
        self._label = label
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-cache-commit", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only (Linux)
        except OSError as e:
            logger.info("%s: KV cache pages are mapped when first written (no idle priority: %s)",
                        self._label, e)
            return
        started = time.monotonic()
        madvise = _madvise()
        for address, length in self._ranges:
            if self._stop.is_set():
                return
            if madvise(address, length, _MADV_POPULATE_WRITE) != 0:
                self._failed(ctypes.get_errno())
                return
        logger.info("%s: KV cache committed, %.0f MiB in %.1f s at idle priority", self._label,
                    self._bytes / 2**20, time.monotonic() - started)

    def _failed(self, code: int) -> None:
        if code == errno.EINVAL:  # a kernel before 5.14
            logger.info("%s: KV cache pages are mapped when first written (no MADV_POPULATE_WRITE)",
                        self._label)
        else:
            logger.warning("%s: committing the KV cache stopped: %s; its pages are mapped when first written",
                           self._label, os.strerror(code))


def _madvise() -> Callable[[int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)  # a foreign call releases the GIL for its duration
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _block_order_ranges(caches: list[torch.Tensor]) -> Iterator[tuple[int, int]]:
    """Page-aligned (address, length) ranges covering the caches, a run of blocks of every plane (layer, K or
    V, head) at a time, the lowest block ids first."""
    _, _, num_blocks, block_size, head_dim = caches[0].shape
    block_bytes = block_size * head_dim * caches[0].element_size()
    plane_bytes = num_blocks * block_bytes
    run = max(1, _BYTES_PER_CALL // block_bytes)
    page = mmap.PAGESIZE
    for first in range(0, num_blocks, run):
        for cache in caches:
            for plane in range(cache.shape[0] * cache.shape[1]):
                start = cache.data_ptr() + plane * plane_bytes + first * block_bytes
                end = start + min(run, num_blocks - first) * block_bytes
                aligned = start - start % page
                yield aligned, end - aligned
