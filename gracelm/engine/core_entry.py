"""The engine-core process's entry: what the core can begin before it imports torch and the engine, which
takes seconds of one CPU, runs beside that import.

Here, the model's content hash (`file_hash.prefetch`): on a first start of a file it reads the whole file,
which otherwise the load would do after the import, before anything that is keyed by the hash (the
converted weights and tokenizer). On a later start the hash is a `stat` and the thread ends at once.
"""

from __future__ import annotations

from gracelm.config import EngineConfig
from gracelm.model import file_hash
from gracelm.model.model_files import resolve_model_path


def run_engine_core(config: EngineConfig, *args: object) -> None:
    """`engine/core.py:run_engine_core` (the same arguments), the model's hash begun first."""
    try:
        file_hash.prefetch(resolve_model_path(config.model))
    except (ValueError, OSError):  # no such model, or an unreadable one: the load says so
        pass
    from gracelm.engine.core import run_engine_core as run

    run(config, *args)
