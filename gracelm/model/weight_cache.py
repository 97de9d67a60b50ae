"""Converted weights, kept on disk: a GGUF file's quantized tensors are dequantized (and llama.cpp's rotary
layout undone) once, then stored under Hugging Face names in the target dtype as one safetensors file, which
later starts map into memory instead of converting again (the pages come from the page cache, and only
those the model touches are read). A file's 4-bit blocks in the int4 kernel's form (`gguf_int4.py`) are
kept the same way, in an entry of their own.

An entry is `cache_dir("weights")/<content hash>-<kind>-v<FORMAT_VERSION>.safetensors`, the kind being the
dtype of dense weights (`bfloat16`; `bfloat16-beside-blocks` where the matrices of low-bit forms have no
dense copy: the other tensors only) or the low-bit form's layout (`blocks-1`, `int4-<layout>`: the latter
differs by CPU kind). A file safetensors refuses (truncated, a torn header) or whose tensors are not those
expected (names, shapes, dtypes) is logged, deleted and converted again; a start never fails on the cache.
safetensors holds no checksum of the data, and reading the whole file to check one would cost what the cache
saves: a bit flipped inside a tensor is not detected, as with any safetensors checkpoint.

A cold start converts into memory and serves the weights from there, while a thread writes the entry from
them (`entry_keeper.py`: a process that misses an entry another is writing waits for it). Where the cache
cannot be written (a read-only or full disk) the weights are served all the same, and converted again at
the next start.

Entries are written atomically (`write_atomic`) and never modified once written, so a mapped file stays valid
even if another process replaces or prunes it. The folder keeps the `MAX_ENTRIES` most recently used
entries (a hit refreshes an entry's modification time); older ones, and entries of other format versions,
are deleted when a new entry is written. Delete the folder to reclaim the space at any time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gracelm.cache_dir import cache_dir, mtime
from gracelm.model import prefaulted_memory
from gracelm.model.entry_keeper import Claim, keep
from gracelm.startup_timeline import mark

logger = logging.getLogger(__name__)

# Bump when the conversion changes what it produces (names, layout, dequantization). 2: int4 entries; 3:
# low-bit matrices stacked as the model stacks them.
FORMAT_VERSION = 3
# Entries kept: with a few models in turn, each still starts warm. A 4-bit GGUF file served in bfloat16 has
# two (the default model's: 270 MB dense, 80 MB int4); the float32 default model's dense entry is 0.5 GB.
MAX_ENTRIES = 6
_SUFFIX = ".safetensors"
# A writer's temporary file (`write_atomic`) older than this was left by a killed writer.
_ABANDONED_AFTER_S = 3600.0

# Each tensor's shape and dtype.
Expected = dict[str, tuple[tuple[int, ...], torch.dtype]]
# What converts a model's weights: writes every tensor of `Expected` into the tensors it is given, of its
# names, shapes and dtypes, whatever they held before.
Fill = Callable[[dict[str, torch.Tensor]], None]

# safetensors' names of the dtypes an entry may hold.
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                torch.uint8: "U8", torch.bool: "BOOL"}


def cached_tensors(model_hash: str, kind: torch.dtype | str, expected: Expected, fill: Fill
                   ) -> dict[str, torch.Tensor]:
    """The entry `kind` of the model whose content hash is `model_hash`, its tensors as `expected`: mapped
    from the cache, else converted by `fill` into memory, served from there and kept (`entry_keeper.py`). A
    process that finds another keeping the entry waits for it, then maps it."""
    path = entry_path(model_hash, kind)
    weights = _read(path, expected)
    if weights is None:
        claim = Claim.wait(path)
        weights = _read(path, expected)  # kept meanwhile by the claim's last holder
        if weights is None:
            return _converted(path, expected, fill, claim)
        if claim is not None:
            claim.release()
    with contextlib.suppress(OSError):  # a read-only cache still serves its entries
        os.utime(path)  # most recently used: the last to be pruned
    mark("read")
    return weights


def _converted(path: Path, expected: Expected, fill: Fill, claim: Claim | None) -> dict[str, torch.Tensor]:
    """The tensors converted into memory, and kept as the entry `path` where `claim` gives this process the
    right to (None: another process is keeping it)."""
    try:
        weights = _filled(expected, fill)
    except BaseException:
        if claim is not None:
            claim.release()
        raise
    mark("repack")
    if claim is not None:
        keep(path, safetensors_header(expected), weights, claim, functools.partial(_prune, path.parent))
    return weights


def safetensors_header(expected: Expected) -> tuple[bytes, dict[str, int]]:
    """The header of a safetensors file of `expected`'s tensors (https://github.com/huggingface/safetensors),
    and where each tensor's bytes begin after it. The format: an 8-byte little-endian length N, then N bytes
    of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}}, offsets into the data that follows the
    header, whose tensors tile it without gaps. The JSON is padded with spaces to a multiple of 8 bytes, and
    the larger elements come first, so that each tensor is aligned to its element's size."""
    order = sorted(expected, key=lambda name: (-expected[name][1].itemsize, name))
    tensors, begins, begin = {}, {}, 0
    for name in order:
        shape, dtype = expected[name]
        end = begin + math.prod(shape) * dtype.itemsize
        tensors[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
        begins[name], begin = begin, end
    text = json.dumps(tensors, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    header = struct.pack("<Q", len(text)) + text
    return header, {name: len(header) + begin for name, begin in begins.items()}


def _filled(expected: Expected, fill: Fill) -> dict[str, torch.Tensor]:
    """The tensors converted into memory of their own: written ahead of the load where it was
    (`prefaulted_memory`)."""
    tensors = {name: _new(shape, dtype) for name, (shape, dtype) in expected.items()}
    fill(tensors)
    return tensors


def _new(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    taken = prefaulted_memory.take(shape, dtype)
    return taken if taken is not None else torch.empty(shape, dtype=dtype)


def entry_path(model_hash: str, kind: torch.dtype | str) -> Path:
    """The entry of dense weights of a dtype, or of another kind (`int4-<layout>`)."""
    name = kind if isinstance(kind, str) else str(kind).removeprefix("torch.")
    return cache_dir("weights") / f"{model_hash}-{name}-v{FORMAT_VERSION}{_SUFFIX}"


def _read(path: Path, expected: Expected) -> dict[str, torch.Tensor] | None:
    if not path.is_file():
        return None
    try:
        weights = load_file(path)
    except (SafetensorError, OSError) as e:
        problem = f"unreadable ({e})"
    else:
        problem = _mismatch(weights, expected)
        if problem is None:
            return weights
    logger.warning("converted-weights cache entry %s is %s; converting the weights again", path, problem)
    path.unlink(missing_ok=True)
    return None


def _mismatch(weights: dict[str, torch.Tensor], expected: Expected) -> str | None:
    """What makes `weights` not the expected tensors, or None."""
    if weights.keys() != expected.keys():
        return f"not of this model ({len(weights)} tensors, {len(expected)} expected)"
    for name, tensor in weights.items():
        if (tuple(tensor.shape), tensor.dtype) != expected[name]:
            return f"not of this model ({name} is {tensor.dtype} {list(tensor.shape)})"
    return None


def _prune(folder: Path) -> None:
    """Keeps the `MAX_ENTRIES` most recently used entries of the current format version; removes the
    temporary files of writers killed mid-write."""
    current = f"-v{FORMAT_VERSION}{_SUFFIX}"
    entries = [p for p in folder.iterdir() if p.suffix == _SUFFIX and not p.name.startswith(".")]
    abandoned = [p for p in folder.iterdir()
                 if p.name.startswith(".") and time.time() - mtime(p) > _ABANDONED_AFTER_S]
    stale = abandoned + [p for p in entries if not p.name.endswith(current)]
    kept = sorted((p for p in entries if p.name.endswith(current)), key=mtime, reverse=True)
    for path in stale + kept[MAX_ENTRIES:]:
        logger.info("weights cache: removing %s", path.name)
        path.unlink(missing_ok=True)

