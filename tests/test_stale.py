"""Stale runtime directories and shared-memory segments of dead owners are reclaimed; live ones are not."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from gracelm.lifecycle.runtime_dir import RuntimeDir
from gracelm.lifecycle.stale import SHM_DIR, owner_pid, reclaim_stale


@pytest.fixture
def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.fixture
def live_pid():
    process = subprocess.Popen(["sleep", "30"])
    yield process.pid
    process.kill()
    process.wait()


@pytest.fixture
def segments():
    made: list[Path] = []

    def make(name: str) -> Path:
        path = SHM_DIR / name
        path.write_bytes(b"\0" * 64)
        made.append(path)
        return path

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def test_owner_pid_follows_the_runtime_dir_naming(tmp_path):
    directory = RuntimeDir(owner_pid=4321, base=tmp_path)
    assert owner_pid(directory.path.name) == 4321
    assert owner_pid("gracelm-77-kv-cache") == 77
    assert owner_pid("gracelm-x-1") is None and owner_pid("pymp-abc") is None


def abandoned(directory: RuntimeDir) -> Path:
    """The directory as its owner's death leaves it: its lock released by the kernel, the files there."""
    os.close(directory._lock)
    return directory.path


def test_dead_owners_are_reclaimed_and_live_ones_untouched(tmp_path, dead_pid, live_pid, segments, caplog):
    stale_dir = abandoned(RuntimeDir(owner_pid=dead_pid, base=tmp_path))
    (stale_dir / "input.sock").touch()
    live_dir = RuntimeDir(owner_pid=live_pid, base=tmp_path).path
    own_dir = RuntimeDir(base=tmp_path).path
    stale_segment = segments(f"gracelm-{dead_pid}-kv")
    live_segment = segments(f"gracelm-{live_pid}-kv")
    not_ours = tmp_path / "other-1-dir"
    not_ours.mkdir()
    with caplog.at_level(logging.WARNING, logger="gracelm.lifecycle.stale"):
        reclaimed = reclaim_stale(bases=[tmp_path])
    mine = {entry.path: entry for entry in reclaimed if entry.owner_pid == dead_pid}
    assert set(mine) == {stale_dir, stale_segment}
    assert not stale_dir.exists() and not stale_segment.exists()
    assert live_dir.exists() and own_dir.exists() and live_segment.exists() and not_ours.exists()
    assert str(mine[stale_dir]) == (f"reclaimed stale runtime dir {stale_dir} (owner pid {dead_pid} is dead: "
                                    "its lock is free)")
    assert f"reclaimed stale shared-memory segment {stale_segment}" in caplog.text


def test_a_reused_pid_does_not_keep_a_stale_dir(tmp_path, live_pid):
    """The lock, not the pid, says who is alive: a live process with the dead owner's pid changes nothing."""
    directory = abandoned(RuntimeDir(owner_pid=live_pid, base=tmp_path))
    (entry,) = reclaim_stale(bases=[tmp_path], shm_dir=tmp_path / "no-shm")
    assert entry.path == directory and "its lock is free" in entry.why
    assert not directory.exists()


def test_a_live_owners_dir_is_kept_whatever_its_times_say(tmp_path, dead_pid):
    """Times can be moved (the reclaim once took a live server's directory whose mtime was set back), pids
    reused: only the lock its owner holds counts, here for a pid that no process has."""
    directory = RuntimeDir(owner_pid=dead_pid, base=tmp_path)
    long_ago = time.time() - 3600
    os.utime(directory.path, (long_ago, long_ago))
    assert reclaim_stale(bases=[tmp_path], shm_dir=tmp_path / "no-shm") == []
    assert directory.path.exists()
    directory.remove()


def test_a_dir_without_its_lock_is_judged_by_its_pid(tmp_path, dead_pid, live_pid):
    """An older version's directory, or one caught between its mkdir and its lock."""
    dead = tmp_path / f"gracelm-{dead_pid}-old"
    live = tmp_path / f"gracelm-{live_pid}-old"
    dead.mkdir()
    live.mkdir()
    (entry,) = reclaim_stale(bases=[tmp_path], shm_dir=tmp_path / "no-shm")
    assert entry.path == dead and entry.why == f"owner pid {dead_pid} is dead"
    assert live.exists()


def test_a_file_is_not_taken_for_a_runtime_dir(tmp_path, dead_pid):
    lookalike = tmp_path / f"gracelm-{dead_pid}-notes.txt"
    lookalike.write_text("not a runtime dir")
    assert reclaim_stale(bases=[tmp_path], shm_dir=tmp_path / "no-shm") == []
    assert lookalike.exists()
