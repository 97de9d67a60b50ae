"""Converted tokenizers, kept on disk: building one goes through transformers for a model directory
(importing it alone takes seconds) and builds a GGUF file's vocabulary and merges into a BPE model, while
its serialized form (`Tokenizer.to_dict`) loads with the `tokenizers` library in a fraction of that.

An entry is `cache_dir("tokenizers")/<content hash>-v<FORMAT_VERSION>.json`, keyed by the model files'
content hash (`file_hash.content_hash`), so a changed file never reuses an old entry. A hit imports no
transformers. An entry that cannot be read back (torn by hand, a format a bug wrote) is logged, deleted and
built again: the cache can only cost a rebuild, never a start. What is checked is the JSON and its keys: the
`tokenizers` object is built from the entry at its first use (`Tokenizer.backend`), and entries are written
whole (`write_atomic`), so only an entry edited into other valid JSON by hand could fail there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from gracelm.cache_dir import cache_dir, write_atomic
from gracelm.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Bump when `Tokenizer.to_dict` or the way a tokenizer is built changes what an entry holds.
FORMAT_VERSION = 1


def cached_tokenizer(model_hash: str, build: Callable[[], Tokenizer]) -> Tokenizer:
    """The tokenizer of the model whose content hash is `model_hash`: from the cache, else `build()`
    (then stored)."""
    path = entry_path(model_hash)
    tokenizer = _read(path)
    if tokenizer is not None:
        return tokenizer
    tokenizer = build()
    keep(model_hash, tokenizer)
    return tokenizer


def keep(model_hash: str, tokenizer: Tokenizer) -> None:
    """Writes the entry of the model's tokenizer; where the cache cannot be written, logs it: the tokenizer
    serves all the same, and is built again at the next start."""
    path = entry_path(model_hash)
    try:
        write_atomic(path, json.dumps(tokenizer.to_dict()).encode())
    except OSError as e:  # a read-only or full disk
        logger.warning("cannot keep the converted tokenizer in %s: %s", path, e)


def kept_tokenizer(model_hash: str) -> Tokenizer | None:
    """The cache's tokenizer of the model, or None where it has none that reads back; a damaged entry is
    left to `cached_tokenizer` to report and replace."""
    return _read(entry_path(model_hash), repair=False)


def entry_path(model_hash: str) -> Path:
    return cache_dir("tokenizers") / f"{model_hash}-v{FORMAT_VERSION}.json"


def _read(path: Path, repair: bool = True) -> Tokenizer | None:
    try:
        data = json.loads(path.read_bytes())
        return Tokenizer.from_dict(data)
    except FileNotFoundError:
        return None
    except Exception as e:  # whatever a damaged entry raises: json, a missing key
        if not repair:
            return None
        logger.warning("tokenizer cache entry %s is unreadable (%s: %s); building the tokenizer again",
                       path, type(e).__name__, e)
        path.unlink(missing_ok=True)
        return None
