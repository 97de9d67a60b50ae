"""Batch API throughput beside the same requests sent online, and interactive time to first token with and
without a batch running (run by hand). Starts `gracelm serve --state-dir TMP` on a free port with the
model given (default: the default model), then for each round, in turn:

- online: `--lines` chat requests sent at once (`--lines` concurrent clients), wall time to the last;
- batch: the same requests as a batch file, wall time from `POST /v1/batches` to `completed`;
- interactive: `--probes` streamed chat requests one after another, TTFT of each, alone and then while a
  batch of 8 × `--lines` lines runs.

Every request generates exactly `--max-tokens` tokens (`ignore_eos`). Reports lines/s and tokens/s of each,
the batch / online ratio per round and its median, and TTFT p50 / p99 alone and under a batch (a machine's
load drifts: compare figures of the same run only).

    python bench/batch.py --lines 64 --max-tokens 32 --rounds 3 [--model PATH] [-- extra serve options]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.server_process import ServerProcess  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--lines", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("serve_args", nargs="*", help="more `gracelm serve` options (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state, \
            ServerProcess(args.model, "--state-dir", state, "--stats-interval", "0", "--disable-log-requests",
                          *args.serve_args) as server:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
        model = api.models.list().data[0].id
        bodies = [{"model": model, "messages": [{"role": "user", "content": f"Tell me a story about {i}."}],
                   "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
                  for i in range(args.lines)]
        ratios, alone, loaded = [], [], []
        for round_ in range(args.rounds):
            online = _online(api, bodies)
            batch = _batch(api, bodies)
            tokens = args.lines * args.max_tokens
            print(f"round {round_}: online {args.lines / online:.2f} lines/s {tokens / online:.1f} tok/s; "
                  f"batch {args.lines / batch:.2f} lines/s {tokens / batch:.1f} tok/s; "
                  f"batch/online {online / batch:.3f}")
            ratios.append(online / batch)
            alone += [_ttft(api, model) for _ in range(args.probes)]
            # A batch long enough to outlast the probes: the requests 8 times over.
            running = threading.Thread(target=_batch, args=(api, bodies * 8), daemon=True)
            running.start()
            time.sleep(0.5)  # its lines are in the engine
            loaded += [_ttft(api, model) for _ in range(args.probes)]
            running.join()
        print(f"batch/online throughput, median of {args.rounds}: {statistics.median(ratios):.3f}")
        print(f"interactive TTFT alone: p50 {_pct(alone, 50):.3f} s p99 {_pct(alone, 99):.3f} s; "
              f"with a batch running: p50 {_pct(loaded, 50):.3f} s p99 {_pct(loaded, 99):.3f} s")


def _online(api: openai.OpenAI, bodies: list[dict]) -> float:
    started = time.monotonic()
    with ThreadPoolExecutor(len(bodies)) as pool:
        list(pool.map(lambda body: api.chat.completions.create(**_sdk(body)), bodies))
    return time.monotonic() - started


def _sdk(body: dict) -> dict:
    """The keywords of the SDK's call for a body: vLLM's fields go in `extra_body`."""
    return {**{k: v for k, v in body.items() if k != "ignore_eos"}, "extra_body": {"ignore_eos": True}}


def _batch(api: openai.OpenAI, bodies: list[dict]) -> float:
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(bodies)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = api.files.create(file=("bench.jsonl", io.BytesIO(content)), purpose="batch")
    started = time.monotonic()
    batch = api.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.05)
        batch = api.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.failed == 0, batch
    return time.monotonic() - started


def _ttft(api: openai.OpenAI, model: str) -> float:
    started = time.monotonic()
    stream = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                         max_tokens=8, stream=True)
    for _ in stream:
        first = time.monotonic() - started
        break
    stream.close()
    return first


def _pct(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


if __name__ == "__main__":
    main()
