"""Background threads at nice 19 (`gracelm/background_priority.py`): the calling thread alone."""

from __future__ import annotations

import os
import threading

from gracelm.background_priority import NICENESS, lower_this_thread


def test_only_the_calling_thread_is_lowered() -> None:
    seen: list[tuple[bool, int]] = []

    def run() -> None:
        seen.append((lower_this_thread(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert seen == [(True, NICENESS)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
