"""The main loop of a worker process (ranks 1..N-1): receive each step from rank 0, run it, never sample.

Start: join the rendezvous store, connect the step channel, say hello, join the process group, load and
shard the model, report how many KV blocks fit; then serve `InitKVCache`, the start-up's `WarmUp`,
`StepBatch` and the prefix cache's `RestoreKVBlocks` (at start) and `SaveKVBlocks` (at the stop) messages in
order. `Stop` is
handled between steps (the loop is single-threaded, so the current step always finishes): the ledger
releases the KV cache, the model and the process group, newest first, and the report goes back to rank 0
before the channel closes and the process exits 0.

Losing rank 0 (its channel disconnects, or a collective fails) is fatal: report what can be reported,
release, exit 1. Signals are not ours to act on (the supervisor's), and the parent-death guarantees come
from `start_process`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback

import zmq

from gracelm.config import EngineConfig
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.faults import faults
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.processes import exit_process
from gracelm.lifecycle.startup_objects import freeze_startup_objects
from gracelm.model.entry_keeper import start_keeping
from gracelm.parallel import messages as m
from gracelm.parallel.distributed import (
    BACKEND,
    channel_key,
    create_store,
    destroy_process_group,
    init_process_group,
)
from gracelm.parallel.kv_shard import restore_shard, save_shard
from gracelm.parallel.sharding import CommTimer
from gracelm.parallel.warmup import run_warmup_batches
from gracelm.parallel.worker import Worker
from gracelm.parallel.worker_group import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS

logger = logging.getLogger(__name__)

_FINAL_SEND_LINGER_MS = 2000


class RankZeroLostError(RuntimeError):
    """The step channel to rank 0 disconnected: the engine core is gone."""


def run_worker(config: EngineConfig, rank: int, world_size: int, store_host: str, store_port: int,
               log_level: int) -> None:
    """Entry point of a worker process; never returns (exits 0 after a stop, 1 after a failure)."""
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s")
    exit_process(WorkerProcess(config, rank, world_size).run(store_host, store_port))


class WorkerProcess:
    def __init__(self, config: EngineConfig, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.worker = Worker(config, rank, world_size)
        self.ledger = Ledger()
        self.context = zmq.Context()
        self.channel = self.context.socket(zmq.DEALER)
        self.channel.setsockopt(zmq.LINGER, _FINAL_SEND_LINGER_MS)
        # Rank 0 unreachable (its node vanished, the link is cut) closes no connection: heartbeats tell.
        self.channel.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.channel.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.address = ""  # rank 0's end of the step channel, once known
        self.poller = zmq.Poller()
        self.monitor: zmq.Socket | None = None
        self.timer: CommTimer | None = None  # the shard's collective time, kept past the model's release
        self.steps = 0
        self.receive_s = 0.0

    def run(self, store_host: str, store_port: int) -> int:
        try:
            self._start(store_host, store_port)
            freeze_startup_objects()
            self._serve()
        except Exception as e:  # noqa: BLE001 - any failure of a rank is fatal, reported, then released
            logger.exception("worker rank %d failed", self.rank)
            self._send(m.Failed(f"rank {self.rank}: {type(e).__name__}: {e}", traceback.format_exc()))
            report = self.ledger.release_all()
            logger.info("worker rank %d teardown after failure:\n%s", self.rank, report.as_table())
            self._close_channel()
            return ExitCode.FATAL
        report = self.ledger.release_all()
        logger.info("worker rank %d stopped:\n%s", self.rank, report.as_table())
        collective_ms = self.timer.seconds * 1000 if self.timer is not None else 0.0
        self._send(m.Stopped(report.to_dict(), self.steps, self.receive_s * 1000, collective_ms))
        self._close_channel()
        return 0

    def _start(self, store_host: str, store_port: int) -> None:
        store = create_store(store_host, store_port, self.rank, self.world_size)
        self.address = store.get(channel_key(self.rank)).decode()
        self.channel.connect(self.address)
        self.monitor = self.channel.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller.register(self.channel, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self._send(m.Hello(self.rank, os.getpid(), socket.gethostname()))
        init_process_group(store, self.rank, self.world_size, self.worker.config.dist_timeout)
        self.ledger.acquire(ResourceKind.PROCESS_GROUP, f"{BACKEND} rank {self.rank}/{self.world_size}",
                            destroy_process_group)
        loaded = self.worker.load_model()
        assert self.worker.shard is not None
        self.timer = self.worker.shard.timer
        self.ledger.acquire(ResourceKind.MODEL, f"{loaded.name} shard {self.rank}/{self.world_size}",
                            self.worker.free_model)
        self._send(m.Loaded(self.worker.available_kv_blocks()))

    def _serve(self) -> None:
        while True:
            message = self._receive()
            if isinstance(message, m.StepBatch):
                self.receive_s += max(0.0, time.time() - message.sent_at)
                self._forward(message)
                self.steps += 1
                faults().after_worker_step(self.rank, self.steps)
            elif isinstance(message, m.InitKVCache):
                self.worker.init_kv_cache(message.num_blocks)
                self.ledger.acquire(ResourceKind.KV_CACHE, f"{message.num_blocks} blocks, rank {self.rank}",
                                    self.worker.free_kv_cache)
                self._send(m.KVCacheReady())
                self.worker.commit_kv_cache()
            elif isinstance(message, m.WarmUp):
                run_warmup_batches(self.worker, message.batches)
                start_keeping()
            elif isinstance(message, m.SaveKVBlocks):
                self._send(save_shard(self.worker, message))
            elif isinstance(message, m.RestoreKVBlocks):
                self._send(restore_shard(self.worker, message))
            elif isinstance(message, m.Stop):
                return

    def _forward(self, batch: m.StepBatch) -> None:
        try:
            self.worker.forward(batch)
        except RuntimeError as e:  # a collective failed: if rank 0 is gone, that is the news to report
            if self._rank_zero_lost(HEARTBEAT_TIMEOUT_MS):
                raise self._lost_error() from e
            raise

    def _rank_zero_lost(self, wait_ms: int) -> bool:
        """The step channel's disconnection, seen within `wait_ms` (0: only if already known)."""
        assert self.monitor is not None
        return bool(self.monitor.poll(wait_ms))

    def _lost_error(self) -> RankZeroLostError:
        return RankZeroLostError(f"rank {self.rank}: lost rank 0 at {self.address}: the step channel "
                                 f"disconnected (the engine core is gone or its node is unreachable)")

    def _receive(self) -> m.ToWorker:
        events = dict(self.poller.poll())
        if self.channel in events:
            return m.decode_to_worker(self.channel.recv(copy=False).buffer)
        raise self._lost_error()

    def _send(self, message: m.FromWorker) -> None:
        try:
            self.channel.send(m.encode(message), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("rank %d could not send %s to rank 0: %s", self.rank, type(message).__name__, e)

    def _close_channel(self) -> None:
        if self.monitor is not None:
            self.channel.disable_monitor()
            self.monitor.close(linger=0)
        self.channel.close()
        self.context.term()
