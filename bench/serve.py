"""Load generator for OpenAI-compatible servers, in the spirit of `vllm bench serve` (run by hand).

Fixed-seed prompts, a fixed number of concurrent clients, streaming chat completions; reports request
throughput, output tokens/s, time to first token (TTFT) and inter-token latency (ITL) p50 / p99.

    python bench/serve.py run --base-url http://127.0.0.1:8000 --concurrency 1 8 32
    python bench/serve.py setup-llama-cpp              # optional: llama-cpp-python[server] in its own venv
    python bench/serve.py compare --concurrency 1 8 32 # gracelm vs llama.cpp on the default GGUF, one run
    python bench/serve.py run --concurrency 1 32 --json-schema-fraction 0 0.5 1   # structured-output mix

`--json-schema-fraction F ...` runs each concurrency level once per fraction F of requests under a JSON
schema (`response_format: json_schema`, evenly spread among the requests), every request with
`ignore_eos` so that constrained and free ones generate the same number of tokens, and reports each
fraction's output tokens/s and ITL against the fraction 0 of the same session. `--rounds R` repeats the
fractions R times in turn (each round in a rotated order) and reports the median of each round's ratios,
for a host whose load drifts.

`setup-llama-cpp` installs `llama-cpp-python[server]` into a separate virtual environment (never a
dependency of gracelm); it compiles llama.cpp, about 7 minutes on 2 cores. `compare` starts `gracelm serve`
and llama.cpp's server on the same GGUF file, one after the other on free ports, and loads each the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

LLAMA_VENV = Path(os.environ.get("GRACELM_BENCH_LLAMA_VENV", Path.home() / ".cache/gracelm-bench/llama-venv"))
TOPICS = ["a lighthouse keeper", "the first snow of winter", "a lost city", "a robot learning to paint",
          "the history of bread", "a journey across the desert", "an old clockmaker", "the ocean at night",
          "a village festival", "a letter never sent", "the migration of birds", "a chess tournament"]
TEMPLATES = ["Write a short story about {}.", "Describe {} in vivid detail.",
             "Tell me everything you know about {}.", "Write a poem about {}, then explain it."]
# The structured-output mix: a bounded title, then free text, as an application asking for JSON would.
BENCH_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                                 "text": {"type": "string"}},
                "required": ["title", "text"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": BENCH_SCHEMA,
                                                          "strict": True}}


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""


def make_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(TEMPLATES).format(rng.choice(TOPICS)) for _ in range(count)]


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                      extra: dict | None = None) -> RequestResult:
    """One streaming chat completion; a token is counted per content chunk (both servers send one per
    token), or taken from `usage` when the server sends it. `extra` goes into the body as it is."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    last, chunks, usage_tokens = None, 0, None
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage_tokens = event["usage"]["completion_tokens"]
                if not any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                chunks += 1
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.ok = True
    result.latency = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    return result


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                    api_key: str | None, json_fraction: float | None = None) -> dict:
    """Runs every prompt with `concurrency` clients at once; returns the level's summary. With
    `json_fraction`, that share of the requests is under `RESPONSE_FORMAT`, and all ignore EOS."""
    queue: asyncio.Queue[tuple[str, dict | None]] = asyncio.Queue()
    for i, prompt in enumerate(prompts):
        queue.put_nowait((prompt, None if json_fraction is None else _mix_extra(i, json_fraction)))
    results: list[RequestResult] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                prompt, extra = queue.get_nowait()
                results.append(await one_request(client, model, prompt, max_tokens, extra))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    return {**summarize(results, duration, concurrency), "json_schema_fraction": json_fraction}


def _mix_extra(index: int, fraction: float) -> dict:
    """Request `index` of the mix: under the schema when the running share of constrained requests
    crosses an integer here (so that a fraction f constrains f of every window of requests)."""
    constrained = int((index + 1) * fraction) > int(index * fraction)
    return {"ignore_eos": True, **({"response_format": RESPONSE_FORMAT} if constrained else {})}


