"""Lifecycle timings of a real `gracelm serve` (default model unless --model): launch to `/ready` 200;
SIGTERM to exit when idle; SIGTERM to exit with 16 streams in flight, beside the time those requests needed
anyway (`alone`) and their own time when the SIGTERM came after their first tokens (`drained`); `kill -9`
of the engine core to `/health` 503 (the failure detected and stated) and to the supervisor's exit;
`kill -9` of the supervisor to its last child gone. Median of --repeat runs. Run by hand:
`python bench/lifecycle.py [--repeat 5] [--model PATH]`.

`--startup` measures the start instead: launch to `/ready` 200 of `gracelm serve` with a cold cache (once,
a fresh `GRACELM_CACHE_DIR`: the tokenizer and the weights are converted) and then a warm one (the same
directory), beside a bare `python -c "import torch"` and, given `--llama-server PATH` (and `--model` a GGUF
file, the default model if not given), llama.cpp's `llama-server` started to a 200 on `/health`, each
--repeat times in turns so that a change in the machine's load touches them alike; medians, and their
ratios to the torch import. Polled every 10 ms.

"Gone", for the children of a killed supervisor, is measured two ways: `dead` when the last one has stopped
running (exited: a zombie or already reaped; a zombie holds no memory, file, socket or device, only its
exit status), `reaped` when the last one has also left the process table. The children of a dead parent are
reparented to init (or the nearest subreaper), which reaps them when it gets round to it: the gap between
the two is that process's, not the server's.

The servers run with OpenMP threads that wait passively (unless OMP_WAIT_POLICY is set already), as the test
suite does: with spinning threads, a 2-thread engine core on a 2-core machine that any other process also
uses slows down some twentyfold (measured: one decode step every 1-2 s instead of ~20 per second), and the
stream figures would measure the neighbours instead of the drain."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gracelm.lifecycle.stale import reclaim_stale  # noqa: E402
from gracelm.model.model_files import default_model_path  # noqa: E402
from tests.server_process import GRACELM, ServerProcess, free_port, start_streams  # noqa: E402

STREAM_TOKENS = 64
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the servers started below


def launch(model: str | None) -> tuple[ServerProcess, float]:
    started = time.monotonic()
    # A drain long enough for 16 streams on a busy 2-core machine: the bench measures the drain, not its cut.
    server = ServerProcess(model, "--stats-interval", "0", "--shutdown-timeout", "300")
    return server, time.monotonic() - started


def timed_exit(server: ServerProcess, act) -> float:
    started = time.monotonic()
    act()
    server.wait_exit(120)
    elapsed = time.monotonic() - started
    server.assert_nothing_left()
    server.close_log()
    return elapsed


def run_once(model: str | None) -> dict[str, float]:
    figures = {}
    server, figures["launch_to_ready_s"] = launch(model)
    figures["idle_sigterm_exit_s"] = timed_exit(server, server.process.terminate)

    server, _ = launch(model)
    started = time.monotonic()
    for stream in start_streams(server.url, 16, STREAM_TOKENS):
        stream.join()
    figures["16_streams_alone_s"] = time.monotonic() - started
    started = time.monotonic()
    streams = start_streams(server.url, 16, STREAM_TOKENS)
    server.capture()
    figures["16_streams_sigterm_exit_s"] = timed_exit(server, server.process.terminate)
    # The same requests' own time, from their start as above, with the SIGTERM after their first tokens:
    # the drain must not slow them.
    figures["16_streams_drained_s"] = max(s.join().ended_at for s in streams) - started
    reasons = [s.finish_reasons for s in streams]
    assert all(r == ["length"] for r in reasons), reasons

    server, _ = launch(model)
    server.capture()
    core = next(p for p in server.children if "engine-core" in " ".join(p.cmdline()))
    started = time.monotonic()
    core.kill()
    figures["core_kill9_to_health_503_s"] = wait_health_failed(server.url) - started
    assert server.wait_exit(120) == 1, server.log()[-3000:]
    figures["core_kill9_to_exit_s"] = time.monotonic() - started
    server.assert_nothing_left()
    server.close_log()

    server, _ = launch(model)
    server.capture()
    started = time.monotonic()
    server.process.kill()
    dead, reaped = wait_gone(server.children, timeout=5)
    figures["supervisor_kill9_to_last_child_dead_s"] = dead - started
    figures["supervisor_kill9_to_last_child_reaped_s"] = reaped - started
    server.wait_exit(5)
    server.close_log()
    return figures


def wait_health_failed(url: str) -> float:
    """When (monotonic) `/health` first answered something else than 200; it must be 503."""
    while True:
        status = httpx.get(f"{url}/health", timeout=5).status_code
        if status != 200:
            assert status == 503, status
            return time.monotonic()
        time.sleep(0.002)


def wait_gone(procs: list[psutil.Process], timeout: float) -> tuple[float, float]:
    """When (monotonic) the last of `procs` stopped running, and when the last left the process table.
    Polled every 2 ms: these are not our children, so there is no sentinel to wait on."""
    dead: dict[int, float] = {}
    reaped: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(reaped) < len(procs):
        if time.monotonic() > deadline:
            raise AssertionError(f"children still present {timeout} s after the supervisor's death: "
                                 f"{[p for p in procs if p.pid not in reaped]}")
        for proc in procs:
            if proc.pid in reaped:
                continue
            now = time.monotonic()
            try:
                zombie = proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                dead.setdefault(proc.pid, now)
                reaped[proc.pid] = now
                continue
            if zombie:
                dead.setdefault(proc.pid, now)
        time.sleep(0.002)
    return max(dead.values()), max(reaped.values())


def time_to_ok(command: list[str], url: str, env: dict[str, str] | None = None) -> float:
    """Seconds from launching `command` to a 200 from `url`; then the process is stopped (SIGTERM)."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {process.returncode} before {url} answered")
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def gracelm_ready(model: str | None, cache: str) -> float:
    port = free_port()
    command = [str(GRACELM), "serve", *([model] if model else []), "--port", str(port),
               "--stats-interval", "0"]
    return time_to_ok(command, f"http://127.0.0.1:{port}/ready", {"GRACELM_CACHE_DIR": cache})


