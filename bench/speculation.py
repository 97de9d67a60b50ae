"""Speculative decoding (`--speculative ngram`, or a draft model) against plain decoding, the same model and
load, in one run.

Each repeat starts `gracelm serve` twice on free ports, one at a time (bench/serve.py's `Server`), once plain
and once with `--spec-args` (default `--speculative ngram`), the order swapped every repeat so that a drift
of the host's speed weighs on both alike. Once its decode graphs are written and its CPU KV cache committed
(both done in the background after start, they would take CPU from the first level), and after one short
warm-up request, each server runs both workloads at every `--concurrency` level with bench/serve.py's
streaming chat clients (aiohttp on uvloop):

- `grounded`: the answer copies its input. Eight passages written here (five of prose, three of code, 155 to
  205 tokens each), each with a task that has it repeated with a small change: fix injected typos
  (in code, in the comments only), replace a word, put every sentence on a line of its own, rename a
  variable, drop the comments. Prompt lookup drafts the input's next tokens, and most are accepted;
- `open`: open-ended questions (a story, a poem, an explanation, a list of ideas) whose answers copy
  nothing of the prompt: drafts come only from an answer's own repeats, and the question is what speculation
  costs there.

Requests are greedy (temperature 0) with a fixed `max_tokens` (`--grounded-max-tokens`, `--open-max-tokens`)
and no `ignore_eos`: a copy ends where its input ends, as a user would see it. Speculation is lossless, so
both servers generate the same tokens; the output tokens each request's `usage` counts are compared, and a
difference is reported (a batch's arithmetic may still round a near-tie the other way). Measured per
workload and level: output tokens/s (usage counts over the level's wall time), TTFT, the inter-token
latency (ITL: between streamed chunks; a speculating step may stream several tokens in one chunk, so its
ITL is a step's, not a token's) and the time per output token of each request (TPOT: from its first token
to its last, over its tokens after the first). From the speculating server's `/metrics`, the
`gracelm_spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total` counters before and after each level:
the acceptance rate (accepted / drafted tokens) and the mean tokens accepted per draft.

Reported per workload and level: the medians over repeats of each server's output tokens/s, the ratio
speculating / plain of each repeat and their median, the same ratio of ITL p50 and TPOT p50, and the
acceptance; then the issue's aims: >= 1.8x output tokens/s at c=1 on `grounded`, and never below 0.95x on
`open` at any level. Measure on a quiet machine and read ratios, not absolute figures.

    .venv/bin/python bench/speculation.py                       # the default model, c = 1 8 32, 2 repeats
    .venv/bin/python bench/speculation.py --repeats 3 --out spec.json
    .venv/bin/python bench/speculation.py --spec-args "--speculative ngram --num-speculative-tokens 6"
    .venv/bin/python bench/speculation.py --spec-args "--speculative-model PATH"   # a draft model
    .venv/bin/python bench/speculation.py --gguf PATH --gracelm-args "--mask-cpu-features amx"
    .venv/bin/python bench/speculation.py --concurrency 1 --num-prompts 2 --repeats 1 \\
        --grounded-max-tokens 48 --open-max-tokens 24          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (  # noqa: E402  (bench/ is not a package)
    TOPICS,
    Load,
    Server,
    default_gguf,
    gracelm_server,
    percentile,
    print_table,
    run_requests,
    summarize,
)

# The aims: speculating / plain output tokens/s.
GROUNDED_AIM = 1.8  # at concurrency 1, on `grounded`
OPEN_FLOOR = 0.95  # at every level, on `open`
TYPO_RATE = 0.15  # the share of words of five letters or more given a typo (two letters swapped)
SPEC_COUNTERS = {"drafts": "gracelm_spec_decode_num_drafts_total",
                 "draft_tokens": "gracelm_spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "gracelm_spec_decode_num_accepted_tokens_total"}
# The log lines of gracelm/model/kv_cache_commit.py that end the background commit of a CPU KV cache.
KV_COMMIT_ENDED = ("KV cache committed", "KV cache pages are mapped when first written",
                   "committing the KV cache stopped")


@dataclass(frozen=True)
class Passage:
    kind: str  # "prose" or "code"
    text: str
    old: str  # prose: a word to replace; code: a variable to rename
    new: str


PASSAGES = [
    Passage("prose",
            "Port Ellis sits at the mouth of a narrow bay, where the river meets the cold northern "
            "sea. For three hundred years its people have lived from fishing, and the harbour still fills "
            "with small boats every evening. The lighthouse on the eastern cliff was built in 1821 after a "
            "storm wrecked eleven ships in a single night. Its keeper, a retired sailor named Thomas Grey, "
            "climbed the spiral stairs twice a day to trim the wick and polish the great lens. Today the "
            "light is automatic, but visitors can still climb to the gallery and look out over the water. "
            "In summer the town holds a festival of boats, with music on the quay and races across the "
            "bay. Port Ellis is quiet in winter, when the ferries stop and the wind keeps most people "
            "indoors, yet many say it is the best season to see the northern lights.", "Port Ellis",
            "Port Wren"),
    Passage("prose",
            "Bread rises because of yeast, a living fungus that feeds on the sugars in flour. As the "
            "yeast eats, it releases carbon dioxide, and the gas is trapped by a stretchy network of "
            "gluten that forms when flour is mixed with water and kneaded. The longer the dough rests, the "
            "more flavour the yeast develops, which is why many bakers let their dough rise slowly in a "
            "cool place overnight. Salt controls the yeast and strengthens the gluten, while too much "
            "sugar can slow it down. When the loaf goes into a hot oven, the gas expands quickly and the "
            "yeast dies, leaving behind the open crumb that makes good bread light. A crust forms as the "
            "surface dries and browns, and the smell of baking fills the kitchen long before the loaf is "
            "ready to eat.", "yeast", "leaven"),
    Passage("prose",
            "Dear Ms. Alvarez, thank you for your letter about the delayed delivery. I am sorry that "
            "the parts for your workshop did not arrive on Thursday as we promised. Our warehouse moved to "
            "a new building last month, and some orders were packed later than planned. I have checked "
            "your order myself: all twelve boxes left our warehouse this morning and should reach you by "
            "Thursday next week. To make up for the trouble, we will not charge you for shipping, and we "
            "have added a set of spare blades to the last box. If anything is missing or damaged when the "
            "parts arrive, please call me directly and I will arrange a replacement the same day. We value "
            "your business and hope to keep serving your workshop for many years. Kind regards, Daniel "
            "Okafor, customer service manager.", "Thursday", "Friday"),
    Passage("prose",
            "Before your first ride, check that the bicycle fits you. Stand over the frame with both "
            "feet flat on the ground; there should be a few centimetres of space between you and the top "
            "tube. Next, set the saddle height: sitting on the saddle with one pedal at its lowest point, "
            "your leg should be almost straight. Tighten the seat clamp firmly, but do not force it. Check "
            "the tyres before every ride and pump them to the pressure printed on their side. Squeeze both "
            "brake levers; the brakes should stop the wheels well before the levers touch the handlebars. "
            "Finally, make sure the chain is clean and lightly oiled, and that the gears change smoothly. "
            "A bicycle that is cared for in this way will stay safe and pleasant to ride for many years.",
            "bicycle", "bike"),
    Passage("prose",
            "The canal was dug between 1790 and 1806 to carry coal from the inland mines to the "
            "coast. Before it opened, the coal travelled on carts over muddy roads, and a single load could "
            "take a week to arrive. Thousands of workers dug the canal by hand, cutting through hills and "
            "building forty locks to lift the boats over the high ground. Horses walked along the towpath "
            "and pulled the narrow boats behind them, each boat carrying as much coal as twenty carts. "
            "Towns grew up along the canal, with warehouses, inns and boatyards. When the railway arrived "
            "fifty years later, the trade slowly moved away, and by 1950 the canal was almost empty. Today "
            "volunteers have restored most of the locks, and the canal is busy again with holiday boats, "
            "walkers and anglers.", "canal", "waterway"),
    Passage("code", '''def moving_average(values, window):
    # Return the average of every run of `window` consecutive values.
    if window <= 0:
        raise ValueError("window must be positive")
    if len(values) < window:
        return []
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for index in range(window, len(values)):
        # Slide the window by one: add the new value, drop the oldest.
        total += values[index] - values[index - window]
        averages.append(total / window)
    return averages


def smooth_series(series, window=3):
    # Smooth each named series and keep the names.
    return {name: moving_average(values, window) for name, values in series.items()}''', "window", "span"),
    Passage("code", '''class Inventory:
    """A shop's stock: item names and how many of each are left."""

    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        # Receiving goods increases the count of the item.
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        # Selling goods decreases the count; an item never goes below zero.
        available = self.items.get(name, 0)
        if count > available:
            raise ValueError(f"only {available} of {name} left")
        self.items[name] = available - count

    def low_stock(self, threshold=5):
        # The items that should be ordered again soon.
        return sorted(name for name, count in self.items.items() if count < threshold)''', "items",
            "stock"),
    Passage("code", '''function debounce(callback, delay) {
  // Call the callback only after the calls stopped for `delay` milliseconds.
  let timer = null;
  return function (...args) {
    if (timer !== null) {
      clearTimeout(timer);
    }
    timer = setTimeout(() => {
      timer = null;
      callback.apply(this, args);
    }, delay);
  };
}