def summarize(results: list[RequestResult], duration: float, concurrency: int) -> dict:
    done = [r for r in results if r.ok]
    ttfts = [r.ttft for r in done]
    itls = [x for r in done for x in r.itls]
    tokens = sum(r.output_tokens for r in done)
    return {
        "concurrency": concurrency, "requests": len(results), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration, "request_throughput": len(done) / duration,
        "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50), "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(itls, 50), "itl_p99_ms": 1000 * percentile(itls, 99),
    }


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1]


def print_table(label: str, rows: list[dict]) -> None:
    print(f"\n{label}")
    print(f"{'conc':>5} {'reqs':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}   (ms)")
    for r in rows:
        print(f"{r['concurrency']:>5} {r['requests']:>5} {r['failed']:>4} {r['request_throughput']:>7.2f} "
              f"{r['output_tokens_per_s']:>10.1f} {r['ttft_p50_ms']:>9.0f} {r['ttft_p99_ms']:>9.0f} "
              f"{r['itl_p50_ms']:>8.1f} {r['itl_p99_ms']:>8.1f}")
        for error in r["errors"]:
            print(f"      error: {error}")


@dataclass
class Load:
    levels: list[int]
    prompts_per_level: int
    max_tokens: int
    seed: int
    api_key: str | None = None
    json_fractions: list[float] | None = None  # None: no structured-output mix
    rounds: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Load:
        return cls(args.concurrency, args.num_prompts, args.max_tokens, args.seed,
                   getattr(args, "api_key", None), getattr(args, "json_schema_fraction", None),
                   getattr(args, "rounds", 1))


async def bench(base_url: str, model: str | None, load: Load) -> list[dict]:
    if model is None:
        headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
        async with httpx.AsyncClient(base_url=base_url, headers=headers) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
    # One warm-up request, so that the first level does not pay for lazy initialisation.
    await run_level(base_url, model, make_prompts(1, load.seed + 1), 1, 8, load.api_key)
    rows = []
    for concurrency in load.levels:
        prompts = make_prompts(max(load.prompts_per_level, concurrency), load.seed)
        fractions = load.json_fractions or [None]
        for round_ in range(load.rounds):
            shift = round_ % len(fractions)
            for fraction in fractions[shift:] + fractions[:shift]:
                row = await run_level(base_url, model, prompts, concurrency, load.max_tokens, load.api_key,
                                      fraction)
                rows.append({**row, "round": round_})
    return rows


def print_mix(rows: list[dict]) -> None:
    """Each fraction's output tokens/s and ITL p50 against the unconstrained run of its level and round:
    the median over rounds of those ratios."""
    print("\nstructured-output mix: cost against fraction 0 at the same concurrency (median over rounds)")
    print(f"{'conc':>5} {'json %':>7} {'out tok/s':>10} {'ratio':>6} {'ITL p50':>8} {'ratio':>6} "
          f"{'ITL p99':>8}   (ms)")
    base = {(r["concurrency"], r["round"]): r for r in rows if r["json_schema_fraction"] == 0}
    groups: dict[tuple[int, float], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["concurrency"], r["json_schema_fraction"]), []).append(r)
    for (concurrency, fraction), runs in sorted(groups.items()):
        refs = [(r, base[(concurrency, r["round"])]) for r in runs if (concurrency, r["round"]) in base]
        tput = statistics.median(r["output_tokens_per_s"] / b["output_tokens_per_s"] for r, b in refs)
        itl = statistics.median(r["itl_p50_ms"] / b["itl_p50_ms"] for r, b in refs)
        print(f"{concurrency:>5} {100 * fraction:>6.0f}% "
              f"{statistics.median(r['output_tokens_per_s'] for r in runs):>10.1f} {tput:>6.3f} "
              f"{statistics.median(r['itl_p50_ms'] for r in runs):>8.1f} {itl:>6.3f} "
              f"{statistics.median(r['itl_p99_ms'] for r in runs):>8.1f}")


# -- servers for `compare` ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_gguf() -> Path:
    from gracelm.model.model_files import default_model_path

    return Path(default_model_path())


