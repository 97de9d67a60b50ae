"""Each error `gracelm serve` answers — status, OpenAI-shaped body, `param` — and the server serving on."""

from __future__ import annotations

import subprocess
import threading

import httpx
import openai
import pytest

from tests.server_process import GRACELM, ServerProcess
from tests.tiny_models import make_tiny_model

BODY_LIMIT = 4096
CONTEXT = 512  # the tiny model's max_position_embeddings
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    # One sequence at a time; slowed steps (10 ms) keep a long request running while a test loads the server,
    # however loaded the machine.
    with ServerProcess(model, "--served-model-name", "tiny", "--max-num-seqs", "1",
                       "--max-request-body-bytes", str(BODY_LIMIT),
                       "--stats-interval", "0", "--kv-cache-memory", "16MiB",
                       env={"GRACELM_TEST_HOOKS": '{"test_step_sleep_s": 0.01}'}) as server:
        yield server


@pytest.fixture(autouse=True)
def still_serving(server):
    yield
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, f"the server stopped serving after the error: {r.text}"


def _error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def _chat(server, body: dict | str | bytes, **kwargs) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60, **kwargs)
    return httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=60,
                      headers={"Content-Type": "application/json"}, **kwargs)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_declared_json_is_refused(server, content_type):
    """What a web page may send without a preflight: a form, text, or a `Blob` of no type (which once ran a
    completion)."""
    body = b'{"prompt": "hi", "max_tokens": 1}'  # valid JSON: only its declared type is wrong
    headers = {} if content_type is None else {"Content-Type": content_type}
    refused = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=60)
    _error(refused, 415, param="Content-Type", code="unsupported_media_type")
    accepted = {"Content-Type": "application/json; charset=utf-8"}
    assert httpx.post(f"{server.url}/v1/completions", content=body, headers=accepted,
                      timeout=60).status_code == 200


@pytest.mark.parametrize(("headers", "status", "param"), [
    ({"Host": "attacker.example"}, 400, "Host"),  # DNS rebinding: the page's own name, resolved to us
    ({"Host": "attacker.example:8000"}, 400, "Host"),
    ({"Origin": "https://attacker.example"}, 403, "Origin"),
    ({"Origin": "null"}, 403, "Origin"),  # a sandboxed page, a local file
    ({"Sec-Fetch-Site": "cross-site"}, 403, "Origin"),
])
def test_what_a_web_page_could_make_a_browser_send_is_refused(server, headers, status, param):
    body = {"prompt": "hi", "max_tokens": 1}
    _error(httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60), status,
           param=param)
    own = {"Origin": server.url, "Sec-Fetch-Site": "same-origin"}  # the status page's own requests
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=own, timeout=60).status_code == 200
    for host in ("localhost", f"localhost:{server.port}", "[::1]", f"127.0.0.1:{server.port}"):
        assert httpx.get(f"{server.url}/health", headers={"Host": host}, timeout=60).status_code == 200


def test_every_route_documents_the_guards_refusals(server):
    """The guards answer before any route, so the schema the fuzzer holds the server to lists their
    statuses on every operation (a cross-origin GET /v1/models once got an undocumented 403)."""
    elsewhere = {"Origin": "https://elsewhere.example"}
    refused = httpx.get(f"{server.url}/v1/models", headers=elsewhere, timeout=60)
    assert refused.status_code == 403
    paths = httpx.get(f"{server.url}/openapi.json", timeout=60).json()["paths"]
    undocumented = [f"{method.upper()} {path}: {status}" for path, operations in paths.items()
                    for method, operation in operations.items() for status in ("400", "403")
                    if status not in operation["responses"]]
    assert undocumented == []


def test_an_allowed_origin_gets_cors_answers_and_others_do_not(tmp_path):
    with ServerProcess(make_tiny_model(tmp_path / "tiny"), "--allowed-origins", "https://app.example",
                       "--allowed-hosts", "*", "--max-model-len", "64", "--kv-cache-memory", "4MiB"
                       ) as server:
        preflight = httpx.options(f"{server.url}/v1/completions", timeout=60, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        body = {"prompt": "hi", "max_tokens": 1}
        allowed = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                             headers={"Origin": "https://app.example", "Host": "gracelm.internal"})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"]
        refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                             headers={"Origin": "https://other.example"})
        assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers


def test_a_requests_own_chat_template_is_refused_without_the_trusting_flag(server):
    """A request's template is code the server runs: vLLM's --trust-request-chat-template lets it in."""
    body = {"messages": USER, "max_tokens": 1, "chat_template": "{{ messages[0]['content'] }}"}
    error = _error(_chat(server, body), 400, param="chat_template")
    assert "--trust-request-chat-template" in error["message"]


def test_malformed_json(server):
    _error(_chat(server, b'{"messages": [}'), 400, code="invalid_json")
    _error(_chat(server, b"[1, 2]"), 400)


@pytest.mark.parametrize("field,value", [("max_tokens", -1), ("max_tokens", 0), ("temperature", 2.5),
                                         ("top_p", 0.0), ("n", 0), ("presence_penalty", 3.0),
                                         ("repetition_penalty", 0.0), ("top_k", -5), ("min_p", 1.5)])
