"""Prometheus's multiprocess files reserve every byte they map (`observability/metrics_files.py`): at
creation and when they grow, and a filesystem without room is an OSError naming the file, never a SIGBUS.
This also checks that the library's internals the reservation relies on still hold."""

from __future__ import annotations

import errno
import os

import pytest
from prometheus_client import mmap_dict, values

from gracelm.observability.metrics_files import _ReservedMmapedDict, reserve_metric_files


def _reserved(path) -> bool:
    stat = os.stat(path)
    return stat.st_blocks * 512 >= stat.st_size > 0


def test_a_new_file_and_its_growth_are_reserved(tmp_path):
    path = tmp_path / "counter_1.db"
    store = _ReservedMmapedDict(str(path))
    try:
        assert os.stat(path).st_size == mmap_dict._INITIAL_MMAP_SIZE and _reserved(path)
        for i in range(2000):  # ~200 KB of entries: the file doubles twice
            store.write_value(f"metric-{i:04d}-" + "x" * 64, float(i), 0.0)
        assert os.stat(path).st_size == 4 * mmap_dict._INITIAL_MMAP_SIZE and _reserved(path)
        assert dict((k, v) for k, v, _ in store.read_all_values())["metric-1999-" + "x" * 64] == 1999.0
    finally:
        store.close()


def test_no_room_is_an_oserror_naming_the_file_and_reported(tmp_path, monkeypatch):
    reported: list[OSError] = []
    monkeypatch.setattr(values, "MmapedDict", values.MmapedDict)  # restored after the test
    monkeypatch.setattr(_ReservedMmapedDict, "on_no_space", None)
    reserve_metric_files(reported.append)
    assert values.MmapedDict is _ReservedMmapedDict

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    path = tmp_path / "histogram_1.db"
    with pytest.raises(OSError, match=f"metrics file {path}: No space left on device") as raised:
        _ReservedMmapedDict(str(path))
    assert raised.value.errno == errno.ENOSPC and reported == [raised.value]
