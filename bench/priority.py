"""Interactive time to first token (TTFT) with and without a saturating background load, in the same run.

Starts `gracelm serve` (the tiny test model, the default model or a path; or loads a running server given
by `--base-url`) and, in rounds, measures the TTFT of short interactive requests (streaming chat, priority
0, `--interactive-concurrency` clients, `--interactive-requests` each time) under each condition, in an
order rotated every round:

- `idle`: nothing else runs;
- `background@P` for each `--background-priority P`: `--background-concurrency` clients keep sending long
  completions (`ignore_eos`, `--background-tokens` tokens) at priority P, more than the server has seats,
  so that every seat is held and more wait. P = 0 is first come, first served: the interactive requests
  queue behind the background; P = 1 is priority scheduling: they take seats back at once.

Before each measurement the background fills the server (its requests all in the engine, as `/metrics`
counts them); after it, the background is cancelled (its streams closed, so the server aborts them) and the
server drained. Reported: per condition the TTFT p50 / p99 (median over rounds), their ratios to `idle` in
the same round (median over rounds), the mean inter-token latency of the window (about one engine step,
from `/metrics`), the TTFT p50 in those steps, and the tokens/s the server generated meanwhile. Measure on a
quiet machine if you can, and read ratios, not absolute figures. A background condition is a name and an
async context manager (`Condition`): another load (a Batch API job, say) plugs in as one more.

    .venv/bin/python bench/priority.py                    # the tiny test model, 3 rounds
    .venv/bin/python bench/priority.py --model default --rounds 3 --background-tokens 128
    .venv/bin/python bench/priority.py --base-url http://127.0.0.1:8000 --background-concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.serve import Load, RequestResult, make_prompts, one_request, percentile  # noqa: E402
from tests.server_process import ServerProcess, metric_value  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402


@dataclass(frozen=True)
class Condition:
    name: str
    # Runs the condition's load for as long as it is entered; given the client, the model and the results
    # list its requests append to.
    load: Callable[[httpx.AsyncClient, str, list[RequestResult]], AbstractAsyncContextManager[None]]


def background(priority: int, concurrency: int, tokens: int, seed: int) -> Condition:
    """`concurrency` clients each sending long completions at `priority`, one after another."""
    load = Load([], 0, tokens, seed, endpoint="completions", ignore_eos=True)
    prompts = make_prompts(concurrency, seed + 7)

    @contextlib.asynccontextmanager
    async def running(client: httpx.AsyncClient, model: str,
                      results: list[RequestResult]) -> AsyncIterator[None]:
        async def worker(prompt: str) -> None:
            while True:
                results.append(await one_request(client, model, prompt, load, {"priority": priority}))

        tasks = [asyncio.create_task(worker(prompt)) for prompt in prompts]
        try:
            await _until_in_engine(client, concurrency)
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    return Condition(f"background@{priority}", running)


@contextlib.asynccontextmanager
async def _idle(client: httpx.AsyncClient, model: str, results: list[RequestResult]) -> AsyncIterator[None]:
    yield


IDLE = Condition("idle", _idle)


async def _engine_counts(client: httpx.AsyncClient) -> tuple[float, float]:
    """The requests in the engine, running and waiting (one model: its series are the only ones)."""
    text = (await client.get("/metrics")).text
    return (metric_value(text, "gracelm_num_requests_running"),
            metric_value(text, "gracelm_num_requests_waiting"))


async def _engine_totals(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's running totals that a window's throughput and step time are read from."""
    text = (await client.get("/metrics")).text
    names = ("gracelm_generation_tokens_total", "gracelm_inter_token_latency_seconds_sum",
             "gracelm_inter_token_latency_seconds_count")
    totals = {}
    for name in names:
        try:
            totals[name] = metric_value(text, name)
        except KeyError:  # nothing observed yet
            totals[name] = 0.0
    return totals


async def _until_in_engine(client: httpx.AsyncClient, count: int, timeout: float = 300) -> None:
    """Waits until at least `count` requests are in the engine (running or waiting)."""
    deadline = time.monotonic() + timeout
    while sum(await _engine_counts(client)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the background never filled the engine with {count} requests")
        await asyncio.sleep(0.05)


async def _until_drained(client: httpx.AsyncClient, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while sum(await _engine_counts(client)) > 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not drain")
        await asyncio.sleep(0.05)


async def measure(client: httpx.AsyncClient, model: str, condition: Condition, args: argparse.Namespace,
                  prompts: list[str]) -> dict:
    """The interactive TTFTs while the condition's load runs, and what that load produced meanwhile."""
    load = Load([], 0, args.interactive_tokens, args.seed, endpoint="chat", ignore_eos=True)
    queue = list(prompts)
    interactive: list[RequestResult] = []
    produced: list[RequestResult] = []

    async def client_loop() -> None:
        while queue:
            interactive.append(await one_request(client, model, queue.pop(), load, {"priority": 0}))

    async with condition.load(client, model, produced):
        before = await _engine_totals(client)
        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(args.interactive_concurrency)))
        duration = time.perf_counter() - started
        after = await _engine_totals(client)
    await _until_drained(client)
    failed = [r.error for r in interactive if not r.ok]
    if failed:
        raise RuntimeError(f"{condition.name}: {len(failed)} interactive requests failed: {failed[:3]}")
    ttfts = [r.ttft for r in interactive]
    delta = {name: after[name] - before[name] for name in after}
    # The mean time between two tokens of a stream over the window: about one engine step.
    itl = delta["gracelm_inter_token_latency_seconds_sum"] / max(1, delta[
        "gracelm_inter_token_latency_seconds_count"])
    return {"condition": condition.name, "ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p99_ms": 1000 * percentile(ttfts, 99), "itl_mean_ms": 1000 * itl,
            "tokens_per_s": delta["gracelm_generation_tokens_total"] / duration,
            "background_finished": sum(1 for r in produced if r.ok)}


