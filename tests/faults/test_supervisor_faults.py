"""Kill -9 of the supervisor: every child follows within a second, and the next start reclaims the runtime
directory it left."""

from __future__ import annotations

import time

import psutil

from tests.faults.helpers import serve


def test_kill_9_of_the_supervisor_takes_every_child_and_the_next_start_reclaims(model):
    server = serve(model)
    server.capture()
    (runtime_dir,) = server.runtime_dirs
    killed = time.monotonic()
    server.process.kill()
    server.wait_exit(5)
    _, alive = psutil.wait_procs(server.children, timeout=1.0)
    # A zombie is dead: only its parent (gone) or init may still reap it.
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"children outlived their parent by 1 s: {alive}"
    assert time.monotonic() - killed < 1.5
    assert runtime_dir.exists()  # SIGKILL leaves it; the next start reclaims it
    server.close_log()
    with serve(model) as following:  # stopped, or killed if an assertion fails: nothing outlives the test
        assert f"reclaimed stale runtime dir {runtime_dir}" in following.log()
        assert not runtime_dir.exists()


