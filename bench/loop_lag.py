"""Event-loop lag of `gracelm serve` under the costliest request its default limits allow.

Probes `/health` back to back (a fresh connection each, as a liveness probe does) on an idle server, then
while the costliest allowed request streams (`tests/costly_requests.py`: n=128, 20 logprobs each, 64 stop
strings of 4096 characters in all), and reports p50 / p99 / max of each and the ratios loaded / idle, measured
in the same run. `/health` does nothing but answer, so its latency is the time the loop makes it wait.

    .venv/bin/python bench/loop_lag.py                 # the tiny test model (fast, frontend-bound)
    .venv/bin/python bench/loop_lag.py --model default # the default model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.costly_requests import MAX_N, costliest_completion  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402


def probe(url: str, until: threading.Event | None, count: int) -> list[float]:
    """`/health` latencies in ms: `count` probes, or as many as fit until `until` is set."""
    latencies = []
    while (until is None and len(latencies) < count) or (until is not None and not until.is_set()):
        begun = time.perf_counter()
        response = httpx.get(f"{url}/health", timeout=30)
        latencies.append((time.perf_counter() - begun) * 1000)
        assert response.status_code == 200, response.text
        time.sleep(0.005)
    return latencies


def costly(url: str, max_tokens: int, started: threading.Event, done: threading.Event,
           lines: list[str]) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=costliest_completion(max_tokens),
                          timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    started.set()
    finally:
        started.set()
        done.set()


def summary(name: str, values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    stats = {"p50": statistics.median(ordered), "p99": p99, "max": ordered[-1]}
    print(f"{name:>8}: {len(values):5d} probes, p50 {stats['p50']:7.2f} ms, p99 {stats['p99']:7.2f} ms, "
          f"max {stats['max']:7.2f} ms")
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (a random tiny Llama), 'default', or a path")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per choice of the costly request")
    parser.add_argument("--idle-probes", type=int, default=300)
    args = parser.parse_args()
    model = {"tiny": str(tiny_model("llama")), "default": None}.get(args.model, args.model)
    server = ServerProcess(model, "--max-num-seqs", str(MAX_N), "--kv-cache-memory", "256MiB",
                           "--max-model-len", "512", "--stats-interval", "0")
    try:
        probe(server.url, None, 20)  # warm-up: connections, first requests
        idle = summary("idle", probe(server.url, None, args.idle_probes))
        started, done, lines = threading.Event(), threading.Event(), []
        thread = threading.Thread(target=costly, args=(server.url, args.max_tokens, started, done, lines),
                                  daemon=True)
        begun = time.perf_counter()
        thread.start()
        started.wait()
        loaded = summary("loaded", probe(server.url, done, 0))
        thread.join()
        elapsed = time.perf_counter() - begun
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        print(f"costly request: n={MAX_N} x {args.max_tokens} tokens streamed in {elapsed:.1f} s "
              f"({len(lines)} SSE events)")
        print("ratios loaded / idle: " + ", ".join(f"{key} {loaded[key] / idle[key]:.2f}x" for key in idle))
    finally:
        server.stop()
        server.close_log()


if __name__ == "__main__":
    main()
