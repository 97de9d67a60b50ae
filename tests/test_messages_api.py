"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official `anthropic` SDK
against a real `gracelm serve`: plain and streamed answers and their event sequence, stop reasons, a tool
round trip, structured output by schema, the refusals each in Anthropic's error shape (and OpenAI's shape
kept elsewhere), both key headers, the metrics and the status page; then a drain with Messages streams in
flight: one completes, one is cut at the deadline and ends with the error event."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Literal

import anthropic
import httpx
import pydantic
import pytest

from gracelm.serving.api_errors import APIError, error_shape
from gracelm.serving.messages_protocol import ACCEPTED_BETAS
from tests.process_checks import wait_until
from tests.server_process import ServerProcess, metric_value
from tests.tiny_models import tiny_model

KEY = "messages-key"
MODEL = "any"
BODY_LIMIT = 65536
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
GREEDY = {"temperature": 0.0}
ALERTS = {"name": "get_alerts", "description": "The weather alerts of a region.",
          "input_schema": {"type": "object", "required": ["level"], "additionalProperties": False,
                           "properties": {"level": {"type": "string", "enum": ["low", "high"]}}}}
# A tool whose input is long whatever the model: at least 300 items, so a request for it runs to max_tokens.
LONG_INPUT = {"name": "list_items", "input_schema": {
    "type": "object", "required": ["items"], "additionalProperties": False,
    "properties": {"items": {"type": "array", "items": {"enum": ["a"]}, "minItems": 300}}}}
LONG_CHOICE = {"type": "tool", "name": "list_items"}


def _serve(*args: str, step_sleep: float = 0.01) -> ServerProcess:
    # The default tools section is long in a 512-token vocabulary: a longer context than the default.
    return ServerProcess(tiny_model("llama", max_position_embeddings=2048), "--max-model-len", "2048",
                         "--served-model-name", MODEL, "--api-key", KEY, "--stats-interval", "0",
                         "--kv-cache-memory", "16MiB", *args,
                         env={"GRACELM_TEST_HOOKS": json.dumps({"test_step_sleep_s": step_sleep})})


@pytest.fixture(scope="module")
def server():
    # One sequence in flight at most, so that a second request while a stream runs is a 429; slowed steps
    # keep that stream running while the test asks.
    with _serve("--max-num-queued-reqs", "1", "--max-request-body-bytes", str(BODY_LIMIT)) as process:
        yield process


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _headers(**extra: str) -> dict[str, str]:
    return {"x-api-key": KEY, "anthropic-version": "2023-06-01", **extra}


def _post(server, path: str, body: dict | bytes, **headers: str) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{path}", content=body, timeout=60,
                          headers=_headers(**{"content-type": "application/json", **headers}))
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, headers=_headers(**headers))


def _streamed(client: anthropic.Anthropic, **fields) -> anthropic.types.Message:
    with client.messages.stream(**fields) as stream:
        return stream.get_final_message()


def _anthropic_error(response: httpx.Response, status: int, kind: str, *named: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    for name in named:
        assert name in body["error"]["message"], body
    return body["error"]["message"]


# -- answers ----------------------------------------------------------------------------------------------

def test_a_plain_message_has_anthropics_shape_and_counts_its_prompt(server, client) -> None:
    fields = dict(model=MODEL, max_tokens=8, messages=USER, system="Answer briefly.")
    message = client.messages.create(**fields, metadata={"user_id": "u-1"}, service_tier="auto",
                                     extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20})
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    named = _post(server, "/v1/messages", BASE, **{"x-request-id": "mine-1"})
    assert named.json()["id"] == "msg_mine-1" and named.headers["x-request-id"] == "mine-1"
    assert [block.type for block in message.content] in (["text"], [])
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert 1 <= message.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model=MODEL, messages=USER, system="Answer briefly.")
    assert counted.input_tokens == message.usage.input_tokens
    without_system = client.messages.count_tokens(model=MODEL, messages=USER)
    assert without_system.input_tokens < counted.input_tokens


