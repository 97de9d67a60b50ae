"""The one directory an instance keeps its files in: ipc sockets, the heartbeat slot, Prometheus's files, the
engine core's temporary files.

It is named after the owner's pid — `gracelm-<pid>-<random>` under `$XDG_RUNTIME_DIR` (or the temp dir) —
and holds `owner.lock`, on which the owner keeps an exclusive `flock` for its whole life: the kernel drops
the lock when the owner dies, however it dies, so a directory whose lock can be taken is a dead instance's
(`stale.py`), whatever its pid or times say.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "gracelm-"
LOCK_NAME = "owner.lock"
# AF_UNIX paths are limited to 107 bytes; leave room for the socket names inside the directory.
_MAX_BASE_LEN = 80


def runtime_base() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK) and len(base) < _MAX_BASE_LEN:
        return Path(base)
    return Path(tempfile.gettempdir())


class RuntimeDir:
    """Created on construction (mode 0700), removed by `remove()`; idempotent."""

    def __init__(self, owner_pid: int | None = None, base: Path | None = None) -> None:
        self.owner_pid = owner_pid if owner_pid is not None else os.getpid()
        name = f"{PREFIX}{self.owner_pid}-{secrets.token_hex(4)}"
        self.path = (base or runtime_base()) / name
        self.path.mkdir(mode=0o700)
        self._lock = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else holds it
        self._removed = False

    def temp_dir(self) -> Path:
        """`tmp/` inside it (made once): the engine core's `TMPDIR`, so that what torch or any library of
        the core unpacks there (a compiled graph's shared library) goes with the directory, at a stop as
        after a kill -9 (the next start's reclaim, `stale.py`)."""
        path = self.path / "tmp"
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def ipc_address(self, name: str) -> str:
        """A ZMQ `ipc://` address for a socket file named `name` inside the directory."""
        return f"ipc://{self.path / name}"

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)  # after the removal: a directory still there stays this live instance's
        if self.path.exists():
            logger.warning("could not remove runtime directory %s", self.path)

    def __repr__(self) -> str:
        return f"RuntimeDir({str(self.path)!r})"
