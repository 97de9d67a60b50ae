"""The routes the field's routers call on each worker (`gracelm/server/worker_routes.py`), against a real
server of a tiny random model with an API key: each route's shape, and each figure against the engine's own
(`/metrics`, `/tokenize`, the prefix cache's hits); then vllm-router and sglang-router, started as processes
in front of it, reading its model name, its load and its rendering."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.process_checks import wait_until
from tests.server_process import ServerProcess, Stream, free_port, metric_value
from tests.tiny_models import tiny_model

MODEL = "tiny-worker"
KEY = "worker-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "the quick red cat"}]
LONG_PROMPT = [7] * 40  # two full KV blocks, which a second request finds cached
# Each engine step sleeps this long, so that a stream of 200 tokens runs for seconds: long enough to be
# seen running.
HOOKS = {"GRACELM_TEST_HOOKS": json.dumps({"test_step_sleep_s": 0.01})}
BIN = Path(sys.executable).parent
KEYED = [("GET", "/server_info"), ("GET", "/get_server_info"), ("GET", "/model_info"),
         ("GET", "/get_model_info"), ("GET", "/tokenizer_info"), ("POST", "/flush_cache"),
         ("POST", "/v1/chat/completions/render"), ("POST", "/v1/completions/render")]
OPEN = [("GET", "/get_load"), ("GET", "/load"), ("GET", "/health_generate")]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model("llama")


def _serve(model_dir: Path, *args: str) -> ServerProcess:
    return ServerProcess(model_dir, "--api-key", KEY, "--served-model-name", MODEL, "--kv-cache-memory",
                         "16MiB", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
                         "--stats-interval", "0", *args, env=HOOKS)


@pytest.fixture(scope="module")
def server(model_dir):
    with _serve(model_dir, "--metrics-names", "vllm") as s:
        yield s


def _get(server: ServerProcess, path: str) -> dict | list:
    r = httpx.get(f"{server.url}{path}", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _post(server: ServerProcess, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={**AUTH, **headers}, timeout=60)


def _metrics(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=60).text


def _complete(server: ServerProcess, prompt: list[int]) -> None:
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_the_key_guards_the_information_and_the_flush_not_the_loads_nor_the_probe(server):
    for method, path in KEYED:
        assert httpx.request(method, f"{server.url}{path}", json={}).status_code == 401, path
    for method, path in OPEN:
        assert httpx.request(method, f"{server.url}{path}", timeout=60).status_code == 200, path


def test_server_and_model_info_say_what_the_engine_runs(server, model_dir):
    info = _get(server, "/server_info")
    assert _get(server, "/get_server_info") == info
    metrics = _metrics(server)
    blocks = metric_value(metrics, "gracelm_kv_cache_blocks_total", model_name=MODEL)
    architectures = json.loads((model_dir / "config.json").read_text())["architectures"]
    assert info == info | {
        "model_path": str(model_dir), "tokenizer_path": str(model_dir), "served_model_name": MODEL,
        "is_generation": True, "architectures": architectures, "tp_size": 1, "dp_size": 1, "nnodes": 1,
        "page_size": BLOCK_SIZE, "kv_block_size": BLOCK_SIZE, "context_length": MAX_MODEL_LEN,
        "max_total_num_tokens": blocks * BLOCK_SIZE, "max_total_tokens": blocks * BLOCK_SIZE,
        "disable_radix_cache": False, "version": _get(server, "/version")["version"]}
    # vLLM's info gauge says the same of the KV cache.
    assert metric_value(metrics, "vllm:cache_config_info", model_name=MODEL, engine="0",
                        block_size=str(BLOCK_SIZE), cache_dtype="auto", enable_prefix_caching="True",
                        num_gpu_blocks=str(int(blocks))) == 1

    model = _get(server, "/model_info")
    assert _get(server, "/get_model_info") == model
    assert model == model | {"model_path": str(model_dir), "tokenizer_path": str(model_dir),
                             "is_generation": True, "architectures": architectures}


def test_tokenizer_info_is_the_tokenizers_config(server, model_dir):
    hf = AutoTokenizer.from_pretrained(model_dir)
    info = _get(server, "/tokenizer_info")
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert {key: info[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")} == {
        key: getattr(hf, key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    assert info["chat_template"] == hf.chat_template and info["model_max_length"] == MAX_MODEL_LEN
    assert {int(i): (t["content"], t["special"]) for i, t in info["added_tokens_decoder"].items()} == {
        i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}


def test_render_answers_the_ids_and_sampling_a_request_runs_with(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0.0, "priority": 3}
    rendered = _post(server, "/v1/chat/completions/render", body, **{"X-Request-Id": "r1"}).json()
    tokens = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    assert rendered["token_ids"] == tokens
    assert rendered["request_id"] == "chatcmpl-r1" and rendered["model"] == MODEL
    assert rendered["features"] is None and rendered["priority"] == 3 and rendered["stream"] is False
    sampling = rendered["sampling_params"]
    assert sampling == sampling | {"max_tokens": 5, "temperature": 0.0, "n": 1}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert answer.usage.prompt_tokens == len(tokens)

    prompts = ["the old stone", "a blue river"]
    rendered = _post(server, "/v1/completions/render", {"model": MODEL, "prompt": prompts},
                     **{"X-Request-Id": "r2"}).json()
    assert [r["token_ids"] for r in rendered] == [
        _post(server, "/tokenize", {"model": MODEL, "prompt": p}).json()["tokens"] for p in prompts]
    assert [r["request_id"] for r in rendered] == ["cmpl-r2-0", "cmpl-r2-1"]


@pytest.mark.parametrize(("route", "body", "status", "param"), [
    ("chat/completions", {"messages": MESSAGES, "bogus": 1}, 400, "bogus"),
    ("chat/completions", {"messages": MESSAGES, "return_hidden_states": True}, 400, "return_hidden_states"),
    ("chat/completions", {"messages": MESSAGES, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "cat " * MAX_MODEL_LEN}]}, 400,
     "messages"),
    ("chat/completions", {"model": "other", "messages": MESSAGES}, 404, "model"),
    ("completions", {"prompt": [[5, 6], [MAX_MODEL_LEN * 1000]]}, 400, "prompt.1"),
    ("completions", {"prompt": "a cat", "n": 0}, 400, "n"),
])
def test_render_refuses_what_the_generation_refuses_in_the_same_words(server, route, body, status, param):
    generation = _post(server, f"/v1/{route}", body)
    render = _post(server, f"/v1/{route}/render", body)
    assert render.status_code == generation.status_code == status, render.text
    assert render.json() == generation.json() and render.json()["error"]["param"] == param


def test_loads_and_the_flush_follow_the_engine(server):
    """Idle: no load. A stream running: one request, its tokens held in the KV cache, one request in the
    server, and the flush refused. After it: flushed, and a prompt cached before finds nothing cached."""
    idle = {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert _get(server, "/get_load") == [idle]
    assert _get(server, "/load") == {"server_load": 0}
    _complete(server, LONG_PROMPT)
    hits = metric_value(_metrics(server), "gracelm_prefix_cache_hits_total", model_name=MODEL)
    _complete(server, LONG_PROMPT)
    cached = metric_value(_metrics(server), "gracelm_prefix_cache_hits_total", model_name=MODEL)
    assert cached == hits + 2 * BLOCK_SIZE

    stream = Stream(server.url, max_tokens=200, headers=AUTH)
    stream.wait_started()
    load = _get(server, "/get_load")
    assert _get(server, "/load") == {"server_load": 1}
    refused = httpx.post(f"{server.url}/flush_cache", headers=AUTH, timeout=60)
    assert stream.ended_at is None, "the stream ended before the checks: slow the steps down"
    assert len(load) == 1 and load[0]["num_reqs"] == 1 and load[0]["num_waiting_reqs"] == 0
    assert 0 < load[0]["num_tokens"] <= MAX_MODEL_LEN and load[0]["num_tokens"] % BLOCK_SIZE == 0
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "requests_running"
    assert stream.join().finish_reasons == ["length"]

    flushed = httpx.post(f"{server.url}/flush_cache", headers=AUTH, timeout=60)
    assert flushed.status_code == 200 and flushed.text == "Cache flushed.\n"
    _complete(server, LONG_PROMPT)
    assert metric_value(_metrics(server), "gracelm_prefix_cache_hits_total", model_name=MODEL) == cached


def test_health_generate_is_one_token_generated(server):
    def counts() -> tuple[float, ...]:  # tokens generated, and the requests of each API
        text = _metrics(server)
        return (metric_value(text, "gracelm_generation_tokens_total", model_name=MODEL),
                *(metric_value(text, "gracelm_api_requests_total", model_name=MODEL, api=api)
                  for api in ("chat_completions", "completions", "responses", "messages")))

    before = counts()
    r = httpx.get(f"{server.url}/health_generate", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ok", "state": "running"}
    # One token, and no client's request: the probe is counted under no API.
    assert counts() == (before[0] + 1, *before[1:])


def test_health_generate_is_admitted_as_any_request(model_dir):
    """Draining with no grace period, the server admits no new request: the probe gets no token (503),
    while the stream admitted before finishes."""
    with _serve(model_dir) as drained:
        stream = Stream(drained.url, max_tokens=200, headers=AUTH)
        stream.wait_started()
        drained.process.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{drained.url}/ready").status_code == 503, 30, "the drain")
        r = httpx.get(f"{drained.url}/health_generate", timeout=60)
        assert r.status_code == 503 and r.json() == {"status": "unhealthy", "state": "draining"}
        assert stream.join().finish_reasons == ["length"]
        assert drained.wait_exit() == 0


def _start(command: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def _end(router: subprocess.Popen) -> None:
    router.send_signal(signal.SIGTERM)
    try:
        router.wait(30)
    except subprocess.TimeoutExpired:
        router.kill()
        router.wait(10)


def _router_json(url: str, path: str) -> dict | None:
    try:
        r = httpx.get(f"{url}{path}", headers=AUTH, timeout=10)
    except httpx.TransportError:
        return None
    return r.json() if r.status_code == 200 else None


def test_sglang_router_names_the_model_and_reads_the_load(server, model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = _start([str(BIN / "python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                     "--port", str(port), "--prometheus-port", str(free_port()), "--worker-urls", server.url,
                     "--api-key", KEY], tmp_path / "sglang-router.log")
    try:
        workers = wait_until(lambda: (_router_json(url, "/workers") or {}).get("workers"), 60,
                             lambda: (tmp_path / "sglang-router.log").read_text()[-3000:])
        assert workers[0]["model_id"] == MODEL and workers[0]["metadata"]["model_path"] == str(model_dir)
        assert [m["id"] for m in _router_json(url, "/v1/models")["data"]] == [MODEL]

        stream = Stream(server.url, max_tokens=200, headers=AUTH)
        stream.wait_started()
        loads = _router_json(url, "/get_loads")["workers"]
        assert stream.ended_at is None, "the stream ended before the check: slow the steps down"
        assert [w["worker"] for w in loads] == [server.url] and loads[0]["load"] > 0
        stream.join()
        assert _router_json(url, "/get_loads")["workers"][0]["load"] == 0

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).model == MODEL
        assert httpx.post(f"{url}/flush_cache", headers=AUTH, timeout=60).json()["workers_flushed"] == 1
    finally:
        _end(router)


def test_vllm_router_renders_on_the_worker(server, tmp_path):
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    router = _start([str(BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                     "--worker-urls", server.url, "--api-key", KEY], tmp_path / "vllm-router.log")
    try:
        wait_until(lambda: _router_json(url, "/v1/models"), 60,
                   lambda: (tmp_path / "vllm-router.log").read_text()[-3000:])
        assert [m["id"] for m in _router_json(url, "/v1/models")["data"]] == [MODEL]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).model == MODEL
        assert client.completions.create(model=MODEL, prompt="the cat", max_tokens=2).model == MODEL
        # Its cache-aware policy took both prompts' ids from the worker's render routes, never falling back.
        routed = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert metric_value(routed, "vllm_router_kv_routing_inputs_total", transport="http",
                            result="render") == 2
        assert "render_unavailable" not in routed
        # vllm-router reads /get_load in SGLang's former shape, {"load": N}, which this server (as SGLang's do
        # now, for sglang-router) does not answer: its load shows as unknown, as for vLLM's own servers.
        assert _router_json(url, "/get_loads")["workers"] == [{"worker": server.url, "load": -1}]
    finally:
        _end(router)
