"""Load generator for OpenAI-compatible servers, in the spirit of `vllm bench serve` (run by hand).

Fixed-seed prompts, a fixed number of concurrent clients, streaming chat completions (or plain
completions, `--endpoint completions`); reports request throughput, output tokens/s, time to first token
(TTFT) and inter-token latency (ITL) p50 / p99. The clients are aiohttp's (`pip install
--no-build-isolation -e '.[bench]'`), on uvloop's event loop: the load generator shares the machine with
the server it measures, and httpx's streaming took twice the CPU (2.2 s against 1.0 s for 96 requests of
128 tokens at 32 streams, ~900 tok/s), taken from whichever server streams fastest.

    python bench/serve.py run --base-url http://127.0.0.1:8000 --concurrency 1 8 32
    python bench/serve.py setup-llama-cpp              # builds llama.cpp's llama-server in its own folder
    python bench/serve.py compare --concurrency 1 8 32 --max-tokens 128 --repeats 2
    python bench/serve.py compare --gracelm-args "--mask-cpu-features amx"   # another CPU's paths
    python bench/serve.py compile-cost --concurrency 8 --num-prompts 32      # a first start's compile
    python bench/serve.py run --concurrency 1 32 --json-schema-fraction 0 0.5 1   # structured-output mix

`--json-schema-fraction F ...` runs each concurrency level once per fraction F of requests under a JSON
schema (`response_format: json_schema`, evenly spread among the requests), every request with
`ignore_eos` so that constrained and free ones generate the same number of tokens, and reports each
fraction's output tokens/s and ITL against the fraction 0 of the same session. `--rounds R` repeats the
fractions R times in turn (each round in a rotated order) and reports the median of each round's ratios,
for a host whose load drifts.

`setup-llama-cpp` builds llama.cpp's C++ `llama-server`, `llama-bench`, `llama-batched-bench` and
`llama-perplexity` (for `bench/perplexity.py`) from the llama.cpp source vendored in the llama-cpp-python
sdist, in its own folder (never a dependency of gracelm); about 15 minutes on 2 cores. `--python-wrapper`
also installs llama-cpp-python[server] into a separate virtual environment. `compare` starts `gracelm
serve` and `llama-server -t T -np 32 -c 32768` (continuous batching, 32 slots) on the same GGUF file, one
at a time on free ports, and loads each the same way: streaming `/v1/completions` of exactly
`--max-tokens` tokens (`ignore_eos`; a request whose `usage` counts other than that fails). `--repeats R`
runs the servers R times, the order swapped each repeat, and reports gracelm / llama-server ratios per
repeat and their median, and says for each start how long it took from launch to ready and the resident
memory of the server's processes at ready (gracelm's first start on a file converts it and compiles its
decode graphs in a child: a cold start) and after the load. `--llama-cpp-python` adds the Python
wrapper's server as a further peer (`--interrupt_requests False`, else a new request cuts a running
stream). `--gracelm-args` passes more
options to `gracelm serve` (a masked CPU feature runs another CPU's kernel paths: docs/kernel_paths.md).

`compile-cost` measures what a first start's background compile of the decode graphs costs the requests
served meanwhile: each repeat loads a server that is compiling (a graph cache of its own, empty; the
converted weights shared) and one with `--enforce-eager` (the same eager steps, no compile), in alternating
order, and reports compiling / eager output tokens/s and how many graphs were written during the loads;
then how long the compile takes on an idle server. """

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import httpx
import psutil
import uvloop

BENCH_CACHE = Path.home() / ".cache/gracelm-bench"
LLAMA_DIR = Path(os.environ.get("GRACELM_BENCH_LLAMA_DIR", BENCH_CACHE / "llama.cpp"))
LLAMA_VENV = Path(os.environ.get("GRACELM_BENCH_LLAMA_VENV", BENCH_CACHE / "llama-venv"))
# The llama-cpp-python release whose sdist vendors the llama.cpp source that `setup-llama-cpp` builds.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_TARGETS = ["llama-server", "llama-bench", "llama-batched-bench", "llama-perplexity"]
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


