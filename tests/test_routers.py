"""gracelm behind the field's own routers, vllm-router and sglang-router from PyPI: every kind of request
routes to two workers without an error, under each router's own defaults and under the command line
`gracelm deploy router` writes; and
`gracelm fleet` restarts its workers one by one under a streaming load without losing a request, then
stops with nothing left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from gracelm.deploy import router
from tests.process_checks import wait_until
from tests.server_process import GRACELM, ServerProcess, free_port, port_is_free
from tests.tiny_models import tiny_model

MODEL = "tiny"
BIN = str(Path(sys.executable).parent)
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def workers():
    args = ("--served-model-name", MODEL, "--kv-cache-memory", "16MiB")
    with ServerProcess(tiny_model(), *args) as a, ServerProcess(tiny_model(), *args) as b:
        yield a, b


def _wait_ok(url: str, child: subprocess.Popen, timeout: float = 60) -> None:
    """Until `url` answers 200; fails at once if `child` (what serves it) exits."""
    def ok() -> bool:
        assert child.poll() is None, f"{child.args} exited with {child.returncode}"
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ok, timeout, url, interval=0.2)


def _router(which: str, policy: str, worker_urls: list[str], tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """The router: with its own defaults alone (`policy` "defaults"), else as `gracelm deploy router` writes
    it."""
    port = free_port()
    if policy == "defaults":
        command = [*router.COMMANDS[which], "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", *worker_urls]
    else:
        urls = [w for url in worker_urls for w in ("--worker-url", url)]
        script = subprocess.run([str(GRACELM), "deploy", "router", str(tiny_model()), "--router", which,
                                 "--policy", policy, "--router-port", str(port), *urls],
                                capture_output=True, text=True, check=True).stdout
        path = tmp_path / f"{which}-router.sh"
        path.write_text(script)
        command = ["sh", str(path)]
    log = open(tmp_path / f"{which}-router.log", "w")  # noqa: SIM115 (closed with the router)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
    process.log = log  # type: ignore[attr-defined]
    return process, f"http://127.0.0.1:{port}"


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(30)
    process.log.close()  # type: ignore[attr-defined]


def _every_kind_of_request(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=6)
    assert chat.choices[0].message.content is not None
    text = client.completions.create(model=MODEL, prompt="the cat", max_tokens=6)
    assert text.choices[0].text
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=6, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    called = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, tools=[TOOL],
                                            tool_choice="required", temperature=0)
    assert called.choices[0].message.tool_calls or called.choices[0].finish_reason == "length"
    shaped = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    assert shaped.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("which", ["vllm", "sglang"])
@pytest.mark.parametrize("policy", ["defaults", "round_robin"])
def test_each_router_routes_every_kind_of_request_to_both_workers(workers, which, policy, tmp_path):
    before = [_finished(w.url) for w in workers]
    process, url = _router(which, policy, [w.url for w in workers], tmp_path)
    try:
        _wait_ok(f"{url}/health", process)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        _every_kind_of_request(client)  # any 4xx or 5xx raises
        assert [m.id for m in client.models.list().data] == [MODEL]  # the router read the workers' names
    finally:
        _stop(process)
    if policy == "round_robin":
        after = [_finished(w.url) for w in workers]
        assert all(a > b for a, b in zip(after, before, strict=True)), f"one got nothing: {before} → {after}"


def _finished(url: str) -> float:
    """Requests the worker finished, by any reason (a reason it has not met yet has no sample)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gracelm_request_success_total{"))


class Load:
    """Bounded streaming load: `clients` threads each streaming chats until stopped; every failure kept."""

    def __init__(self, url: str, clients: int) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        self.done = threading.Event()
        self.completed = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                chunks = list(self.client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=16, stream=True,
                    extra_body={"ignore_eos": True}))
                reasons = [c.choices[0].finish_reason for c in chunks
                           if c.choices and c.choices[0].finish_reason]
                if reasons == ["length"]:
                    self.completed += 1
                else:
                    self.failures.append(f"stream ended with {reasons}")
            except openai.OpenAIError as exc:
                self.failures.append(repr(exc))

    def stop(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(120)


def _ports_in_a_row(count: int) -> int:
    """A port free with the `count` - 1 after it (the fleet's router and workers)."""
    for _ in range(100):
        port = free_port()
        if port + count <= 65535 and all(port_is_free(port + i) for i in range(count)):
            return port
    raise RuntimeError(f"no {count} free ports in a row")


class Fleet:
    """`with Fleet(tmp_path, *fleet options) as fleet:` a `gracelm fleet` of two workers on free ports, its
    log in `tmp_path`; `stop()` does the checks; killed if a test leaves it running."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = _ports_in_a_row(3)
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(2)]
        self.log_path = tmp_path / "fleet.log"
        with open(self.log_path, "w") as log:
            command = [str(GRACELM), "fleet", str(tiny_model()), "--port", str(self.port), "--replicas", "2"]
            self.process = subprocess.Popen([*command, *args], stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.children: list[psutil.Process] = []

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        """Until the fleet logs `text`; fails at once if it exits."""
        def logged() -> bool:
            assert self.process.poll() is None, self.log()[-3000:]
            return text in self.log()

        wait_until(logged, timeout, lambda: f"{text!r} not logged:\n{self.log()[-3000:]}", interval=0.2)

    def capture(self) -> None:
        """Records the processes that must be gone after the stop."""
        self.children = psutil.Process(self.process.pid).children(recursive=True)

    def stop(self) -> str:
        """SIGTERM, then asserts: exit code 0, no process of the fleet left, its ports free. Its log."""
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(120) == 0, self.log()[-3000:]
        _, alive = psutil.wait_procs(self.children, timeout=10)
        assert not alive, f"left running: {alive}"
        assert all(port_is_free(self.port + i) for i in range(3))
        return self.log()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *_) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def test_a_rolling_restart_of_the_fleet_loses_no_request_and_its_stop_leaves_nothing(tmp_path):
    with Fleet(tmp_path, "--served-model-name", MODEL, "--kv-cache-memory", "16MiB") as fleet:
        fleet.wait_for("fleet ready")
        fleet.capture()
        load = Load(fleet.url, clients=3)
        try:
            time.sleep(1)  # the load reaches both workers before the restart begins
            fleet.process.send_signal(signal.SIGHUP)
            fleet.wait_for("rolling restart done", timeout=180)
            # Both restarted workers are back in rotation: each finishes requests of the load.
            after = [_finished(url) for url in fleet.workers]
            wait_until(lambda: all(_finished(u) > n for u, n in zip(fleet.workers, after, strict=True)), 30,
                       "both restarted workers finishing requests", interval=0.2)
        finally:
            load.stop()
        assert not load.failures, load.failures[:5]
        assert load.completed > 0
        log = fleet.stop()
    assert re.findall(r"worker (\d) restarted", log) == ["0", "1"]
    # The workers' access logs keep the requests and leave out the router's checks, one a second.
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log and '"GET /ready HTTP/1.1"' not in log


def test_a_fleet_stopped_while_its_workers_start_starts_no_router_and_leaves_nothing(tmp_path):
    with Fleet(tmp_path) as fleet:
        # A worker loads its model: the fleet has set its signal handlers before it started them.
        fleet.wait_for("gracelm.model.loader")
        fleet.capture()
        log = fleet.stop()
    assert "fleet stopping" in log and "fleet ready" not in log


def test_a_router_script_refuses_a_grace_period_shorter_than_its_health_checks():
    result = subprocess.run([str(GRACELM), "deploy", "router", "/m.gguf", "--worker-url", "http://a:1",
                             "--drain-grace-period", "1"], capture_output=True, text=True)
    assert result.returncode == 2 and "--drain-grace-period 1" in result.stderr
    result = subprocess.run([str(GRACELM), "deploy", "router", "/m.gguf"], capture_output=True, text=True)
    assert result.returncode == 2 and "--worker-url" in result.stderr
    script = subprocess.run([str(GRACELM), "deploy", "router", "/m.gguf", "--worker-url", "http://a:1"],
                            capture_output=True, text=True, check=True).stdout
    assert "--drain-grace-period=5" in script and "--health-check-endpoint /ready" in script
