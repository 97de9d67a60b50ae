"""A full filesystem where the runtime directory lives: at start-up, exit 3 naming the path; while serving,
no process dies of a signal: a write that finds no space is a clean fatal error naming the path, exit 1.
The filesystem is a small tmpfs mounted by the test (root only) as `$XDG_RUNTIME_DIR`."""

from __future__ import annotations

import httpx

from tests.faults.helpers import (
    assert_one_end,
    core_of,
    fill,
    finish,
    full_filesystem,
    leave_nothing_behind,
    serve,
    small_filesystem,
)
from tests.process_checks import leftover_children
from tests.server_process import ServerProcess


def test_a_full_runtime_filesystem_at_start_up_exits_3_naming_the_path(model):
    with full_filesystem() as full:
        server = ServerProcess(model, "--kv-cache-memory", "4MiB", "--num-threads", "1", wait_ready=False,
                               env={"XDG_RUNTIME_DIR": str(full)})
        assert server.wait_exit(60) == 3, server.log()
        log = server.log()
        server.close_log()
        assert "No space left on device" in log and f"heartbeat slot {full}/gracelm-" in log, log
        assert sorted(p.name for p in full.iterdir()) == ["filler"]  # the runtime directory is gone
    assert leftover_children() == []




def test_a_runtime_filesystem_filled_while_serving_is_a_clean_fatal_stop(model):
    with small_filesystem("1m") as runtime_base:
        server = serve(model, env={"XDG_RUNTIME_DIR": str(runtime_base)})
        core = core_of(server)
        try:
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            fill(runtime_base)
            # The first request makes the server's first latency histogram: a metrics file that finds no
            # room. The request fails (a generic 500), the server stops: no process dies of a signal.
            answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                                timeout=30)
            assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal_error"
            log = finish(server, 1, within=15)
        finally:
            leave_nothing_behind(server, core)
        assert_one_end(log, "stopped")  # the core was stopped on request, not killed by a signal
        fatal = next(line for line in log.splitlines() if "fatal: " in line and "cannot reserve" in line)
        assert f"metrics file {runtime_base}/gracelm-{server.pid}-" in fatal, fatal
        assert "No space left on device" in fatal, fatal
        assert "SIGBUS" not in log
        assert sorted(p.name for p in runtime_base.iterdir()) == ["filler"]  # the runtime directory is gone
    assert leftover_children() == []
