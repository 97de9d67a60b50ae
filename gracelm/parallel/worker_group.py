"""Rank 0's side of a tensor-parallel group: the worker processes of node 0, a step channel to every worker
rank (on any node), and a monitor that notices a worker's death at once.

Each worker rank has its own ZMQ DEALER socket here, bound on a free TCP port of the rendezvous host and
published in the store; one socket per rank means that a disconnection names the rank. A step goes out as
one msgpack frame sent to every channel, before rank 0 runs its own shard.

Death, noticed by a monitor thread: a local worker's process sentinel, or any worker's channel
disconnecting (the kernel closes a dead process's connections; ZMTP heartbeats catch a node that
vanished without closing them). The monitor records the first death, wakes whoever waits on this group
and calls `on_death` (rank 0's executor interrupts the engine core's main thread with it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import zmq

from gracelm.config import EngineConfig
from gracelm.lifecycle.ledger import Ledger, ResourceKind
from gracelm.lifecycle.processes import ChildProcess, start_process
from gracelm.parallel import messages as m
from gracelm.parallel.distributed import channel_key, create_store, rendezvous_address
from gracelm.parallel.layout import Layout

logger = logging.getLogger(__name__)

# A peer that answers no ZMTP heartbeat for this long is gone, even if its connection was never closed
# (both ends of a step channel use them).
HEARTBEAT_IVL_MS = 500
HEARTBEAT_TIMEOUT_MS = 1500
_SEND_RETRY_MS = 50
# A stop message, the worker's teardown and its report.
WORKER_STOP_TIMEOUT_S = 10.0
# What a worker process runs, named so that starting one imports nothing of it here.
WORKER_ENTRY = "gracelm.parallel.worker_process:run_worker"


class WorkerDiedError(RuntimeError):
    """A worker rank is gone: the message names it and says how it ended."""


class WorkerFailedError(RuntimeError):
    """A worker rank reported a failure (its traceback is in the log)."""


class WorkerGroup:
    def __init__(self, config: EngineConfig, layout: Layout, ledger: Ledger,
                 on_death: Callable[[WorkerDiedError], None]) -> None:
        self.layout = layout
        self.ranks = range(1, layout.world_size)
        self.on_death = on_death
        self.death: WorkerDiedError | None = None
        self.dead_rank: int | None = None
        self.hellos: dict[int, m.Hello] = {}
        self.reports: dict[int, m.Stopped] = {}
        host, port = rendezvous_address(config)
        self.store = create_store(host, port, 0, layout.world_size)
        ledger.acquire(ResourceKind.SOCKET, f"rendezvous store {host}:{self.store.port}", self._drop_store)
        self.context = zmq.Context()
        ledger.acquire(ResourceKind.ZMQ_CONTEXT, "worker channels' context", self.context.term, timeout=2)
        self._wake_r, self._wake_w = os.pipe()
        self.channels: dict[int, zmq.Socket] = {}
        self.monitors: dict[int, zmq.Socket] = {}
        for rank in self.ranks:
            self._open_channel(rank, host)
        ledger.acquire(ResourceKind.SOCKET, f"step channels to ranks 1..{layout.world_size - 1}",
                       self._close_channels, timeout=2)
        self.processes: dict[int, ChildProcess] = {}
        for rank in layout.node_ranks(0)[1:]:
            self._start_local(config, ledger, rank, host)
        self._monitor = threading.Thread(target=self._watch, name="tp-worker-monitor", daemon=True)
        self._monitor.start()
        ledger.acquire(ResourceKind.THREAD, "tensor-parallel worker monitor", self._stop_monitor, timeout=2)
        ledger.acquire(ResourceKind.PROCESS, f"worker ranks 1..{layout.world_size - 1}: stop and teardown",
                       self._stop_workers, timeout=WORKER_STOP_TIMEOUT_S + 1)

    # -- start ---------------------------------------------------------------------------------------

    def _open_channel(self, rank: int, host: str) -> None:
        channel = self.context.socket(zmq.DEALER)
        channel.setsockopt(zmq.LINGER, 0)
        channel.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        channel.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        port = channel.bind_to_random_port(f"tcp://{host}")
        self.channels[rank] = channel
        self.monitors[rank] = channel.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.store.set(channel_key(rank), f"tcp://{host}:{port}")

    def _start_local(self, config: EngineConfig, ledger: Ledger, rank: int, host: str) -> None:
        process = start_process(f"Worker-{rank}", f"gracelm::worker-{rank}", WORKER_ENTRY,
                                (config, rank, self.layout.world_size, host, self.store.port,
                                 logging.getLogger().getEffectiveLevel()))
        self.processes[rank] = process

        def join() -> None:
            outcome = process.stop(WORKER_STOP_TIMEOUT_S)
            if outcome != "exited":
                raise RuntimeError(f"worker rank {rank} had to be {outcome}")
            if process.exitcode != 0:
                raise RuntimeError(process.describe_exit())

        ledger.acquire(ResourceKind.PROCESS, f"worker rank {rank} (pid {process.pid})", join,
                       timeout=WORKER_STOP_TIMEOUT_S + 7, force=lambda: process.stop(0))

    def wait_hellos(self, timeout: float) -> None:
        """Every worker rank, local or remote, has connected its channel and is joining the group."""
        for rank in self.ranks:
            self.hellos[rank] = self.receive(rank, m.Hello, timeout)
            logger.info("worker rank %d is up: pid %d on %s", rank, self.hellos[rank].pid,
                        self.hellos[rank].host)

    # -- talking -------------------------------------------------------------------------------------

    def broadcast(self, message: m.ToWorker) -> None:
        data = m.encode(message)
        for rank, channel in self.channels.items():
            self._send(rank, channel, data)

    def _send(self, rank: int, channel: zmq.Socket, data: bytes) -> None:
        # Never blocks on a dead peer: a DEALER whose peer is gone has nowhere to queue the message.
        while True:
            self.raise_if_dead()
            try:
                channel.send(data, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                channel.poll(_SEND_RETRY_MS, zmq.POLLOUT)

    def gather(self, kind: type, timeout: float) -> dict[int, m.FromWorker]:
        return {rank: self.receive(rank, kind, timeout) for rank in self.ranks}

    def receive(self, rank: int, kind: type, timeout: float) -> m.FromWorker:
        """The next message of worker `rank`, which must be a `kind`; raises if the worker fails or dies,
        or `TimeoutError` after `timeout` s."""
        poller = zmq.Poller()
        poller.register(self.channels[rank], zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while True:
            events = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self.channels[rank] in events:
                return self._expect(rank, m.decode_from_worker(self.channels[rank].recv()), kind)
            self.raise_if_dead()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"worker rank {rank} sent no {kind.__name__} within {timeout:.0f} s")

    @staticmethod
    def _expect(rank: int, message: m.FromWorker, kind: type) -> m.FromWorker:
        if isinstance(message, m.Failed):
            logger.error("worker rank %d failed:\n%s", rank, message.traceback)
            raise WorkerFailedError(message.error)
        if not isinstance(message, kind):
            raise RuntimeError(f"worker rank {rank} sent {type(message).__name__}, expected {kind.__name__}")
        return message

    def raise_if_dead(self) -> None:
        if self.death is not None:
            raise self.death

    def wait_for_death(self, timeout: float) -> WorkerDiedError | None:
        """After a collective failed: the death that explains it, once the monitor has seen it."""
        deadline = time.monotonic() + timeout
        while self.death is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.death

    # -- death ---------------------------------------------------------------------------------------

    def _watch(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for process in self.processes.values():
            poller.register(process.sentinel, zmq.POLLIN)
        for monitor in self.monitors.values():
            poller.register(monitor, zmq.POLLIN)
        events = dict(poller.poll())
        if self._wake_r in events:
            return
        for rank, process in self.processes.items():
            if process.sentinel in events:
                return self._record_death(rank, f"tensor-parallel worker rank {rank}: "
                                                f"{process.describe_exit()}")
        for rank, monitor in self.monitors.items():
            if monitor in events:
                return self._record_death(rank, self._describe_disconnect(rank))

    def _describe_disconnect(self, rank: int) -> str:
        process = self.processes.get(rank)
        if process is not None:
            return f"tensor-parallel worker rank {rank}: {process.describe_exit()}"
        hello = self.hellos.get(rank)
        where = f"pid {hello.pid} on {hello.host}" if hello else "not yet identified"
        return (f"tensor-parallel worker rank {rank} ({where}, node {self.layout.node_of(rank)}) "
                f"disconnected: it exited or its node is unreachable")

    def _record_death(self, rank: int, description: str) -> None:
        logger.error("%s", description)
        self.dead_rank = rank
        self.death = WorkerDiedError(description)
        os.write(self._wake_w, b"x")  # wakes any receive() of the main thread
        self.on_death(self.death)

    # -- stop ----------------------------------------------------------------------------------------

    def _stop_monitor(self) -> None:
        if self._monitor.is_alive():
            os.write(self._wake_w, b"s")
            self._monitor.join()

    def _stop_workers(self) -> None:
        """Stop message to every live worker; each finishes its step, tears down, and sends its report."""
        self._stop_monitor()
        if self.death is not None:
            logger.warning("stopping the tensor-parallel group after: %s", self.death)
        data = m.encode(m.Stop())
        deadline = time.monotonic() + WORKER_STOP_TIMEOUT_S
        for channel in self.channels.values():
            try:
                channel.send(data, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # that worker is gone; its process entry says how
        missing = [rank for rank in self.ranks
                   if rank == self.dead_rank or not self._await_report(rank, deadline)]
        if missing:
            raise RuntimeError(f"no teardown report from worker ranks {missing}")

    def _await_report(self, rank: int, deadline: float) -> bool:
        """Waits for worker `rank`'s `Stopped` (False if it fails, dies or is late instead)."""
        poller = zmq.Poller()
        poller.register(self.channels[rank], zmq.POLLIN)
        process = self.processes.get(rank)
        if process is not None:
            poller.register(process.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self.channels[rank] in events:
                message = m.decode_from_worker(self.channels[rank].recv())
                if isinstance(message, m.Stopped):
                    self.reports[rank] = message
                    return True
                if isinstance(message, m.Failed):
                    return False
            elif events or time.monotonic() >= deadline:
                return False  # the process ended without a report, or the time is up

    def _close_channels(self) -> None:
        for rank, channel in self.channels.items():
            channel.disable_monitor()
            self.monitors[rank].close(linger=0)
            channel.close(linger=0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _drop_store(self) -> None:
        # A TCPStore has no close(): its server (and port) go when the last reference does.
        del self.store
