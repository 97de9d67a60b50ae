"""torch.distributed for tensor parallelism: where the ranks live, the TCP rendezvous, the process group.

The ranks of a tensor-parallel group are spread evenly over the nodes: node k holds ranks
k*L .. (k+1)*L - 1 with L = tensor_parallel_size / nnodes; rank 0, on node 0, lives in the engine core.
Rank 0 hosts the rendezvous store (a `TCPStore` on `--dist-init-addr`, or on a free port of 127.0.0.1 on
one node); the workers find there both the process group and the address of their step channel.

The group uses gloo: the model runs on the CPU. Its timeout bounds every collective, so a peer that hangs
mid-step turns into an error on the others instead of a hang; a peer that dies closes its connections and
the others' collectives fail at once.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import psutil
import torch.distributed as dist

from gracelm.config import EngineConfig
from gracelm.parallel.layout import LayoutError

logger = logging.getLogger(__name__)

BACKEND = "gloo"
# Which network interface gloo uses; when unset, the one that reaches the rendezvous host.
_GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
# How long workers and rank 0 wait for each other at start-up (the other node may start later).
RENDEZVOUS_TIMEOUT_S = 120.0
_LOCAL_HOST = "127.0.0.1"


def rendezvous_address(config: EngineConfig) -> tuple[str, int]:
    """HOST, PORT of the store: `dist_init_addr` across nodes; on one node 127.0.0.1 and port 0 (rank 0
    binds a free port and hands it to its local workers)."""
    if config.nnodes == 1 and not config.dist_init_addr:
        return _LOCAL_HOST, 0
    assert config.dist_init_addr
    host, sep, port = config.dist_init_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LayoutError(f"dist_init_addr must be HOST:PORT, got {config.dist_init_addr!r}")
    return host, int(port)


def create_store(host: str, port: int, rank: int, world_size: int) -> dist.TCPStore:
    """Rank 0 serves the store (returns at once); the others connect, retrying until the timeout."""
    return dist.TCPStore(host, port, world_size, is_master=rank == 0,
                         timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S), wait_for_workers=False)


def init_process_group(store: dist.TCPStore, rank: int, world_size: int, timeout: float) -> None:
    """Joins the gloo group; each collective fails after `timeout` s without its peers (`--dist-timeout`:
    long enough for the slowest legitimate step; the core monitor's hang timeout is the finer net)."""
    # Unasked, gloo takes the address the machine's hostname resolves to, often 127.0.1.1 (Debian's
    # /etc/hosts): a rank on another host would then be told to connect to its own loopback.
    interface = None
    if _GLOO_INTERFACE_ENV not in os.environ:
        interface = _interface_towards(store.host, store.port)
        if interface is not None:
            logger.info("rank %d: gloo on %s, the interface that reaches %s", rank, interface, store.host)
            os.environ[_GLOO_INTERFACE_ENV] = interface
    try:
        dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    finally:
        # Gloo read it as it made the group. Left set, it would reach what the process starts or runs next
        # (an `Engine` user's process: another engine across hosts, on this one's loopback).
        if interface is not None:
            del os.environ[_GLOO_INTERFACE_ENV]


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def channel_key(rank: int) -> str:
    """The store key under which rank 0 publishes the address of worker `rank`'s step channel."""
    return f"gracelm/step-channel/{rank}"


def _interface_towards(host: str, port: int) -> str | None:
    """The name of the network interface this machine sends to `host` from (None if no interface has the
    address the route picks)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # a UDP connect sends nothing: it only chooses the route and source address
        local = probe.getsockname()[0]
    return next((name for name, addresses in psutil.net_if_addrs().items()
                 if any(a.address.split("%")[0] == local for a in addresses)), None)
