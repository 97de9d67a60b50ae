"""`/metrics` after a few known requests to a real server with `--metrics-names vllm`: prefix-cache queries
and hits, preemptions, per-request token, n and max_tokens histograms, per-sequence queue / prefill /
decode / inference times, finish reasons — each with the right value, under gracelm's names and under
vLLM's (`vllm:*`, labels `model_name` and `engine`), so that vLLM's dashboards read them unchanged. Also:
requests and HTTP access are logged by default."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import ServerProcess
from tests.tiny_models import tiny_model

NAME = "tiny"
PREFIXES = ("gracelm_", "vllm:")
BLOCK_SIZE = 16
LONG_PROMPT = [7] * 40  # two full KV blocks: the second request finds them cached


@pytest.fixture(scope="module")
def server():
    with ServerProcess(tiny_model("llama"), "--metrics-names", "vllm", "--served-model-name", NAME,
                       "--block-size", str(BLOCK_SIZE), env={"GRACELM_API_KEY": None}) as server:
        yield server  # stopped at exit: exit code 0, nothing left behind


@pytest.fixture(scope="module")
def answers(server):
    """Two 40-token completions (4 tokens each) and one of a short prompt (under a block: it can hit
    nothing) with n=2 (3 tokens each): 3 requests, 4 sequences, 14 generated tokens, every one finished by
    length."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    no_eos = {"ignore_eos": True}
    first = [client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=4, extra_body=no_eos)
             for _ in range(2)]
    pair = client.completions.create(model=NAME, prompt="the cat", n=2, max_tokens=3, extra_body=no_eos)
    assert pair.usage.prompt_tokens < BLOCK_SIZE
    return [*first, pair]


@pytest.fixture(scope="module")
def samples(server, answers):
    """Every sample of a scrape, by name and label set."""
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples, name: str, **labels: str) -> float:
    prefix = "vllm:" if name.startswith("vllm:") else "gracelm_"
    labels = {"model_name": NAME, **({"engine": "0"} if prefix == "vllm:" else {}), **labels}
    return samples[(name, frozenset(labels.items()))]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_token_counters_and_per_request_histograms(samples, answers, prefix):
    prompt_tokens = sum(a.usage.prompt_tokens for a in answers)
    assert _value(samples, f"{prefix}prompt_tokens_total") == prompt_tokens
    assert _value(samples, f"{prefix}generation_tokens_total") == 14
    assert _value(samples, f"{prefix}request_prompt_tokens_count") == 3
    assert _value(samples, f"{prefix}request_prompt_tokens_sum") == prompt_tokens
    assert _value(samples, f"{prefix}request_generation_tokens_sum") == 14
    assert _value(samples, f"{prefix}request_params_n_sum") == 1 + 1 + 2
    assert _value(samples, f"{prefix}request_params_n_bucket", le="1.0") == 2
    assert _value(samples, f"{prefix}request_params_max_tokens_sum") == 4 + 4 + 3
    assert _value(samples, f"{prefix}request_success_total", finished_reason="length") == 4
    assert _value(samples, f"{prefix}request_success_total", finished_reason="stop") == 0
    assert _value(samples, f"{prefix}time_to_first_token_seconds_count") == 3
    assert _value(samples, f"{prefix}e2e_request_latency_seconds_count") == 3


@pytest.mark.parametrize("prefix", PREFIXES)
def test_phase_times_per_sequence(samples, prefix):
    phases = ("queue", "prefill", "decode", "inference")
    for phase in phases:
        assert _value(samples, f"{prefix}request_{phase}_time_seconds_count") == 4
    sums = {phase: _value(samples, f"{prefix}request_{phase}_time_seconds_sum") for phase in phases}
    assert all(value >= 0 for value in sums.values())
    # inference = prefill + decode, for each sequence
    assert sums["inference"] == pytest.approx(sums["prefill"] + sums["decode"], rel=1e-6, abs=1e-9)
    assert sums["prefill"] > 0 and sums["decode"] > 0  # each sequence had a prefill step, and 2+ tokens


