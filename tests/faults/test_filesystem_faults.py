"""A full filesystem where the runtime directory lives: at start-up, exit 3 naming the path; while serving,
no process dies of a signal: a write that finds no space is a clean fatal error naming the path, exit 1.
The filesystem is a small tmpfs mounted by the test (root only) as `$XDG_RUNTIME_DIR`."""

from __future__ import annotations

from tests.faults.helpers import full_filesystem
from tests.process_checks import leftover_children
from tests.server_process import ServerProcess


def test_a_full_runtime_filesystem_at_start_up_exits_3_naming_the_path(model, tmp_path):
    with full_filesystem(tmp_path) as full:
        server = ServerProcess(model, "--kv-cache-memory", "4MiB", "--num-threads", "1", wait_ready=False,
                               env={"XDG_RUNTIME_DIR": str(full)})
        assert server.wait_exit(60) == 3, server.log()
        log = server.log()
        server.close_log()
        assert "No space left on device" in log and f"heartbeat slot {full}/gracelm-" in log, log
        assert sorted(p.name for p in full.iterdir()) == ["filler"]  # the runtime directory is gone
    assert leftover_children() == []


