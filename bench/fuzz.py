"""Long schema fuzzing of a real `gracelm serve` (a tiny random-weight model unless --model; with an API key
unless --no-api-key): the run of `tests/test_schema_fuzz.py` with --max-examples per route (the test takes
20) and any --seed. Prints the cases run, the answers by route and status, the failures by kind (failed
checks, hangs, a server gone) and every 5xx found, which must be 0; then checks that the server still
answers /health, its KV cache is empty again and it stops cleanly. Exit status 0 only if all of that holds.
Run by hand: `python bench/fuzz.py [--max-examples 500] [--seed 1]`.

The context is --max-model-len tokens (default 64), so that whatever the fuzzer asks for, generation stays
short; --continue-on-failure keeps fuzzing a route after its first failure (the count per kind is then
the number of failing cases, not of routes)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the test suite: see bench/lifecycle.py

from tests.schema_fuzz import fuzz, wait_idle  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402

API_KEY = "fuzz-key"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=500, help="examples per route and phase")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--request-timeout", type=float, default=30.0, help="seconds; longer is a hang")
    parser.add_argument("--max-model-len", type=int, default=64)
    parser.add_argument("--model", help="model to serve (default: a tiny random-weight model)")
    parser.add_argument("--no-api-key", action="store_true", help="serve without an API key")
    parser.add_argument("--continue-on-failure", action="store_true")
    args = parser.parse_args()

    api_key = None if args.no_api_key else API_KEY
    options = ["--max-model-len", str(args.max_model_len), "--kv-cache-memory", "16MiB", "--stats-interval",
               "0", *(["--api-key", api_key] if api_key else [])]
    with ServerProcess(args.model or tiny_model("llama"), *options) as server:
        started = time.monotonic()
        result = fuzz(server.url, max_examples=args.max_examples, seed=args.seed,
                      request_timeout=args.request_timeout, api_key=api_key,
                      continue_on_failure=args.continue_on_failure)
        elapsed = time.monotonic() - started
        print(f"max examples per route: {args.max_examples}, seed: {args.seed}, {elapsed:.0f} s "
              f"({result.cases / elapsed:.0f} cases/s)")
        print(result.report())
        health = httpx.get(f"{server.url}/health", timeout=10).status_code
        idle = wait_idle(server.url)
        print(f"after the run: /health {health}, idle with the KV cache empty: {idle}")
    print("stopped cleanly: exit 0, nothing left")  # `ServerProcess` raised otherwise
    return 0 if result.clean and health == 200 and idle else 1


if __name__ == "__main__":
    sys.exit(main())
