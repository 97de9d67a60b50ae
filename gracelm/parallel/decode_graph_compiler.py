"""The decode graph compiler's process (`gracelm::compile`, started by `decode_graph_build.py`): loads the
model as the engine core did (its conversions are cached by now) and writes each package the cache lacks,
one sequence's first.

It runs only on CPU time that serving leaves idle from its first instruction: this module imports nothing
heavy, and `compile_in_child` lowers the process's priority before it imports torch, inductor and the
model's loader. Imported at normal priority, torch alone is seconds of CPU, which a cold start's warm-up and
HTTP start would share with it.
"""

from __future__ import annotations

import logging
import os

from gracelm.config import EngineConfig


def compile_in_child(config: EngineConfig) -> None:
    """The compiler process's entry."""
    _serving_first()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s")
    import threading

    import torch
    from tqdm import tqdm

    import gracelm.cpu_features as cpu_features
    from gracelm.lifecycle.processes import exit_process
    from gracelm.model.decode_graph import compile_graph, inductor_cache
    from gracelm.model.loader import load_model
    from gracelm.parallel.decode_graph_build import graph_files
    from gracelm.parallel.worker import dense_weights_for

    # torch.fx's interpreter makes a (disabled) tqdm bar, whose default lock is a multiprocessing semaphore:
    # registered with the resource tracker in a spawned process, and left to it by the quick exit below.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(1)
    # Before inductor reads its configuration: no pool of compile workers, and its own cache in gracelm's.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache()))
    cpu_features.mask(config.mask_cpu_features)
    loaded = load_model(config.model, config.dtype, config.quantization,
                        dense_weights=dense_weights_for(config))
    loaded.freeze()
    loaded.model.model.decode_attention = config.decode_attention
    for rows, path in graph_files(config, loaded).items():
        if not path.exists():
            compile_graph(loaded.model, config.block_size, rows, path)
            logging.getLogger(__name__).info("decode graph written to %s", path)
    # At once: the interpreter's teardown of torch and inductor, at low priority beside a busy core, takes
    # many seconds for nothing.
    exit_process(0)


def _serving_first() -> None:
    """Runs this process (and the compilers it starts, which inherit it) only on CPU time that serving
    leaves idle (SCHED_IDLE): the compile costs the requests beside it no CPU time, only what they share
    besides (caches, memory bandwidth), and goes on between their steps. Where the policy is refused, the
    lowest nice value."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
