"""The directory gracelm keeps what it can recompute but would rather not at every start: content hashes
of model files, converted tokenizers, converted weights. Anything in it may be deleted at any time.

`$GRACELM_CACHE_DIR`, else `$XDG_CACHE_HOME/gracelm`, else `~/.cache/gracelm`. Files in it are written
atomically (`write_atomic`: a temporary file in the same directory, fsynced, then renamed), so a reader
never sees a torn file, whatever kills the writer.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

ENV = "GRACELM_CACHE_DIR"


def cache_dir(*parts: str) -> Path:
    """The cache directory (or a folder of it), created if missing."""
    base = os.environ.get(ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "gracelm")
    path = Path(base, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: Path, data: bytes | Callable[[Path], None]) -> None:
    """Replaces `path` by `data` all at once: readers see the old file or the new one, never a part. `data`:
    the bytes, or what writes them into the file it is given (a large file written from its tensors, with no
    copy of the whole in memory)."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            if callable(data):
                data(Path(temporary))
            else:
                file.write(data)
                file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    # The rename itself is durable once the directory is.
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def mtime(path: Path) -> float:
    """`path`'s modification time, 0 once it is gone (pruned by another process meanwhile): for sorting a
    folder's entries by use."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