async def bench(base_url: str, args: argparse.Namespace) -> list[dict]:
    conditions = [IDLE] + [background(p, args.background_concurrency, args.background_tokens, args.seed)
                           for p in args.background_priority]
    limits = httpx.Limits(max_connections=args.background_concurrency + args.interactive_concurrency + 2,
                          max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = make_prompts(args.interactive_requests, args.seed)
        await measure(client, model, IDLE, args, prompts[:2])  # warm-up: lazy initialisation
        rows = []
        for round_ in range(args.rounds):
            shift = round_ % len(conditions)
            for condition in conditions[shift:] + conditions[:shift]:
                row = await measure(client, model, condition, args, prompts)
                rows.append({**row, "round": round_})
                print(f"round {round_} {row['condition']:>14}: TTFT p50 {row['ttft_p50_ms']:8.1f} ms, "
                      f"p99 {row['ttft_p99_ms']:8.1f} ms, ITL mean {row['itl_mean_ms']:6.1f} ms, "
                      f"{row['tokens_per_s']:7.1f} tok/s", flush=True)
    return rows


def report(rows: list[dict]) -> list[dict]:
    """Per condition: medians over rounds of TTFT p50 / p99 and of their ratios to `idle` in that round."""
    idle = {r["round"]: r for r in rows if r["condition"] == "idle"}
    summary = []
    print(f"\n{'condition':>14} {'TTFT p50':>9} {'ratio':>6} {'TTFT p99':>9} {'ratio':>6} {'ITL':>6} "
          f"{'p50/ITL':>7} {'tok/s':>7}   (ms; medians over rounds)")
    for name in dict.fromkeys(r["condition"] for r in rows):
        runs = [r for r in rows if r["condition"] == name]
        line = {"condition": name, "rounds": len(runs)}
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_mean_ms", "tokens_per_s"):
            line[key] = statistics.median(r[key] for r in runs)
        # TTFT in engine steps of its own window: what the scheduler controls, whatever the machine's speed.
        line["ttft_p50_steps"] = statistics.median(r["ttft_p50_ms"] / r["itl_mean_ms"] for r in runs)
        for key in ("ttft_p50_ms", "ttft_p99_ms"):
            ratios = [r[key] / idle[r["round"]][key] for r in runs]
            line[key.replace("_ms", "_ratio")] = statistics.median(ratios)
        summary.append(line)
        print(f"{name:>14} {line['ttft_p50_ms']:>9.1f} {line['ttft_p50_ratio']:>6.2f} "
              f"{line['ttft_p99_ms']:>9.1f} {line['ttft_p99_ratio']:>6.2f} {line['itl_mean_ms']:>6.1f} "
              f"{line['ttft_p50_steps']:>7.1f} {line['tokens_per_s']:>7.1f}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (a random tiny Llama), 'default', or a path")
    parser.add_argument("--base-url", default=None, help="load this running server instead of starting one")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="seats of the server started here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interactive-requests", type=int, default=20, help="per condition and round")
    parser.add_argument("--interactive-concurrency", type=int, default=1)
    parser.add_argument("--interactive-tokens", type=int, default=8)
    parser.add_argument("--background-concurrency", type=int, default=8,
                        help="background clients (more than the server's seats, to saturate it)")
    parser.add_argument("--background-tokens", type=int, default=256)
    parser.add_argument("--background-priority", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the rounds and the summary as JSON here")
    args = parser.parse_args()
    if args.base_url is not None:
        rows = asyncio.run(bench(args.base_url, args))
    else:
        model = {"tiny": lambda: tiny_model("llama"), "default": lambda: None}.get(args.model,
                                                                                 lambda: args.model)()
        with ServerProcess(model, "--max-num-seqs", str(args.max_num_seqs), "--disable-log-requests",
                           "--stats-interval", "0") as server:
            rows = asyncio.run(bench(server.url, args))
    summary = report(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
