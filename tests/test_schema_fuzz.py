"""Schema fuzzing (`tests/schema_fuzz.py`) of a real `gracelm serve` with an API key, bounded to tens of
examples per route with a fixed seed: no 5xx, no hang, no crash, nothing undocumented or off-schema. Then
the server still serves, its KV cache is empty again, its log shows no error, and it stops cleanly.

Generation stays short whatever the fuzzer asks for: the context (`--max-model-len`) is 64 tokens."""

from __future__ import annotations

import time

import httpx

from tests.schema_fuzz import fuzz
from tests.server_process import ServerProcess, metric_value
from tests.tiny_models import tiny_model

API_KEY = "fuzz-key"
MAX_EXAMPLES = 20
SEED = 20261201
REQUEST_TIMEOUT = 30.0  # a request unanswered this long is a hang (the longest allowed takes ~1 s here)


def test_fuzzing_the_schema_finds_nothing_and_leaves_nothing():
    with ServerProcess(tiny_model("llama"), "--api-key", API_KEY, "--max-model-len", "64",
                       "--kv-cache-memory", "16MiB", "--stats-interval", "0") as server:
        result = fuzz(server.url, max_examples=MAX_EXAMPLES, seed=SEED, request_timeout=REQUEST_TIMEOUT,
                      api_key=API_KEY)
        assert result.clean, result.report()
        # It reached the engine (answers, with the key), the validation (400s), the key check (401s) and
        # the router (405s) of each generation route.
        for route in ("POST /v1/chat/completions", "POST /v1/completions"):
            assert {200, 400, 401, 405} <= set(result.statuses[route]), result.report()
        assert result.cases >= 7 * MAX_EXAMPLES, result.report()

        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        _wait_idle(server)
        log = server.log()
        assert "Traceback" not in log and " ERROR " not in log, log[-5000:]


def _wait_idle(server: ServerProcess, timeout: float = 30) -> None:
    """Nothing runs and the KV cache is empty again (aborted requests are freed at the engine's next
    step, so this may take a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        idle = (metric_value(text, "gracelm_kv_cache_usage_perc") == 0
                and metric_value(text, "gracelm_num_requests_running") == 0
                and metric_value(text, "gracelm_num_requests_waiting") == 0)
        if idle or time.monotonic() > deadline:
            assert idle, text
            return
        time.sleep(0.1)
