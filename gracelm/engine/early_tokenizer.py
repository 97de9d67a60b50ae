"""The frontend's tokenizer, got in a thread while the engine core starts (docs/architecture.md, "Start-up").

The core's first second is its own imports, on one CPU; meanwhile a thread here gets the model's tokenizer:
from the cache where the model's hash and its tokenizer are kept, else, for a GGUF file whose tokenizer the
`tokenizers` library builds alone (`gguf_tokenizer.builds_alone`), from the file's metadata. Then, at Ready:

- For such a file the core builds none before Ready, and sends none (`Ready.tokenizer` None): the one got
  here is the model's, where it is of the file the core loaded: the file unchanged (its device, inode, size
  and modification time) since the thread read it, and its content hash the core's. A tokenizer built here
  is kept in the cache, for the next starts and for the core's own, which it builds only where a request
  needs it: by the thread, under the hash the core's start keeps beside its imports, or, where that was not
  known yet, beside the first requests. A file replaced meanwhile is read once more; one that changes again
  fails the start.
- Otherwise (a model directory, a GGUF kind only transformers builds) the core sends its tokenizer, and the
  one got here is taken only where it is that one. Transformers is never imported here: it takes seconds
  and hundreds of MB of the HTTP process's memory.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gracelm.engine import messages as msg
from gracelm.lifecycle.signals import HANDLED_SIGNALS
from gracelm.model.file_hash import content_hash, known_hash
from gracelm.model.model_files import resolve_model_path

if TYPE_CHECKING:
    from gracelm.model.tokenizer import Tokenizer

# What tells a file's versions apart without reading it, as the hash index does (`file_hash.file_hash`).
Stamp = tuple[int, int, int, int]


@dataclass(frozen=True)
class Got:
    tokenizer: Tokenizer | None
    stamp: Stamp | None  # the file's while it was read; None where it changed meanwhile
    # The content hash whose cache entry it is (read, or kept here); None where the hash was not known yet.
    model_hash: str | None


def begin(model: str | None) -> Future[Got]:
    """`read(model)` in a thread; the core's start is not delayed by it (signals stay the main thread's)."""
    future: Future[Got] = Future()

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
        try:
            future.set_result(read(model))
        except BaseException as e:  # noqa: BLE001 - the core reports what is wrong with the model
            future.set_exception(e)

    threading.Thread(target=run, name="early-tokenizer", daemon=True).start()
    return future


def read(model: str | None, cached: bool = True) -> Got:
    """The model's tokenizer from the cache, where its hash is kept (`cached`), else built from a GGUF file
    where the `tokenizers` library builds it alone, and kept where the core has hashed the file by then."""
    from gracelm.model import tokenizer_cache
    from gracelm.model.tokenizer import Tokenizer

    path = resolve_model_path(model)
    stamp = _stamp(path)
    model_hash = known_hash(path) if cached else None
    tokenizer = None if model_hash is None else tokenizer_cache.kept_tokenizer(model_hash)
    if tokenizer is None:
        model_hash = None
        if path.is_file():
            tokenizer = Tokenizer.from_gguf_without_transformers(path)
        if tokenizer is not None:
            model_hash = known_hash(path)  # kept by the core's hash of the file, beside its imports
    unchanged = stamp is not None and _stamp(path) == stamp  # the hash, too, is of what was read
    if tokenizer is None:
        return Got(None, None, None)
    if unchanged and model_hash is not None and not tokenizer_cache.entry_path(model_hash).exists():
        tokenizer_cache.keep(model_hash, tokenizer)  # here, not beside the first requests
    # Built and serialized here, beside the core's start, not after Ready: the server hands its serialized
    # form to the grammar checker, and keeps it.
    tokenizer.backend  # noqa: B018
    tokenizer.to_dict()
    return Got(tokenizer, stamp if unchanged else None, model_hash if unchanged else None)


def take(ready: msg.Ready, model: str | None, early: Future[Got]) -> Tokenizer:
    """The model's tokenizer, once the core is Ready: see the module's docstring."""
    from gracelm.model.tokenizer import Tokenizer
    from gracelm.model.tokenizer_cache import keep

    try:
        got: Got | None = early.result()
    except Exception:  # noqa: BLE001 - what the core reported of the model is what counts
        got = None
    if ready.tokenizer is not None:
        if got is not None and got.tokenizer is not None and got.tokenizer.to_dict() == ready.tokenizer:
            return got.tokenizer
        return Tokenizer.from_dict(ready.tokenizer)
    path = resolve_model_path(model)
    if got is None or not _of_model(got, path, ready.model_hash):
        got = read(model, cached=False)
        if not _of_model(got, path, ready.model_hash):
            raise RuntimeError(f"the model file {path} changed while the engine core loaded it: the "
                               f"tokenizer read from it is not the loaded model's")
    assert got.tokenizer is not None
    if got.model_hash is None:  # built before the core's hash was known: kept beside the first requests
        threading.Thread(target=keep, args=(ready.model_hash, got.tokenizer), name="keep-tokenizer").start()
    return got.tokenizer


def _of_model(got: Got, path: Path, model_hash: str) -> bool:
    """Whether `got` is the tokenizer of the file the core loaded, whose hash is `model_hash`: the cache's
    entry of that hash, or built from the file, unchanged since and of that hash (kept by the core: a
    `stat`)."""
    if got.tokenizer is None or got.stamp is None or got.stamp != _stamp(path):
        return False
    return (got.model_hash or content_hash(path)) == model_hash


def _stamp(path: Path) -> Stamp | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns
