"""What a process made at start-up (modules, the model, the app, the tokenizer) lives until it exits: once it
serves, those objects are moved out of the cyclic garbage collector's reach (`gc.freeze`), so its full
collections walk only what serving made since.

Without it, a full collection walked every object start-up left: in the HTTP process it held the event loop
for tens of ms; in the engine core (torch's modules, the loaded model, the compiled graphs' runtime: 185,000
tracked objects with the default model) one takes 122 ms, a pause of every stream, and Python starts one
whenever the objects that survived two collections since the last one reach a quarter of those already
there. Frozen objects are never freed: start-up's few cyclic leftovers stay too (a collection first would
free them: 23 objects in the engine core, for those 122 ms before its first step).

The engine core's imports (torch's, then its own) run with the collector paused (`imports_uncollected`):
they make those objects, and while they grow Python collects them over and over, each full collection
walking all those made so far; a tenth of the imports' time went to it. A module's objects live as long as
the process, so they are frozen at once: the cyclic garbage the imports leave (a few thousand tuples,
cells and functions, under a MiB) stays with them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def imports_uncollected() -> Iterator[None]:
    """Imports with the cyclic collector paused, what they made frozen after them (see above)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def freeze_startup_objects() -> None:
    """Called once a process has finished starting, right before it serves."""
    gc.freeze()
