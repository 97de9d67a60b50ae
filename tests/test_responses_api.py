"""The Responses API (`/v1/responses`) through the official `openai` client against real servers on a tiny
random-weight model: plain and streamed answers and their event sequence, a tool round trip, structured
output by schema, stored responses (`previous_response_id`, retrieve, input items, delete) across a restart,
background responses and their cancel, each refusal's error shape, /metrics and the status page, and
drains with Responses streams and background responses in flight. Also, without a server: the store's
bounds, its settling of unfinished background responses, and the journal's upgrade from version 2.

Output of a random-weight model is noise, so whatever must parse (a call's arguments, a schema's JSON) is
asked for under a constraint (`tool_choice` required or named, `text.format` json_schema), which also makes
the answer end by itself (`response.completed`); unconstrained answers run to `max_output_tokens`
(`response.incomplete`).
"""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from gracelm.batch.journal import DB_NAME, SCHEMA_VERSION, Journal
from gracelm.serving.response_store import STOPPED_ERROR, ResponseStore
from tests.process_checks import wait_until
from tests.server_process import ServerProcess, metric_value
from tests.tiny_models import tiny_model

LEVEL = {"type": "string", "enum": ["low", "high"]}
ALERTS = {"type": "function", "name": "get_alerts", "strict": True, "description": "Weather alerts.",
          "parameters": {"type": "object", "properties": {"level": LEVEL}, "required": ["level"],
                         "additionalProperties": False}}
FORECAST = {"type": "function", "name": "get_forecast", "strict": True,
            "parameters": {"type": "object", "properties": {"days": {"type": "integer", "enum": [1, 2, 3]}},
                           "required": ["days"], "additionalProperties": False}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]},
                                         "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False}
CITY_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
# A string no answer can close before the drain's deadline: the model may not end it sooner.
ENDLESS = {"format": {"type": "json_schema", "name": "long", "schema": {
    "type": "object", "properties": {"s": {"type": "string", "minLength": 3000}}, "required": ["s"]}}}
SLOW_STEPS = json.dumps({"test_step_sleep_s": 0.05})


def _serve(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
    # The default tools section is long in a 512-token vocabulary: a longer context than the default.
    model = tiny_model("llama", max_position_embeddings=2048)
    return ServerProcess(model, "--max-model-len", "2048", "--served-model-name", "any", "--stats-interval",
                         "0", *args, env={"OMP_WAIT_POLICY": "PASSIVE", **(env or {})})


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("responses-state")


@pytest.fixture(scope="module")
def server(state_dir):
    """The server with a state directory; `restarted` stops it."""
    with _serve("--state-dir", str(state_dir)) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


# -- plain and streamed ---------------------------------------------------------------------------------

def test_a_plain_response_has_openais_shape_and_is_stored(client, server):
    response = client.responses.create(model="any", input="Hello there", instructions="Answer briefly.",
                                       max_output_tokens=6, temperature=0.0, metadata={"k": "v"})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and response.output_text == message.content[0].text
    usage = response.usage
    assert usage.output_tokens == 6 and usage.total_tokens == usage.input_tokens + 6
    assert usage.input_tokens > 5
    assert response.instructions == "Answer briefly." and response.metadata == {"k": "v"}
    assert response.model_extra["store"] is True
    stored = client.responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()
    items = client.responses.input_items.list(response.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Hello there"


def test_a_stream_sends_openais_event_sequence_and_the_same_answer(client):
    fields = dict(model="any", input="Hello", max_output_tokens=6, temperature=0.0)
    plain = client.responses.create(**fields, store=False)
    events = list(client.responses.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == plain.output_text
    assert final.usage.output_tokens == 6 and final.incomplete_details.reason == "max_output_tokens"


def test_structured_output_follows_the_schema_plain_and_streamed(client):
    fields = dict(model="any", input="Which city?", text=CITY_FORMAT, max_output_tokens=60, temperature=1.0)
    for seed_text in ("a", "b"):
        response = client.responses.create(**{**fields, "input": f"Which city? {seed_text}"})
        assert response.status == "completed", response
        jsonschema.validate(json.loads(response.output_text), CITY)
    with client.responses.stream(**fields) as stream:
        final = stream.get_final_response()  # the SDK's accumulator: it needs response.completed
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), CITY)


# -- tools ----------------------------------------------------------------------------------------------

def _call(response):
    [call] = [item for item in response.output if item.type == "function_call"]
    return call


def test_a_tool_round_trip_with_previous_response_id(client):
    first = client.responses.create(model="any", input="Any weather alerts?", tools=[ALERTS, FORECAST],
                                    tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                    max_output_tokens=80)
    assert first.status == "completed"
    call = _call(first)
    assert call.name in ("get_alerts", "get_forecast") and call.call_id.startswith("call_")
    tool = ALERTS if call.name == "get_alerts" else FORECAST
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "no alerts"}
    second = client.responses.create(model="any", previous_response_id=first.id, input=[result],
                                     tools=[ALERTS, FORECAST], max_output_tokens=5)
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    # The conversation continued holds the first question, the call and its result.
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_tool_round_trip_sent_whole_without_storage(client):
    question = {"role": "user", "content": [{"type": "input_text", "text": "Alerts?"}]}
    first = client.responses.create(model="any", input=[question], tools=[ALERTS], store=False,
                                    tool_choice={"type": "function", "name": "get_alerts"},
                                    max_output_tokens=40)
    call = _call(first)
    assert call.name == "get_alerts" and first.model_extra["store"] is False
    jsonschema.validate(json.loads(call.arguments), ALERTS["parameters"])
    given_back = [question, call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id, "output": "none"}]
    second = client.responses.create(model="any", input=given_back, tools=[ALERTS], store=False,
                                     max_output_tokens=4)
    assert second.output[0].type == "message"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_streamed_call_arguments_reassemble_to_the_plain_call(client):
    fields = dict(model="any", input="Forecast?", tools=[ALERTS, FORECAST], max_output_tokens=40,
                  tool_choice={"type": "function", "name": "get_forecast"}, temperature=0.0)
    plain = _call(client.responses.create(**fields))
    with client.responses.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == done.arguments == _call(final).arguments == plain.arguments
    assert _call(final).name == "get_forecast"


