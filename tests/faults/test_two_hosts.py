"""Two nodes of a tensor-parallel group on two hosts of their own (network namespaces joined by a veth pair,
`tests/faults/netns.py`): node 0 (`gracelm serve`, rank 0, HTTP) on host A, node 1 (headless, rank 1) on
host B. A SIGTERM to node 0 drains both; cutting the link under load makes both sides fail fast, naming the
peer. Nothing is left on either."""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults.netns import HOST_A, TwoHosts
from tests.server_process import ServerProcess, Stream, free_port, port_is_free

pytestmark = pytest.mark.timeout(180)


class Nodes:
    """Node 1 on host B, then node 0 on host A, both slowed a little so that a stream lasts."""

    def __init__(self, hosts: TwoHosts, model: str, *args: str) -> None:
        self.hosts = hosts
        common = ("--tensor-parallel-size", "2", "--nnodes", "2",
                  "--dist-init-addr", f"{HOST_A}:{free_port()}", "--num-threads", "1",
                  "--kv-cache-memory", "4MiB", "--stats-interval", "0", *args)
        env = {"GRACELM_TEST_HOOKS": '{"test_step_sleep_s": 0.02}'}
        self.node1 = ServerProcess(model, *common, "--node-rank", "1", wait_ready=False, env=env,
                                   prefix=hosts.prefix(hosts.b))
        self.node0 = ServerProcess(model, *common, "--node-rank", "0", wait_ready=False, env=env,
                                   prefix=hosts.prefix(hosts.a))
        self.nodes = (self.node0, self.node1)
        try:
            hosts.run(hosts.a, self.node0.wait_ready, 180, (self.node1,))
            self.node1.capture()
        except BaseException:
            self.kill()
            raise

    def streams(self, count: int, max_tokens: int) -> list[Stream]:
        """Streams from host A, each started (a first token arrived)."""
        def start() -> list[Stream]:
            streams = [Stream(self.node0.url, max_tokens) for _ in range(count)]
            for stream in streams:
                stream.wait_started()
            return streams

        return self.hosts.run(self.hosts.a, start)

    def wait_exits(self, timeout: float) -> tuple[int, int]:
        return self.node0.wait_exit(timeout), self.node1.wait_exit(timeout)

    def assert_nothing_left(self) -> None:
        """Nothing of either node: processes, runtime directories, segments, and node 0's port on host A."""
        for node in self.nodes:
            node.assert_nothing_left()
        assert self.hosts.run(self.hosts.a, port_is_free, self.node0.port), "node 0's port still in use"

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def close_logs(self) -> None:
        for node in self.nodes:
            node.close_log()


@pytest.fixture
def hosts():
    with TwoHosts() as hosts:
        yield hosts


def test_sigterm_to_node_0_drains_both_hosts(hosts, tp_model):
    nodes = Nodes(hosts, tp_model)
    try:
        streams = nodes.streams(2, max_tokens=60)
        nodes.node0.process.send_signal(signal.SIGTERM)
        for stream in streams:
            stream.join(60)
            assert stream.error is None and stream.events[-1] == "[DONE]", stream.events
            assert stream.finish_reasons == ["length"] and stream.completion_tokens == 60
        assert nodes.wait_exits(60) == (0, 0), nodes.node0.log()[-3000:] + nodes.node1.log()[-3000:]
        nodes.assert_nothing_left()
        assert "process group  gloo rank 1/2" in nodes.node1.log()
    except BaseException:
        nodes.kill()
        raise
    finally:
        nodes.close_logs()


def test_the_link_cut_under_load_fails_both_hosts_fast_naming_the_peer(hosts, tp_model):
    dist_timeout = 3.0  # a collective waits this long for a peer (default 60 s)
    nodes = Nodes(hosts, tp_model, "--dist-timeout", str(dist_timeout))
    try:
        streams = nodes.streams(2, max_tokens=400)
        cut = time.monotonic()
        hosts.set_link(hosts.b, hosts.link_b, "down")
        codes = nodes.wait_exits(30)
        elapsed = time.monotonic() - cut
        log0, log1 = nodes.node0.log(), nodes.node1.log()
        assert codes == (1, 1), log0[-3000:] + log1[-3000:]
        assert elapsed < dist_timeout + 5, elapsed
        for stream in streams:
            stream.join(10)
            assert stream.events[-1] == "[DONE]" and [e["code"] for e in stream.errors] == ["engine_dead"]
        nodes.assert_nothing_left()
        assert "worker rank 1" in log0 and "node 1" in log0 and "unreachable" in log0, log0[-3000:]
        assert f"rank 0 at tcp://{HOST_A}:" in log1, log1[-3000:]
    except BaseException:
        nodes.kill()
        raise
    finally:
        nodes.close_logs()