def test_a_stream_sends_the_event_sequence_and_the_same_message(client) -> None:
    fields = dict(model=MODEL, max_tokens=12, messages=USER, extra_body=GREEDY)
    plain = client.messages.create(**fields)
    kinds = [event.type for event in client.messages.create(**fields, stream=True)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = kinds[1:-2]
    assert blocks == ["content_block_start", *["content_block_delta"] * (len(blocks) - 2),
                      "content_block_stop"] or not blocks
    streamed = _streamed(client, **fields)
    assert [block.to_dict() for block in streamed.content] == [block.to_dict() for block in plain.content]
    assert streamed.stop_reason == plain.stop_reason
    assert streamed.usage.input_tokens == plain.usage.input_tokens
    assert streamed.usage.output_tokens == plain.usage.output_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(client) -> None:
    fields = dict(model=MODEL, max_tokens=24, messages=USER, extra_body=GREEDY)
    text = client.messages.create(**fields).content[0].text
    assert len(text) >= 6, text
    sequence = text[len(text) // 2:len(text) // 2 + 2]
    for message in (client.messages.create(**fields, stop_sequences=[sequence]),
                    _streamed(client, **fields, stop_sequences=[sequence])):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == sequence
        assert (message.content[0].text if message.content else "") == text[:text.index(sequence)]


def test_consecutive_turns_of_one_role_are_one_turn(client) -> None:
    apart = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]}]
    joined = [{"role": "user", "content": "a\n\nb"}]
    assert (client.messages.count_tokens(model=MODEL, messages=apart).input_tokens
            == client.messages.count_tokens(model=MODEL, messages=joined).input_tokens)


def test_a_system_turn_inside_the_conversation_is_rendered_there(client, server) -> None:
    """Claude Code's mid-conversation system turns: text blocks, rendered as a system message where they
    stand; any other block is refused naming it."""
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
             {"role": "user", "content": "c"}]
    without = [turn for turn in turns if turn["role"] != "system"]
    counted = client.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    assert counted > client.messages.count_tokens(model=MODEL, messages=without).input_tokens
    message = client.messages.create(model=MODEL, max_tokens=2, messages=turns,
                                     extra_headers={"anthropic-beta": "mid-conversation-system-2026-04-07"})
    assert message.usage.input_tokens == counted
    image = {"type": "image", "source": {"type": "url", "url": "http://example.invalid/x.png"}}
    refused = {**BASE, "messages": [*USER, {"role": "system", "content": [image]}]}
    _anthropic_error(_post(server, "/v1/messages", refused), 400, "invalid_request_error",
                     "messages.1.content.0")


def test_a_prefill_is_continued(client) -> None:
    prefill = [*USER, {"role": "assistant", "content": "The weather is"}]
    counted = client.messages.count_tokens(model=MODEL, messages=prefill).input_tokens
    assert counted > client.messages.count_tokens(model=MODEL, messages=USER).input_tokens
    message = client.messages.create(model=MODEL, max_tokens=4, messages=prefill)
    assert message.usage.input_tokens == counted


# -- tools and structured output -------------------------------------------------------------------------

def test_a_tool_round_trip(client) -> None:
    fields = dict(model=MODEL, max_tokens=40, tools=[ALERTS], extra_body=GREEDY)
    call = client.messages.create(**fields, messages=USER, tool_choice={"type": "tool", "name": "get_alerts"})
    assert call.stop_reason == "tool_use"
    [use] = [block for block in call.content if block.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_alerts" and use.input["level"] in ("low", "high")

    result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "2 alerts"}]}
    history = [*USER, {"role": "assistant", "content": [block.model_dump() for block in call.content]},
               {"role": "user", "content": [result]}]
    answer = client.messages.create(**fields, messages=history)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.output_tokens >= 1
    # The call and its result reach the prompt; a failed call says so.
    before = client.messages.count_tokens(model=MODEL, messages=USER, tools=[ALERTS]).input_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[ALERTS]).input_tokens
    assert answer.usage.input_tokens == counted > before
    failed = [*history[:2], {"role": "user", "content": [{**result, "is_error": True}]}]
    assert client.messages.count_tokens(model=MODEL, messages=failed, tools=[ALERTS]).input_tokens > counted


