"""Two hosts of their own for a test: two network namespaces joined by a veth pair, each end with its own
address (`HOST_A` and `HOST_B`, on a /24 that exists only inside them), made by the test and removed at the
end even after a failure. Needs root and iproute2.

A process is started in a namespace with the prefix `ip netns exec <name>` (which execs in place: same pid).
The test itself reaches a namespace from a thread of its own that enters it (`in_namespace`): a network
namespace is per thread, and the threads that thread starts inherit it, so httpx and the `Stream` helper
work there unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

HOST_A = "10.231.0.1"
HOST_B = "10.231.0.2"
_PREFIX_LEN = 24
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)

T = TypeVar("T")


class TwoHosts:
    def __init__(self) -> None:
        # Names of our own (the pid), so that concurrent runs never share or delete each other's.
        self.a = f"gracelm-test-{os.getpid()}-a"
        self.b = f"gracelm-test-{os.getpid()}-b"
        self.link_a = "veth-a"  # names inside the namespaces only
        self.link_b = "veth-b"

    def prefix(self, namespace: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", namespace)

    def set_link(self, namespace: str, link: str, state: str) -> None:
        _ip("-n", namespace, "link", "set", link, state)

    def run(self, namespace: str, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` in a thread inside `namespace`; its result (or its exception)."""
        outcome: list[Any] = []

        def target() -> None:
            try:
                with in_namespace(namespace):
                    outcome.append((True, function(*args)))
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                outcome.append((False, e))

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def __enter__(self) -> TwoHosts:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            pytest.skip("two hosts of their own need root and iproute2 (network namespaces)")
        try:
            _ip("netns", "add", self.a)
            _ip("netns", "add", self.b)
            _ip("link", "add", self.link_a, "netns", self.a, "type", "veth", "peer", "name", self.link_b,
                "netns", self.b)
            for namespace, link, address in ((self.a, self.link_a, HOST_A), (self.b, self.link_b, HOST_B)):
                _ip("-n", namespace, "addr", "add", f"{address}/{_PREFIX_LEN}", "dev", link)
                _ip("-n", namespace, "link", "set", link, "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        # Deleting a namespace deletes the veth end in it, and with it the pair.
        for namespace in (self.a, self.b):
            if os.path.exists(f"/run/netns/{namespace}"):
                _ip("netns", "delete", namespace)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


@contextlib.contextmanager
def in_namespace(name: str) -> Iterator[None]:
    """The calling thread in network namespace `name`, then back in its own."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")
