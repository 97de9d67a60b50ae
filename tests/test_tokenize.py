"""`/tokenize` and `/detokenize` (vLLM's shapes), `root` / `parent` in `/v1/models` and the `X-Request-Id`
header, against a real server of a tiny random model."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.server_process import ServerProcess
from tests.tiny_models import tiny_model

MODEL = "tiny-tokenize"
TEXT = "the quick red cat runs over the old stone"


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--served-model-name", MODEL, "--kv-cache-memory", "16MiB",
                       "--max-model-len", "256") as s:
        yield s


def _post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


def test_tokenize_round_trip(server, model_dir):
    hf = AutoTokenizer.from_pretrained(model_dir)
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == hf(TEXT)["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    back = _post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": hf.decode(body["tokens"], skip_special_tokens=True)}
    assert TEXT in back["prompt"]
    strs = _post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()["token_strs"]
    assert strs == hf.convert_ids_to_tokens(body["tokens"])


def test_tokenize_messages_as_the_chat_endpoint_renders_them(server, model_dir):
    hf = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "hello"}]
    tokens = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert tokens == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens == len(tokens)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "a", "colour": 1}, "colour"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_requests_name_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_models_have_root_and_parent(server, model_dir):
    card = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == MODEL and card["root"] == str(model_dir) and card["parent"] is None


def test_request_id_header_and_body_field(server):
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 2}
    sent = _post(server, "/v1/completions", body, headers={"X-Request-Id": "client-id-42"})
    assert sent.headers["x-request-id"] == "client-id-42" and sent.json()["id"] == "cmpl-client-id-42"
    own = _post(server, "/v1/completions", body)
    assert own.headers["x-request-id"] == own.json()["id"] and own.json()["id"].startswith("cmpl-")
    named = _post(server, "/v1/completions", {**body, "request_id": "body-7"})
    assert named.json()["id"] == "cmpl-body-7" and named.headers["x-request-id"] == "cmpl-body-7"
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      headers={"X-Request-Id": "stream-1"},
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                            "max_tokens": 2}) as streamed:
        assert streamed.headers["x-request-id"] == "stream-1"
        assert '"id":"chatcmpl-stream-1"' in streamed.read().decode()
    refused = _post(server, "/v1/completions", {**body, "n": 0}, headers={"X-Request-Id": "bad-1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
    assert httpx.get(f"{server.url}/health", timeout=30).headers["x-request-id"]


@pytest.mark.parametrize(("where", "value"), [
    ("request_id", "ok\n2026-12-05 00:00:00,000 INFO gracelm.server: forged"),  # a forged log line
    ("request_id", "tab\there"), ("request_id", "é"), ("request_id", "x" * 257),
    ("X-Request-Id", "x" * 257), ("X-Request-Id", "bell\x07"),
])
def test_a_request_id_that_cannot_go_into_a_log_line_or_a_header_is_a_400(server, where, value):
    """Once such an id forged a line of the log, then broke the answer's header: the client got nothing."""
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 2}
    if where == "request_id":
        answer = _post(server, "/v1/completions", {**body, "request_id": value})
    else:
        answer = _post(server, "/v1/completions", body, headers={"X-Request-Id": value.encode("latin-1")})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == where and "printable ASCII" in error["message"]
    assert "forged" not in server.log()
    assert _post(server, "/v1/completions", body).status_code == 200  # and it serves on