def test_invalid_sampling_parameters(server, field, value):
    _error(_chat(server, {"messages": USER, field: value}), 400, param=field, code="invalid_value")


HUGE = 2**70  # beyond int64 and uint64: msgpack cannot carry it to the engine core


@pytest.mark.parametrize("field,value", [("seed", HUGE), ("seed", -HUGE), ("top_k", HUGE),
                                         ("max_tokens", HUGE), ("stop_token_ids", [HUGE]), ("n", 129)])
@pytest.mark.parametrize("stream", [False, True])
def test_integers_beyond_their_range_are_refused_naming_the_field(server, field, value, stream):
    body = {"messages": USER, field: value, "stream": stream}
    _error(_chat(server, body), 400, param=field, code="invalid_value")
    completion = httpx.post(f"{server.url}/v1/completions", timeout=60,
                            json={"prompt": "hi", field: value, "stream": stream})
    _error(completion, 400, param=field, code="invalid_value")


@pytest.mark.parametrize("extreme", [{"temperature": 1e-300}, {"temperature": 1e-300, "top_k": 3},
                                     {"repetition_penalty": 1e-300, "temperature": 2.0},
                                     {"top_p": 1e-300, "temperature": 1.0, "seed": 2**64 - 1, "n": 2}])
def test_extreme_but_valid_floats_are_served(server, extreme):
    body = {"prompt": "the cat", "max_tokens": 4, **extreme}
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert plain.status_code == 200 and all(c["finish_reason"] == "length" for c in plain.json()["choices"])
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": USER, "max_tokens": 4, "stream": True, **extreme}) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert stream.status_code == 200 and lines[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in lines)


def test_wrong_type_names_the_field(server):
    _error(_chat(server, {"messages": USER, "temperature": "hot"}), 400, param="temperature")


def test_top_logprobs_needs_logprobs(server):
    _error(_chat(server, {"messages": USER, "top_logprobs": 2}), 400, param="top_logprobs")


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ("hello", "messages"),
    ([{"content": "no role"}], "messages.0.role"),
    ([{"role": "wizard", "content": "hi"}], "messages.0.role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content"),
])
def test_bad_messages(server, messages, param):
    _error(_chat(server, {"messages": messages}), 400, param=param)


def test_prompt_plus_max_tokens_beyond_context(server):
    error = _error(_chat(server, {"messages": USER, "max_tokens": CONTEXT}), 400, param="max_tokens",
                   code="context_length_exceeded")
    assert str(CONTEXT) in error["message"]
    too_long = httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": [5] * (CONTEXT + 10), "max_tokens": 1})
    _error(too_long, 400, code="context_length_exceeded")


def test_bad_prompts(server):
    url = f"{server.url}/v1/completions"
    _error(httpx.post(url, json={"prompt": [10**6], "max_tokens": 1, "stream": True}), 400, param="prompt")
    _error(httpx.post(url, json={"prompt": "", "max_tokens": 1}), 400, param="prompt")
    # A batch of prompts is served (tests/test_request_fields.py); a bad one in it is named by its place.
    _error(httpx.post(url, json={"prompt": ["one", ""], "max_tokens": 1}), 400, param="prompt.1")
    _error(httpx.post(url, json={"max_tokens": 1}), 400, param="prompt")


def test_unknown_model(server):
    _error(_chat(server, {"model": "gpt-17", "messages": USER}), 404, param="model", code="model_not_found")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=1)


def test_unknown_route_and_method(server):
    missing = _error(httpx.get(f"{server.url}/v1/nothing"), 404, code="not_found")
    assert "GET /v1/nothing" in missing["message"], missing
    wrong = _error(httpx.get(f"{server.url}/v1/completions"), 405, code="method_not_allowed")
    assert "GET /v1/completions" in wrong["message"] and "POST" in wrong["message"], wrong


def test_oversize_body(server):
    big = {"messages": [{"role": "user", "content": "x" * BODY_LIMIT}]}
    _error(_chat(server, big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit must hold on the bytes actually received
        for _ in range(BODY_LIMIT // 512 + 2):
            yield b" " * 512

    _error(_chat(server, chunks()), 413, code="request_too_large")


def test_oversize_bodies_under_load_each_get_their_413(server):
    """The refused body is read and dropped before the answer: a connection closed with unread bytes is
    reset by the kernel, which can destroy the 413 before the client reads it."""
    big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'  # larger than the socket buffers
    results: list[int | str] = []

    def post() -> None:
        try:
            results.append(_chat(server, big).status_code)
        except httpx.TransportError as e:
            results.append(repr(e))

    body = {"prompt": "busy", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as running:
        lines = running.iter_lines()  # kept referenced: a collected iterator would close the connection
        assert any(line.startswith("data: ") for line in lines)
        for _ in range(2):
            threads = [threading.Thread(target=post) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
    assert results == [413] * 16, results


def test_openai_client_gets_bad_request(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, temperature=9)
    assert info.value.body["param"] == "temperature"


def _serve_exit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(GRACELM), "serve", *args], capture_output=True, text=True, timeout=120)


def test_usage_error_exits_2():
    done = _serve_exit("--port", "70000")
    assert done.returncode == 2, done.stderr
    assert "port" in done.stderr
