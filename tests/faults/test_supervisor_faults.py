"""Kill -9 of the supervisor: every child follows within a second, and the next start reclaims the runtime
directory it left, the engine core's temporary files with it: nothing is left in TMPDIR."""

from __future__ import annotations

import signal
import time

import psutil

from tests.faults.helpers import serve
from tests.server_process import temp_entries


def test_kill_9_of_the_supervisor_takes_every_child_and_the_next_start_reclaims(model):
    temp_before = set(temp_entries())
    server = serve(model)
    try:
        server.capture()
        (runtime_dir,) = server.runtime_dirs
        # The core's temporary files (a compiled graph torch unpacks, say) are the runtime directory's.
        (runtime_dir / "tmp" / "aotinductor_unpacking").mkdir()  # as if killed while a package unpacks
    except BaseException:
        server.kill()  # nothing of it outlives the test
        raise
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
    assert [entry for entry in temp_entries() if entry not in temp_before] == []




def test_a_fatal_signal_of_the_supervisor_is_logged_its_children_follow_and_the_next_start_reclaims(model):
    """A native crash of the supervisor itself (SIGSEGV, as a library on its event loop once caused): its
    stacks in the log, every child gone within a second, and the next start reclaims what it left."""
    temp_before = set(temp_entries())
    server = serve(model)
    try:
        server.capture()
        (runtime_dir,) = server.runtime_dirs
    except BaseException:
        server.kill()
        raise
    server.process.send_signal(signal.SIGSEGV)
    assert server.wait_exit(5) == -signal.SIGSEGV
    _, alive = psutil.wait_procs(server.children, timeout=1.5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    log = server.log()
    assert "Fatal Python error: Segmentation fault" in log and "Current thread" in log, log[-3000:]
    server.close_log()
    with serve(model) as following:
        assert f"reclaimed stale runtime dir {runtime_dir}" in following.log()
    assert [entry for entry in temp_entries() if entry not in temp_before] == []
