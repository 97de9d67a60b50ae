"""Cache entries of converted weights written from the tensors being served: a conversion goes into the
process's memory, and the entry file is then written from it. A server's cold start (`deferred_keeping`)
serves the weights at once, and a thread of the same process writes the entry after the warm-up
(`start_keeping`), at the lowest priority, for the next start to map; every other load keeps its entries
before it returns.

Why: a cold start that converted straight into the entry's file, mapped shared, spent most of its repack
faulting in file pages, and the flush to disk after it; the same conversion into anonymous memory takes a
third of that, and the write then costs the start nothing (figures: bench/RESULTS.md). What the process
holds is the same either way: the weights, once.

A `Claim` (an exclusive `flock` on a lock file beside the entry, `.<entry>.lock`) marks an entry being
converted or kept. A process that misses an entry another holds (the decode graph compiler started beside a
cold start, a second server of the same model) waits for the claim, then maps the kept entry instead of
converting the model again. The lock dies with its holder, so a killed writer blocks nobody; its temporary
file and lock file are removed by a later write's pruning once an hour old (`weight_cache._prune`).

A stop does not wait for a write: `stop_keeping` (the model's release) stops it between two chunks and
removes its temporary file, so nothing is left; the next start converts again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from gracelm.background_priority import lower_this_thread
from gracelm.cache_dir import write_atomic

logger = logging.getLogger(__name__)

# Bytes written per call: a stop waits for one at most.
_CHUNK = 64 << 20
_keepers: set[_Keeper] = set()
_deferring = False
_keepers_lock = threading.Lock()


class Claim:
    """The exclusive right to convert and keep one entry, held until `release`."""

    def __init__(self, lock_path: Path, fd: int) -> None:
        self._lock_path = lock_path
        self._fd: int | None = fd

    @classmethod
    def wait(cls, entry: Path) -> Claim | None:
        """The entry's claim, once no other process holds it; None at once where another does and this load
        is a server's (`deferred_keeping`): its tensor-parallel ranks load the same entries, and one that
        waited for another's write, deferred until after a warm-up they take part in, would wait for good.
        An unwritable folder gives a claim of nothing (the write then fails, and says so)."""
        _finish_own(entry)  # a deferred write of this process would hold the lock for good
        lock_path = entry.with_name(f".{entry.name}.lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return cls(lock_path, -1)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if _deferring else 0))  # waits without the GIL
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(lock_path, fd)

    def release(self) -> None:
        """Unlinked before it is unlocked: a process waiting on it then finds the entry, and a later one
        takes a new lock file. Only its own: a lock file made since by another process (which found this
        one unlinked) is that process's."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if fd >= 0:
            with contextlib.suppress(OSError):
                if os.stat(self._lock_path).st_ino == os.fstat(fd).st_ino:
                    self._lock_path.unlink()
            os.close(fd)


class _Stopped(Exception):
    """The process stops: the write is abandoned, its temporary file removed."""


class _Keeper:
    """One entry to write from the tensors being served, then its claim to release."""

    def __init__(self, path: Path, header: tuple[bytes, dict[str, int]], tensors: dict[str, torch.Tensor],
                 claim: Claim, after: Callable[[], None]) -> None:
        self.path = path
        self._header, self._starts = header
        self._tensors = dict(tensors)  # the caller's dict may change (the loader adds to it), not its tensors
        self._claim = claim
        self._after = after
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._write_behind, name="weights-cache-writer", daemon=True)
        self.thread.start()

    def _write_behind(self) -> None:
        lower_this_thread()  # beside serving, the write takes what the requests leave
        self.write()

    def write(self) -> None:
        started = time.monotonic()
        try:
            write_atomic(self.path, self._write)
        except _Stopped:
            logger.info("weights cache: %s not kept, the process stops", self.path.name)
        except Exception as e:  # a read-only or full disk above all: served anyway, converted again next time
            logger.warning("cannot keep the converted weights in %s: %s", self.path, e)
        else:
            logger.info("weights cache: kept %s (%.2f GB) in %.1f s", self.path.name,
                        self.path.stat().st_size / 1e9, time.monotonic() - started)
            self._after()
        finally:
            self.end()

    def end(self) -> None:
        self._claim.release()
        with _keepers_lock:
            _keepers.discard(self)

    def _write(self, temporary: Path) -> None:
        fd = os.open(temporary, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, self._header, 0)
            for name, tensor in self._tensors.items():
                data = tensor.detach().reshape(-1).view(torch.uint8).numpy()
                for begin in range(0, len(data), _CHUNK):
                    if self.stopping.is_set():
                        raise _Stopped
                    _write_all(fd, data[begin:begin + _CHUNK], self._starts[name] + begin)
        finally:
            os.close(fd)


def _write_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


@contextlib.contextmanager
def deferred_keeping() -> Iterator[None]:
    """Within it, the entries a load converts are kept once `start_keeping` is called (the server's model,
    after its warm-up), not before the load returns."""
    global _deferring
    _deferring = True
    try:
        yield
    finally:
        _deferring = False


def keep(path: Path, header: tuple[bytes, dict[str, int]], tensors: dict[str, torch.Tensor], claim: Claim,
         after: Callable[[], None]) -> None:
    """Writes the entry `path` (`header`: its safetensors header and where each tensor begins) from
    `tensors`, then releases `claim` and calls `after` (the folder's pruning) once the entry is kept: now, or
    within `deferred_keeping`, in a thread that `start_keeping` starts. The tensors must not change
    meanwhile: they are the weights being served."""
    keeper = _Keeper(path, header, tensors, claim, after)
    with _keepers_lock:
        _keepers.add(keeper)
    if not _deferring:
        keeper.write()


def start_keeping() -> None:
    """Starts the writes deferred by `deferred_keeping`: once the start has no more use for the CPU (after
    the warm-up), as the write would otherwise slow it."""
    with _keepers_lock:
        for keeper in _keepers:
            if keeper.thread is None:
                keeper.start()


def stop_keeping(timeout: float = 10.0) -> None:
    """Abandons the writes asked for (each removes its temporary file) and waits for their threads."""
    with _keepers_lock:
        keepers = list(_keepers)
    for keeper in keepers:
        keeper.stopping.set()
        if keeper.thread is None:  # never started: nothing written
            keeper.end()
    for keeper in keepers:
        if keeper.thread is not None:
            keeper.thread.join(timeout)


def _finish_own(entry: Path) -> None:
    with _keepers_lock:
        own = [keeper for keeper in _keepers if keeper.path == entry]
    for keeper in own:
        if keeper.thread is None:
            keeper.start()
        assert keeper.thread is not None
        keeper.thread.join()

