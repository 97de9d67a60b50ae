"""Soak run of a real `gracelm serve`: an hour (--duration) of mixed load at bounded concurrency, with the
server's processes sampled over time; a CSV, a plot and verdict lines at the end. Run by hand:

    .venv/bin/pip install --no-build-isolation -e '.[bench]'       # matplotlib, for the plot
    .venv/bin/python bench/soak.py --out soak-out                      # the default model, 3600 s
    .venv/bin/python bench/soak.py --tiny --duration 60 --out /tmp/soak # a tiny random model, a quick try
    .venv/bin/python bench/soak.py --model PATH -- --max-num-seqs 16     # options after `--` go to serve

The load: --concurrency clients (default 6), each sending one request after another, drawn at random
(fixed seed): chat and completions, plain and streamed, n > 1, streams the client drops after a few chunks,
requests the client gives up on before they end, hostile bodies (bad JSON, a text/plain body, an oversized
body, out-of-range and oversized values, unknown model, prompts too long or outside the vocabulary: each
must get a 4xx with an OpenAI error body) and extreme but valid values (served, or refused with a 4xx). Any
5xx, transport error (timeouts included), stream without `[DONE]`, error event, malformed answer or hostile
body accepted is a failure.

Every --interval seconds (default 5) it samples, by the pids of the processes it started, the supervisor's
and the engine core's RSS, open file descriptors and threads (psutil), and KV-cache usage, running and
waiting requests (`/metrics`). Before the load, the KV cache is filled once with unique prompts (--no-kv-fill
to skip): its pages are mapped in only when first written (`model/attention.py:_zero_pages`) and fresh
blocks are taken before cached ones, so without the fill the core's RSS would climb for as long as untouched
blocks remain, which is no leak. After the load, it waits for the server to be idle.

Verdicts (exit code 1 if any fails): no failed request; memory flat after warm-up (per process, the median
RSS of the load's last quarter at most --rss-tolerance above that of its second quarter); no fd or thread
growth (the last quarter's maximum at most --fd-slack / --thread-slack above the second quarter's, and the
idle value at most the second quarter's maximum); KV back to zero when idle (usage 0, running 0, waiting 0
within --idle-timeout); then SIGTERM: exit code 0, and no process, port, runtime directory or shared-memory
segment left. Written to --out: samples.csv, soak.png, verdicts.txt, summary.json, server.log.

Judge the memory verdict on a run of 30 minutes or more: after the KV fill, the core's heap still grows in
steps for some minutes (measured on the default model: +190 MB over the first 3 minutes of load, levelling
off), as batches of new sizes come (n=128 most of all) and the allocator keeps its high-water mark.

The server runs with OpenMP threads that wait passively (unless OMP_WAIT_POLICY is set), as in
bench/lifecycle.py: on shared cores, spinning threads measure the neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gracelm.config import EngineConfig  # noqa: E402
from gracelm.model.model_files import read_model_config  # noqa: E402
from gracelm.serving.server_config import ServerConfig  # noqa: E402
from tests.server_process import ServerProcess, metric_value  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the server started below

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
REQUEST_TIMEOUT_S = 600  # a request slower than this is a hang, counted as a failure
SYSTEM = "You are a concise assistant. Answer in one or two sentences, plainly."
WORDS = ("river lighthouse winter bread desert clock ocean festival letter bird chess robot garden city "
         "mountain train library storm lantern harbour").split()
FAILURES_KEPT = 20


class Failure(Exception):
    """A request answered in a way the server must never answer."""


@dataclass
class Target:
    """What the requests need to know of the server and its model."""

    url: str
    model: str
    max_model_len: int
    vocab_size: int
    max_tokens: int
    limits: ServerConfig  # the server's request limits (its defaults: options that change them are refused)


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (scenario, outcome) -> count
    failures: int = 0
    examples: list[str] = field(default_factory=list)

    def ok(self, scenario: str, outcome: str) -> None:
        self.outcomes[(scenario, outcome)] += 1

    def fail(self, scenario: str, what: str) -> None:
        self.outcomes[(scenario, "FAILED")] += 1
        self.failures += 1
        if len(self.examples) < FAILURES_KEPT:
            self.examples.append(f"{scenario}: {what}")

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())


# -- requests -------------------------------------------------------------------------------------------

def user_text(rng: random.Random) -> str:
    return f"Tell me about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}, {rng.randint(1, 10**6)}."


def valid_body(target: Target, rng: random.Random, chat: bool, stream: bool, n: int = 1) -> dict:
    body = {"model": target.model, "max_tokens": rng.randint(1, target.max_tokens), "n": n, "stream": stream,
            "temperature": rng.choice([0.0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": user_text(rng)}]
    else:
        body["prompt"] = f"{SYSTEM}\n{user_text(rng)}"
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def check_choices(choices: list[dict], n: int, chat: bool) -> None:
    if sorted(c["index"] for c in choices) != list(range(n)):
        raise Failure(f"choices {[c['index'] for c in choices]} for n={n}")
    for choice in choices:
        text = choice["message"]["content"] if chat else choice["text"]
        if not isinstance(text, str) or choice["finish_reason"] not in ("stop", "length"):
            raise Failure(f"malformed choice {json.dumps(choice)[:300]}")


async def plain(client: httpx.AsyncClient, path: str, body: dict) -> str:
    response = await client.post(path, json=body)
    if response.status_code != 200:
        raise Failure(f"HTTP {response.status_code} for a valid request: {response.text[:300]}")
    check_choices(response.json()["choices"], body["n"], path == CHAT)
    return "200"


async def stream(client: httpx.AsyncClient, path: str, body: dict, drop_after: int | None = None) -> str:
    """Reads a stream to `[DONE]`, each choice finished once; or drops it after `drop_after` events."""
    finished: Counter = Counter()
    events, done = 0, False
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread())[:300]
            raise Failure(f"HTTP {response.status_code} for a valid stream: {text!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise Failure(f"error event {event['error']}")
            finished.update(c["index"] for c in event.get("choices", []) if c.get("finish_reason"))
            events += 1
            if drop_after is not None and events >= drop_after:
                return "dropped"  # leaving the block closes the connection mid-stream
    if not done:
        raise Failure("stream ended without [DONE]")
    if sorted(finished.elements()) != list(range(body["n"])):
        raise Failure(f"finish reasons for choices {sorted(finished.elements())}, n={body['n']}")
    return "200"


async def send(client: httpx.AsyncClient, body: dict) -> str:
    path = CHAT if "messages" in body else COMPLETIONS
    return await (stream(client, path, body) if body["stream"] else plain(client, path, body))


async def refused(client: httpx.AsyncClient, path: str, allow_served: bool, **request) -> str:
    """Sends a request that must be refused with a 4xx and an OpenAI error body (or, if `allow_served`,
    may be served, well-formed)."""
    response = await client.post(path, **request)
    if allow_served and response.status_code == 200:
        body = request.get("json", {})
        if body.get("stream"):
            if "data: [DONE]" not in response.text or '"error"' in response.text:
                raise Failure(f"stream without [DONE] or with an error event: {response.text[-300:]}")
        else:
            check_choices(response.json()["choices"], body.get("n", 1), path == CHAT)
        return "200"
    if not 400 <= response.status_code < 500:
        raise Failure(f"HTTP {response.status_code}, expected 4xx: {response.text[:300]}")
    try:
        response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        raise Failure(f"HTTP {response.status_code} without an OpenAI error body: "
                      f"{response.text[:300]}") from None
    return str(response.status_code)


def hostile_requests(target: Target, rng: random.Random) -> list[tuple[str, str, dict]]:
    """(name, path, httpx request arguments) of bodies that must be refused."""
    chat = {"model": target.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    limits = target.limits
    completion = {"model": target.model, "prompt": "hi", "max_tokens": 4}
    json_headers = {"Content-Type": "application/json"}
    text_headers = {"Content-Type": "text/plain"}
    cases = [
        ("bad-json", CHAT, {"content": b'{"messages": [{"role": "user"', "headers": json_headers}),
        ("not-an-object", COMPLETIONS, {"content": b"[1, 2, 3]", "headers": json_headers}),
        ("nan-temperature", CHAT, {"content": json.dumps({**chat, "temperature": math.nan}).encode(),
                                   "headers": json_headers}),
        ("text-plain", CHAT, {"content": json.dumps(chat).encode(), "headers": text_headers}),
        ("oversized-body", COMPLETIONS,
         {"json": {**completion, "prompt": "x" * (limits.max_request_body_bytes + 1)}}),
        ("too-many-stop-strings", CHAT,
         {"json": {**chat, "stop": [f"s{i}" for i in range(limits.max_stop_strings + 1)]}}),
        ("stop-strings-too-long", COMPLETIONS,
         {"json": {**completion, "stop": ["y" * (limits.max_stop_chars + 1)]}}),
        ("unknown-model", CHAT, {"json": {**chat, "model": "no-such-model"}}),
        ("no-messages", CHAT, {"json": {**chat, "messages": []}}),
        ("bad-role", CHAT, {"json": {**chat, "messages": [{"role": "wizard", "content": "hi"}]}}),
        ("empty-prompt", COMPLETIONS, {"json": {**completion, "prompt": []}}),
        ("token-outside-vocab", COMPLETIONS, {"json": {**completion, "prompt": [target.vocab_size + 7]}}),
        ("prompt-too-long", COMPLETIONS,
         {"json": {**completion, "prompt": [5] * (target.max_model_len + 1)}}),
        ("max-tokens-beyond-context", CHAT, {"json": {**chat, "max_tokens": target.max_model_len + 1}}),
    ]
    values = [("out-of-range", {"temperature": -1, "top_p": 0, "top_k": -2, "min_p": 2, "presence_penalty": 5,
                                "repetition_penalty": 0, "n": 129, "max_tokens": 0, "logprobs": 21}),
              ("oversized", {"seed": 2**70, "top_k": 2**70, "max_tokens": 2**70, "n": 2**70,
                             "stop_token_ids": [2**70], "temperature": math.inf})]  # inf: JSON's Infinity
    for kind, fields in values:
        for name, value in fields.items():
            body = {**completion, name: value, "stream": rng.random() < 0.5}
            cases.append((f"{kind}-{name}", COMPLETIONS,
                          {"content": json.dumps(body).encode(), "headers": json_headers}))
    cases.append(("out-of-range-top_logprobs", CHAT,
                  {"json": {**chat, "logprobs": True, "top_logprobs": 21}}))
    return cases


def extreme_bodies(target: Target, rng: random.Random) -> list[tuple[str, dict]]:
    """(name, body) of valid values at the edges: served, or refused with a 4xx, never a 5xx."""
    edges = {
        "tiny-temperature": {"temperature": 1e-30},
        "tiny-repetition-penalty": {"repetition_penalty": 1e-30, "temperature": 1.0},
        "hot-top-k-1": {"temperature": 2.0, "top_k": 1},
        "tiny-top-p": {"top_p": 1e-30, "temperature": 1.0},
        "min-p-1": {"min_p": 1.0, "temperature": 1.0},
        "max-seed-n3": {"seed": 2**64 - 1, "n": 3, "temperature": 1.0},
        "min-seed": {"seed": -(2**63), "temperature": 1.0},
        "logprobs-20": {"logprobs": 20},
        "penalties": {"presence_penalty": -2.0, "frequency_penalty": 2.0, "temperature": 1.0},
        "many-stop-token-ids": {"stop_token_ids": list(range(min(256, target.vocab_size)))},
        "stop-strings": {"stop": [w * 3 for w in WORDS[:16]]},
        "most-stop-strings": {"stop": costliest_stops(target.limits)},
        "max-top-k": {"top_k": 2**31 - 1, "temperature": 1e-6},
        "n-128": {"n": 128, "max_tokens": 2},
    }
    prompt = f"{SYSTEM}\n{user_text(rng)}"
    return [(name, {"model": target.model, "prompt": prompt, "max_tokens": rng.randint(1, 8),
                    "stream": rng.random() < 0.5, **edge}) for name, edge in edges.items()]


def costliest_stops(limits: ServerConfig) -> list[str]:
    """As many distinct stop strings as allowed, as long as allowed in all."""
    count = limits.max_stop_strings
    return [str(i).zfill(limits.max_stop_chars // count) for i in range(count)] if count else []


# -- scenarios: each sends one request and returns its outcome, or raises Failure ------------------------

Scenario = Callable[[httpx.AsyncClient, Target, random.Random], Awaitable[str]]


async def served(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
    return await send(client, valid_body(target, rng, rng.random() < 0.5, rng.random() < 0.6))


async def fan_out(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
    body = valid_body(target, rng, rng.random() < 0.5, rng.random() < 0.5, n=rng.randint(2, 4))
    return await send(client, body)


async def dropped_stream(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
    chat = rng.random() < 0.5
    body = valid_body(target, rng, chat, True, n=rng.choice([1, 1, 2]))
    body["max_tokens"] = target.max_tokens
    return await stream(client, CHAT if chat else COMPLETIONS, body, drop_after=rng.randint(1, 4))


async def given_up(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
    """A request the client abandons (closes its connection) after a random time, often mid-generation."""
    body = valid_body(target, rng, rng.random() < 0.5, rng.random() < 0.5)
    body["max_tokens"] = target.max_tokens
    try:
        return await asyncio.wait_for(send(client, body), timeout=rng.uniform(0.05, 1.5))
    except TimeoutError:
        return "abandoned"


async def hostile(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
    name, path, request = rng.choice(hostile_requests(target, rng))
    try:
        return f"{name} {await refused(client, path, False, **request)}"
    except (Failure, httpx.TransportError) as e:
        raise Failure(f"{name}: {type(e).__name__} {e}") from None


async def extreme(client: httpx.AsyncClient, target: Target, rng: random.Random) -> str:
    name, body = rng.choice(extreme_bodies(target, rng))
    try:
        return f"{name} {await refused(client, COMPLETIONS, True, json=body)}"
    except (Failure, httpx.TransportError) as e:
        raise Failure(f"{name}: {type(e).__name__} {e}") from None


MIX: list[tuple[str, Scenario, int]] = [  # name, scenario, weight
    ("served", served, 40), ("n>1", fan_out, 8), ("dropped-stream", dropped_stream, 10),
    ("abandoned", given_up, 8), ("hostile", hostile, 28), ("extreme", extreme, 6),
]


async def client_loop(target: Target, seed: int, tally: Tally, stop: asyncio.Event) -> None:
    rng = random.Random(seed)
    names, scenarios, weights = zip(*MIX, strict=True)
    async with httpx.AsyncClient(base_url=target.url, timeout=REQUEST_TIMEOUT_S) as client:
        while not stop.is_set():
            index = rng.choices(range(len(MIX)), weights)[0]
            try:
                outcome = await scenarios[index](client, target, rng)
            except Failure as e:
                tally.fail(names[index], str(e))
            except httpx.TransportError as e:
                tally.fail(names[index], f"transport error {type(e).__name__}: {e}")
            else:
                tally.ok(names[index], outcome)


async def fill_kv(target: Target, tokens: int, concurrency: int, rng: random.Random) -> None:
    """Prefills unique prompts worth `tokens` tokens, so that every KV block has been written once."""
    length = min(1024, target.max_model_len - 2)
    prompts = [[rng.randrange(target.vocab_size) for _ in range(length)]
               for _ in range(math.ceil(tokens / length))]

    async def worker(client: httpx.AsyncClient) -> None:
        while prompts:
            body = {"model": target.model, "prompt": prompts.pop(), "max_tokens": 1}
            response = await client.post(COMPLETIONS, json=body)
            if response.status_code != 200:
                raise RuntimeError(f"KV fill request: HTTP {response.status_code} {response.text[:300]}")

    async with httpx.AsyncClient(base_url=target.url, timeout=REQUEST_TIMEOUT_S) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


# -- sampling -------------------------------------------------------------------------------------------

PROCESS_COLUMNS = ("rss_mb", "fds", "threads")
COLUMNS = ("t_s", "phase", *(f"{who}_{c}" for who in ("supervisor", "core") for c in PROCESS_COLUMNS),
           "kv_usage", "running", "waiting", "requests", "failures")


class Sampler:
    """Samples the two processes (by pid) and the engine's gauges every `interval` s, tagged by phase."""

    def __init__(self, server: ServerProcess, core: psutil.Process, interval: float, tally: Tally) -> None:
        self.procs = {"supervisor": psutil.Process(server.pid), "core": core}
        self.url, self.interval, self.tally = server.url, interval, tally
        self.phase = "start"
        self.rows: list[dict] = []
        self.started = time.monotonic()

    async def engine_gauges(self, client: httpx.AsyncClient) -> dict[str, float]:
        try:
            text = (await client.get(f"{self.url}/metrics")).text
        except httpx.TransportError as e:
            self.tally.fail("metrics", f"transport error {type(e).__name__}: {e}")
            return {"kv_usage": math.nan, "running": math.nan, "waiting": math.nan}
        return {"kv_usage": metric_value(text, "gracelm_kv_cache_usage_perc"),
                "running": metric_value(text, "gracelm_num_requests_running"),
                "waiting": metric_value(text, "gracelm_num_requests_waiting")}

    async def sample(self, client: httpx.AsyncClient) -> dict:
        row: dict = {"t_s": round(time.monotonic() - self.started, 2), "phase": self.phase}
        for who, proc in self.procs.items():
            with proc.oneshot():
                row[f"{who}_rss_mb"] = round(proc.memory_info().rss / 2**20, 2)
                row[f"{who}_fds"] = proc.num_fds()
                row[f"{who}_threads"] = proc.num_threads()
        row.update(await self.engine_gauges(client))
        row.update(requests=self.tally.total, failures=self.tally.failures)
        self.rows.append(row)
        return row

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while not stop.is_set():
                await self.sample(client)
                try:
                    await asyncio.wait_for(stop.wait(), self.interval)
                except TimeoutError:
                    pass