// Search as the user types, but send one request per pause in typing.
const input = document.querySelector("#search");
const search = debounce(async (query) => {
  const response = await fetch(`/api/search?q=${encodeURIComponent(query)}`);
  const results = await response.json();
  renderResults(results);
}, 300);
input.addEventListener("input", (event) => search(event.target.value));''', "timer", "handle"),
]


def _swap_letters(word: str, rng: random.Random) -> str:
    if rng.random() >= TYPO_RATE:
        return word
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def with_typos(text: str, rng: random.Random, comments_only: bool = False) -> str:
    """`text` with two inner letters swapped in some of its longer words (only on comment lines)."""
    lines = []
    for line in text.split("\n"):
        if comments_only and not line.lstrip().startswith(("#", "//")):
            lines.append(line)
            continue
        lines.append(re.sub(r"[A-Za-z]{5,}", lambda m: _swap_letters(m.group(), rng), line))
    return "\n".join(lines)


def _fenced(code: str) -> str:
    return f"```\n{code}\n```"


Task = Callable[[Passage, random.Random], str]
TASKS: dict[str, list[Task]] = {
    "prose": [
        lambda p, rng: "Fix the spelling mistakes in the text below. Reply with the corrected text only, "
                       f"nothing else.\n\n{with_typos(p.text, rng)}",
        lambda p, rng: f'Repeat the text below word for word, but write "{p.new}" wherever it says '
                       f'"{p.old}". Reply with the text only.\n\n{p.text}',
        lambda p, rng: "Reformat the text below with each sentence on a line of its own. Do not change "
                       f"any words. Reply with the text only.\n\n{p.text}",
    ],
    "code": [
        lambda p, rng: f"Rename the variable `{p.old}` to `{p.new}` in the code below. Reply with the "
                       f"whole code only, nothing else.\n\n{_fenced(p.text)}",
        lambda p, rng: "Fix the spelling mistakes in the comments of the code below and change nothing "
                       "else. Reply with the whole code only.\n\n"
                       f"{_fenced(with_typos(p.text, rng, comments_only=True))}",
        lambda p, rng: "Repeat the code below unchanged, except that every comment is removed. Reply with "
                       f"the code only.\n\n{_fenced(p.text)}",
    ],
}
OPEN_TEMPLATES = ["Write a short story about {}.", "Explain why people find {} fascinating.",
                  "List ten ideas for a film about {}, one line each.",
                  "Write a poem about {}, then explain it.", "Describe {} in vivid detail."]


def grounded_prompts(count: int, seed: int) -> list[str]:
    """`count` copy-with-a-change prompts: the passages in a seeded order, over and over, each time with the
    next of its kind's tasks (so that a passage comes back with another task)."""
    rng = random.Random(seed)
    order = rng.sample(range(len(PASSAGES)), len(PASSAGES))
    prompts = []
    for i in range(count):
        passage = PASSAGES[order[i % len(order)]]
        tasks = TASKS[passage.kind]
        prompts.append(tasks[(i % len(order) + i // len(order)) % len(tasks)](passage, rng))
    return prompts


def open_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(OPEN_TEMPLATES).format(rng.choice(TOPICS)) for _ in range(count)]


@dataclass(frozen=True)
class Workload:
    name: str
    make: Callable[[int, int], list[str]]  # (count, seed) -> prompts
    max_tokens: int


# -- one server's load ----------------------------------------------------------------------------------

async def run_workload(base_url: str, model: str, prompts: list[str], concurrency: int, load: Load) -> dict:
    """Every prompt with `concurrency` streaming clients at once (bench/serve.py's `run_requests`): the
    level's summary, its TPOT p50 and each request's output tokens, in prompt order."""
    results, duration = await run_requests(base_url, model, prompts, concurrency, load)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in results if r.ok and r.output_tokens > 1]
    return {**summarize(results, duration, concurrency), "tpot_p50_ms": 1000 * percentile(tpots, 50),
            "request_tokens": [r.output_tokens if r.ok else None for r in results]}


def counter_total(metrics: str, name: str) -> float:
    """The sum of a counter's samples in Prometheus text (one model: one series); 0 before any is made."""
    pattern = re.compile(rf"{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)")
    return sum(float(m.group(1)) for line in metrics.splitlines() if (m := pattern.fullmatch(line)))


async def spec_counters(client: aiohttp.ClientSession) -> dict[str, float]:
    async with client.get("/metrics", raise_for_status=True) as response:
        text = await response.text()
    return {key: counter_total(text, name) for key, name in SPEC_COUNTERS.items()}


def spec_stats(before: dict[str, float], after: dict[str, float]) -> dict:
    """A level's drafts from the counters around it: totals, acceptance rate and tokens accepted per draft."""
    delta = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    return {**delta,
            "acceptance_rate": delta["accepted_tokens"] / delta["draft_tokens"] if delta["draft_tokens"]
            else float("nan"),
            "accepted_per_draft": delta["accepted_tokens"] / delta["drafts"] if delta["drafts"]
            else float("nan")}


async def measure(base_url: str, workloads: list[Workload], prompts: dict[str, list[str]],
                  args: argparse.Namespace, speculating: bool) -> list[dict]:
    """Each workload at each level on one server, after a short warm-up request."""
    rows = []
    async with aiohttp.ClientSession(base_url) as client:
        async with client.get("/v1/models", raise_for_status=True) as response:
            model = (await response.json())["data"][0]["id"]
        warm = Load([1], 1, 16, args.seed)
        await run_workload(base_url, model, prompts[workloads[0].name][:1], 1, warm)
        for workload in workloads:
            for concurrency in args.concurrency:
                load = Load([concurrency], args.num_prompts, workload.max_tokens, args.seed)
                count = max(args.num_prompts, concurrency)
                before = await spec_counters(client)
                row = await run_workload(base_url, model, prompts[workload.name][:count], concurrency, load)
                spec = spec_stats(before, await spec_counters(client)) if speculating else None
                rows.append({"workload": workload.name, **row, "spec": spec})
    return rows


def wait_kv_committed(server: Server, timeout: float) -> None:
    """Waits for the server's background commit of its CPU KV cache to end (committed, or mapped on first
    write, as its log says): on a host of few cores it slowed the first level measured by half."""
    deadline = time.monotonic() + timeout
    while not any(marker in Path(server._log.name).read_text() for marker in KV_COMMIT_ENDED):
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.label} exited ({server.process.returncode}); see {server._log.name}")
        if time.monotonic() > deadline:
            print(f"note: no end of the KV cache's commit in {server._log.name} after {timeout:.0f} s "
                  "(a GPU's cache has none); measuring")
            return
        time.sleep(0.5)


def serve_and_measure(label: str, repeat: int, args: argparse.Namespace, workloads: list[Workload],
                      prompts: dict[str, list[str]], log_dir: Path) -> list[dict]:
    """Starts one server (`plain` or `spec`), waits for its decode graphs and its KV cache's commit, loads
    it, stops it."""
    options = shlex.split(args.gracelm_args)
    if label == "spec":
        options += shlex.split(args.spec_args)
    model = Path(args.gguf) if args.gguf else default_gguf()
    server: Server = gracelm_server(model, log_dir / f"{label}-{repeat}.log", options)
    try:
        server.wait_ready()
        server.wait_compiled()
        wait_kv_committed(server, args.settle_timeout)
        rows = uvloop.run(measure(server.base_url, workloads, prompts, args, label == "spec"))
    finally:
        server.stop()
    for workload in workloads:
        print_table(f"{label} ({' '.join(options) or 'no options'}), {workload.name}, repeat {repeat + 1} "
                    f"of {args.repeats}", [r for r in rows if r["workload"] == workload.name])
    return [{**row, "server": label, "repeat": repeat} for row in rows]


# -- the comparison -------------------------------------------------------------------------------------

def _ratios(pairs: list[tuple[dict, dict]], metric: str) -> dict:
    per_repeat = [spec[metric] / plain[metric] for plain, spec in pairs]
    return {"per_repeat": per_repeat, "median": statistics.median(per_repeat)}


def _pooled_spec(specs: list[dict]) -> dict:
    """The acceptance over every repeat's drafts of a level."""
    totals = {key: sum(s[key] for s in specs) for key in SPEC_COUNTERS}
    return spec_stats(dict.fromkeys(SPEC_COUNTERS, 0.0), totals)


def _token_check(pairs: list[tuple[dict, dict]]) -> dict:
    """Whether both servers generated the same output tokens: totals, and requests whose count differs."""
    differing = sum(a != b for plain, spec in pairs
                    for a, b in zip(plain["request_tokens"], spec["request_tokens"], strict=True))
    return {"plain_tokens": [p["output_tokens"] for p, _ in pairs],
            "spec_tokens": [s["output_tokens"] for _, s in pairs], "requests_differing": differing,
            "same": differing == 0 and all(p["output_tokens"] == s["output_tokens"] for p, s in pairs)}


def pair_up(runs: list[dict], workloads: list[Workload], levels: list[int]) -> list[dict]:
    """Per workload and level: the plain and speculating runs of each repeat side by side."""
    by_key = {(r["server"], r["workload"], r["concurrency"], r["repeat"]): r for r in runs}
    repeats = sorted({r["repeat"] for r in runs})
    summary = []
    for workload in workloads:
        for concurrency in levels:
            pairs = [(by_key[("plain", workload.name, concurrency, k)], by_key[("spec", workload.name,
                                                                                concurrency, k)])
                     for k in repeats]
            summary.append({
                "workload": workload.name, "concurrency": concurrency,
                "plain_tok_s": statistics.median(p["output_tokens_per_s"] for p, _ in pairs),
                "spec_tok_s": statistics.median(s["output_tokens_per_s"] for _, s in pairs),
                **{f"{metric}_ratio": _ratios(pairs, metric)
                   for metric in ("output_tokens_per_s", "itl_p50_ms", "tpot_p50_ms")},
                "spec": _pooled_spec([s["spec"] for _, s in pairs]),
                "tokens": _token_check(pairs),
                "failed": sum(p["failed"] + s["failed"] for p, s in pairs)})
    return summary


def print_summary(summary: list[dict]) -> None:
    for name in dict.fromkeys(row["workload"] for row in summary):
        print(f"\n{name}: speculating / plain (tok/s: above 1 is speculation faster; ITL, TPOT p50: below 1 "
              "is; medians over repeats)")
        print(f"{'conc':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'tok/s ratio (per repeat)':>26} "
              f"{'ITL p50':>7} {'TPOT p50':>8} {'accept':>6} {'acc/draft':>9} {'drafts':>7}  tokens")
        for row in (r for r in summary if r["workload"] == name):
            ratio = row["output_tokens_per_s_ratio"]
            cell = f"{ratio['median']:.2f} (" + ", ".join(f"{x:.2f}" for x in ratio["per_repeat"]) + ")"
            differing = row["tokens"]["requests_differing"]
            tokens = "same" if row["tokens"]["same"] else f"DIFFER ({differing} requests)"
            print(f"{row['concurrency']:>5} {row['plain_tok_s']:>11.1f} {row['spec_tok_s']:>10.1f} "
                  f"{cell:>26} "
                  f"{row['itl_p50_ms_ratio']['median']:>7.2f} {row['tpot_p50_ms_ratio']['median']:>8.2f} "
                  f"{row['spec']['acceptance_rate']:>6.0%} {row['spec']['accepted_per_draft']:>9.2f} "
                  f"{row['spec']['drafts']:>7.0f}  {tokens}")


def check_aims(summary: list[dict]) -> dict:
    """The issue's aims against the medians, each None where its level or workload was not run."""
    grounded = [r["output_tokens_per_s_ratio"]["median"] for r in summary
                if r["workload"] == "grounded" and r["concurrency"] == 1]
    open_ = [r["output_tokens_per_s_ratio"]["median"] for r in summary if r["workload"] == "open"]
    aims = {"grounded_c1": grounded[0] if grounded else None, "open_min": min(open_) if open_ else None}
    print()
    if aims["grounded_c1"] is not None:
        met = "met" if aims["grounded_c1"] >= GROUNDED_AIM else "NOT met"
        print(f"aim: grounded at c=1 >= {GROUNDED_AIM:.2f}x output tok/s: {aims['grounded_c1']:.2f}x, {met}")
    if aims["open_min"] is not None:
        met = "met" if aims["open_min"] >= OPEN_FLOOR else "NOT met"
        print(f"aim: open >= {OPEN_FLOOR:.2f}x at every level: lowest {aims['open_min']:.2f}x, {met}")
    return aims


def warn(summary: list[dict]) -> None:
    for row in summary:
        where = f"{row['workload']} at c={row['concurrency']}"
        if not row["tokens"]["same"]:
            tokens = row["tokens"]
            print(f"warning: {where}: the servers' output tokens differ (plain {tokens['plain_tokens']}, "
                  f"speculating {tokens['spec_tokens']}, {tokens['requests_differing']} requests differ): "
                  "the tok/s ratio compares different work")
        if row["failed"]:
            print(f"warning: {where}: {row['failed']} requests failed (see the tables above)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", "--model", dest="gguf", default=None,
                        help="the model gracelm serves (default: gracelm's default model)")
    parser.add_argument("--gracelm-args", default="", help="more options of both servers, one string")
    parser.add_argument("--spec-args", default="--speculative ngram",
                        help="the speculating server's options, one string (default: \"--speculative "
                             "ngram\"; a draft model: \"--speculative-model PATH\")")
    parser.add_argument("--workloads", nargs="+", choices=["grounded", "open"], default=["grounded", "open"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-prompts", type=int, default=16,
                        help="requests per workload and level (at least the concurrency)")
    parser.add_argument("--grounded-max-tokens", type=int, default=256)
    parser.add_argument("--open-max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs of both servers, the order swapped each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-timeout", type=float, default=120,
                        help="seconds to wait after ready for the CPU KV cache's background commit to end")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a new temporary directory)")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    return args


def main() -> int:
    args = parse_args()
    makers = {"grounded": (grounded_prompts, args.grounded_max_tokens),
              "open": (open_prompts, args.open_max_tokens)}
    workloads = [Workload(name, *makers[name]) for name in args.workloads]
    count = max(args.num_prompts, *args.concurrency)
    prompts = {w.name: w.make(count, args.seed) for w in workloads}
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gracelm-bench-spec-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {log_dir}")
    runs = []
    for repeat in range(args.repeats):
        for label in (["plain", "spec"] if repeat % 2 == 0 else ["spec", "plain"]):
            runs += serve_and_measure(label, repeat, args, workloads, prompts, log_dir)
    summary = pair_up(runs, workloads, args.concurrency)
    print_summary(summary)
    aims = check_aims(summary)
    warn(summary)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary,
                                              "aims": aims}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