def test_a_streamed_call_is_the_same_call(client) -> None:
    fields = dict(model=MODEL, max_tokens=100, messages=USER, tools=[ALERTS], extra_body=GREEDY,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    plain = client.messages.create(**fields)
    streamed = _streamed(client, **fields)
    assert plain.stop_reason == streamed.stop_reason == "tool_use"
    plain_uses = [(b.name, b.input) for b in plain.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == plain_uses
    assert len(plain_uses) == 1 and plain_uses[0][0] == "get_alerts"  # disable_parallel_tool_use


class Alert(pydantic.BaseModel):
    level: Literal["low", "high"]
    # an enum, not an int: sampled digits could run past max_tokens (the SDK's parse drops an int's bounds
    # from the schema it sends)
    count: Literal[1, 2, 3]


def test_structured_output_by_schema(client) -> None:
    message = client.messages.parse(model=MODEL, max_tokens=60, messages=USER, output_format=Alert,
                                    extra_body={"temperature": 1.0})
    assert isinstance(message.parsed_output, Alert), message.content


# -- refusals --------------------------------------------------------------------------------------------

BASE = {"model": MODEL, "max_tokens": 4, "messages": USER}
REFUSALS = [
    ({"temprature": 0.5}, "temprature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [ALERTS], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{**ALERTS, "strict": True}]}, "tools.0.strict"),
    ({"temperature": -1.0}, "temperature"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_sequences": ["x"] * 1000}, "stop_sequences"),
    ({"system": [{"type": "text", "text": "a", "citations": [{}]}]}, "system.0.citations"),
    ({"messages": [{"role": "user", "content": "hi " * 3000}]}, "maximum context length"),
    ({"output_config": {"effort": "low"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "objec"}}}},
     "output_config.format"),
    ({"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_alerts", "input": {}}]}]}, "messages.1"),
]


@pytest.mark.parametrize(("change", "named"), REFUSALS)
def test_a_refused_request_is_a_400_naming_the_field(client, change: dict, named: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(**BASE, extra_body=change)
    assert refused.value.type == "invalid_request_error"
    assert named in refused.value.api_message, refused.value.body


def test_each_refusal_before_a_route_is_in_anthropics_shape(server) -> None:
    _anthropic_error(_post(server, "/v1/messages", b"{not json"), 400, "invalid_request_error", "JSON")
    _anthropic_error(_post(server, "/v1/messages", {**BASE, "model": "claude-x"}), 404, "not_found_error",
                     "claude-x")
    _anthropic_error(_post(server, "/v1/messages", b"[" + b" " * BODY_LIMIT + b"]"), 413, "request_too_large")
    _anthropic_error(_post(server, "/v1/messages", BASE, **{"anthropic-beta": "context-1m-2025-08-07"}), 400,
                     "invalid_request_error", "anthropic-beta", "context-1m-2025-08-07")
    _anthropic_error(httpx.get(f"{server.url}/v1/messages", headers=_headers()), 405,
                     "invalid_request_error", "GET /v1/messages")
    _anthropic_error(_post(server, "/v1/messages/nope", BASE), 404, "not_found_error", "/v1/messages/nope")
    _anthropic_error(_post(server, "/v1/messages", BASE, origin="https://elsewhere.example"), 403,
                     "permission_error", "elsewhere.example")
    _anthropic_error(_post(server, "/v1/messages", BASE, **{"x-api-key": "wrong"}), 401,
                     "authentication_error", "x-api-key")
    _anthropic_error(_post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": []}), 400,
                     "invalid_request_error", "messages")
    # Elsewhere, OpenAI's shape.
    openai_401 = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "wrong"})
    assert openai_401.status_code == 401 and openai_401.json()["error"]["code"] == "invalid_api_key"


def test_the_sdks_error_classes(server, client) -> None:
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**BASE)
    assert wrong.value.type == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(**{**BASE, "model": "claude-x"})
    assert unknown.value.type == "not_found_error"


def test_both_key_headers_are_taken_on_every_route(server) -> None:
    by_header = anthropic.Anthropic(base_url=server.url, api_key=None, max_retries=0,
                                    default_headers={"x-api-key": KEY})
    assert by_header.messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
        assert _post(server, "/v1/messages", BASE, **headers).status_code == 200


def test_accepted_betas_and_any_version_are_taken(server) -> None:
    betas = ",".join(ACCEPTED_BETAS)
    headers = {"anthropic-beta": betas, "anthropic-version": "2099-01-01"}
    answer = _post(server, "/v1/messages", BASE, **headers)
    assert answer.status_code == 200, answer.text