async def one_request(client: aiohttp.ClientSession, model: str, prompt: str, load: Load,
                      extra: dict | None = None) -> RequestResult:
    """One streaming request to `load.endpoint`; a token is counted per chunk with text (every server here
    sends one per token), or taken from `usage` when the server sends it. `extra` goes into the body as
    it is. With `load.ignore_eos`, a request whose `usage` is missing or counts other than
    `load.max_tokens` fails: the servers compared must generate the same number of tokens."""
    body = {"model": model, "max_tokens": load.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **ENDPOINTS[load.endpoint].body(prompt),
            **({"ignore_eos": True} if load.ignore_eos else {}), **(extra or {})}
    start = time.perf_counter()
    last, chunks, usage_tokens = None, 0, None
    result = RequestResult(ok=False)
    try:
        async with client.post(ENDPOINTS[load.endpoint].path, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage_tokens = event["usage"]["completion_tokens"]
                if not any(ENDPOINTS[load.endpoint].text(c) for c in event.get("choices", [])):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                chunks += 1
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if load.ignore_eos and usage_tokens != load.max_tokens:
        result.error = f"usage: {usage_tokens} completion tokens, {load.max_tokens} asked"
        return result
    result.ok = True
    return result


@dataclass(frozen=True)
class Endpoint:
    path: str
    body: Callable[[str], dict]
    text: Callable[[dict], str | None]  # a streamed choice's new text


ENDPOINTS = {
    "chat": Endpoint("/v1/chat/completions", lambda p: {"messages": [{"role": "user", "content": p}]},
                     lambda choice: choice.get("delta", {}).get("content")),
    "completions": Endpoint("/v1/completions", lambda p: {"prompt": p}, lambda choice: choice.get("text")),
}


def auth_headers(load: Load) -> dict[str, str]:
    return {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int, load: Load,
                    json_fraction: float | None = None) -> dict:
    """Runs every prompt with `concurrency` clients at once; returns the level's summary. With
    `json_fraction`, that share of the requests is under `RESPONSE_FORMAT`, and all ignore EOS."""
    extras = [None if json_fraction is None else _mix_extra(i, json_fraction) for i in range(len(prompts))]
    results, duration = await run_requests(base_url, model, prompts, concurrency, load, extras)
    return {**summarize(results, duration, concurrency), "json_schema_fraction": json_fraction}


async def run_requests(base_url: str, model: str, prompts: list[str], concurrency: int, load: Load,
                       extras: list[dict | None] | None = None) -> tuple[list[RequestResult], float]:
    """Every prompt (with its extra body fields, if any) through `concurrency` clients at once: each
    request's result, in the prompts' order, and the wall time of them all."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(prompts)):
        queue.put_nowait(index)
    results: list[RequestResult] = [RequestResult(ok=False, error="not run")] * len(prompts)
    # A connection per request: llama-server closes a kept-alive connection after some streamed answers,
    # and the next request sent on it fails at once without reaching the server.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(base_url, headers=auth_headers(load), connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as client:
        async def worker() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                extra = extras[index] if extras is not None else None
                results[index] = await one_request(client, model, prompts[index], load, extra)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    return results, duration


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
    endpoint: str = "chat"
    ignore_eos: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Load:
        if args.command == "compare":  # the same number of tokens from every server, the same prompt text
            return cls(args.concurrency, args.num_prompts, args.max_tokens, args.seed,
                       endpoint="completions", ignore_eos=True)
        return cls(args.concurrency, args.num_prompts, args.max_tokens, args.seed, args.api_key,
                   args.json_schema_fraction, args.rounds, args.endpoint, args.ignore_eos)


async def bench(base_url: str, model: str | None, load: Load) -> list[dict]:
    if model is None:
        async with aiohttp.ClientSession(base_url, headers=auth_headers(load)) as client:
            async with client.get("/v1/models", raise_for_status=True) as response:
                model = (await response.json())["data"][0]["id"]
    # One warm-up request, so that the first level does not pay for lazy initialisation.
    await run_level(base_url, model, make_prompts(1, load.seed + 1), 1, replace(load, max_tokens=8))
    rows = []
    for concurrency in load.levels:
        prompts = make_prompts(max(load.prompts_per_level, concurrency), load.seed)
        fractions = load.json_fractions or [None]
        for round_ in range(load.rounds):
            shift = round_ % len(fractions)
            for fraction in fractions[shift:] + fractions[:shift]:
                row = await run_level(base_url, model, prompts, concurrency, load, fraction)
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
    """A server process for one side of the comparison, ready when `ready_path` answers 200, stopped with
    SIGTERM (SIGKILL after 30 s)."""

    def __init__(self, label: str, command: list[str], port: int, log: Path, ready_path: str,
                 env: dict[str, str] | None = None) -> None:
        self.label, self.port, self.ready_path = label, port, ready_path
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = log.open("w")
        self._launched = time.monotonic()
        self.start_s = math.nan  # launch to ready, once ready
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def resident_mib(self) -> float:
        """The resident memory of the server's processes (itself and every descendant), summed."""
        root = psutil.Process(self.process.pid)
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += proc.memory_info().rss
        return total / 2**20

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited ({self.process.returncode}); see {self._log.name}")
            try:
                if httpx.get(f"{self.base_url}{self.ready_path}", timeout=2).status_code == 200:
                    self.start_s = time.monotonic() - self._launched
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.label} not ready after {timeout} s")

    def load_split(self) -> str:
        """gracelm's own account of its model's load (the core's "model load:" line), or ""."""
        found = re.search(r"model load: (.*)", Path(self._log.name).read_text())
        return found.group(1) if found else ""

    def wait_compiled(self, timeout: float = 900) -> None:
        """gracelm's first start on a model compiles its decode steps in the background: measured once each
        graph the core said it compiles is written (the first step after loads them)."""
        deadline = time.monotonic() + timeout
        while True:
            text = Path(self._log.name).read_text()
            wanted = re.search(r"compiling in the background \(pid \d+\): (\d+) graph", text)
            if wanted is None or text.count("decode graph written") >= int(wanted.group(1)):
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.label}: its decode graphs were not written; see {self._log.name}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def compile_bytecode() -> None:
    """gracelm's bytecode brought up to date, as `scripts/bootstrap.sh` and an installed wheel leave it: the
    starts measured then exclude compiling the modules a change of the source left stale (each start of an
    editable install does it again where PYTHONDONTWRITEBYTECODE is set)."""
    package = Path(__file__).resolve().parents[1] / "gracelm"
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(package)], check=True,
                   stdout=subprocess.DEVNULL)


