"""gracelm behind vllm-router (`gracelm fleet`), measured by hand against one server in the same run.

    python bench/fleet.py compare --concurrency 8 --num-prompts 48 --repeats 2
    python bench/fleet.py restart --concurrency 4 --seconds 40

`compare` loads one `gracelm serve` and a fleet of `--replicas` workers behind vllm-router, one after the
other on the default model (the order swapped each repeat), with the same streaming chat load
(`bench/serve.py`'s clients), and reports tokens/s and TTFT of each and the fleet / single ratios. On a
host with fewer cores than the replicas want, the replicas share them: the ratio then shows the router's
cost, not a fleet's gain.

`restart` runs a fleet under a steady streaming load (`--concurrency` clients, each one request after
another) and sends it SIGHUP a third of the way in: a rolling restart of every worker. It reports, for the
steady part before and the restart's span, the requests, the failed ones, TTFT p50/p99 and the longest gap
a client saw (the longest wait for a request's first token or for its next one), and the restart's
duration.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (  # noqa: E402  (bench/ is not a package)
    Load,
    RequestResult,
    Server,
    default_gguf,
    free_port,
    gracelm_server,
    make_prompts,
    one_request,
    percentile,
    print_table,
    run_level,
)

GRACELM = Path(sys.executable).parent / "gracelm"


def fleet_server(gguf: Path, log: Path, replicas: int) -> Server:
    port = free_port()
    command = [str(GRACELM), "fleet", str(gguf), "--port", str(port), "--replicas", str(replicas),
               "--stats-interval", "0"]
    return Server(f"fleet of {replicas}", command, port, log, "/health")


async def _level(server: Server, args: argparse.Namespace) -> dict:
    load = Load([args.concurrency], args.num_prompts, args.max_tokens, args.seed)
    prompts = make_prompts(args.num_prompts, args.seed)
    async with aiohttp.ClientSession(server.base_url) as client:
        model = await _model(client)
    return await run_level(server.base_url, model, prompts, args.concurrency, load)


async def _model(client: aiohttp.ClientSession) -> str:
    async with client.get("/v1/models", raise_for_status=True) as response:
        return (await response.json())["data"][0]["id"]


def compare(args: argparse.Namespace) -> None:
    gguf, logs = default_gguf(), Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    ratios = []
    for repeat in range(args.repeats):
        rows = {}
        order = ["single", "fleet"] if repeat % 2 == 0 else ["fleet", "single"]
        for side in order:
            log = logs / f"{side}-{repeat}.log"
            server = gracelm_server(gguf, log, ["--stats-interval", "0"]) if side == "single" \
                else fleet_server(gguf, log, args.replicas)
            try:
                server.wait_ready()
                rows[side] = {**asyncio.run(_level(server, args)), "concurrency": args.concurrency}
            finally:
                server.stop()
            print_table(f"repeat {repeat}: {side}", [rows[side]])
        ratios.append({key: rows["fleet"][key] / rows["single"][key]
                       for key in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")})
        print(f"repeat {repeat}: fleet / single: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios[-1].items()))


class Timeline:
    """Each request's start, end, result and longest wait, for the steady and restart windows."""

    def __init__(self) -> None:
        self.requests: list[tuple[float, float, RequestResult]] = []

    def window(self, start: float, end: float) -> dict:
        inside = [r for s, e, r in self.requests if start <= s < end]
        ok = [r for r in inside if r.ok]
        waits = [max([r.ttft, *r.itls]) for r in ok]
        return {"requests": len(inside), "failed": len(inside) - len(ok),
                "ttft_p50_ms": 1000 * percentile([r.ttft for r in ok], 50),
                "ttft_p99_ms": 1000 * percentile([r.ttft for r in ok], 99),
                "longest_gap_ms": 1000 * max(waits, default=float("nan")),
                "errors": sorted({r.error for r in inside if not r.ok})[:3]}


async def _steady_load(url: str, args: argparse.Namespace, until: float, timeline: Timeline) -> None:
    load = Load([args.concurrency], 0, args.max_tokens, args.seed, ignore_eos=True)
    prompts = make_prompts(64, args.seed)
    connector = aiohttp.TCPConnector(limit=args.concurrency, force_close=True)
    async with aiohttp.ClientSession(url, connector=connector) as client:
        model = await _model(client)

        async def one_client(index: int) -> None:
            n = index
            while time.monotonic() < until:
                start = time.monotonic()
                result = await one_request(client, model, prompts[n % len(prompts)], load)
                timeline.requests.append((start, time.monotonic(), result))
                n += args.concurrency

        await asyncio.gather(*(one_client(i) for i in range(args.concurrency)))


def restart(args: argparse.Namespace) -> None:
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "fleet-restart.log"
    fleet = fleet_server(default_gguf(), log, args.replicas)
    timeline = Timeline()
    try:
        fleet.wait_ready()
        begin = time.monotonic()
        hangup = begin + args.seconds / 3

        async def run() -> float:
            load = asyncio.create_task(_steady_load(fleet.base_url, args, begin + args.seconds, timeline))
            await asyncio.sleep(hangup - time.monotonic())
            fleet.process.send_signal(signal.SIGHUP)
            while "rolling restart done" not in log.read_text():
                await asyncio.sleep(0.2)
            done = time.monotonic()
            await load
            return done

        done = asyncio.run(run())
    finally:
        fleet.stop()
    print(f"rolling restart of {args.replicas} workers: {done - hangup:.1f} s")
    for name, (start, end) in {"steady": (begin, hangup), "restart": (hangup, done)}.items():
        row = timeline.window(start, end)
        print(f"{name:>8}: {row['requests']} requests, {row['failed']} failed, TTFT p50 "
              f"{row['ttft_p50_ms']:.0f} ms, p99 {row['ttft_p99_ms']:.0f} ms, longest gap "
              f"{row['longest_gap_ms']:.0f} ms {row['errors'] or ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("compare", "restart"):
        command = commands.add_parser(name)
        command.add_argument("--concurrency", type=int, default=4)
        command.add_argument("--max-tokens", type=int, default=64)
        command.add_argument("--replicas", type=int, default=2)
        command.add_argument("--seed", type=int, default=0)
        command.add_argument("--log-dir", default="/tmp/gracelm-bench-fleet")
    commands.choices["compare"].add_argument("--num-prompts", type=int, default=48)
    commands.choices["compare"].add_argument("--repeats", type=int, default=2)
    commands.choices["restart"].add_argument("--seconds", type=float, default=40)
    args = parser.parse_args()
    (compare if args.command == "compare" else restart)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
