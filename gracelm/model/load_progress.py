"""The progress line (tqdm, on stderr) while a model's weights load, shown only when stderr is a terminal:
`gracelm serve` or `gracelm generate` run by hand, or the offline `Engine` in a terminal. Under systemd, in a
log file, in a test or a notebook it stays off (a bar redrawn with carriage returns garbles a log); the
start-up timeline line says how long the load took there."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def load_progress(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    stream = sys.stderr
    if stream is None or not stream.isatty():
        return iter(items)
    # tqdm's default lock is a multiprocessing semaphore, registered with the resource tracker the server's
    # processes share; the engine core ends with os._exit, so it would be reported leaked at every stop.
    # One process's bar needs a thread lock only.
    tqdm.set_lock(threading.RLock())
    return iter(tqdm(items, total=total, desc=description, unit="tensor", file=stream, dynamic_ncols=True))