def gracelm_server(gguf: Path, log: Path, options: list[str] = (), env: dict[str, str] | None = None
                   ) -> Server:
    """`options`: more of `gracelm serve`'s (`--gracelm-args`); `env`: the server's whole environment."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "gracelm"), "serve", str(gguf), "--port", str(port),
               "--stats-interval", "0", *options]
    return Server("gracelm", command, port, log, "/ready", env)


def llama_server(binary: Path, gguf: Path, log: Path, threads: int, options: list[str] = ()) -> Server:
    """llama.cpp's C++ server with continuous batching over 32 slots of 1,024 tokens each; `options`: more
    of its own (`--embeddings`)."""
    if not binary.exists():
        raise SystemExit(f"no llama-server at {binary}; run `bench/serve.py setup-llama-cpp` or give "
                         "--llama-server PATH")
    port = free_port()
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", "32", "-c", "32768", "-cb",
               "--host", "127.0.0.1", "--port", str(port), *options]
    return Server("llama-server", command, port, log, "/health")


def llama_cpp_python_server(gguf: Path, log: Path, threads: int) -> Server:
    python = LLAMA_VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no llama-cpp-python venv at {LLAMA_VENV}; run `bench/serve.py setup-llama-cpp "
                         "--python-wrapper` first")
    port = free_port()
    # Without --interrupt_requests False, each new request cuts the stream that is running.
    command = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", "2048", "--n_threads", str(threads),
               "--interrupt_requests", "False"]
    return Server("llama-cpp-python", command, port, log, "/v1/models")


# -- building llama.cpp ---------------------------------------------------------------------------------

# ggml's x86 ISA options and the /proc/cpuinfo flags each needs (GGML_AVX512 compiles for F, CD, VL, DQ, BW).
GGML_ISA_FLAGS = {
    "GGML_SSE42": {"sse4_2"}, "GGML_AVX": {"avx"}, "GGML_AVX2": {"avx2"}, "GGML_FMA": {"fma"},
    "GGML_F16C": {"f16c"}, "GGML_BMI2": {"bmi2"}, "GGML_AVX_VNNI": {"avx_vnni"},
    "GGML_AVX512": {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"},
    "GGML_AVX512_VBMI": {"avx512vbmi"}, "GGML_AVX512_VNNI": {"avx512_vnni"},
    "GGML_AVX512_BF16": {"avx512_bf16"},
}


def cpu_flags(cpuinfo: str) -> set[str]:
    """The ISA flags of the first CPU listed in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return set()


