"""Embeddings/s: gracelm against llama.cpp's `llama-server --embeddings` on the same GGUF file (run by hand).

    .venv/bin/python bench/model_shapes.py --shape qwen3-embedding-0.6b --out /tmp/qwen3-embedding.gguf
    .venv/bin/python bench/embeddings.py --gguf /tmp/qwen3-embedding.gguf --concurrency 1 8 --repeats 2

Each server in turn (never both at once: they would share the two cores), the order swapped every repeat:
started, warmed by a few requests, then loaded by `--concurrency` clients that send `--requests` requests to
`/v1/embeddings`, each of `--inputs-per-request` texts of mixed lengths (fixed seeds, the same texts for
both; new texts for each level, so that no prefix cache answers). Reports embeddings/s, prompt tokens/s
(each server's own `usage` count) and the request latency's median, then gracelm / llama-server ratios per
repeat and their median. The file's `pooling_type` tells both servers how to pool (`bench/model_shapes.py`
writes Qwen3-Embedding's, the last token); both
normalise. llama-server embeds an input in one physical batch, so inputs stay under its 512 tokens; its
slots and context are the serving comparison's (`-np 32 -c 32768`) unless `--llama-args` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import LLAMA_DIR, gracelm_server, llama_server  # noqa: E402

WORDS = ("river stone light winter market garden letter engine harbour signal forest paper window "
         "silver thunder orchard bridge lantern meadow compass").split()


def make_texts(count: int, seed: int) -> list[str]:
    """Texts of 4 to 160 words, as a retrieval corpus's passages and queries mix."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 12, 40, 160)))) for _ in range(count)]


async def one_request(session: aiohttp.ClientSession, url: str, texts: list[str]) -> tuple[float, int]:
    """Latency and prompt tokens of one request; raises where the answer is not one vector per text."""
    start = time.perf_counter()
    async with session.post(url, json={"model": "bench", "input": texts}) as response:
        body = await response.json()
    if response.status != 200 or len(body.get("data", [])) != len(texts):
        raise RuntimeError(f"{url}: {response.status} {str(body)[:300]}")
    return time.perf_counter() - start, body["usage"]["prompt_tokens"]


def make_batches(requests: int, per_request: int, seed: int) -> list[list[str]]:
    texts = make_texts(requests * per_request, seed)
    return [texts[i : i + per_request] for i in range(0, len(texts), per_request)]


async def load(base_url: str, warm_up: list[list[str]], batches: list[list[str]], concurrency: int) -> dict:
    """`batches` sent by `concurrency` clients, each taking the next batch as it finishes one, after the
    `warm_up` batches (each server's first requests pay for lazy work)."""
    url = f"{base_url}/v1/embeddings"
    queue = list(reversed(batches))
    results: list[tuple[float, int]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for batch in warm_up:
            await one_request(session, url, batch)

        async def client() -> None:
            while queue:
                results.append(await one_request(session, url, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    inputs = sum(len(batch) for batch in batches)
    return {"concurrency": concurrency, "embeddings_per_s": inputs / duration,
            "tokens_per_s": sum(tokens for _, tokens in results) / duration,
            "latency_p50_ms": 1000 * statistics.median(latency for latency, _ in results)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="an embedding model's GGUF file")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--inputs-per-request", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--llama-server", default=str(LLAMA_DIR / "build" / "bin" / "llama-server"))
    parser.add_argument("--gracelm-args", default="", help="more options of `gracelm serve`")
    parser.add_argument("--llama-args", default="",
                        help="more options of llama-server, after (so over) its -np 32 -c 32768")
    args = parser.parse_args()
    gguf, logs = Path(args.gguf), Path(tempfile.mkdtemp(prefix="gracelm-bench-embed-"))
    # Texts of their own for the warm-up and for each level, so that no server answers from a cache.
    warm_up = make_batches(2, args.inputs_per_request, seed=0)
    levels = {c: make_batches(args.requests, args.inputs_per_request, seed=1 + i)
              for i, c in enumerate(args.concurrency)}
    options = ["--task", "embed", "--served-model-name", "bench", *args.gracelm_args.split()]
    starters = {"gracelm": lambda log: gracelm_server(gguf, log, options),
                "llama-server": lambda log: llama_server(Path(args.llama_server), gguf, log, args.threads,
                                                         ["--embeddings", *args.llama_args.split()])}
    ratios: dict[int, list[float]] = {c: [] for c in args.concurrency}
    print(f"server logs in {logs}")
    for repeat in range(args.repeats):
        rows = {}
        for label in (list(starters) if repeat % 2 == 0 else list(reversed(starters))):
            server = starters[label](logs / f"{label}-{repeat}.log")
            try:
                server.wait_ready()
                rows[label] = [uvloop.run(load(server.base_url, warm_up, levels[c], c))
                               for c in args.concurrency]
            finally:
                server.stop()
            for row in rows[label]:
                print(f"repeat {repeat + 1} {label:>12}: c={row['concurrency']:>3} "
                      f"{row['embeddings_per_s']:8.1f} embeddings/s {row['tokens_per_s']:9.0f} tokens/s "
                      f"p50 {row['latency_p50_ms']:8.1f} ms")
        for ours, theirs in zip(rows["gracelm"], rows["llama-server"], strict=True):
            ratios[ours["concurrency"]].append(ours["embeddings_per_s"] / theirs["embeddings_per_s"])
    for concurrency, values in ratios.items():
        print(f"c={concurrency}: gracelm / llama-server embeddings/s "
              f"{', '.join(f'{v:.2f}' for v in values)} (median {statistics.median(values):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
