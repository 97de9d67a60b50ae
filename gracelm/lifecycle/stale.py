"""At start-up, remove what instances killed without a chance to clean up (`kill -9`, OOM) left behind:
runtime directories (`gracelm-<pid>-<random>`, see `runtime_dir.py`) and /dev/shm segments named
`gracelm-<pid>-...`, whose owner pid is dead. Left there, they pile up until tmpfs is full and the next
start dies (a known SGLang failure).

An owner is dead when no process has its pid, when that process is a zombie, or when it started after the
entry last changed: the owner made the entry, so it was running before it, and a younger process with the
same pid is a reuse of the number. Entries of other users are left alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import psutil

from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")
# Process start times are computed from boot time and clock ticks; file times are exact. Allow for that.
_CLOCK_SLACK_S = 1.0


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
        if pid is None or entry.is_dir(follow_symlinks=False) != want_dir:
            continue
        try:
            stat = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile, by its owner or by another start
        if stat.st_uid != os.getuid():
            continue
        why = _why_dead(pid, stat.st_mtime)
        if why is not None and _remove(Path(entry.path), want_dir):
            reclaimed.append(Reclaimed(Path(entry.path), pid, what, why))
    return reclaimed


def _why_dead(pid: int, changed_at: float) -> str | None:
    """Why the owner `pid` of an entry last changed at `changed_at` is dead, or None if it may be alive."""
    if pid == os.getpid():
        return None
    try:
        process = psutil.Process(pid)
        started = process.create_time()
        zombie = process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return f"owner pid {pid} is dead"
    except psutil.AccessDenied:
        return None
    if zombie:
        return f"owner pid {pid} is a zombie"
    if started > changed_at + _CLOCK_SLACK_S:
        return f"owner pid {pid} is dead; the pid now belongs to a process started later"
    return None


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
