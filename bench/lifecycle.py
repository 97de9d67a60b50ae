"""Lifecycle timings of a real `gracelm serve` (default model unless --model): launch to `/ready` 200;
SIGTERM to exit when idle; SIGTERM to exit with 16 streams in flight, beside the time those requests needed
anyway; `kill -9` of the engine core to the supervisor's exit; `kill -9` of the supervisor to its last child
gone. Median of --repeat runs. Run by hand: `python bench/lifecycle.py [--repeat 5] [--model PATH]`."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gracelm.lifecycle.stale import reclaim_stale  # noqa: E402
from tests.server_process import ServerProcess, start_streams  # noqa: E402

STREAM_TOKENS = 64


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
    streams = start_streams(server.url, 16, STREAM_TOKENS)
    server.capture()
    figures["16_streams_sigterm_exit_s"] = timed_exit(server, server.process.terminate)
    reasons = [s.finish_reasons for s in streams]
    assert all(r == ["length"] for r in reasons), reasons

    server, _ = launch(model)
    server.capture()
    core = next(p for p in server.children if "engine-core" in " ".join(p.cmdline()))
    figures["core_kill9_to_exit_s"] = timed_exit(server, core.kill)

    server, _ = launch(model)
    server.capture()
    started = time.monotonic()
    server.process.kill()
    psutil.wait_procs(server.children, timeout=5)
    figures["supervisor_kill9_to_last_child_gone_s"] = time.monotonic() - started
    server.wait_exit(5)
    server.close_log()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    runs = [run_once(args.model) for _ in range(args.repeat)]
    reclaim_stale()  # the last killed supervisor's runtime directory
    for key in runs[0]:
        values = [run[key] for run in runs]
        print(f"{key:40s} median {statistics.median(values):7.3f}  (runs: "
              f"{', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
