"""The niceness of the threads whose work is worth a faster next start or an earlier write, never the current
request's or start's time: the cache entries written after a cold start's warm-up (`model/entry_keeper.py`),
the memory written ahead beside torch's import (`model/prefaulted_memory.py`). At nice 19 such a thread takes
the CPU time the others leave, yet still finishes under load (SCHED_IDLE, which the decode graph compiler and
the KV cache's commit take, could starve it while requests run)."""

from __future__ import annotations

import os
import threading

NICENESS = 19


def lower_this_thread() -> bool:
    """This thread at `NICENESS` (on Linux a thread is a task of its own); False where the system refuses."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except OSError:
        return False
    return True