async def wait_idle(sampler: Sampler, timeout: float) -> float | None:
    """Seconds until KV usage, running and waiting are all 0 (polled every 0.5 s), or None."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        while time.monotonic() - started < timeout:
            gauges = await sampler.engine_gauges(client)
            if gauges == {"kv_usage": 0.0, "running": 0.0, "waiting": 0.0}:
                return time.monotonic() - started
            await asyncio.sleep(0.5)
    return None


# -- verdicts -------------------------------------------------------------------------------------------

def quarters(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The load phase's second and last quarters (by time)."""
    load = [r for r in rows if r["phase"] == "load"]
    start, end = load[0]["t_s"], load[-1]["t_s"]
    span = end - start
    second = [r for r in load if start + span / 4 <= r["t_s"] < start + span / 2]
    last = [r for r in load if r["t_s"] >= start + 3 * span / 4]
    if not second or not last:
        raise SystemExit("too few samples for the verdicts: lengthen --duration or shorten --interval")
    return second, last


def memory_verdicts(rows: list[dict], tolerance: float) -> list[tuple[bool, str]]:
    second, last = quarters(rows)
    hours = (statistics.median(r["t_s"] for r in last) - statistics.median(r["t_s"] for r in second)) / 3600
    verdicts = []
    for who in ("supervisor", "core"):
        before = statistics.median(r[f"{who}_rss_mb"] for r in second)
        after = statistics.median(r[f"{who}_rss_mb"] for r in last)
        growth = (after - before) / before
        verdicts.append((growth <= tolerance,
                         f"memory flat after warm-up ({who}): RSS median {before:.1f} MB (2nd quarter) -> "
                         f"{after:.1f} MB (last quarter), {100 * growth:+.2f}% "
                         f"(tolerance +{100 * tolerance:.0f}%; {(after - before) / hours:+.1f} MB/h)"))
    return verdicts


