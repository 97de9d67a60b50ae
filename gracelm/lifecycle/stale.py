"""At start-up, remove what instances killed without a chance to clean up (`kill -9`, OOM) left behind:
runtime directories (`gracelm-<pid>-<random>`, see `runtime_dir.py`) and /dev/shm segments named
`gracelm-<pid>-...`, whose owner pid is dead. Left there, they pile up until tmpfs is full and the next
start dies (a known SGLang failure).

A runtime directory's owner is dead when the directory's `owner.lock` can be locked (`runtime_dir.py`: the
owner holds it while it lives, and the kernel releases it at its death), whatever the pid or any time says:
times can be moved, pids reused. A directory without the lock file (made by an older version, or caught
between its mkdir and its lock) and a segment are a dead owner's when no process has the owner pid, or it is
a zombie. Entries of other users are left alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

from gracelm.lifecycle.runtime_dir import LOCK_NAME, PREFIX, runtime_base

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")


@dataclasses.dataclass(frozen=True)
class Reclaimed:
    path: Path
    owner_pid: int
    what: str  # "runtime dir" or "shared-memory segment"
    why: str

    def __str__(self) -> str:
        return f"reclaimed stale {self.what} {self.path} ({self.why})"


def owner_pid(name: str) -> int | None:
    """The owner pid encoded in a runtime-dir or segment name, or None if the name is not ours."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def reclaim_stale(bases: Iterable[Path] | None = None, shm_dir: Path = SHM_DIR) -> list[Reclaimed]:
    """Removes stale runtime directories under `bases` (by default every base a runtime directory may have
    been created in) and stale segments in `shm_dir`; logs and returns what was reclaimed."""
    if bases is None:
        bases = dict.fromkeys([runtime_base(), Path(tempfile.gettempdir())])
    reclaimed = []
    for base in bases:
        reclaimed += _reclaim_in(base, "runtime dir", want_dir=True)
    if shm_dir.is_dir():
        reclaimed += _reclaim_in(shm_dir, "shared-memory segment", want_dir=False)
    for entry in reclaimed:
        logger.warning("%s", entry)
    return reclaimed


def _reclaim_in(directory: Path, what: str, want_dir: bool) -> list[Reclaimed]:
    reclaimed = []
    try:
        entries = list(os.scandir(directory))
    except OSError as e:
        logger.debug("cannot scan %s for stale entries: %s", directory, e)
        return []
    for entry in entries:
        pid = owner_pid(entry.name)
        if pid is None or pid == os.getpid() or entry.is_dir(follow_symlinks=False) != want_dir:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue  # removed meanwhile, by its owner or by another start
        path = Path(entry.path)
        with _dead_owner(path, pid, want_dir) as why:
            if why is not None and _remove(path, want_dir):
                reclaimed.append(Reclaimed(path, pid, what, why))
    return reclaimed


@contextlib.contextmanager
def _dead_owner(path: Path, pid: int, is_dir: bool) -> Iterator[str | None]:
    """Why the owner of the entry `path` is dead, or None if it may be alive. A runtime directory's lock,
    once taken, is held until the block ends: a second start reclaiming at the same moment finds it held
    and leaves the directory to this one."""
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW) if is_dir else None
    except FileNotFoundError:
        fd = None
    except OSError:
        yield None  # a lock file we may not open: not ours to judge
        return
    if fd is None:
        yield _pid_dead(pid)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield None
        return
    try:
        yield f"owner pid {pid} is dead: its lock is free"
    finally:
        os.close(fd)


def _pid_dead(pid: int) -> str | None:
    """Why no live process has the owner pid `pid`, or None."""
    try:
        zombie = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return f"owner pid {pid} is dead"
    except psutil.AccessDenied:
        return None
    return f"owner pid {pid} is a zombie" if zombie else None


def _remove(path: Path, is_dir: bool) -> bool:
    try:
        if is_dir:
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        logger.warning("could not remove stale %s: %s", path, e)
        return False
    return True