class Server:
    """A server process for one side of the comparison, stopped with SIGTERM (SIGKILL after 30 s)."""

    def __init__(self, label: str, command: list[str], port: int, log: Path) -> None:
        self.label, self.port = label, port
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = log.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited ({self.process.returncode}); see {self._log.name}")
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.label} not ready after {timeout} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def gracelm_server(gguf: Path, log_dir: Path) -> Server:
    port = free_port()
    command = [str(Path(sys.executable).parent / "gracelm"), "serve", str(gguf), "--port", str(port),
               "--stats-interval", "0"]
    return Server("gracelm", command, port, log_dir / "gracelm.log")


def llama_cpp_server(gguf: Path, log_dir: Path, threads: int) -> Server:
    python = LLAMA_VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no llama.cpp venv at {LLAMA_VENV}; run `bench/serve.py setup-llama-cpp` first")
    port = free_port()
    command = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", "2048", "--n_threads", str(threads)]
    return Server("llama.cpp", command, port, log_dir / "llama_cpp.log")


def setup_llama_cpp() -> None:
    """Creates the separate venv and installs llama-cpp-python[server] there (compiles llama.cpp)."""
    LLAMA_VENV.parent.mkdir(parents=True, exist_ok=True)
    if not (LLAMA_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(LLAMA_VENV)], check=True)
    pip = [str(LLAMA_VENV / "bin" / "python"), "-m", "pip", "install", "--upgrade"]
    subprocess.run([*pip, "pip"], check=True)
    subprocess.run([*pip, "llama-cpp-python[server]"], check=True)
    print(f"llama-cpp-python[server] installed in {LLAMA_VENV}")


def compare(args: argparse.Namespace) -> dict:
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gracelm-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {log_dir}")
    results = {}
    # One server at a time: on a 2-core machine two would steal each other's CPU.
    starters = (lambda: gracelm_server(gguf, log_dir), lambda: llama_cpp_server(gguf, log_dir, args.threads))
    for start in starters:
        server = start()
        try:
            server.wait_ready()
            rows = asyncio.run(bench(server.base_url, None, Load.from_args(args)))
        finally:
            server.stop()
        results[server.label] = rows
        print_table(f"{server.label} on {gguf.name}", rows)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="load one running server")
    run.add_argument("--base-url", default="http://127.0.0.1:8000")
    run.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    run.add_argument("--api-key", default=os.environ.get("GRACELM_API_KEY"))
    run.add_argument("--json-schema-fraction", type=float, nargs="+", default=None, metavar="F",
                     help="run each level once per fraction F (0 to 1) of requests under a JSON schema")
    run.add_argument("--rounds", type=int, default=1, help="with --json-schema-fraction: rounds of fractions")
    cmp = commands.add_parser("compare", help="gracelm vs llama.cpp's server on the same GGUF file")
    cmp.add_argument("--gguf", default=None, help="default: gracelm's default model")
    cmp.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    cmp.add_argument("--log-dir", default=None, help="server logs (default: a new temporary directory)")
    for sub in (run, cmp):
        sub.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
        sub.add_argument("--num-prompts", type=int, default=16,
                         help="requests per concurrency level (at least the concurrency)")
        sub.add_argument("--max-tokens", type=int, default=64)
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--out", default=None, help="also write the results as JSON here")
    commands.add_parser("setup-llama-cpp", help="install llama-cpp-python[server] into its own venv")
    args = parser.parse_args()
    if args.command == "setup-llama-cpp":
        setup_llama_cpp()
        return 0
    if args.command == "run":
        if args.json_schema_fraction and not all(0 <= f <= 1 for f in args.json_schema_fraction):
            parser.error("--json-schema-fraction: each fraction must be between 0 and 1")
        rows = asyncio.run(bench(args.base_url, args.model, Load.from_args(args)))
        print_table(args.base_url, rows)
        if args.json_schema_fraction:
            print_mix(rows)
        results: dict = {"server": rows}
    else:
        results = compare(args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