def growth_verdicts(rows: list[dict], fd_slack: int, thread_slack: int) -> list[tuple[bool, str]]:
    second, last = quarters(rows)
    idle = [r for r in rows if r["phase"] == "idle"]
    verdicts = []
    for who in ("supervisor", "core"):
        for what, slack in (("fds", fd_slack), ("threads", thread_slack)):
            column = f"{who}_{what}"
            before, after = max(r[column] for r in second), max(r[column] for r in last)
            at_idle = idle[-1][column]
            verdicts.append((after <= before + slack and at_idle <= before,
                             f"no {what} growth ({who}): max {before} (2nd quarter), {after} (last quarter, "
                             f"slack {slack}), {at_idle} when idle"))
    return verdicts


def key_samples(rows: list[dict]) -> dict[str, dict]:
    """The samples at the server's start, at the load's start and end, and at the idle end."""
    load = [r for r in rows if r["phase"] == "load"]
    return {"ready": rows[0], "load start (warm KV)": load[0], "load end": load[-1], "idle end": rows[-1]}


# -- output ---------------------------------------------------------------------------------------------

def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] / 60 for r in rows]
    panels = [("core RSS (MB)", ["core_rss_mb"]), ("supervisor RSS (MB)", ["supervisor_rss_mb"]),
              ("open fds", ["supervisor_fds", "core_fds"]),
              ("threads", ["supervisor_threads", "core_threads"]), ("KV usage (%)", ["kv_usage"])]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 13), sharex=True)
    for ax, (label, columns) in zip(axes, panels, strict=True):
        for column in columns:
            scale = 100 if column == "kv_usage" else 1
            ax.plot(t, [r[column] * scale for r in rows], label=column, linewidth=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        shade_phases(ax, rows)
        ax.legend(loc="upper left", fontsize=8)
    requests = axes[-1].twinx()  # counts on their own scale beside the KV share
    for column, colour in (("running", "tab:red"), ("waiting", "tab:purple")):
        requests.plot(t, [r[column] for r in rows], label=column, linewidth=0.8, color=colour, alpha=0.7)
    requests.set_ylabel("requests running, waiting")
    requests.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("minutes since sampling began (the server ready)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def shade_phases(ax, rows: list[dict]) -> None:
    """The KV fill and the idle end shaded, and the two quarters the verdicts compare."""
    for phase, colour in (("kv-fill", "tab:orange"), ("idle", "tab:green")):
        indices = [i for i, r in enumerate(rows) if r["phase"] == phase]
        if indices:
            end = rows[min(indices[-1] + 1, len(rows) - 1)]["t_s"]  # up to the next phase's first sample
            ax.axvspan(rows[indices[0]]["t_s"] / 60, end / 60, color=colour, alpha=0.15, label=phase)
    for quarter, label in zip(quarters(rows), ("compared quarters", None), strict=True):
        ax.axvspan(quarter[0]["t_s"] / 60, quarter[-1]["t_s"] / 60, color="tab:blue", alpha=0.07, label=label)


# -- the run --------------------------------------------------------------------------------------------

@dataclass
class Options:
    duration: float
    concurrency: int
    interval: float
    kv_fill: bool
    idle_timeout: float
    seed: int


async def soak(server: ServerProcess, target: Target, kv_tokens: int, options: Options,
               tally: Tally) -> tuple[Sampler, float | None]:
    core = next(p for p in server.children if "engine-core" in " ".join(p.cmdline()))
    sampler = Sampler(server, core, options.interval, tally)
    sampling_done = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(sampling_done))
    if options.kv_fill:
        sampler.phase = "kv-fill"
        await fill_kv(target, kv_tokens, options.concurrency, random.Random(options.seed))
    sampler.phase = "load"
    stop = asyncio.Event()
    clients = [asyncio.create_task(client_loop(target, options.seed + i, tally, stop))
               for i in range(options.concurrency)]
    await asyncio.sleep(options.duration)
    stop.set()
    await asyncio.gather(*clients)  # each client ends its request in flight
    async with httpx.AsyncClient(timeout=60) as client:
        await sampler.sample(client)  # the last sample under load
    sampler.phase = "idle"
    idle_after = await wait_idle(sampler, options.idle_timeout)
    await asyncio.sleep(2 * options.interval)  # a few idle samples for the fd and thread verdicts
    sampling_done.set()
    await sampling
    return sampler, idle_after


def stop_verdicts(server: ServerProcess) -> list[tuple[bool, str]]:
    server.capture()
    server.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        code = server.process.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()
        return [(False, "SIGTERM: no exit within 120 s (killed)")]
    verdicts = [(code == 0, f"SIGTERM: exit code {code} after {time.monotonic() - started:.1f} s")]
    try:
        server.assert_nothing_left()
        left = "resource_tracker: There appear to be" in server.log()
        verdicts.append((not left, "nothing left (processes, port, runtime directory, shared memory)"
                         + ("; but the resource tracker cleaned up after the server" if left else "")))
    except AssertionError as e:
        verdicts.append((False, f"something left after the stop: {e}"))
    return verdicts


def load_target(server: ServerProcess, model_path: str | None, max_tokens: int) -> tuple[Target, int]:
    """The target of the requests, and the KV tokens to fill."""
    card = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    config = read_model_config(model_path)
    target = Target(server.url, card["id"], card["max_model_len"], config.vocab_size, max_tokens,
                    ServerConfig())
    return target, int(metric_value(metrics, "gracelm_kv_cache_blocks_total"))


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random-weight llama, made here")
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of load (default 3600)")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--max-tokens", type=int, default=32, help="most tokens a request asks for")
    parser.add_argument("--kv-fill", action=argparse.BooleanOptionalAction, default=True,
                        help="write every KV block once before the load (see above)")
    parser.add_argument("--idle-timeout", type=float, default=60.0)
    parser.add_argument("--rss-tolerance", type=float, default=0.05, help="RSS growth allowed (fraction)")
    parser.add_argument("--fd-slack", type=int, default=4)
    parser.add_argument("--thread-slack", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("soak-out"))
    args = parser.parse_args(argv)
    if args.tiny and args.model:
        parser.error("--tiny and --model exclude each other")
    if not (args.interval > 0 and args.duration >= 8 * args.interval and args.concurrency >= 1):
        parser.error("--duration must be at least 8 --interval (two samples a quarter), --interval positive, "
                     "--concurrency at least 1")
    for option in ("--block-size", "--max-request-body-bytes", "--max-stop-strings", "--max-stop-chars"):
        if option in serve_args:
            parser.error(f"{option}: not supported here (the KV fill and the hostile bodies assume its "
                         f"default)")
    return args, serve_args


