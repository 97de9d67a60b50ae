"""Gets rank 0's model its compiled decode step (`model/decode_graph.py`) without delaying the start: loaded
from the cache when it is there (0.1 s, before the core says Ready), else compiled in a child process
(`gracelm::compile`, niced, one thread) while the engine serves eagerly, and loaded between two steps once
the child has written it. A start that finds no package therefore serves at eager speed for about a minute
(the default model on this project's machine); every later start of the same model, torch and CPU is fast
from its first step.

The child is a resource of the executor's ledger: a stop kills it (a compile is worth nothing half done;
its temporary file is removed by the next compile) and any compiler process it left. Its failure costs only
speed: it is logged, and the engine goes on eagerly. Where the graph does not apply (`applies`), nothing
is started.
"""

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
from gracelm.model.decode_graph import DecodeGraph, compile_graph, graph_key, graph_path
from gracelm.model.file_hash import content_hash
from gracelm.model.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)

COMPILER_ENTRY = "gracelm.parallel.decode_graph_build:compile_in_child"
_STOP_TIMEOUT_S = 5.0


def applies(config: EngineConfig, loaded: LoadedModel, world_size: int) -> bool:
    """The graph is traced through the int4 kernels of one rank on the CPU, in the default computation."""
    gate = loaded.model.model.int4_gate
    return (not config.enforce_eager and not config.deterministic and world_size == 1
            and loaded.device.type == "cpu" and loaded.dtype == torch.bfloat16
            and gate is not None and gate.admits(1))


class DecodeGraphBuild:
    """The compiled decode step of the driver's model: `state` is "loaded", "compiling", "failed" or "off"."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, ledger: Ledger) -> None:
        self.config = config
        self.loaded = loaded
        self.state = "off"
        self._child: ChildProcess | None = None
        self.path = graph_path(graph_key(content_hash(loaded.path), loaded.dtype, config.block_size))
        if self.path.exists():
            self._load()
            return
        self._child = start_process("decode graph compiler", "gracelm::compile", COMPILER_ENTRY,
                                    (config, str(self.path)))
        self.state = "compiling"
        logger.info("decode graph: compiling in the background (pid %d); eager until it is ready",
                    self._child.pid)
        ledger.acquire(ResourceKind.PROCESS, f"decode graph compiler (pid {self._child.pid})", self._stop,
                       timeout=_STOP_TIMEOUT_S + 1)

    def poll(self) -> None:
        """Loads the graph once the child has written it (called between steps; a non-blocking wait)."""
        if self.state != "compiling":
            return
        assert self._child is not None
        code = self._child.exitcode
        if code is None:
            return
        if code == 0 and self.path.exists():
            self._load()
        else:
            self.state = "failed"
            logger.warning("decode graph: the compiler ended (%s); serving eagerly",
                           self._child.describe_exit())

    def _load(self) -> None:
        try:
            graph = DecodeGraph.load(self.path)
        except Exception as e:  # a damaged package: rebuilt at the next start
            logger.warning("decode graph: cannot load %s (%s); removed, serving eagerly", self.path, e)
            self.path.unlink(missing_ok=True)
            self.state = "failed"
            return
        self.loaded.model.model.decode_graph = graph
        self.state = "loaded"
        logger.info("decode graph loaded from %s: decode steps of one sequence run compiled", self.path)

    def _stop(self) -> str:
        assert self._child is not None
        if self._child.exitcode is None:
            self._child.process.kill()  # it ignores SIGTERM, as every child does; nothing in it to save
        return self._child.stop(_STOP_TIMEOUT_S)


def compile_in_child(config: EngineConfig, path: str) -> None:
    """The compiler process: loads the model as the engine core did (its conversions are cached by now) and
    writes the package."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s")
    os.nice(10)  # the serving core comes first
    # torch.fx's interpreter makes a (disabled) tqdm bar, whose default lock is a multiprocessing semaphore:
    # registered with the resource tracker in a spawned process, and left to it by the quick exit below.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(1)
    # Before inductor reads its configuration: no pool of compile workers, and its own cache in gracelm's.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(path).parent / "inductor"))
    loaded = load_model(config.model, config.dtype, config.quantization)
    loaded.freeze()
    compile_graph(loaded.model, config.block_size, Path(path))
    logger.info("decode graph written to %s", path)
    # At once: the interpreter's teardown of torch and inductor took 26 s at nice 10 beside a busy core, and
    # the core loads the package only once this process has exited.
    exit_process(0)
