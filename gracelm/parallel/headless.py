"""A node other than node 0 of a multi-node tensor-parallel group: its worker ranks only, no frontend.

`gracelm serve --nnodes N --node-rank K --dist-init-addr HOST:PORT ...` (K > 0) runs `run_headless`: it
starts this node's ranks as worker processes and waits for them. Node 0's engine core drives them: a stop
there sends each worker its stop message, they tear down and exit 0, and so does this process. A worker that
fails or loses rank 0 exits non-zero, and this node then stops the others and exits FATAL. SIGTERM, SIGINT or
SIGHUP here stops this node's workers at once (node 0 sees their death and fails fast: a group missing a rank
cannot serve) and exits CLEAN_STOP, since the operator asked for it.
"""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import wait

import gracelm.cpu_features as cpu_features
from gracelm.config import EngineConfig
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.processes import ChildProcess, start_process
from gracelm.lifecycle.signals import STOP_SIGNALS
from gracelm.parallel.distributed import rendezvous_address
from gracelm.parallel.layout import Layout, check_parallel_config
from gracelm.parallel.worker_group import WORKER_ENTRY, WORKER_STOP_TIMEOUT_S

logger = logging.getLogger(__name__)

_POLL_S = 0.2


def run_headless(config: EngineConfig) -> int:
    """Runs this node's worker ranks until they end; returns the process's exit code."""
    if config.node_rank == 0:
        raise ValueError("run_headless is for nodes other than node 0 (node_rank > 0)")
    check_parallel_config(config)
    layout = Layout.from_config(config)
    host, port = rendezvous_address(config)
    stop_requested: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop_requested.append(signum))
                for sig in STOP_SIGNALS}
    ledger = Ledger()
    workers: dict[int, ChildProcess] = {}
    try:
        for rank in layout.node_ranks(config.node_rank):
            process = start_process(f"Worker-{rank}", f"gracelm::worker-{rank}", WORKER_ENTRY,
                                    (config, rank, layout.world_size, host, port,
                                     logging.getLogger().getEffectiveLevel()),
                                    cpu_features.environment(config.mask_cpu_features))
            workers[rank] = process
            ledger.acquire(ResourceKind.PROCESS, f"worker rank {rank} (pid {process.pid})",
                           lambda p=process: p.stop(WORKER_STOP_TIMEOUT_S), timeout=WORKER_STOP_TIMEOUT_S + 7)
        logger.info("node %d: worker ranks %s started, rendezvous %s:%d", config.node_rank,
                    list(workers), host, port)
        code = _supervise(workers, stop_requested)
    finally:
        report = ledger.release_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("node %d stopped (exit %d):\n%s", config.node_rank, code, report.as_table())
    return code


def _supervise(workers: dict[int, ChildProcess], stop_requested: list[int]) -> int:
    """Waits until every worker has exited (CLEAN_STOP if all exited 0), one fails (FATAL), or a stop
    signal arrives (CLEAN_STOP; the workers are then stopped at once)."""
    running = dict(workers)
    while running:
        if stop_requested:
            logger.info("%s: stopping this node's workers", signal.Signals(stop_requested[0]).name)
            for process in running.values():
                process.stop(0)
            return ExitCode.CLEAN_STOP
        for sentinel in wait([p.sentinel for p in running.values()], timeout=_POLL_S):
            rank = next(r for r, p in running.items() if p.sentinel == sentinel)
            process = running.pop(rank)
            description = process.describe_exit()
            if process.exitcode != 0:
                logger.error("worker rank %d failed: %s", rank, description)
                return ExitCode.FATAL
            logger.info("worker rank %d stopped: %s", rank, description)
    return ExitCode.CLEAN_STOP
