"""Gets rank 0's model its compiled decode steps (`model/decode_graph.py`: one for one sequence, one for 2
up to 64, `graph_batches`) without delaying the start: loaded from the cache when they are there, else
compiled in a child process (`gracelm::compile`, one thread, at idle priority from its first instruction:
`decode_graph_compiler.py`) while the engine serves. Either way a graph serves only once it is loaded and
checked, which the core does after it says Ready, one graph at a time, while it is idle or between two
steps (`poll`); until then steps run eagerly, as the warm-up did. A stop before the end keeps the graphs
written: the next start compiles only the others, and finds in inductor's cache the kernels it had compiled.
A start that finds no package therefore serves at eager speed until the compile is done (minutes); every
later start of the same model, torch and CPU serves compiled once its graphs are checked.

Each graph proves itself before it serves (`model/decode_graph_check.py`). A graph that cannot be loaded or
fails its check, a compiler that fails, and a compiled step that raises while serving (`LlamaModel`) cost
only speed: each is logged, `status()` says so on /metrics, and the engine serves those steps eagerly.

The child is a resource of the executor's ledger: a stop kills it (a compile is worth nothing half done;
its temporary file is removed by the next compile) and any compiler process it left. Where the graphs do
not apply (`graph_applies`), nothing is started."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from gracelm.config import EngineConfig
from gracelm.lifecycle.faults import faults
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.processes import ChildProcess, start_process
from gracelm.memory_budget import available_memory, gib
from gracelm.model.decode_graph import DecodeGraph, damaged, graph_batches, graph_key, graph_path
from gracelm.model.decode_graph_check import check
from gracelm.model.file_hash import content_hash
from gracelm.model.llama import low_bit_layout
from gracelm.model.loader import LoadedModel

logger = logging.getLogger(__name__)

COMPILER_ENTRY = "gracelm.parallel.decode_graph_compiler:compile_in_child"
# What the compiler takes beside its copy of the weights: torch's inductor, the traced graphs, the C++
# compiler it runs.
_COMPILER_WORK = 1 << 30
_STOP_TIMEOUT_S = 5.0


def graph_applies(config: EngineConfig, loaded: LoadedModel, world_size: int) -> bool:
    """The graph is traced through the int4 kernels of one rank on the CPU, in the default computation (a
    model with int4 forms runs in bfloat16, or in float32 where bfloat16 is emulated)."""
    gate = loaded.model.model.int4_gate
    return (not config.enforce_eager and not config.deterministic and world_size == 1
            and loaded.device.type == "cpu" and gate is not None and gate.bound(False) >= 1)


class DecodeGraphBuild:
    """The compiled decode steps of the driver's model, one per `graph_batches` entry: each pending until it
    is loaded and checked (`poll`), or until the compiler that was to write it has ended without."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, weight_bytes: int, ledger: Ledger) -> None:
        """`weight_bytes`: what the loaded model's tensors hold, as the compiler's copy will
        (`Worker.weight_bytes`)."""
        self.loaded = loaded
        self.weight_bytes = weight_bytes
        self.block_size = config.block_size
        self._pending = graph_files(config, loaded)
        self.failures: list[str] = []  # why a graph does not serve
        self._child: ChildProcess | None = None
        missing = [rows for rows, path in self._pending.items() if not path.exists()]
        if not missing:
            return
        if not self._compiler_fits():
            for rows in missing:
                del self._pending[rows]
            return
        self._child = start_process("decode graph compiler", "gracelm::compile", COMPILER_ENTRY, (config,))
        logger.info("decode graph: compiling in the background (pid %d): %d graph(s); eager until each is "
                    "ready", self._child.pid, len(missing))
        ledger.acquire(ResourceKind.PROCESS, f"decode graph compiler (pid {self._child.pid})", self._stop,
                       timeout=_STOP_TIMEOUT_S + 1)

    def _compiler_fits(self) -> bool:
        """Whether the compiler, which loads a model of its own, fits in the memory left now; where it
        does not, the graphs it would compile are given up (`eager-fallback`): they cost speed, the child
        could cost the server (an OOM kill picks the largest process, the engine core)."""
        need = self.weight_bytes + _COMPILER_WORK
        available = available_memory()
        if need <= available.bytes:
            return True
        self._fail(f"not compiled: the compiler's copy of the model and its work need {gib(need)}, and "
                   f"{gib(available.bytes)} is available ({available.source})")
        return False

    def due(self) -> bool:
        """Whether a graph is written and waits for `poll` (a stat per pending graph)."""
        return any(path.exists() for path in self._pending.values())

    def poll(self) -> None:
        """Loads and checks the next graph written, if any: one a call, as each takes a few steps' time
        (called between steps, and by an idle core while `due`)."""
        if not self._pending:
            return
        ended = self._child is None or self._child.exitcode is not None  # before the files: all it wrote
        self._load_next()
        if self._pending and ended and not self.due():
            self._fail(f"the compiler ended ({self._child.describe_exit()})" if self._child is not None
                       else "its package was removed before it was loaded")
            self._pending.clear()

    def status(self) -> str:
        """For /metrics: compiling (the compiler runs), checking (graphs of the cache not yet loaded and
        checked), compiled, partly-compiled (a graph failed, another serves), eager-fallback (every graph
        failed: `failures`)."""
        if self._pending:
            return "compiling" if self._child is not None and self._child.exitcode is None else "checking"
        decoder = self.loaded.model.model
        if decoder.decode_graph_failure is None and not self.failures:
            return "compiled"
        return "partly-compiled" if decoder.decode_graphs else "eager-fallback"

    def _load_next(self) -> None:
        if self.loaded.model.model.decode_graph_failure is not None:  # a compiled step raised: no more
            self._pending.clear()
            return
        written = [rows for rows, path in self._pending.items() if path.exists()]
        if not written:
            return
        rows = written[0]  # one sequence's first, as the compiler writes them
        path = self._pending.pop(rows)
        started = time.monotonic()
        graph = self._load(path, rows)
        if graph is not None:
            self.loaded.model.model.decode_graphs.append(graph)
            logger.info("decode graph loaded from %s and checked in %.1f s: decode steps of %d to %d "
                        "sequences run compiled", path, time.monotonic() - started, rows.start, rows.stop - 1)

    def _load(self, path: Path, rows: range) -> DecodeGraph | None:
        """The graph at `path`, loaded and checked (`decode_graph_check.py`); None where it failed."""
        try:
            graph = DecodeGraph.load(path, rows, self.block_size, self.loaded.model.model)
            graph.skew = faults().decode_graph_skew()
        except Exception as e:
            if damaged(path):  # rebuilt at the next start
                path.unlink(missing_ok=True)
            self._fail(f"cannot load {path} ({e}){'; removed' if not path.exists() else ''}")
            return None
        problem = check(self.loaded.model, graph, self.block_size)
        if problem is not None:
            self._fail(f"the graph of {rows.start} to {rows.stop - 1} sequences failed its check: {problem}")
            return None
        return graph

    def _fail(self, why: str) -> None:
        logger.warning("decode graph: %s; serving eagerly where it would have served", why)
        self.failures.append(why)

    def _stop(self) -> str:
        assert self._child is not None
        if self._child.exitcode is None:
            self._child.process.kill()  # it ignores SIGTERM, as every child does; nothing in it to save
        return self._child.stop(_STOP_TIMEOUT_S)


def graph_files(config: EngineConfig, loaded: LoadedModel) -> dict[range, Path]:
    """Where the cache keeps each graph of `loaded` (frozen, its CPU features masked as `config` says), by
    the sequences of its steps (`graph_batches`)."""
    key = (content_hash(loaded.path), loaded.dtype, config.block_size)
    layout = low_bit_layout(loaded.model)
    return {rows: graph_path(graph_key(*key, rows, layout, config.decode_attention))
            for rows in graph_batches(loaded.model)}