def main() -> int:
    args, serve_args = parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "bench/soak.py needs matplotlib: .venv/bin/pip install --no-build-isolation -e '.[bench]'",
            file=sys.stderr,
        )
        return 2
    model = args.model
    if args.tiny:
        from tests.tiny_models import tiny_model

        model = str(tiny_model("llama"))
    args.out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(model, *serve_args)
    tally = Tally()
    try:
        target, kv_blocks = load_target(server, model, args.max_tokens)
        options = Options(args.duration, args.concurrency, args.interval, args.kv_fill, args.idle_timeout,
                          args.seed)
        kv_tokens = math.ceil(kv_blocks * EngineConfig().block_size * 1.05)
        sampler, idle_after = asyncio.run(soak(server, target, kv_tokens, options, tally))
    except BaseException:
        server.kill()
        (args.out / "server.log").write_text(server.log())
        server.close_log()
        raise
    stopped = stop_verdicts(server)
    (args.out / "server.log").write_text(server.log())
    server.close_log()
    verdicts = [(tally.failures == 0, f"requests: {tally.total}, failed: {tally.failures}"),
                *memory_verdicts(sampler.rows, args.rss_tolerance),
                *growth_verdicts(sampler.rows, args.fd_slack, args.thread_slack),
                (idle_after is not None, "KV back to zero when idle: " + (
                    f"usage 0, running 0, waiting 0 after {idle_after:.1f} s" if idle_after is not None
                    else f"not within {args.idle_timeout:.0f} s")),
                *stopped]
    return report(args, sampler.rows, tally, verdicts, model)