@pytest.mark.parametrize("prefix", PREFIXES)
def test_prefix_cache_and_preemption_counters(samples, answers, prefix):
    short_prompt = answers[2].usage.prompt_tokens
    # Each sequence is looked up once, the pair's two each with its prompt; the second long prompt finds
    # the first's two full blocks.
    assert _value(samples, f"{prefix}prefix_cache_queries_total") == 2 * len(LONG_PROMPT) + 2 * short_prompt
    assert _value(samples, f"{prefix}prefix_cache_hits_total") == 2 * BLOCK_SIZE
    assert _value(samples, f"{prefix}num_preemptions_total") == 0


def test_engine_gauges_under_both_names(samples):
    for prefix in PREFIXES:
        assert _value(samples, f"{prefix}num_requests_running") == 0
        assert _value(samples, f"{prefix}num_requests_waiting") == 0
        assert 0 <= _value(samples, f"{prefix}kv_cache_usage_perc") <= 1
    # gracelm's own metrics have no vLLM twin.
    assert not any(name.startswith("vllm:lifecycle") or name.startswith("vllm:request_faults")
                   for name, _ in samples)


def test_a_second_scrape_counts_nothing_twice(server, samples):
    text = httpx.get(f"{server.url}/metrics").text
    again = {(s.name, frozenset(s.labels.items())): s.value
             for family in text_string_to_metric_families(text) for s in family.samples}
    for name in ("vllm:request_queue_time_seconds_count", "vllm:prefix_cache_hits_total",
                 "gracelm_prefix_cache_queries_total", "gracelm_request_decode_time_seconds_count"):
        assert _value(again, name) == _value(samples, name)


def test_requests_and_access_are_logged_by_default(server, answers):
    log = server.log()
    assert f"request {answers[0].id}: 40 prompt tokens, " in log and "ignore_eos=True" in log
    assert "n=2" in log
    assert '"POST /v1/completions HTTP/1.1" 200' in log


def test_the_request_log_never_holds_a_constraints_or_stop_strings_text(server):
    """A structured-output constraint was logged in full (a 41 KB line for a large schema): its kind, size
    and hash only, as for stop strings and bad words."""
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(300)}}
    body = {"model": NAME, "prompt": "a", "max_tokens": 2, "stop": ["secret-stop"],
            "bad_words": ["secret-word"], "structured_outputs": {"json": schema}}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    line = next(line for line in server.log().splitlines()
                if answer.json()["id"] in line and "prompt tokens" in line)
    assert "field_1" not in line and "secret" not in line and len(line) < 600, line
    assert re.search(r"structured_outputs=\{json: <\d+ chars, sha256 [0-9a-f]{12}>\}", line), line
    assert "stop=<1 items>" in line and "bad_words=<1 items>" in line


def test_preemptions_are_counted():
    """Three 40-token prompts growing to 60 tokens on a cache of 6 blocks of 16: they cannot all run at
    once, so some are preempted, and every one still finishes."""
    with ServerProcess(tiny_model("llama"), "--metrics-names", "vllm", "--served-model-name", NAME,
                       "--max-model-len", "64", "--kv-cache-memory", "48KiB",
                       env={"GRACELM_API_KEY": None}) as server:
        assert "6 KV blocks of 16 tokens" in server.log()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

        def complete(i: int):
            return client.completions.create(model=NAME, prompt=[10 + i] * 40, max_tokens=20,
                                             extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(complete, range(3)))
        assert all(a.usage.completion_tokens == 20 for a in answers)
        text = httpx.get(f"{server.url}/metrics").text
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    preemptions = _value(samples, "gracelm_num_preemptions_total")
    assert preemptions > 0 and _value(samples, "vllm:num_preemptions_total") == preemptions
    # A preempted sequence is timed once, from its first scheduling.
    assert _value(samples, "vllm:request_inference_time_seconds_count") == 3
