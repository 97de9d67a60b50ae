"""Faults of the start-up: a stop signal while the weights load abandons the start (exit 0); a taken port and
a model that cannot be read are start-up failures (exit 3) naming what failed. Nothing is left."""

from __future__ import annotations

import shutil
import signal
import socket
import time

import pytest

from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base
from tests.faults.helpers import finish, serve
from tests.server_process import ServerProcess


def test_sigterm_while_the_weights_load_abandons_the_start(model):
    server = serve(model, wait_ready=False, test_slow_load_s=60)
    deadline = time.monotonic() + 60
    while "delaying the model load" not in server.log():
        assert time.monotonic() < deadline and server.process.poll() is None, server.log()
        time.sleep(0.1)
    server.capture()
    assert any("engine-core" in " ".join(p.cmdline()) for p in server.children)
    server.process.send_signal(signal.SIGTERM)
    log = finish(server, 0, within=15)
    assert "start-up abandoned: SIGTERM" in log
    assert not list(runtime_base().glob(f"{PREFIX}{server.pid}-*"))


def _serve_exit(model: str | None, *args: str, prefix: tuple[str, ...] = ()) -> tuple[int, str]:
    """A start that must fail: its exit code and log, once nothing of it is left."""
    server = ServerProcess(model, *args, wait_ready=False, prefix=prefix)
    code = server.wait_exit(120)
    server.assert_nothing_left()
    log = server.log()
    server.close_log()
    return code, log


def test_missing_model_is_a_startup_failure(tmp_path):
    code, log = _serve_exit(str(tmp_path / "no-such-model"))
    assert code == 3, log
    assert "start-up failed" in log and "no-such-model" in log


def test_port_in_use_is_a_startup_failure():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        started = time.monotonic()
        code, log = _serve_exit(None, "--port", str(taken.getsockname()[1]))
    assert code == 3, log
    assert "cannot listen" in log
    assert time.monotonic() - started < 30  # refused before any model is loaded


def test_an_unreadable_weights_file_exits_3_naming_it(model, tmp_path):
    """chmod 000 stops no root process: the server runs as root without the capabilities that override file
    permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH dropped from its bounding set), so the kernel
    refuses the read as it would for any other user."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop the file-permission capabilities")
    unreadable = tmp_path / "model"
    shutil.copytree(model, unreadable)
    weights = unreadable / "model.safetensors"
    weights.chmod(0)
    without_override = ("setpriv", "--bounding-set=-dac_override,-dac_read_search")
    code, log = _serve_exit(str(unreadable), prefix=without_override)
    assert code == 3, log
    assert f"cannot read the weights file {weights}: Permission denied" in log, log