def report(args: argparse.Namespace, rows: list[dict], tally: Tally, verdicts: list[tuple[bool, str]],
           model: str | None) -> int:
    lines = [f"{'PASS' if ok else 'FAIL'}  {text}" for ok, text in verdicts]
    write_csv(rows, args.out / "samples.csv")
    passed = all(ok for ok, _ in verdicts)
    title = (f"gracelm soak: {model or 'default model'}, {args.duration:.0f} s load, concurrency "
             f"{args.concurrency}; {'all verdicts PASS' if passed else 'FAILED'}")
    plot(rows, args.out / "soak.png", title)
    (args.out / "verdicts.txt").write_text("\n".join(lines) + "\n")
    outcomes = {f"{s} {o}": n for (s, o), n in sorted(tally.outcomes.items())}
    by_status: Counter = Counter()
    for (scenario, outcome), count in tally.outcomes.items():
        by_status[f"{scenario} {outcome.split(' ')[-1]}"] += count
    milestones = key_samples(rows)
    summary = {"model": model, "duration_s": args.duration, "concurrency": args.concurrency,
               "requests": tally.total, "failures": tally.failures, "failure_examples": tally.examples,
               "outcomes": outcomes, "samples": milestones,
               "verdicts": [{"pass": ok, "text": text} for ok, text in verdicts]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("outcomes:", ", ".join(f"{k}: {v}" for k, v in sorted(by_status.items())))
    for example in tally.examples:
        print("  failure:", example)
    print(f"{'supervisor / core':24s} {'RSS (MB)':>18s} {'fds':>8s} {'threads':>8s}")
    for name, row in milestones.items():
        print(f"{name:24s} {row['supervisor_rss_mb']:8.1f} / {row['core_rss_mb']:7.1f} "
              f"{row['supervisor_fds']:3d} / {row['core_fds']:2d} {row['supervisor_threads']:3d} / "
              f"{row['core_threads']:2d}")
    print("\n".join(lines))
    print(f"written to {args.out}/: samples.csv, soak.png, verdicts.txt, summary.json, server.log")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