def ggml_cpu_options(flags: set[str]) -> list[str]:
    """cmake options naming the ISA extensions ggml may use, each only when the CPU has it, AMX never.
    Not GGML_NATIVE: its -march=native turns on ggml's AMX code on a CPU that has AMX, and a llama-server
    so built died of SIGILL / SIGSEGV on such a machine once started with 32 slots (`-np 32 -c 32768`),
    where the same source built with the extensions listed one by one, AMX left out, serves."""
    options = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return options + [f"-D{option}={'ON' if needs <= flags else 'OFF'}"
                      for option, needs in GGML_ISA_FLAGS.items()]


def setup_llama_cpp(directory: Path, jobs: int) -> Path:
    """Downloads the llama-cpp-python sdist into `directory`, unpacks it and builds the llama.cpp tools
    it vendors there; returns the llama-server binary."""
    directory.mkdir(parents=True, exist_ok=True)
    sdist = directory / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "--dest", str(directory)],
                       check=True)
    source = directory / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not source.exists():
        with tarfile.open(sdist) as archive:
            archive.extractall(directory, filter="data")
    build = directory / "build"
    options = ggml_cpu_options(cpu_flags(Path("/proc/cpuinfo").read_text()))
    print("cmake options:", " ".join(options))
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", *options], check=True)
    subprocess.run(["cmake", "--build", str(build), f"-j{jobs}", "--target", *LLAMA_TARGETS], check=True)
    binary = build / "bin" / "llama-server"
    print(f"built {', '.join(LLAMA_TARGETS)} in {binary.parent}")
    return binary