def llama_server_ready(binary: str, model: str) -> float:
    port = free_port()
    command = [binary, "-m", model, "-t", "2", "-np", "32", "-c", "32768", "--port", str(port),
               "--host", "127.0.0.1"]
    return time_to_ok(command, f"http://127.0.0.1:{port}/health")


def import_torch() -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - started


def startup(model: str | None, repeat: int, llama_server: str | None) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {"gracelm_cold_cache_s": [], "gracelm_warm_cache_s": [],
                                       "import_torch_s": []}
    if llama_server:
        figures["llama_server_s"] = []
    with tempfile.TemporaryDirectory(prefix="gracelm-bench-cache-") as cache:
        figures["gracelm_cold_cache_s"].append(gracelm_ready(model, cache))
        for _ in range(repeat):
            figures["import_torch_s"].append(import_torch())
            figures["gracelm_warm_cache_s"].append(gracelm_ready(model, cache))
            if llama_server:
                figures["llama_server_s"].append(llama_server_ready(llama_server,
                                                                    model or str(default_model_path())))
    return figures


def print_figures(figures: dict[str, list[float]]) -> None:
    for key, values in figures.items():
        print(f"{key:40s} median {statistics.median(values):7.3f}  (runs: "
              f"{', '.join(f'{v:.3f}' for v in values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--model", default=None)
    parser.add_argument("--startup", action="store_true", help="measure the start only (see above)")
    parser.add_argument("--llama-server", default=None, help="with --startup: a llama-server binary")
    args = parser.parse_args()
    if args.startup:
        figures = startup(args.model, args.repeat, args.llama_server)
        print_figures(figures)
        torch_s = statistics.median(figures["import_torch_s"])
        for key in figures:
            if key != "import_torch_s":
                print(f"{key:40s} / import torch  {statistics.median(figures[key]) / torch_s:5.2f}x")
        return
    runs = [run_once(args.model) for _ in range(args.repeat)]
    reclaim_stale()  # the last killed supervisor's runtime directory
    print_figures({key: [run[key] for run in runs] for key in runs[0]})


if __name__ == "__main__":
    main()
