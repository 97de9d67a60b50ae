"""Faults of the start-up: a stop signal while the weights load abandons the start (exit 0); a taken port and
a model that cannot be read are start-up failures (exit 3) naming what failed. Nothing is left."""

from __future__ import annotations

import signal
import time

from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base
from tests.faults.helpers import finish, serve


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


