"""Gets rank 0's model its compiled decode steps (`model/decode_graph.py`: one for one sequence, one for 2
up to 64, `graph_batches`) without delaying the start: loaded from the cache when they are there (0.1 s
each, before the core says Ready), else compiled in a child process (`gracelm::compile`, one thread, at
idle priority: `decode_graph_compiler.py`) while the engine serves eagerly, and each loaded between two
steps once the child has written it (one sequence's first). A stop before the end keeps the graphs
written: the next start compiles only the others, and finds in inductor's cache the kernels it had compiled.
A start that finds no package therefore serves at eager speed for a minute or two (the default model on
this project's machine: about 45 s, then 40 s more, with the attention a compiled op of its own); every
later start of the same model, torch and CPU is fast from its first step.

Each graph proves itself before it serves (`model/decode_graph_check.py`). A graph that cannot be loaded or
fails its check, a compiler that fails, and a compiled step that raises while serving (`LlamaModel`) cost
only speed: each is logged, `status()` says so on /metrics, and the engine serves those steps eagerly.

The child is a resource of the executor's ledger: a stop kills it (a compile is worth nothing half done;
its temporary file is removed by the next compile) and any compiler process it left. Where the graphs do
not apply (`graph_applies`), nothing is started."""

from __future__ import annotations

import logging
from pathlib import Path

import gracelm.startup_timeline as startup_timeline
from gracelm.config import EngineConfig
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.processes import ChildProcess, start_process
from gracelm.memory_budget import available_memory, gib
from gracelm.model.decode_graph import DecodeGraph, damaged, graph_batches, graph_key, graph_path
from gracelm.model.decode_graph_check import check
from gracelm.model.decode_graph_proof import keep_proof, proven
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
    if loaded.model.model.graph_refusal is not None and not config.enforce_eager:
        logger.info("decode graph: not for %s: %s; decode steps run eagerly", loaded.config.architecture,
                    loaded.model.model.graph_refusal)
        return False
    return (not config.enforce_eager and not config.deterministic and world_size == 1
            and loaded.device.type == "cpu" and gate is not None and gate.bound(False) >= 1)


class DecodeGraphBuild:
    """The compiled decode steps of the driver's model, one per `graph_batches` entry: those still to load are
    pending until the child has written them, or until it has ended without."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, weight_bytes: int, ledger: Ledger) -> None:
        """`weight_bytes`: what the loaded model's tensors hold, as the compiler's copy will
        (`Worker.weight_bytes`)."""
        self.loaded = loaded
        self.weight_bytes = weight_bytes
        self.block_size = config.block_size
        self._config = config
        self._ledger = ledger
        self._pending = graph_files(config, loaded)
        self.failures: list[str] = []  # why a graph does not serve
        self._load_written()
        self._child: ChildProcess | None = None

    def compile_missing(self) -> None:
        """Starts the compiler of the graphs still missing, where it fits: once the warm-up has run, whose
        steps the start of a child importing torch beside them would slow, though it runs at idle priority."""
        if self._child is not None or not self._pending or not self._compiler_fits():
            return
        self._child = start_process("decode graph compiler", "gracelm::compile", COMPILER_ENTRY,
                                    (self._config,))
        logger.info("decode graph: compiling in the background (pid %d): %d graph(s); eager until each is "
                    "ready", self._child.pid, len(self._pending))
        self._ledger.acquire(ResourceKind.PROCESS, f"decode graph compiler (pid {self._child.pid})",
                             self._stop, timeout=_STOP_TIMEOUT_S + 1)

    def _compiler_fits(self) -> bool:
        """Whether the compiler, which loads a model of its own, fits in the memory left now; where it
        does not, the graphs are given up (`eager-fallback`): they cost speed, the child could cost the
        server (an OOM kill picks the largest process, the engine core)."""
        need = self.weight_bytes + _COMPILER_WORK
        available = available_memory()
        if need <= available.bytes:
            return True
        self._fail(f"not compiled: the compiler's copy of the model and its work need {gib(need)}, and "
                   f"{gib(available.bytes)} is available ({available.source})")
        self._pending.clear()
        return False

    def poll(self) -> None:
        """Loads each graph once the child has written it (called between steps: a stat per missing graph,
        a non-blocking wait)."""
        if not self._pending or self._child is None:  # nothing missing, or no compiler (yet)
            return
        code = self._child.exitcode
        self._load_written()
        if self._pending and code is not None:
            self._fail(f"the compiler ended ({self._child.describe_exit()})")
            self._pending.clear()

    def status(self) -> str:
        """For /metrics: compiling, compiled, partly-compiled (a graph failed, another serves),
        eager-fallback (every graph failed: `failures`)."""
        if self._pending:
            return "compiling"
        decoder = self.loaded.model.model
        if decoder.decode_graph_failure is None and not self.failures:
            return "compiled"
        return "partly-compiled" if decoder.decode_graphs else "eager-fallback"

    def _load_written(self) -> None:
        decoder = self.loaded.model.model
        if decoder.decode_graph_failure is not None:  # a compiled step raised: no more
            self._pending.clear()
            return
        loaded: dict[range, tuple[DecodeGraph, Path]] = {}
        for rows, path in list(self._pending.items()):
            if path.exists():
                del self._pending[rows]
                graph = self._load(path, rows)
                if graph is not None:
                    loaded[rows] = graph, path
        if not loaded:
            return
        problems = self._check(loaded)
        startup_timeline.mark("verify")
        for rows, (graph, path) in loaded.items():
            if rows in problems and problems[rows] is not None:
                self._fail(f"the graph of {rows.start} to {rows.stop - 1} sequences failed its check: "
                           f"{problems[rows]}")
                continue
            if rows in problems:
                keep_proof(path)
            decoder.decode_graphs.append(graph)
            logger.info("decode graph loaded from %s: decode steps of %d to %d sequences run compiled%s",
                        path, rows.start, rows.stop - 1,
                        "" if rows in problems else " (its check passed at an earlier start)")

    def _check(self, loaded: dict[range, tuple[DecodeGraph, Path]]) -> dict[range, str | None]:
        """Each graph of `loaded` that no proof covers (`decode_graph_proof.py`), checked: None where it
        serves, else what differs. The proven ones are loaded beside those serving for the others' check."""
        unproven = {rows: graph for rows, (graph, path) in loaded.items() if not proven(path)}
        proven_graphs = [graph for rows, (graph, _) in loaded.items() if rows not in unproven]
        serving = (*self.loaded.model.model.decode_graphs, *proven_graphs)
        problems = check(self.loaded.model, list(unproven.values()), self.block_size, serving=serving)
        return dict(zip(unproven, problems, strict=True))

    def _load(self, path: Path, rows: range) -> DecodeGraph | None:
        """The graph at `path`, loaded (checked by the caller: `decode_graph_check.py`); None where it
        failed."""
        try:
            graph = DecodeGraph.load(path, rows, self.block_size, self.loaded.model.model)
            startup_timeline.mark("compile")  # a start's share of the compile: loading what was compiled
        except Exception as e:
            if damaged(path):  # rebuilt at the next start
                path.unlink(missing_ok=True)
            self._fail(f"cannot load {path} ({e}){'; removed' if not path.exists() else ''}")
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