# -- refusals -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"bogus": 1}, "bogus", "unrecognized_argument"),
    ({"background": True, "stream": True}, "stream", "unsupported_parameter"),
    ({"background": True, "store": False}, "store", "invalid_value"),
    ({"background_options": {"completion_window": "2h"}}, "background_options", "unsupported_parameter"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
    ({"reasoning": {"effort": "medium", "summary": "auto"}}, "reasoning", "unsupported_parameter"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include",
     "unsupported_parameter"),
    ({"include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "unsupported_parameter"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "invalid_value"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "context_length_exceeded"),
    ({"temperature": "hot"}, "temperature", "invalid_value"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_parameter"),
    ({"tools": [{**ALERTS, "defer_loading": True}]}, "tools.0.defer_loading", "unsupported_parameter"),
    ({"tools": [ALERTS], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", None),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.type",
     "unsupported_parameter"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "extra": 1}}},
     "text.format.extra", "unrecognized_argument"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0.type", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_1"}]},
     "input.1.type", "unsupported_parameter"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id",
     "invalid_value"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "invalid_value"),
])
def test_each_refusal_is_a_400_naming_the_field(client, fields: dict, param: str, code: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as caught:  # extra_body: sent as it is, unchecked by the SDK
        client.responses.create(model="any", input="hi", max_output_tokens=2, extra_body=fields)
    error = caught.value.body
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, error


def test_the_fields_codex_cli_sends_are_taken(client):
    """Codex CLI's own fields: its ids, a summary of reasoning and reasoning's encrypted content, both of
    which are honoured by giving none (no output is reasoning here)."""
    codex = {"client_metadata": {"session_id": "s-1", "x-codex-installation-id": "i-1"},
             "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
             "prompt_cache_key": "s-1", "store": False, "parallel_tool_calls": True, "tool_choice": "auto",
             "tools": [ALERTS]}
    response = client.responses.create(model="any", input="hi", max_output_tokens=4, extra_body=codex)
    assert response.status in ("completed", "incomplete") and not response.store
    assert response.output and all(item.type in ("message", "function_call") for item in response.output)


def test_unknown_ids_are_404s_and_cancel_is_refused(client, server):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="any", input="hi", previous_response_id="resp_nope",
                                max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    assert caught.value.body["code"] == "previous_response_not_found"
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError) as caught:
            call("resp_nope")
        assert "resp_nope" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="hi", max_output_tokens=2)
    kept = client.responses.create(model="any", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(kept.id)
    assert "background" in caught.value.body["message"]
    assert client.responses.delete(kept.id) is None  # the SDK reads no body; the server's is below
    other = client.responses.create(model="any", input="x", max_output_tokens=1)
    deleted = httpx.delete(f"{server.url}/v1/responses/{other.id}")
    assert deleted.json() == {"id": other.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def _until_done(client: openai.OpenAI, response_id: str):
    def ended():
        response = client.responses.retrieve(response_id)
        return response if response.status not in ("queued", "in_progress") else None

    return wait_until(ended, 60, "the background response's end")


def test_a_background_response_is_queued_then_stored_at_its_end(client):
    queued = client.responses.create(model="any", input="Hello", max_output_tokens=4, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _until_done(client, queued.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 4 and done.output_text
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(done.id)
    assert "incomplete" in caught.value.body["message"]


def test_cancel_aborts_a_background_response(client, server):
    running = client.responses.create(model="any", input="go", text=ENDLESS, max_output_tokens=1500,
                                      background=True)
    with pytest.raises(openai.BadRequestError) as caught:  # not finished: nothing to go on from yet
        client.responses.create(model="any", input="next", previous_response_id=running.id,
                                max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"  # again: as it is
    running_now = lambda: metric_value(httpx.get(f"{server.url}/metrics").text,  # noqa: E731
                                       "gracelm_num_requests_running")
    wait_until(lambda: running_now() == 0, 10, "the engine's abort")


def test_metrics_and_the_status_page_count_the_api(client, server):
    metrics = httpx.get(f"{server.url}/metrics").text
    before = metric_value(metrics, "gracelm_api_requests_total", api="responses")
    client.responses.create(model="any", input="hi", max_output_tokens=2)
    list(client.responses.create(model="any", input="hi", max_output_tokens=2, stream=True))
    text = httpx.get(f"{server.url}/metrics").text
    assert metric_value(text, "gracelm_api_requests_total", api="responses") == before + 2
    assert httpx.get(f"{server.url}/status.json").json()["requests"]["admitted_by_api"]["responses"] >= 2


# -- across a restart -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def before_restart(client):
    return client.responses.create(model="any", input="Remember: blue.", instructions="Be short.",
                                   max_output_tokens=4)


@pytest.fixture(scope="module")
def restarted(server, state_dir, before_restart):
    """Started again on the same state directory, steps slowed, a drain deadline of 4 s; the drain test
    stops it."""
    server.stop()
    with _serve("--state-dir", str(state_dir), "--shutdown-timeout", "4",
                env={"GRACELM_TEST_HOOKS": SLOW_STEPS}) as process:
        yield process


def test_previous_response_id_across_a_restart(restarted, before_restart):
    client = _client(restarted)
    assert client.responses.retrieve(before_restart.id).output_text == before_restart.output_text
    after = client.responses.create(model="any", input="What colour?", previous_response_id=before_restart.id,
                                    max_output_tokens=3)
    items = client.responses.input_items.list(after.id, order="asc").data
    # The first question, its answer, and the question after the restart.
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "Remember: blue."), ("assistant", before_restart.output_text), ("user", "What colour?")]
    assert after.instructions is None  # instructions are not carried over
    assert after.usage.input_tokens > before_restart.usage.input_tokens


def test_a_drain_waits_for_a_background_response_and_fails_one_at_its_deadline(restarted, state_dir):
    client = _client(restarted)
    short = client.responses.create(model="any", input="go", max_output_tokens=20, background=True)
    endless = client.responses.create(model="any", input="go", text=ENDLESS, max_output_tokens=1500,
                                      background=True)
    for response in (short, endless):
        wait_until(lambda r=response: client.responses.retrieve(r.id).status == "in_progress", 30,
                   "the background response's start")
    restarted.process.send_signal(signal.SIGTERM)
    assert restarted.wait_exit() == 0
    journal = Journal(state_dir)
    try:
        store = ResponseStore(journal, 100, 3600)
        assert store.load(short.id).response["status"] == "incomplete"
        failed = store.load(endless.id).response
        assert failed["status"] == "failed" and "aborted" in failed["error"]["message"]
        assert failed["output"] and failed["output"][0]["type"] == "message"
    finally:
        journal.close()


# -- without a state directory, and a drain -------------------------------------------------------------

@pytest.fixture(scope="module")
def unstored():
    """No state directory, steps slowed, a drain deadline of 4 s; the drain test stops it."""
    with _serve("--shutdown-timeout", "4", env={"GRACELM_TEST_HOOKS": SLOW_STEPS}) as process:
        yield process


def test_without_a_state_dir_nothing_is_stored(unstored):
    client = _client(unstored)
    response = client.responses.create(model="any", input="hi", max_output_tokens=2)
    assert response.model_extra["store"] is False
    for fields, param in (({"store": True}, "store"), ({"previous_response_id": response.id},
                                                       "previous_response_id"),
                          ({"previous_response_id": ""}, "previous_response_id"),
                          ({"background": True}, "background")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="any", input="hi", max_output_tokens=2, **fields)
        assert caught.value.body["param"] == param and "--state-dir" in caught.value.body["message"]
        assert caught.value.body["code"] == "state_dir_required"
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(response.id)
    assert "--state-dir" in caught.value.body["message"]


class _Reader:
    """A streamed response read in a thread: its events, and once one arrived, `started`."""

    def __init__(self, client: openai.OpenAI, **fields) -> None:
        self.events: list = []
        self.error: BaseException | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client, fields), daemon=True)
        self._thread.start()

    def _run(self, client: openai.OpenAI, fields: dict) -> None:
        try:
            for event in client.responses.create(model="any", input="go", stream=True, **fields):
                self.events.append(event)
                if event.type.endswith(".delta"):
                    self.started.set()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc
        finally:
            self.started.set()

    def join(self) -> list:
        self._thread.join(60)
        assert not self._thread.is_alive() and self.error is None, self.error
        return [e.type for e in self.events]


def test_a_drain_finishes_a_stream_in_flight_and_cuts_one_at_its_deadline(unstored):
    client = _client(unstored)
    short = _Reader(client, max_output_tokens=20)
    endless = _Reader(client, max_output_tokens=1500, text=ENDLESS)
    for reader in (short, endless):
        assert reader.started.wait(60)
    unstored.process.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(f"{unstored.url}/ready").status_code == 503, 10, "the drain")
    with pytest.raises(openai.APIStatusError) as caught:  # the drain takes nothing new
        client.responses.create(model="any", input="late", max_output_tokens=2)
    assert caught.value.status_code == 503
    assert short.join()[-1] in ("response.completed", "response.incomplete")
    started = time.monotonic()
    kinds = endless.join()
    assert kinds[-2:] == ["error", "response.failed"], kinds
    error, failed = endless.events[-2:]
    assert error.code == "request_aborted" and error.message == failed.response.error.message
    assert failed.response.status == "failed" and failed.response.error.code == "server_error"
    assert failed.response.output and failed.response.output[0].type == "message"
    assert time.monotonic() - started < 10
    assert unstored.wait_exit() == 0


