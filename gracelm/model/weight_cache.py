"""Converted weights, kept on disk: a GGUF file's quantized tensors are dequantized (and llama.cpp's rotary
layout undone) once, then stored under Hugging Face names in the target dtype as one safetensors file, which
later starts map into memory instead of converting again (the pages come from the page cache, and only
those the model touches are read).

An entry is `cache_dir("weights")/<content hash>-<dtype>-v<FORMAT_VERSION>.safetensors`. A file safetensors
refuses (truncated, a torn header) or whose tensors are not those expected (names, shapes, dtype) is
logged, deleted and converted again; a start never fails on the cache. safetensors holds no checksum of the
data, and reading the whole file to check one would cost what the cache saves: a bit flipped inside a
tensor is not detected, as with any safetensors checkpoint.

Entries are written atomically (`write_atomic`) and never modified in place, so a mapped file stays valid
even if another process replaces or prunes it. The folder keeps the `MAX_ENTRIES` most recently used
entries (a hit refreshes an entry's modification time); older ones, and entries of other format versions,
are deleted when a new entry is written. Delete the folder to reclaim the space at any time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from gracelm.cache_dir import cache_dir, write_atomic

logger = logging.getLogger(__name__)

# Bump when the conversion changes what it produces (names, layout, dequantization).
FORMAT_VERSION = 1
# Converted models kept: with a few models in turn, each still starts warm; the float32 default model's
# entry is 0.5 GB.
MAX_ENTRIES = 4
_SUFFIX = ".safetensors"
# A writer's temporary file (`write_atomic`) older than this was left by a killed writer.
_ABANDONED_AFTER_S = 3600.0

Shapes = dict[str, tuple[int, ...]]


def cached_weights(model_hash: str, dtype: torch.dtype, shapes: Shapes,
                   convert: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The converted weights of the model whose content hash is `model_hash`, in `dtype`, named and shaped
    as `shapes` says: mapped from the cache, else `convert()`ed (then stored)."""
    path = entry_path(model_hash, dtype)
    weights = _read(path, dtype, shapes)
    if weights is not None:
        with contextlib.suppress(OSError):  # a read-only cache still serves its entries
            os.utime(path)  # most recently used: the last to be pruned
        return weights
    weights = convert()
    try:
        write_atomic(path, save(weights))
    except OSError as e:  # a read-only or full disk: serve anyway, convert again next time
        logger.warning("cannot keep the converted weights in %s: %s", path, e)
        return weights
    _prune(path.parent)
    return weights


def entry_path(model_hash: str, dtype: torch.dtype) -> Path:
    dtype_name = str(dtype).removeprefix("torch.")
    return cache_dir("weights") / f"{model_hash}-{dtype_name}-v{FORMAT_VERSION}{_SUFFIX}"


def _read(path: Path, dtype: torch.dtype, shapes: Shapes) -> dict[str, torch.Tensor] | None:
    if not path.is_file():
        return None
    try:
        weights = load_file(path)
    except (SafetensorError, OSError) as e:
        problem = f"unreadable ({e})"
    else:
        problem = _mismatch(weights, dtype, shapes)
        if problem is None:
            return weights
    logger.warning("converted-weights cache entry %s is %s; converting the weights again", path, problem)
    path.unlink(missing_ok=True)
    return None


def _mismatch(weights: dict[str, torch.Tensor], dtype: torch.dtype, shapes: Shapes) -> str | None:
    """What makes `weights` not the expected tensors, or None."""
    if weights.keys() != shapes.keys():
        return f"not of this model ({len(weights)} tensors, {len(shapes)} expected)"
    for name, tensor in weights.items():
        if tuple(tensor.shape) != shapes[name] or tensor.dtype != dtype:
            return f"not of this model ({name} is {tensor.dtype} {list(tensor.shape)})"
    return None


def _prune(folder: Path) -> None:
    """Keeps the `MAX_ENTRIES` most recently used entries of the current format version; removes the
    temporary files of writers killed mid-write."""
    current = f"-v{FORMAT_VERSION}{_SUFFIX}"
    entries = [p for p in folder.iterdir() if p.suffix == _SUFFIX and not p.name.startswith(".")]
    abandoned = [p for p in folder.iterdir()
                 if p.name.startswith(".") and time.time() - _mtime(p) > _ABANDONED_AFTER_S]
    stale = abandoned + [p for p in entries if not p.name.endswith(current)]
    kept = sorted((p for p in entries if p.name.endswith(current)), key=_mtime, reverse=True)
    for path in stale + kept[MAX_ENTRIES:]:
        logger.info("weights cache: removing %s", path.name)
        path.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # pruned by another process meanwhile
        return 0.0