def setup_python_wrapper() -> None:
    """Creates the separate venv and installs llama-cpp-python[server] there (compiles llama.cpp)."""
    LLAMA_VENV.parent.mkdir(parents=True, exist_ok=True)
    if not (LLAMA_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(LLAMA_VENV)], check=True)
    pip = [str(LLAMA_VENV / "bin" / "python"), "-m", "pip", "install", "--upgrade"]
    subprocess.run([*pip, "pip"], check=True)
    subprocess.run([*pip, f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON_VERSION}"], check=True)
    print(f"llama-cpp-python[server] installed in {LLAMA_VENV}")


# -- compare --------------------------------------------------------------------------------------------

def compare(args: argparse.Namespace) -> dict:
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    compile_bytecode()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gracelm-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {log_dir}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    options = shlex.split(args.gracelm_args)
    starters = {"gracelm": lambda log: gracelm_server(gguf, log, options),
                "llama-server": lambda log: llama_server(Path(args.llama_server), gguf, log, args.threads)}
    if args.llama_cpp_python:
        starters["llama-cpp-python"] = lambda log: llama_cpp_python_server(gguf, log, args.threads)
    results: dict[str, list[dict]] = {label: [] for label in starters}
    for repeat in range(args.repeats):
        # One server at a time (on a 2-core machine two would steal each other's CPU), in the order
        # reversed every repeat, so that a drift of the host's speed weighs on both sides alike.
        order = list(starters) if repeat % 2 == 0 else list(reversed(starters))
        for label in order:
            server = starters[label](log_dir / f"{label}-{repeat}.log")
            try:
                server.wait_ready()
                footprint = {"start_s": server.start_s, "ready_mib": server.resident_mib()}
                if label == "gracelm":
                    server.wait_compiled()
                rows = uvloop.run(bench(server.base_url, None, Load.from_args(args)))
                footprint["served_mib"] = server.resident_mib()
            finally:
                server.stop()
            results[label] += [{**row, **footprint, "repeat": repeat} for row in rows]
            print_table(f"{label} on {gguf.name}, repeat {repeat + 1} of {args.repeats}", rows)
            print(f"{label}: ready {footprint['start_s']:.1f} s after launch; resident (every process of "
                  f"the server) {footprint['ready_mib']:.0f} MiB at ready, {footprint['served_mib']:.0f} MiB "
                  "after the load")
            if server.load_split():
                print(f"{label}: model load {server.load_split()}")
    ratios = {peer: compare_ratios(results["gracelm"], results[peer]) for peer in starters
              if peer != "gracelm"}
    for peer, rows in ratios.items():
        print_ratios(peer, rows)
    return {**results, "ratios": ratios}


def compile_cost(args: argparse.Namespace) -> dict:
    """What the background compile of a first start costs the requests served beside it: each repeat runs
    the level once on a server compiling its decode graphs (an empty graph cache, the converted weights
    shared) and once on one with `--enforce-eager` (no compile, the same eager steps), in alternating
    order; the ratio of their output tokens/s. Then how long the compile takes with no load."""
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gracelm-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    load = Load(args.concurrency, args.num_prompts, args.max_tokens, args.seed, endpoint="completions",
                ignore_eos=True)
    rows: dict[str, list[dict]] = {"compiling": [], "eager": []}
    for repeat in range(args.repeats):
        for label in (["compiling", "eager"] if repeat % 2 == 0 else ["eager", "compiling"]):
            options = ["--enforce-eager"] if label == "eager" else []
            log = log_dir / f"{label}-{repeat}.log"
            server = gracelm_server(gguf, log, options, _cold_graphs_env(log_dir))
            try:
                server.wait_ready()
                measured = uvloop.run(bench(server.base_url, None, load))
                text = Path(server._log.name).read_text()
                written = text.count("decode graph written")
            finally:
                server.stop()
            rows[label] += [{**row, "repeat": repeat, "graphs_written_meanwhile": written}
                            for row in measured]
            print_table(f"gracelm {label}, repeat {repeat + 1} of {args.repeats}", measured)
    ratios = [{"concurrency": c, "tok_s_ratio": statistics.median(
        a["output_tokens_per_s"] / b["output_tokens_per_s"]
        for a in rows["compiling"] for b in rows["eager"]
        if a["concurrency"] == b["concurrency"] == c and a["repeat"] == b["repeat"])}
        for c in args.concurrency]
    idle = gracelm_server(gguf, log_dir / "idle.log", [], _cold_graphs_env(log_dir))
    try:
        idle.wait_ready()
        started = time.monotonic()
        idle.wait_compiled()
        idle_compile_s = time.monotonic() - started
    finally:
        idle.stop()
    print("\ncompiling / eager output tok/s (median of the repeats): "
          + ", ".join(f"c={r['concurrency']} {r['tok_s_ratio']:.3f}" for r in ratios))
    written = [r["graphs_written_meanwhile"] for r in rows["compiling"]]
    print(f"graphs written during the loaded runs: {written}; the compile on an idle server: "
          f"{idle_compile_s:.0f} s")
    return {**rows, "ratios": ratios, "idle_compile_s": idle_compile_s}


def _cold_graphs_env(log_dir: Path) -> dict[str, str]:
    """An environment whose gracelm cache has no graphs (nor inductor's cache) but shares the converted
    weights, tokenizers and file hashes of the usual cache (`GRACELM_CACHE_DIR`, else ~/.cache/gracelm)."""
    usual = Path(os.environ.get("GRACELM_CACHE_DIR") or Path.home() / ".cache/gracelm")
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=log_dir))
    for name in ("weights", "tokenizers", "file-hashes.json"):
        if (usual / name).exists():
            (cache / name).symlink_to(usual / name)
    return {**os.environ, "GRACELM_CACHE_DIR": str(cache)}


RATIO_METRICS = ["output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms"]


