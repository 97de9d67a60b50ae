"""What the engine core calls to run the model: rank 0 in-process, and with tensor parallelism the other
ranks in worker processes (`WorkerGroup`).

The engine core's view — load, size the cache, execute, release, shut down — is the same for any size.
With N > 1: a model whose heads do not divide by N is refused before any process starts; rank 0 decides
the number of KV blocks (the smallest that every rank can hold) and tells the workers; each step is sent
to the workers before rank 0 runs its own shard, and only rank 0 samples.

A worker's death surfaces as `WorkerDiedError` naming the rank and how it ended: raised by the step that
meets it (a collective fails when a peer is gone), by any wait on the workers, and, when the core is idle,
in the engine core's main thread itself — the monitor interrupts it with SIGUSR2, whose handler raises —
so the core's fatal path runs within a fraction of a second in every case.

Every resource is in a ledger; `shutdown()` releases them newest first and returns the report, rank 0's
entries followed by each worker's own teardown (KV cache, model, process group).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

import gracelm.startup_timeline as startup_timeline
from gracelm.config import EngineConfig, ModelConfig
from gracelm.lifecycle.ledger import Ledger, Outcome, ResourceKind, ResourceReport, ShutdownReport
from gracelm.model.entry_keeper import start_keeping
from gracelm.model.llama import long_prompts_differ
from gracelm.model.loader import LoadedModel
from gracelm.model_step import ModelStep, StepResult
from gracelm.parallel import messages as m
from gracelm.parallel.decode_graph_build import DecodeGraphBuild, graph_applies
from gracelm.parallel.distributed import (
    BACKEND,
    RENDEZVOUS_TIMEOUT_S,
    destroy_process_group,
    init_process_group,
)
from gracelm.parallel.layout import Layout, check_parallel_config
from gracelm.parallel.sharding import CommTimer
from gracelm.parallel.warmup import run_warmup, warmup_steps
from gracelm.parallel.worker import Worker
from gracelm.parallel.worker_group import WorkerDiedError, WorkerGroup

logger = logging.getLogger(__name__)

_INTERRUPT_SIGNAL = signal.SIGUSR2
# How long a failed collective may wait for the monitor to name the worker that caused it.
_DEATH_EXPLAIN_S = 1.5
_GATHER_BEAT_S = 0.5


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.layout = Layout.from_config(config)
        self.ledger = Ledger()
        self._driver = Worker(config, rank=0, world_size=self.layout.world_size)
        self._group: WorkerGroup | None = None
        self._worker_blocks: list[int] = []
        self._death_raised = False
        self._stopping = False
        self._main_thread: int | None = None
        self._previous_handler = None
        self.steps = 0
        self.send_s = 0.0
        self._timer: CommTimer | None = None  # rank 0's collective time, kept past the model's release
        self.graph_build: DecodeGraphBuild | None = None  # one rank only: `decode_graph_build.py`
        self.draft_graph_build: DecodeGraphBuild | None = None  # a draft model's (`draft_model.py`)
        if self.layout.world_size > 1:
            check_parallel_config(config)
            try:
                self._start_group()
            except BaseException:
                self.shutdown()
                raise

    def _start_group(self) -> None:
        world = self.layout.world_size
        self._install_interrupt()
        self._group = WorkerGroup(self.config, self.layout, self.ledger, self._on_worker_death)
        self._group.wait_hellos(RENDEZVOUS_TIMEOUT_S)
        init_process_group(self._group.store, 0, world, self.config.dist_timeout)
        self.ledger.acquire(ResourceKind.PROCESS_GROUP, f"{BACKEND} rank 0/{world}", destroy_process_group)

    def load_model(self) -> LoadedModel:
        loaded = self._driver.load_model()
        self.ledger.acquire(ResourceKind.MODEL, f"{loaded.name} rank 0/{self.layout.world_size}",
                            self._driver.free_model)
        if self._group is not None:
            assert self._driver.shard is not None
            self._timer = self._driver.shard.timer
            replies = self._group.gather(m.Loaded, RENDEZVOUS_TIMEOUT_S)
            self._worker_blocks = [reply.available_kv_blocks for reply in replies.values()]
        return loaded

    @property
    def model_config(self) -> ModelConfig:
        return self._driver.model_config

    def available_kv_blocks(self) -> int:
        """What the most constrained rank can hold: every rank's cache has the same number of blocks."""
        return min([self._driver.available_kv_blocks(), *self._worker_blocks])

    def init_kv_cache(self, num_blocks: int) -> None:
        if self._group is not None:
            self._group.broadcast(m.InitKVCache(num_blocks))
        self._driver.init_kv_cache(num_blocks)
        startup_timeline.mark("kv_cache")
        self.ledger.acquire(ResourceKind.KV_CACHE, f"{num_blocks} blocks, rank 0", self._driver.free_kv_cache)
        if self._group is not None:
            self._group.gather(m.KVCacheReady, RENDEZVOUS_TIMEOUT_S)
        else:
            self._build_graphs()
        self._warm_up(num_blocks)
        start_keeping()  # before the compiler, which waits for the entries rather than converting again
        for build in (self.graph_build, self.draft_graph_build):
            if build is not None:
                build.compile_missing()
        self._driver.commit_kv_cache()

    def _build_graphs(self) -> None:
        """The compiled decode steps of the model, and of a draft model (its passes after its first are
        decode steps of one row per drafting sequence), each where they apply."""
        if graph_applies(self.config, self._driver.loaded, self.layout.world_size):
            self.graph_build = DecodeGraphBuild(self.config, self._driver.loaded, self._driver.weight_bytes,
                                               self.ledger)
        draft = self._driver.draft
        if draft is not None and graph_applies(self.config, draft.loaded, self.layout.world_size):
            self.draft_graph_build = DecodeGraphBuild(draft.config_of(self.config), draft.loaded,
                                                     draft.weight_bytes, self.ledger)

    def _warm_up(self, num_blocks: int) -> None:
        """The first steps, on every rank, before the core says Ready (`warmup.py`): after the compiled
        graphs load, so that they run too; before the cache's pages are committed, which would compete."""
        steps = warmup_steps(self.config.block_size, num_blocks, self.model_config.vocab_size,
                             pooled=self.config.task == "embed",
                             long_prompt=long_prompts_differ(self._driver.loaded.model))
        if self._group is not None:
            self._group.broadcast(m.WarmUp([step.batch for step in steps]))
        run_warmup(self._driver, steps)

    def execute(self, step: ModelStep) -> StepResult:
        """Runs one step on every rank; the run of sampled tokens of each request of `step.request_ids`, in
        order (its drafts kept, then its token or a `SamplingFault` when its sampling raised: only its
        request ends), and the prompt logprobs of `step.prompt_rows` (rank 0 has the gathered logits of
        every row)."""
        if self._group is None:
            for build in (self.graph_build, self.draft_graph_build):
                if build is not None:
                    build.poll()
            return self._driver.sample_step(step)
        started = time.perf_counter()
        step.batch.sent_at = time.time()
        self._group.broadcast(step.batch)
        self.send_s += time.perf_counter() - started
        self.steps += 1
        try:
            return self._driver.sample_step(step)
        except RuntimeError as e:
            # A collective fails when a peer is gone; say which one, if the monitor can tell.
            death = self._group.wait_for_death(_DEATH_EXPLAIN_S)
            if death is None or isinstance(e, WorkerDiedError):
                raise
            self._death_raised = True
            raise death from e

    def kernel_paths(self) -> dict[str, str]:
        """Rank 0's kernels, and whether its decode steps run compiled (`decode_graph_build.py`), a draft
        model's too."""
        paths = {**self._driver.kernel_paths(), "decode_graph": _status(self.graph_build)}
        if self._driver.draft is not None:
            paths["draft_decode_graph"] = _status(self.draft_graph_build)
        return paths

    def memory_use(self) -> dict[str, int]:
        """Rank 0's memory by part (`Worker.memory_use`)."""
        return self._driver.memory_use()

    def compiled_steps(self) -> int:
        """Steps rank 0 ran through a compiled decode graph so far."""
        return 0 if self._driver.loaded is None else self._driver.loaded.model.model.compiled_steps

    def release_requests(self, request_ids: list[str]) -> None:
        self._driver.release_requests(request_ids)

    # -- KV-cache snapshots (`kv_persistence.py`): rank 0's shard here, the workers' by message --------

    @property
    def worker_ranks(self) -> range:
        return self._group.ranks if self._group is not None else range(0)

    def send_to_workers(self, message: m.ToWorker) -> None:
        assert self._group is not None
        self._group.broadcast(message)

    def gather_from_workers(self, kind: type, deadline: float,
                            beat: Callable[[], None] = lambda: None) -> dict[int, m.FromWorker]:
        """Each worker's next message, which must be a `kind`, by `deadline` (monotonic); `beat` runs every
        `_GATHER_BEAT_S` meanwhile, so that a long save does not look like a hung core."""
        assert self._group is not None
        replies: dict[int, m.FromWorker] = {}
        for rank in self._group.ranks:
            while rank not in replies:
                try:
                    wait = min(_GATHER_BEAT_S, max(0.0, deadline - time.monotonic()))
                    replies[rank] = self._group.receive(rank, kind, wait)
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise
                    beat()
        return replies

    def kv_layout(self) -> dict:
        return self._driver.kv_layout()

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        return self._driver.read_kv_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], contents: list[bytes]) -> None:
        self._driver.write_kv_blocks(block_ids, contents)

    def shutdown(self) -> ShutdownReport:
        """Stops the workers and frees everything; idempotent. The report lists rank 0's resources, then
        each worker's own teardown."""
        self._stopping = True
        self._uninstall_interrupt()
        report = self.ledger.release_all()
        if self._group is None:
            return report
        self._log_communication()
        combined = ShutdownReport(list(report.resources))
        for rank, stopped in sorted(self._group.reports.items()):
            combined.resources.extend(_worker_resources(rank, stopped.report))
        return combined

    def communication_stats(self) -> dict[str, float]:
        """Per-step communication of this tensor-parallel group so far, in milliseconds."""
        steps = max(self.steps, 1)
        collective_s = self._timer.seconds if self._timer is not None else 0.0
        return {"steps": self.steps, "send_ms_per_step": self.send_s * 1000 / steps,
                "rank0_collective_ms_per_step": collective_s * 1000 / steps}

    def _log_communication(self) -> None:
        assert self._group is not None
        stats = self.communication_stats()
        for rank, stopped in sorted(self._group.reports.items()):
            if stopped.steps:
                stats[f"rank{rank}_receive_ms_per_step"] = stopped.receive_ms / stopped.steps
                stats[f"rank{rank}_collective_ms_per_step"] = stopped.collective_ms / stopped.steps
        logger.info("tensor-parallel communication: %s",
                    ", ".join(f"{key} {value:.3f}" for key, value in stats.items()))

    # -- a worker's death while the core is idle -----------------------------------------------------

    def _install_interrupt(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._main_thread = threading.get_ident()
            self._previous_handler = signal.signal(_INTERRUPT_SIGNAL, self._raise_death)

    def _uninstall_interrupt(self) -> None:
        if self._main_thread is not None and threading.get_ident() == self._main_thread:
            signal.signal(_INTERRUPT_SIGNAL, self._previous_handler)
            self._main_thread = None

    def _on_worker_death(self, death: WorkerDiedError) -> None:
        """Monitor thread: makes the main thread raise `death` wherever it waits (a poll returns EINTR)."""
        if self._main_thread is not None:
            signal.pthread_kill(self._main_thread, _INTERRUPT_SIGNAL)

    def _raise_death(self, _signum: int, _frame: object) -> None:
        if self._stopping or self._death_raised or self._group is None or self._group.death is None:
            return
        self._death_raised = True
        raise self._group.death


def _worker_resources(rank: int, report: dict) -> list[ResourceReport]:
    return [ResourceReport(ResourceKind(r["kind"]), f"rank {rank}: {r['name']}", Outcome(r["outcome"]),
                           r["ms"], r["error"], r["released_at"]) for r in report["resources"]]


def _status(build: DecodeGraphBuild | None) -> str:
    return "eager" if build is None else build.status()
