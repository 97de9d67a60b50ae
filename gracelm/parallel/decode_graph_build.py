"""Gets rank 0's model its compiled decode steps (`model/decode_graph.py`: one for one sequence, one for 2
up to 64, `graph_batches`) without delaying the start: loaded from the cache when they are there (0.1 s
each, before the core says Ready), else compiled in a child process (`gracelm::compile`, niced, one
thread) while the engine serves eagerly, and each loaded between two steps once the child has written it
(one sequence's first).
A start that finds no package therefore serves at eager speed for a minute or two (the default model on
this project's machine: about 45 s, then 40 s more, with the attention a compiled op of its own); every
later start of the same model, torch and CPU is fast from its first step.

The child is a resource of the executor's ledger: a stop kills it (a compile is worth nothing half done;
its temporary file is removed by the next compile) and any compiler process it left. Its failure costs only
speed: it is logged, and the engine goes on eagerly. Where the graphs do not apply (`graph_applies`), nothing
is started."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
from tqdm import tqdm

from gracelm.config import EngineConfig
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.processes import ChildProcess, exit_process, start_process
from gracelm.model.decode_graph import DecodeGraph, compile_graph, graph_batches, graph_key, graph_path
from gracelm.model.file_hash import content_hash
from gracelm.model.llama import low_bit_layout
from gracelm.model.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)

COMPILER_ENTRY = "gracelm.parallel.decode_graph_build:compile_in_child"
_STOP_TIMEOUT_S = 5.0


def graph_applies(config: EngineConfig, loaded: LoadedModel, world_size: int) -> bool:
    """The graph is traced through the int4 kernels of one rank on the CPU, in the default computation (a
    model with int4 forms runs in bfloat16, or in float32 where bfloat16 is emulated)."""
    gate = loaded.model.model.int4_gate
    return (not config.enforce_eager and not config.deterministic and world_size == 1
            and loaded.device.type == "cpu" and gate is not None and gate.bound(False) >= 1)


class DecodeGraphBuild:
    """The compiled decode steps of the driver's model, one per `graph_batches` entry: those still to load are
    pending until the child has written them, or until it has ended without."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, ledger: Ledger) -> None:
        self.loaded = loaded
        self.block_size = config.block_size
        key = (content_hash(loaded.path), loaded.dtype, config.block_size)
        layout = low_bit_layout(loaded.model)
        self._pending = {rows: graph_path(graph_key(*key, rows, layout))
                         for rows in graph_batches(loaded.model)}
        self._load_written()
        self._child: ChildProcess | None = None
        if not self._pending:
            return
        missing = [(rows, str(path)) for rows, path in self._pending.items()]
        self._child = start_process("decode graph compiler", "gracelm::compile", COMPILER_ENTRY,
                                    (config, missing))
        logger.info("decode graph: compiling in the background (pid %d): %d graph(s); eager until each is "
                    "ready", self._child.pid, len(missing))
        ledger.acquire(ResourceKind.PROCESS, f"decode graph compiler (pid {self._child.pid})", self._stop,
                       timeout=_STOP_TIMEOUT_S + 1)

    def poll(self) -> None:
        """Loads each graph once the child has written it (called between steps: a stat per missing graph,
        a non-blocking wait)."""
        if not self._pending:
            return
        assert self._child is not None
        code = self._child.exitcode
        self._load_written()
        if self._pending and code is not None:
            logger.warning("decode graph: the compiler ended (%s); serving eagerly where no graph is loaded",
                           self._child.describe_exit())
            self._pending.clear()

    def _load_written(self) -> None:
        for rows, path in list(self._pending.items()):
            if not path.exists():
                continue
            del self._pending[rows]
            try:
                graph = DecodeGraph.load(path, rows, self.block_size)
            except Exception as e:  # a damaged package: rebuilt at the next start
                logger.warning("decode graph: cannot load %s (%s); removed", path, e)
                path.unlink(missing_ok=True)
                continue
            self.loaded.model.model.decode_graphs.append(graph)
            logger.info("decode graph loaded from %s: decode steps of %d to %d sequences run compiled", path,
                        rows.start, rows.stop - 1)

    def _stop(self) -> str:
        assert self._child is not None
        if self._child.exitcode is None:
            self._child.process.kill()  # it ignores SIGTERM, as every child does; nothing in it to save
        return self._child.stop(_STOP_TIMEOUT_S)


def compile_in_child(config: EngineConfig, missing: list[tuple[range, str]]) -> None:
    """The compiler process: loads the model as the engine core did (its conversions are cached by now) and
    writes each missing package (the graph of `rows` sequences at `path`), one sequence's first."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s")
    os.nice(10)  # the serving core comes first
    # torch.fx's interpreter makes a (disabled) tqdm bar, whose default lock is a multiprocessing semaphore:
    # registered with the resource tracker in a spawned process, and left to it by the quick exit below.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(1)
    # Before inductor reads its configuration: no pool of compile workers, and its own cache in gracelm's.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(missing[0][1]).parent / "inductor"))
    loaded = load_model(config.model, config.dtype, config.quantization)
    loaded.freeze()
    for rows, path in missing:
        compile_graph(loaded.model, config.block_size, rows, Path(path))
        logger.info("decode graph written to %s", path)
    # At once: the interpreter's teardown of torch and inductor took 26 s at nice 10 beside a busy core.
    exit_process(0)