def compare_ratios(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """gracelm / peer for each concurrency level and metric: the ratio of each repeat and their median."""
    peer = {(r["concurrency"], r["repeat"]): r for r in theirs}
    rows = []
    for concurrency in sorted({r["concurrency"] for r in ours}):
        pairs = [(r, peer[(concurrency, r["repeat"])]) for r in ours
                 if r["concurrency"] == concurrency and (concurrency, r["repeat"]) in peer]
        row: dict = {"concurrency": concurrency}
        for metric in RATIO_METRICS:
            per_repeat = [a[metric] / b[metric] for a, b in pairs]
            row[metric] = {"per_repeat": per_repeat, "median": statistics.median(per_repeat)}
        rows.append(row)
    return rows


def print_ratios(peer: str, rows: list[dict]) -> None:
    print(f"\ngracelm / {peer} (tok/s: above 1 is gracelm faster; TTFT, ITL: below 1 is gracelm faster)")
    print(f"{'conc':>5} " + " ".join(f"{m:>28}" for m in RATIO_METRICS))
    for row in rows:
        cells = [f"{row[m]['median']:.2f} (" + ", ".join(f"{x:.2f}" for x in row[m]["per_repeat"]) + ")"
                 for m in RATIO_METRICS]
        print(f"{row['concurrency']:>5} " + " ".join(f"{c:>28}" for c in cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="load one running server")
    run.add_argument("--base-url", default="http://127.0.0.1:8000")
    run.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    run.add_argument("--api-key", default=os.environ.get("GRACELM_API_KEY"))
    run.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    run.add_argument("--ignore-eos", action="store_true",
                     help="every request generates --max-tokens tokens (checked against usage)")
    run.add_argument("--json-schema-fraction", type=float, nargs="+", default=None, metavar="F",
                     help="run each level once per fraction F (0 to 1) of requests under a JSON schema")
    run.add_argument("--rounds", type=int, default=1, help="with --json-schema-fraction: rounds of fractions")
    cmp = commands.add_parser("compare", help="gracelm vs llama.cpp's llama-server on the same GGUF file")
    cmp.add_argument("--gguf", default=None, help="default: gracelm's default model")
    cmp.add_argument("--llama-server", default=str(LLAMA_DIR / "build" / "bin" / "llama-server"),
                     help="the llama-server binary (default: the one setup-llama-cpp builds)")
    cmp.add_argument("--llama-cpp-python", action="store_true",
                     help="also compare llama-cpp-python's server (setup-llama-cpp --python-wrapper)")
    cmp.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    cmp.add_argument("--repeats", type=int, default=2, help="runs of every server, the order swapped each")
    cmp.add_argument("--log-dir", default=None, help="server logs (default: a new temporary directory)")
    cmp.add_argument("--gracelm-args", default="",
                     help="more options of gracelm serve, one string (e.g. \"--mask-cpu-features amx\")")
    cost = commands.add_parser("compile-cost", help="gracelm serving while its first start compiles, "
                                                    "against --enforce-eager")
    cost.add_argument("--gguf", default=None, help="default: gracelm's default model")
    cost.add_argument("--repeats", type=int, default=2, help="runs of each, the order swapped each")
    cost.add_argument("--log-dir", default=None, help="server logs (default: a new temporary directory)")
    for sub in (run, cmp, cost):
        sub.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
        sub.add_argument("--num-prompts", type=int, default=16,
                         help="requests per concurrency level (at least the concurrency)")
        sub.add_argument("--max-tokens", type=int, default=64)
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--out", default=None, help="also write the results as JSON here")
    setup = commands.add_parser("setup-llama-cpp", help="build llama.cpp's llama-server in its own folder")
    setup.add_argument("--dir", default=str(LLAMA_DIR), help="where to download and build")
    setup.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    setup.add_argument("--python-wrapper", action="store_true",
                       help="also install llama-cpp-python[server] into its own venv")
    args = parser.parse_args()
    if args.command == "setup-llama-cpp":
        setup_llama_cpp(Path(args.dir), args.jobs)
        if args.python_wrapper:
            setup_python_wrapper()
        return 0
    if args.command == "run":
        if args.json_schema_fraction and not all(0 <= f <= 1 for f in args.json_schema_fraction):
            parser.error("--json-schema-fraction: each fraction must be between 0 and 1")
        rows = uvloop.run(bench(args.base_url, args.model, Load.from_args(args)))
        print_table(args.base_url, rows)
        if args.json_schema_fraction:
            print_mix(rows)
        results: dict = {"server": rows}
    else:
        if args.repeats < 1:
            parser.error("--repeats: at least 1")
        results = compare(args) if args.command == "compare" else compile_cost(args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