def test_a_busy_server_answers_429_in_anthropics_shape(server, client) -> None:
    with client.messages.stream(model=MODEL, max_tokens=400, messages=USER, tools=[LONG_INPUT],
                                tool_choice=LONG_CHOICE) as stream:
        next(iter(stream))  # in flight
        with pytest.raises(anthropic.RateLimitError) as busy:
            client.messages.create(**BASE)
    assert busy.value.type == "rate_limit_error" and busy.value.response.headers["retry-after"]
    # Closing the stream aborted its request: the next test finds the server idle.
    wait_until(lambda: _status(server)["requests"]["in_flight"] == 0, 30, "the stream's release")


def _status(server) -> dict:
    return httpx.get(f"{server.url}/status.json", headers={"Authorization": f"Bearer {KEY}"}).json()


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (403, "permission_error"), (404, "not_found_error"),
                                              (413, "request_too_large"), (429, "rate_limit_error"),
                                              (500, "api_error"), (503, "overloaded_error")])
def test_errors_take_the_shape_of_their_path(status: int, kind: str) -> None:
    error = APIError(status, "what went wrong", param="x", code="y")
    # Anthropic's shape has no param: the message names the field.
    assert error_shape("/v1/messages/count_tokens")(error) == {
        "type": "error", "error": {"type": kind, "message": "x: what went wrong"}}
    named = APIError(status, "x: what went wrong", param="x")
    assert error_shape("/v1/messages")(named)["error"]["message"] == "x: what went wrong"
    assert error_shape("/v1/messagesx")(error)["error"]["param"] == "x"
    assert error_shape("/v1/chat/completions")(error)["error"]["code"] == "y"


def test_metrics_and_the_status_page_count_messages_requests(server) -> None:
    def admitted() -> float:
        return metric_value(httpx.get(f"{server.url}/metrics").text, "gracelm_api_requests_total",
                            api="messages")

    before = admitted()
    assert _post(server, "/v1/messages", BASE).status_code == 200
    after = admitted()
    assert after == before + 1
    assert _status(server)["requests"]["admitted_by_api"]["messages"] == after


# -- the drain -------------------------------------------------------------------------------------------

class _MessagesStream:
    """A Messages stream through the SDK, read in a thread: its events, and how it ended."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.kinds: list[str] = []
        self.final: anthropic.types.Message | None = None
        self.error: anthropic.APIStatusError | None = None
        self.started = threading.Event()
        client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        fields = dict(model=MODEL, max_tokens=max_tokens, messages=USER, tools=[LONG_INPUT],
                      tool_choice=LONG_CHOICE)
        self._thread = threading.Thread(target=self._run, args=(client, fields), daemon=True)
        self._thread.start()

    def _run(self, client: anthropic.Anthropic, fields: dict) -> None:
        try:
            with client.messages.stream(**fields) as stream:
                for event in stream:
                    self.kinds.append(event.type)
                    self.started.set()
                self.final = stream.get_final_message()
        except anthropic.APIStatusError as exc:
            self.error = exc
        finally:
            self.started.set()

    def join(self) -> _MessagesStream:
        self._thread.join(60)
        assert not self._thread.is_alive()
        return self


def test_a_drain_completes_one_messages_stream_and_cuts_the_other_with_an_error_event() -> None:
    # 50 ms a step: the short stream runs about 1.5 s, well within the drain's 4; the long one 20 s.
    server = _serve("--shutdown-timeout", "4", step_sleep=0.05)
    try:
        short, long = _MessagesStream(server.url, 30), _MessagesStream(server.url, 400)
        for stream in (short, long):
            assert stream.started.wait(60)
        server.capture()
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert "message_stop" not in short.kinds  # in flight when the drain began
        wait_until(lambda: httpx.get(f"{server.url}/ready").status_code == 503, 10, "the drain")
        _anthropic_error(_post(server, "/v1/messages", BASE), 503, "overloaded_error")
        short.join()
        assert short.error is None and short.final is not None, short.error
        assert short.final.stop_reason == "max_tokens" and short.final.usage.output_tokens == 30
        assert short.kinds[-1] == "message_stop"
        long.join()
        assert time.monotonic() - signalled < 10
        assert long.error is not None and long.final is None
        assert long.error.body["type"] == "error" and long.error.type == "overloaded_error", long.error.body
        assert "message_stop" not in long.kinds
        assert server.wait_exit(30) == 0, server.log()[-3000:]
        server.assert_nothing_left()
    finally:
        if server.process.poll() is None:
            server.kill()
        server.close_log()
