"""The engine-core process's entry: what the core can begin before it imports torch and the engine, which
takes seconds of one CPU, runs beside that import.

Here, the model's content hash (`file_hash.prefetch`): on a first start of a file it reads the whole file,
which otherwise the load would do after the import, before anything that is keyed by the hash (the
converted weights and tokenizer). On a later start the hash is a `stat` and the thread ends at once.

And on a first start of a model file, the memory its conversion will write (`model/prefaulted_memory.py`):
a page's first write costs a fault, which a thread takes on beside the import.

The import itself runs with Python's cyclic collector paused (`lifecycle/startup_objects.py`).
"""

from __future__ import annotations

from gracelm.config import EngineConfig
from gracelm.lifecycle.startup_objects import imports_uncollected
from gracelm.model import file_hash, prefaulted_memory
from gracelm.model.model_files import resolve_model_path


def run_engine_core(config: EngineConfig, *args: object) -> None:
    """`engine/core.py:run_engine_core` (the same arguments), the model's hash begun first."""
    try:
        path = resolve_model_path(config.model)
        file_hash.prefetch(path)
        if path.is_file():
            prefaulted_memory.begin(path)
    except (ValueError, OSError):  # no such model, or an unreadable one: the load says so
        pass
    with imports_uncollected():
        from gracelm.engine.core import run_engine_core as run
    run(config, *args)
