"""What a restarted server's first request costs against the ones after it: `gracelm serve` (default model
unless --model) is launched, timed to `/ready` 200, then sent --requests streamed chat completions of
--max-tokens tokens one after another (each `ignore_eos`, prompts of the same length that differ from their
first block, so that no request finds another's prefix cached); for each its time to first token (TTFT) and
its total. Behind a router the first request after `/ready` is a user's: it should cost what the next ones
do. Reported per start: launch to ready, the `warmup` phase of the start-up timeline, the first request's
TTFT and total and the median of the others'; over --repeat starts, the median and range of each, and of the
first request's over the others'.

`--compare-tree DIR` runs the same starts of another tree as the baseline (`PYTHONPATH=DIR`: a directory
holding another version's `gracelm/` package, its compiled kernels included), alternating with this one,
each round in the other order, so that a drift of the host's load touches both alike. Run by hand:

    .venv/bin/python bench/first_request.py --repeat 5
    .venv/bin/python bench/first_request.py --repeat 6 --compare-tree /tmp/before
    .venv/bin/python bench/first_request.py --repeat 3 --server-args "--enforce-eager --dense-weights on"

The servers run with OpenMP threads that wait passively, as in bench/lifecycle.py (a 2-core machine shared
with the client)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.server_process import ServerProcess  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the servers started below
WORDS = ["sea", "fox", "owl", "oak", "sun", "elk", "bee", "ant", "ice", "ink", "jam", "kit"]


def messages(index: int) -> list[dict[str, str]]:
    """A chat whose system message begins with a word of its own: its first KV block is its own."""
    word = WORDS[index % len(WORDS)]
    return [{"role": "system", "content": f"{word} {index}: you write short poems."},
            {"role": "user", "content": f"Write a short poem about the {word}."}]


def chat(url: str, index: int, max_tokens: int) -> tuple[float, float]:
    """TTFT and total of one streamed chat completion, in seconds."""
    body = {"messages": messages(index), "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.perf_counter() - started
    assert first is not None, "no token came"
    return first, time.perf_counter() - started


def one_start(args: argparse.Namespace, tree: str | None) -> dict[str, float]:
    """One server start of this tree (None) or of `tree`, and its requests; times in ms, ready in s."""
    env = {"PYTHONPATH": tree} if tree is not None else None
    started = time.monotonic()
    with ServerProcess(args.model, "--stats-interval", "0", *shlex.split(args.server_args), env=env,
                       startup_timeout=600) as server:
        ready_s = time.monotonic() - started
        times = [chat(server.url, index, args.max_tokens) for index in range(max(2, args.requests))]
        warmup = re.search(r"start-up timeline \(ms\): .*?\bwarmup (\d+)", server.log())
    rest = times[1:]
    return {"ready_s": ready_s, "warmup_ms": float(warmup.group(1)) if warmup else 0.0,
            "first_ttft_ms": times[0][0] * 1000, "next_ttft_ms": statistics.median(t for t, _ in rest) * 1000,
            "first_total_ms": times[0][1] * 1000,
            "next_total_ms": statistics.median(total for _, total in rest) * 1000}


def summarize(label: str, runs: list[dict[str, float]]) -> None:
    print(f"{label}: {len(runs)} starts, median (min, max)")
    for run in runs:  # the first request over the steady ones
        run["first_over_next_ttft"] = run["first_ttft_ms"] / run["next_ttft_ms"]
        run["first_over_next_total"] = run["first_total_ms"] / run["next_total_ms"]
    for key in runs[0]:
        values = [run[key] for run in runs]
        print(f"  {key}: {statistics.median(values):.3f} ({min(values):.3f}, {max(values):.3f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: gracelm's default model")
    parser.add_argument("--repeat", type=int, default=3, help="server starts (of each tree)")
    parser.add_argument("--requests", type=int, default=6, help="requests after each start (>= 2)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--server-args", default="", help="more options for gracelm serve")
    parser.add_argument("--compare-tree", default=None, metavar="DIR",
                        help="another tree's directory (PYTHONPATH), started alternately as the baseline")
    args = parser.parse_args()
    trees: dict[str, str | None] = {"this tree": None}
    if args.compare_tree is not None:
        trees[f"baseline {args.compare_tree}"] = args.compare_tree
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    for index in range(args.repeat):
        for label in list(trees) if index % 2 == 0 else list(reversed(trees)):
            run = one_start(args, trees[label])
            runs[label].append(run)
            shown = ", ".join(f"{k} {v:.3f}" if k == "ready_s" else f"{k} {v:.0f}" for k, v in run.items())
            print(f"{label}, start {index + 1}: {shown}", flush=True)
    for label, done in runs.items():
        summarize(label, done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
