"""Prometheus's multiprocess files with every byte reserved on disk before it is mapped.

prometheus_client keeps each process's values in files it memory-maps (`mmap_dict.MmapedDict`): a file is
made sparse (`truncate`) at 64 KiB and doubled the same way when its entries outgrow it. On a full
filesystem the first store into a page that was never backed kills the process with SIGBUS: the server
died with nothing in its log and its runtime directory left. Here the bytes are reserved
(`posix_fallocate`) before the library maps them, so a full filesystem is an `OSError` (ENOSPC) naming the
file, at the call that needed the space; `on_no_space` is told first, so the server can stop cleanly.

The subclass relies on `MmapedDict`'s entry layout and its `_capacity`, `_used`, `_f` and `_fname`
attributes (prometheus_client 0.20 to 0.26); `tests/test_metrics_files.py` checks that they still hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import mmap_dict, values


class _ReservedMmapedDict(mmap_dict.MmapedDict):
    on_no_space: Callable[[OSError], None] | None = None

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        if not read_mode:
            fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                size = os.fstat(fd).st_size or mmap_dict._INITIAL_MMAP_SIZE
                _reserve(fd, size, filename)
            finally:
                os.close(fd)
        super().__init__(filename, read_mode)

    def _init_value(self, key: str) -> None:
        # The library's entry: length, key padded to 8 bytes, value and timestamp; its file doubles to fit.
        encoded = len(key.encode("utf-8"))
        entry = 4 + encoded + (8 - (encoded + 4) % 8) + 16
        capacity = self._capacity
        while self._used + entry > capacity:
            capacity *= 2
        if capacity > self._capacity:
            _reserve(self._f.fileno(), capacity, self._fname)
        super()._init_value(key)


def _reserve(fd: int, size: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        error = OSError(e.errno, f"cannot reserve {size} bytes for the metrics file {path}: {e.strerror}")
        if _ReservedMmapedDict.on_no_space is not None:
            _ReservedMmapedDict.on_no_space(error)
        raise error from None


def reserve_metric_files(on_no_space: Callable[[OSError], None] | None = None) -> None:
    """From now on, this process's multiprocess metric files reserve their bytes; `on_no_space` is called
    (then the error raised) when a file cannot get them."""
    _ReservedMmapedDict.on_no_space = on_no_space
    values.MmapedDict = _ReservedMmapedDict  # the name `MultiProcessValue` builds its files with
