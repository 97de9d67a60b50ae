"""A process's C heap: the model process's keeps what a step frees, for the next step (`keep_freed_memory`);
every serving process returns what its start-up freed, once (`release_freed_memory`).

A decode step of a few dozen sequences allocates and frees megabyte tensors every time: the logits
[rows, vocabulary] in bfloat16 and float32 (6.3 MB at 32 rows of the default model's 49,152 tokens), and
each sampling operation over them. glibc serves such sizes from fresh mmaps (above its dynamic
threshold) or trims them off the heap top when freed, so the kernel unmaps them and, at the next step,
faults and zeroes every page again: 12 % of the engine core's CPU time at 32 concurrent streams
(`perf`: clear_page, page faults), beside the step's own work. With allocations below 64 MB always from
the heap, and the heap trimmed only above 256 MB of free memory, the pages stay mapped from step to step.
Measured with `bench/serve.py run --concurrency 32` (default model, 128 tokens, alternating servers, three
each): 823-953 output tok/s against 657-886, ITL p99 48-54 ms against 65-75.

The cost: the process keeps up to 256 MB of freed heap (its peak transient use, in practice tens of MB)
instead of returning it; the KV cache and weights (far above 64 MB each, or memory-mapped) are unaffected.
What the load freed (a cold start's conversions above all) is returned once, before serving
(`release_freed_memory`): that peak is not a step's. The HTTP process returns its own start-up's (the
tokenizer's parse, the imports' transients) once its warm-up is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> bool:
    """Sets this process's glibc heap to keep freed memory (see above); False, logged, where the C library is
    not glibc (musl has no mallopt: the default behaviour stays, slower, nothing else changes)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                               and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        logger.info("the C library's heap keeps its default thresholds (no glibc mallopt)")
        return False
    return True


def release_freed_memory() -> None:
    """Returns the heap's free memory to the system now (glibc's `malloc_trim`; nothing elsewhere)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (`find_library` runs a program to find it)."""
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None
