"""Reading the GGUF container: metadata, the tensor table, and each tensor's raw bytes.

`gguf.GGUFReader` builds a numpy view for every string of the vocabulary and merge table, which costs
over 3 s for a 49k-token model before a single weight is read. The container format is simple, so this
module parses it with `struct` (a few tens of milliseconds) and leaves dequantization to `gguf.quants`.
Every read is bounds-checked, so a truncated or corrupt file fails with a message naming the path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from gracelm.arith import cdiv

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file, or it is corrupt or truncated."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # torch order: the fastest-moving dimension last
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int

    def part(self, name: str, start: int, shape: tuple[int, ...]) -> GGUFTensorInfo:
        """A part of this tensor as an entry of its own: `shape`'s elements from index `start` of its first
        dimension on (rows of a fused matrix; one expert of a stack, `shape` then without that dimension).
        Its bytes are a range of this one's, since each index of the first dimension is whole blocks."""
        per_index = self.nbytes // self.shape[0]
        return replace(self, name=name, shape=shape, offset=self.offset + start * per_index,
                       nbytes=self.nbytes * prod(shape) // prod(self.shape))


@dataclass
class GGUFFile:
    """A GGUF file's metadata and tensor table; tensor bytes are read on demand."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    def raw_tensor(self, info: GGUFTensorInfo) -> np.ndarray:
        """The stored bytes of a tensor as uint8, shaped (*rows, bytes per row) as `gguf.quants` expects."""
        # A plain read, not a memory map: gguf.quants slices its input into many small views, and each
        # view of an np.memmap pays for the subclass's bookkeeping (several times the dequantization cost).
        return _rows(np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset), info)

    @contextlib.contextmanager
    def mapped_tensors(self) -> Iterator[Callable[[GGUFTensorInfo], np.ndarray]]:
        """What gives `raw_tensor`'s arrays as read-only views of the file mapped into memory, no copy (the
        page cache's own pages): for a reader that takes each byte once, as the packer does. The views are
        valid inside the `with` only: its end unmaps the file, and raises BufferError if a view is still
        held; after an error the mapping goes with the last view."""
        with open(self.path, "rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        yield lambda info: _rows(np.frombuffer(mapping, np.uint8, info.nbytes, info.offset), info)
        mapping.close()


def _rows(data: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """A tensor's stored bytes shaped (*rows, bytes per row)."""
    block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
    return data.reshape(*info.shape[:-1], info.shape[-1] // block_size * type_size)


def read_gguf(path: str | Path, string_arrays: bool = True) -> GGUFFile:
    """Parses the metadata and the tensor table of the GGUF file at `path`. Without `string_arrays`, those
    (the vocabulary, the merges: most of the parsing) are skipped, their values None."""
    path = Path(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise GGUFFormatError(f"{path} is not a GGUF file: it is too short to hold a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, _Cursor(buf, path, string_arrays))


class _Cursor:
    """Sequential little-endian reads over the mapped file, each checked against its end."""

    def __init__(self, buf: mmap.mmap, path: Path, string_arrays: bool = True):
        self.buf = buf
        self.path = path
        self.pos = 0
        self.string_arrays = string_arrays  # else skipped (`read_gguf`)

    def take(self, n: int) -> int:
        """Advances over n bytes and returns where they start."""
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise GGUFFormatError(
                f"{self.path} is truncated or corrupt: a read of {n} bytes at offset {start} runs past "
                f"the end of the file ({len(self.buf)} bytes)"
            )
        self.pos += n
        return start

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.take(n)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{self.path} is corrupt: invalid UTF-8 string at offset {start}") from e

    def strings(self, count: int) -> list[str] | None:
        """A string array: a vocabulary or a merge table, tens of thousands of items, so a tight loop."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        read_length = _U64.unpack_from
        items, keep, whole = [], self.string_arrays, False
        for _ in range(count):
            if pos + 8 > end:
                break
            (n,) = read_length(buf, pos)
            if keep:
                items.append(buf[pos + 8 : pos + 8 + n])
            pos += 8 + n
        else:
            whole = pos <= end
        if not whole:
            raise GGUFFormatError(f"{self.path} is truncated or corrupt: a string array runs past its end")
        self.pos = pos
        if not keep:
            return None
        try:
            return [item.decode("utf-8") for item in items]
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{self.path} is corrupt: invalid UTF-8 in a string array") from e

    def value(self, value_type: int) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise GGUFFormatError(f"{self.path} is corrupt: unknown metadata value type {value_type}")
        return self.unpack(fmt)

    def array(self) -> Any:
        item_type = self.unpack("<I")
        count = self.unpack("<Q")
        if item_type == GGUFValueType.STRING:
            return self.strings(count)
        if item_type == GGUFValueType.ARRAY:
            return [self.array() for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(item_type)
        if fmt is None:
            raise GGUFFormatError(f"{self.path} is corrupt: unknown array item type {item_type}")
        # Token types and scores are long numeric arrays: read them in one go, not item by item.
        start = self.take(count * struct.calcsize(fmt))
        return np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=start).tolist()


def _parse(path: Path, cur: _Cursor) -> GGUFFile:
    if cur.buf[:4] != _MAGIC:
        raise GGUFFormatError(f"{path} is not a GGUF file: it does not start with the GGUF magic bytes")
    cur.take(4)
    version = cur.unpack("<I")
    if version not in _VERSIONS:
        raise GGUFFormatError(
            f"{path} has GGUF version {version}; only versions {_VERSIONS} (little-endian) are readable"
        )
    tensor_count = cur.unpack("<Q")
    kv_count = cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    table = [_tensor_entry(cur) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = cdiv(cur.pos, alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, rel_offset in table:
        info = _tensor_info(path, name, shape, ggml_type, data_start + rel_offset)
        if info.offset + info.nbytes > len(cur.buf):
            raise GGUFFormatError(
                f"{path} is truncated: tensor {name} ends at byte {info.offset + info.nbytes} "
                f"but the file has {len(cur.buf)} bytes"
            )
        tensors[name] = info
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


def _tensor_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.unpack("<I")
    if n_dims > 8:
        raise GGUFFormatError(f"{cur.path} is corrupt: tensor {name} claims {n_dims} dimensions")
    dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
    ggml_type = cur.unpack("<I")
    offset = cur.unpack("<Q")
    # GGUF lists dimensions fastest-moving first; torch the other way round.
    return name, tuple(reversed(dims)), ggml_type, offset


def _tensor_info(
    path: Path, name: str, shape: tuple[int, ...], ggml_type: int, offset: int
) -> GGUFTensorInfo:
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError as e:
        raise GGUFFormatError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from e
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block_size:
        raise GGUFFormatError(
            f"{path} is corrupt: tensor {name} of type {qtype.name} has shape {shape}, whose last "
            f"dimension is not a multiple of the block size {block_size}"
        )
    nbytes = prod(shape) // block_size * type_size
    return GGUFTensorInfo(name=name, shape=shape, ggml_type=qtype, offset=offset, nbytes=nbytes)