# -- the store, without a server ------------------------------------------------------------------------

def _response(response_id: str, created_at: float) -> dict:
    return {"id": response_id, "created_at": created_at, "output": []}


def test_the_store_keeps_the_newest_within_its_count_and_age(tmp_path):
    journal = Journal(tmp_path)
    try:
        store = ResponseStore(journal, max_count=3, max_age_s=3600)
        now = time.time()
        store.save(_response("resp_old", now - 7200), [])  # past its age: pruned at once
        assert store.load("resp_old") is None and store.count() == 0
        for i in range(5):
            store.save(_response(f"resp_{i}", now - 100 + i), [{"role": "user", "content": str(i)}])
        assert store.count() == 3
        assert [store.load(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
        assert store.load("resp_4").input_items == [{"role": "user", "content": "4"}]
        assert store.delete("resp_4") and not store.delete("resp_4") and store.count() == 2
        # Opened again with tighter bounds: the oldest pruned at the start.
        assert ResponseStore(journal, max_count=1, max_age_s=3600).prune() == 1
        assert store.count() == 1 and store.load("resp_3") is not None
        # One past its age is not found even before it is pruned.
        assert ResponseStore(journal, max_count=10, max_age_s=10).load("resp_3") is None
    finally:
        journal.close()


def test_a_background_response_a_stop_left_unfinished_is_failed_at_the_start(tmp_path):
    journal = Journal(tmp_path)
    try:
        store = ResponseStore(journal, 10, 3600)
        for status in ("queued", "in_progress", "completed"):
            store.save({**_response(f"resp_{status}", time.time()), "status": status}, [])
        assert store.settle() == 2
        assert store.load("resp_in_progress").response["status"] == "failed"
        assert store.load("resp_queued").response["error"] == STOPPED_ERROR
        assert store.load("resp_completed").response["status"] == "completed"
    finally:
        journal.close()


def test_a_version_2_journal_gains_the_responses_table(tmp_path):
    journal = Journal(tmp_path)
    file = journal.add_file("in.jsonl", "batch", io.BytesIO(b"{}\n"))
    journal.close()
    with sqlite3.connect(tmp_path / DB_NAME) as db:  # the journal as version 2 wrote it
        db.execute("DROP TABLE responses")
        db.execute("PRAGMA user_version=2")
    journal = Journal(tmp_path)
    try:
        assert journal.get_file(file.id) is not None
        ResponseStore(journal, 10, 3600).save(_response("resp_a", time.time()), [])
        with journal.read_transaction() as db:
            assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    finally:
        journal.close()
