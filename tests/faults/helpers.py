"""What the fault cases share: a slowed tiny server, its core, how it must end, a full filesystem, a memory
cgroup, the core's end lines in the log, and the clean-up after a case that failed half-way."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from gracelm.memory_budget import CGROUP_ROOT, own_cgroup
from tests.server_process import ServerProcess


def serve(model: str, *args: str, wait_ready: bool = True, env: dict[str, str] | None = None,
          **hooks) -> ServerProcess:
    hooks = {"test_step_sleep_s": 0.02, **hooks}
    return ServerProcess(model, "--kv-cache-memory", "4MiB", "--stats-interval", "0",
                         "--max-model-len", "512", "--num-threads", "1", *args, wait_ready=wait_ready,
                         env={"GRACELM_TEST_HOOKS": json.dumps(hooks), **(env or {})})


def core_of(server: ServerProcess) -> psutil.Process:
    return next(p for p in server.children if "engine-core" in " ".join(p.cmdline()))


def finish(server: ServerProcess, code: int, within: float) -> str:
    assert server.wait_exit(within) == code, server.log()[-5000:]
    server.assert_nothing_left()
    log = server.log()
    server.close_log()
    return log


def plain_request(url: str, result: list) -> threading.Thread:
    def run() -> None:
        body = {"prompt": "a dog", "max_tokens": 400, "ignore_eos": True}
        result.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def health_once_failure_known(url: str, within: float = 2.0) -> int | str:
    """`/health` as soon as it stops answering 200: it must turn 503 before the server goes away (it answers
    for a quarter of a second). One client, its connection kept: a new client a poll (an SSL context, a
    connect) costs tens of milliseconds on a loaded machine, enough to miss that window."""
    deadline = time.monotonic() + within
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            try:
                status = client.get(f"{url}/health").status_code
            except httpx.TransportError as e:
                return f"unreachable: {e!r}"
            if status != 200:
                return status
            time.sleep(0.01)
    return 200


def kill_9_when_idle(server: ServerProcess, process: psutil.Process) -> str:
    """SIGKILL of an idle process of the server: `/health` turns 503 before the server goes away, and the
    server exits 1 within 2 s of the kill, leaving nothing. Returns its log."""
    killed = time.monotonic()
    process.kill()
    health = health_once_failure_known(server.url)
    assert server.wait_exit(5) == 1, server.log()[-5000:]
    assert time.monotonic() - killed < 2.0
    log = finish(server, 1, within=5)
    assert health == 503
    return log


@contextlib.contextmanager
def small_filesystem(size: str = "64k"):
    """A tmpfs of `size` mounted by the test (root only) on a folder of its own in /tmp, unmounted and removed
    at the end. Not in the test's `tmp_path`: a server's sockets in it must have paths of at most 107
    characters, and `tmp_path` is long under a private TMPDIR or a pytest-xdist worker."""
    mount_point = Path(tempfile.mkdtemp(prefix="gracelm-fs-", dir="/tmp"))
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
        try:
            yield mount_point
        finally:
            subprocess.run(["umount", str(mount_point)], check=True)
    finally:
        mount_point.rmdir()


@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A memory cgroup (v1 or v2) under this process's own, limited to `limit` bytes, and the prefix of a
    command that runs in it; removed at the end. Skips where the test may not make one (no write access
    to the cgroup tree, or v2 without the memory controller delegated)."""
    v1, v2 = own_cgroup("memory"), own_cgroup("")
    candidates = [] if v1 is None else [(CGROUP_ROOT / "memory" / v1.lstrip("/"), "memory.limit_in_bytes")]
    candidates += [] if v2 is None else [(CGROUP_ROOT / v2.lstrip("/"), "memory.max")]
    for parent, limit_file in candidates:
        folder = parent / f"gracelm-test-{os.getpid()}"
        try:
            folder.mkdir()
        except OSError:
            continue
        try:
            (folder / limit_file).write_text(str(limit))
        except OSError:
            folder.rmdir()
            continue
        try:
            yield folder, ("sh", "-c", f'echo $$ > {folder / "cgroup.procs"} && exec "$@"', "sh")
        finally:
            folder.rmdir()
        return
    pytest.skip("no memory cgroup can be made here (no write access to /sys/fs/cgroup's memory tree)")


def fill(mount_point) -> None:
    """Writes a file `filler` until no byte fits."""
    with contextlib.suppress(OSError), (mount_point / "filler").open("wb") as filler:
        while True:
            filler.write(b"\0" * 4096)
            filler.flush()


@contextlib.contextmanager
def full_filesystem():
    """A tmpfs of 64 KiB, filled up: a runtime directory where no byte can be written."""
    with small_filesystem() as mount_point:
        fill(mount_point)
        yield mount_point


ENDED = re.compile(r"engine core ended \((\w+)\): (.*)$")


def ended_lines(log: str) -> list[tuple[str, str, str]]:
    """Every `engine core ended (<reason>): <message>` line of the log: (reason, message, the whole line)."""
    found = []
    for line in log.splitlines():
        m = ENDED.search(line)
        if m:
            found.append((m.group(1), m.group(2), line))
    return found


def assert_one_end(log: str, reason: str) -> str:
    """Exactly one end line in the log, with `reason` (and no other reason's); returns its message. A fatal
    end is logged at ERROR, a requested stop at INFO."""
    ends = ended_lines(log)
    assert [r for r, _, _ in ends] == [reason], f"end lines: {[line for _, _, line in ends]}\n{log[-5000:]}"
    (_, message, line), = ends
    level = "INFO" if reason == "stopped" else "ERROR"
    assert f" {level} " in line, line
    return message


def leave_nothing_behind(server: ServerProcess, core: psutil.Process) -> None:
    """After a test that failed early: resumes and kills the core (stopped, it might outlive everything
    else) and then the whole server, by pid."""
    with contextlib.suppress(psutil.Error):
        core.resume()
        core.kill()
    if server.process.poll() is None:
        server.kill()


def wait_stopped(process: psutil.Process, within: float = 2.0) -> None:
    """SIGSTOP takes effect asynchronously: a process running on another CPU stops a moment later."""
    deadline = time.monotonic() + within
    while process.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"pid {process.pid} not stopped: {process.status()}"
        time.sleep(0.01)

