"""What a process made at start-up (modules, the model, the app, the tokenizer) lives until it exits: once it
serves, those objects are moved out of the cyclic garbage collector's reach (`gc.freeze`), so its full
collections walk only what serving made since.

Without it, a full collection walked every object start-up left: in the HTTP process it held the event loop
for tens of ms; in the engine core (torch's modules, the loaded model, the compiled graphs' runtime: 185,000
tracked objects with the default model) one takes 122 ms, a pause of every stream, and Python starts one
whenever the objects that survived two collections since the last one reach a quarter of those already
there. Frozen objects are never freed: start-up's few cyclic leftovers stay too (a collection first would
free them: 23 objects in the engine core, for those 122 ms before its first step).

The collector is paused while a start makes most of those objects: as they grow they set off collection
after collection, each full one walking every object made so far. In the engine core that is its imports
(`imports_uncollected`: torch's and its own; a tenth of their time went to it); in the HTTP process its
whole start (`pause_collection` until `freeze_startup_objects`: its imports, the tokenizer's vocabulary,
the routes' schemas). The cyclic garbage made meanwhile (a few thousand small objects, under a MiB in
each process) is frozen with the rest.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def pause_collection() -> None:
    """Pauses the cyclic collector until `freeze_startup_objects`."""
    gc.disable()


@contextlib.contextmanager
def imports_uncollected() -> Iterator[None]:
    """Imports with the cyclic collector paused, what they made frozen after them."""
    pause_collection()
    try:
        yield
    finally:
        freeze_startup_objects()


def freeze_startup_objects() -> None:
    """Called once a process has finished starting, right before it serves; the collector runs from then on
    (again, after `pause_collection`)."""
    gc.freeze()
    gc.enable()
