"""The on-disk snapshot of the prefix cache (`--kv-cache-dir`): its fingerprint, file format, writing,
verified reading and size bound. Torch-free: block contents come and go as bytes.

A snapshot holds full cached blocks under their chained content hashes (`kv_cache_manager.hash_block`):
a hash names a block's whole prefix, so no parent link is stored. It is only valid for the same weights,
tokenizer, KV dtype, block size, KV layout, tensor-parallel degree and rank and format version; those make
up the fingerprint, whose digest and rank name the file (`kv-<digest>-rank<r>.snap`) and which the header
repeats in full, so another model, dtype or layout never reads it.

File: `MAGIC | u32 header length | header (JSON) | u32 crc32 of the header | u64 block count`, then per
block `32-byte hash | u32 crc32 of the data | data (block_bytes)`, most recently used first (so a snapshot
cut by the size bound or by the stop's deadline keeps the most valuable blocks). crc32, not sha256: it is
there against torn or damaged files, not against an adversary, and it checks gigabytes at memory speed.
A file whose header, fingerprint or size is wrong is skipped whole, with a log line; a block whose
checksum is wrong is skipped alone.

Atomic: a snapshot is written to a temporary file named after the writer's pid, fsynced, then renamed over
the previous one, so a kill -9 at any moment leaves the previous snapshot whole. Temporary files of dead
writers are removed by the next save or restore.

Bounded: `enforce_bound` keeps the snapshot files of the directory (every fingerprint's; files of other
programs are not ours to count or delete) within the bound, removing the oldest first; the snapshot being
written is cut to the bound itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import stat
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from gracelm.cache_dir import mtime

logger = logging.getLogger(__name__)

# Changes whenever the file format or the meaning of its bytes changes: an older file then never matches.
FORMAT_VERSION = 1
MAGIC = b"GRACEKV\x00"
HASH_BYTES = 32  # sha256 digests (`hash_block`)
_RECORD_HEAD = struct.Struct("<32sI")  # block hash, crc32 of its data
_COUNT = struct.Struct("<Q")
_U32 = struct.Struct("<I")
SUFFIX = ".snap"
_TEMP_SUFFIX = ".tmp"


def fingerprint(*, weights_hash: str, tokenizer_hash: str, kv_layout: dict[str, Any], hash_scheme: str,
                tensor_parallel_size: int, rank: int) -> dict[str, Any]:
    """Everything that makes the KV of a token sequence reusable, as plain JSON types."""
    return {"format_version": FORMAT_VERSION, "weights": weights_hash, "tokenizer": tokenizer_hash,
            "kv_layout": kv_layout, "hash_scheme": hash_scheme,
            "tensor_parallel_size": tensor_parallel_size, "rank": rank}


def fingerprint_digest(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:32]


def snapshot_path(directory: Path, fp: dict[str, Any]) -> Path:
    return directory / f"kv-{fingerprint_digest(fp)}-rank{fp['rank']}{SUFFIX}"


def _header_bytes(fp: dict[str, Any], block_bytes: int) -> bytes:
    return json.dumps({"fingerprint": fp, "block_bytes": block_bytes}, sort_keys=True).encode()


def prefix_size(fp: dict[str, Any], block_bytes: int) -> int:
    return len(MAGIC) + _U32.size * 2 + len(_header_bytes(fp, block_bytes)) + _COUNT.size


def record_size(block_bytes: int) -> int:
    return _RECORD_HEAD.size + block_bytes


def max_blocks(fp: dict[str, Any], block_bytes: int, bound: int) -> int:
    """How many blocks a snapshot of this fingerprint holds within `bound` bytes."""
    return max(0, (bound - prefix_size(fp, block_bytes)) // record_size(block_bytes))


@dataclasses.dataclass(frozen=True)
class SaveResult:
    path: Path
    blocks: int
    bytes: int


class SnapshotWriter:
    """One snapshot being written: `add` blocks (most recent first) until it says full, then `commit` (or
    `abort`). Never touches the previous snapshot before `commit` renames over it."""

    def __init__(self, directory: Path, fp: dict[str, Any], block_bytes: int, bound: int,
                 block_delay: Callable[[], None] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        remove_dead_temporaries(directory)
        self.directory = directory
        self.path = snapshot_path(directory, fp)
        self.block_bytes = block_bytes
        self.bound = bound
        self.max_blocks = max_blocks(fp, block_bytes, bound)
        self.blocks = 0
        self._block_delay = block_delay  # test hook: a slow write, to kill a save half-way
        fd, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.{os.getpid()}.", suffix=_TEMP_SUFFIX,
                                         dir=directory)
        self._temporary = Path(temporary)
        self._file = os.fdopen(fd, "wb")
        header = _header_bytes(fp, block_bytes)
        self._file.write(MAGIC + _U32.pack(len(header)) + header + _U32.pack(zlib.crc32(header)))
        self._count_offset = self._file.tell()
        self._file.write(_COUNT.pack(0))  # patched by `commit`

    @property
    def full(self) -> bool:
        return self.blocks >= self.max_blocks

    def add(self, block_hash: bytes, data: bytes | memoryview) -> bool:
        """Appends one block; False (nothing written) once the bound is reached."""
        if self.full:
            return False
        if len(block_hash) != HASH_BYTES or len(data) != self.block_bytes:
            raise ValueError(f"a block is {HASH_BYTES} hash bytes and {self.block_bytes} data bytes, got "
                             f"{len(block_hash)} and {len(data)}")
        self._file.write(_RECORD_HEAD.pack(block_hash, zlib.crc32(data)))
        self._file.write(data)
        self.blocks += 1
        if self._block_delay is not None:
            self._block_delay()
        return True

    def commit(self) -> SaveResult:
        """Makes the snapshot the current one (fsync, rename, fsync of the directory), then bounds the
        directory, this snapshot kept."""
        try:
            self._file.seek(self._count_offset)
            self._file.write(_COUNT.pack(self.blocks))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._temporary, self.path)
        except BaseException:
            self.abort()
            raise
        _fsync_directory(self.directory)
        size = self.path.stat().st_size
        enforce_bound(self.directory, self.bound, keep=self.path)
        return SaveResult(self.path, self.blocks, size)

    def abort(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            self._temporary.unlink()


def read_snapshot(directory: Path, fp: dict[str, Any], block_bytes: int,
                  max_blocks: int) -> Iterator[tuple[bytes, bytes]]:
    """The verified blocks (hash, data) of this fingerprint's snapshot, most recent first, at most
    `max_blocks`; nothing, with a log line, when the file is missing, torn or not this fingerprint's."""
    path = snapshot_path(directory, fp)
    remove_dead_temporaries(directory)
    file = _open_regular(path)
    if file is None:
        return
    with file:
        count = _verified_count(file, path, fp, block_bytes)
        if count is None:
            return
        record = _RECORD_HEAD.size
        for index in range(min(count, max_blocks)):
            block_hash, crc = _RECORD_HEAD.unpack(file.read(record))
            data = file.read(block_bytes)
            if zlib.crc32(data) != crc:
                logger.warning("kv snapshot %s: block %d fails its checksum; skipped", path.name, index)
                continue
            yield block_hash, data


def _open_regular(path: Path) -> BinaryIO | None:
    """The snapshot at `path` open for reading, or None (logged) where there is none or it is no regular
    file: opened without blocking, since a FIFO put there would hang the start on its open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        logger.info("kv snapshot: none for this model and layout in %s", path.parent)
        return None
    except OSError as e:
        return _skip(path, f"cannot be opened ({e})")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return _skip(path, "not a regular file")
    return os.fdopen(fd, "rb")


def _verified_count(file, path: Path, fp: dict[str, Any], block_bytes: int) -> int | None:
    """The block count of a file whose header is this fingerprint's and whose size matches it, else None."""
    expected = _header_bytes(fp, block_bytes)
    head = file.read(len(MAGIC) + _U32.size)
    if len(head) < len(MAGIC) + _U32.size or head[:len(MAGIC)] != MAGIC:
        return _skip(path, "not a gracelm kv snapshot (bad magic)")
    (header_len,) = _U32.unpack(head[len(MAGIC):])
    if header_len > 1 << 20:
        return _skip(path, "header length is implausible")
    header = file.read(header_len)
    crc = file.read(_U32.size)
    if len(crc) < _U32.size or _U32.unpack(crc)[0] != zlib.crc32(header):
        return _skip(path, "header fails its checksum")
    if header != expected:
        return _skip(path, f"written for another model, layout or format: {header[:300]!r}")
    raw = file.read(_COUNT.size)
    if len(raw) < _COUNT.size:
        return _skip(path, "truncated")
    (count,) = _COUNT.unpack(raw)
    size = os.fstat(file.fileno()).st_size
    if size != file.tell() + count * record_size(block_bytes):
        return _skip(path, f"{size} bytes where {count} blocks need "
                           f"{file.tell() + count * record_size(block_bytes)} (torn or truncated)")
    return count


def _skip(path: Path, why: str) -> None:
    logger.warning("kv snapshot %s skipped: %s", path, why)
    return None


def snapshot_files(directory: Path) -> list[Path]:
    """Every snapshot and temporary snapshot file of the directory (what the bound counts)."""
    return [p for p in directory.glob("kv-*" + SUFFIX)] + list(directory.glob(".kv-*" + _TEMP_SUFFIX))


def enforce_bound(directory: Path, bound: int, keep: Path) -> None:
    """Removes snapshot files, oldest first, until those left (`keep` included) fit in `bound` bytes."""
    total = keep.stat().st_size
    others = sorted((p for p in snapshot_files(directory) if p != keep), key=mtime, reverse=True)
    for path in others:  # newest first: each kept while it fits
        with contextlib.suppress(FileNotFoundError):
            size = path.stat().st_size
            if total + size <= bound:
                total += size
                continue
            path.unlink()
            logger.info("kv snapshot %s removed: over the --kv-cache-dir-size bound", path.name)


def remove_dead_temporaries(directory: Path) -> None:
    """Removes temporary files whose writer (the pid in the name) is gone: the leftovers of a kill -9."""
    for path in directory.glob(".kv-*" + _TEMP_SUFFIX):
        parts = path.name.split(".")
        pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None
        if pid is None or not pid_alive(pid):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                logger.info("kv snapshot: removed %s, left by a writer that died", path.name)


def pid_alive(pid: int) -> bool:
    """Whether a process of that pid runs (ours counts; one of another user's too)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True



def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
