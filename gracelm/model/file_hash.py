"""A content hash of a model's weight files, computed once per file and then kept, keyed by the file's
path, size and modification time (a file changed in place gets a new hash; an unchanged one costs a
`stat`). It names the weights themselves, whatever the model is called: what the KV-cache snapshot and
the converted-weights cache are keyed by.

`prefetch` starts a hash in a thread, which the next `content_hash` of the same path waits for: the digest
runs without holding the GIL, so the engine core hashes a new file beside its own imports
(`engine/core_entry.py`).

A file's hash is the XXH3-128 of its bytes (`xxhash`): it reads memory as fast as memory gives it, so an 8B
model's 5 GB take a fraction of a second of one CPU where sha256 took seconds of every CPU, which a first
start shares with torch's import and its own conversion. It is no cryptographic hash: it tells files apart,
not a file made to collide with another, which would be served that other's converted weights; the cache
trusts the model files it is given, as it trusts its own folder. The index names the definition (`INDEX`),
so a hash kept under another is never taken for this one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import threading
from concurrent.futures import Future
from pathlib import Path

import xxhash

from gracelm.cache_dir import cache_dir, write_atomic

logger = logging.getLogger(__name__)

INDEX = "file-hashes-v3.json"  # v3: XXH3-128 of the bytes (v2: sha256 of 32 MiB chunks' sha256)
_lock = threading.Lock()  # one process's threads update the index one at a time
_prefetched: dict[Path, Future[str]] = {}


def prefetch(path: str | Path) -> None:
    """Starts `content_hash(path)` in a daemon thread; the next `content_hash(path)` takes its result."""
    path = Path(path).resolve()
    future: Future[str] = Future()
    with _lock:
        _prefetched[path] = future

    def run() -> None:
        try:
            future.set_result(_content_hash(path))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who hashes again
            future.set_exception(e)

    threading.Thread(target=run, name="content-hash", daemon=True).start()


def prefetched(path: str | Path) -> str | None:
    """The hash `prefetch` began, once computed, left for `content_hash` to take; else the kept one
    (`known_hash`). None where neither is (the prefetch failed, or none was begun of an unknown file)."""
    path = Path(path).resolve()
    with _lock:
        future = _prefetched.get(path)
    if future is None:
        return known_hash(path)
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - the load hashes again, and reports what fails
        return None


def content_hash(path: str | Path) -> str:
    """A file's XXH3-128 (hex; see above); a directory's, sha256 of its weight and config files' names and
    hashes."""
    path = Path(path).resolve()
    with _lock:
        future = _prefetched.pop(path, None)
    if future is not None:
        try:
            return future.result()
        except Exception as e:  # noqa: BLE001 - hashed again below, where the failure is the caller's
            logger.debug("the prefetched hash of %s failed (%s); hashing again", path, e)
    return _content_hash(path)


def known_hash(path: str | Path) -> str | None:
    """`content_hash(path)` where every file's hash is already kept (a `stat` each), else None: never reads
    a model file. For a process that can use the hash if it is there and need not wait for it."""
    try:
        return _content_hash(Path(path).resolve(), compute=False)
    except (OSError, LookupError):
        return None


def _content_hash(path: Path, compute: bool = True) -> str:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json", ".gguf", ".jinja"))
        listing = "\n".join(f"{p.name} {file_hash(p, compute)}" for p in files)
        return hashlib.sha256(listing.encode()).hexdigest()
    return file_hash(path, compute)


def file_hash(path: Path, compute: bool = True) -> str:
    """The file's hash (`_digest`): from the index where it is kept; else computed and kept (`compute`), or
    LookupError."""
    stat = path.stat()
    key = f"{path} {stat.st_size} {stat.st_mtime_ns}"
    index_path = cache_dir() / INDEX
    with _lock:
        index = _read_index(index_path)
        if key in index:
            return index[key]
    if not compute:
        raise LookupError(f"no kept hash of {path}")
    digest = _digest(path)
    with _lock:
        index = _read_index(index_path)  # another process may have added entries meanwhile
        index = {k: v for k, v in index.items() if not k.startswith(f"{path} ")}  # older versions go
        index[key] = digest
        write_atomic(index_path, json.dumps(index, indent=0).encode())
    return digest


def _digest(path: Path) -> str:
    """XXH3-128 of the file's bytes, hex."""
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        if not size:
            return xxhash.xxh3_128().hexdigest()
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        with memoryview(mapping) as data:
            return xxhash.xxh3_128(data).hexdigest()
    finally:
        with contextlib.suppress(BufferError):  # a view an error's traceback holds: unmapped with it
            mapping.close()


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return index if isinstance(index, dict) else {}
