"""Two nodes of a tensor-parallel group on one machine, over 127.0.0.1: node 0 a `gracelm serve` with rank 0,
node 1 a headless `gracelm serve --node-rank 1` with rank 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil

from tests.server_process import ServerProcess, free_port


class TwoNodes:
    """Node 0: `gracelm serve` with rank 0; node 1: `gracelm serve --node-rank 1`, headless, with rank 1."""

    def __init__(self, model: Path) -> None:
        self.addr = f"127.0.0.1:{free_port()}"
        common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", self.addr,
                  "--num-threads", "1"]
        self.node1 = subprocess.Popen(
            [str(Path(sys.executable).parent / "gracelm"), "serve", "--model", str(model), *common,
             "--node-rank", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            self.node0 = ServerProcess(model, *common, "--node-rank", "0", "--kv-cache-memory", "4MiB")
        except BaseException:
            self.node1.kill()
            self.node1.wait()
            raise
        self.node1_procs = [psutil.Process(self.node1.pid), *psutil.Process(self.node1.pid).children(True)]

    def node1_output(self, timeout: float) -> tuple[int, str]:
        out, _ = self.node1.communicate(timeout=timeout)
        return self.node1.returncode, out

    def kill_all(self) -> None:
        self.node0.kill()
        self.node0.close_log()
        for proc in self.node1_procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.node1.wait(10)


