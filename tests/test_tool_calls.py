"""Tool calling: each family's parser (whole, and streamed split at every character boundary), the request's
tool fields checked, the chat template given the tools and the tool history, and — against a real server
through the official `openai` client — named, required and auto choices, streamed and not."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from gracelm.serving import tool_parsers
from gracelm.serving.api_errors import APIError
from gracelm.serving.tool_calls import (
    DEFAULT_TOOLS_PROMPT,
    StreamedChoice,
    final_message,
    plan,
    template_messages,
)
from gracelm.serving.tool_parsers import Call, Content, merged

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}},
                                       "required": ["zone"], "additionalProperties": False}}}

# (parser, text, the events it reads)
CASES = [
    ("hermes", 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
               '</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call> Done.',
     [Content("Let me look. "), Call("get_weather", '{"city": "Oslo"}'), Content("\n"),
      Call("get_time", '{"zone": 1}'), Content(" Done.")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}',  # left open at the end
     [Call("f", '{"a": [1, {"b": "}"}]}')]),
    ("hermes", 'a <tool_call>{"name": 3}</tool_call> b <tool_ca',  # not a call: given back whole
     [Content('a <tool_call>{"name": 3}</tool_call> b <tool_ca')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as a string
     [Call("f", '{"x": 1}')]),
    ("smollm2", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
                '{"name": "get_time", "arguments": {"zone": 2}}]</tool_call>',
     [Call("get_weather", '{"city": "Paris", "unit": "c"}'), Call("get_time", '{"zone": 2}')]),
    ("smollm2", "No tool fits < that.", [Content("No tool fits < that.")]),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}] ok',
     [Content("Sure "), Call("f", '{"a": 1}'), Call("g", "{}"), Content(" ok")]),
    ("mistral", ' [{"name": "f", "arguments": {"a": 1}}]', [Call("f", '{"a": 1}')]),  # marker left out
    ("mistral", "[1] is a citation, [TOOL_CALLS] is not closed",
     [Content("[1] is a citation, [TOOL_CALLS] is not closed")]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     [Call("f", '{"a": 1}'), Call("g", "{}")]),
    ("llama3_json", ' {"name": "f", "parameters": {"a": "b"}} and then text',
     [Call("f", '{"a": "b"}'), Content(" and then text")]),
    ("llama3_json", '{"answer": 42}', [Content('{"answer": 42}')]),
    ("llama3_json", 'The call would be {"name": "f", "parameters": {}}',
     [Content('The call would be {"name": "f", "parameters": {}}')]),
    ("llama3_json", "<|python_t", [Content("<|python_t")]),
]


def _fed(parser: tool_parsers.ToolParser, pieces: list[str]) -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return merged(events + parser.finish())


@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_parser_reads_the_same_calls_however_the_text_is_split(name: str, text: str, expected: list) -> None:
    parser_class = tool_parsers.PARSERS[name]
    assert parser_class().parse(text) == expected
    for cut in range(len(text) + 1):
        assert _fed(parser_class(), [text[:cut], text[cut:]]) == expected, f"split at {cut}"
    assert _fed(parser_class(), list(text)) == expected, "one character at a time"


@pytest.mark.parametrize("name", sorted(tool_parsers.PARSERS))
def test_text_without_calls_comes_back_whole(name: str) -> None:
    for text in ["", "Hello there.", " [a] {b} <c> ; ", '{"name": "x"', "<tool_call>oops", "[TOOL_CALLS]["]:
        parser = tool_parsers.PARSERS[name]()
        assert "".join(e.text for e in parser.parse(text)) == text


def test_required_choice_output_is_read_as_a_list_of_calls() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}]'
    expected = [Call("get_weather", '{"city": "Rome", "unit": "f"}')]
    for cut in range(len(text) + 1):
        assert _fed(tool_parsers.CallListParser(), [text[:cut], text[cut:]]) == expected


def test_auto_parser_follows_the_chat_template() -> None:
    choose = tool_parsers.parser_for_template
    assert choose("{{ messages }}", renders_tools=False) == "smollm2"
    assert choose("{% if tools %}<tool_call>{% endif %}", renders_tools=True) == "hermes"
    assert choose("{% if tools %}[AVAILABLE_TOOLS][TOOL_CALLS]{% endif %}", renders_tools=True) == "mistral"
    assert choose('{% if tools %}<|python_tag|>"parameters"{% endif %}', renders_tools=True) == "llama3_json"


# -- the request's fields ------------------------------------------------------------------------------

def _refused(param: str, **fields) -> str:
    with pytest.raises(APIError) as caught:
        plan(fields.get("tools"), fields.get("tool_choice"), fields.get("parallel_tool_calls"), "hermes")
    assert caught.value.status == 400
    assert caught.value.param == param
    assert param in caught.value.message
    return caught.value.message


def test_malformed_tool_fields_are_refused_naming_the_field() -> None:
    _refused("tools.0.type", tools=[{"type": "retrieval", "function": {"name": "x"}}])
    _refused("tools.1.function.name", tools=[WEATHER, {"type": "function", "function": {"name": 3}}])
    _refused("tools.0.function", tools=[{"type": "function"}])
    message = _refused("tool_choice.function.name", tools=[WEATHER],
                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_weather" in message
    _refused("tool_choice.type", tools=[WEATHER], tool_choice={"type": "custom", "function": {"name": "x"}})
    _refused("tool_choice", tools=[WEATHER], tool_choice="sometimes")
    _refused("tool_choice", tool_choice="required")


def test_tool_choice_decides_rendering_parsing_and_the_constraint() -> None:
    assert plan([WEATHER], "none", None, "hermes").tools is None
    assert plan([WEATHER], "none", None, "hermes").reader() is None
    auto = plan([WEATHER], None, None, "hermes")
    assert auto.tools == [WEATHER] and auto.schema is None and auto.reader() is not None
    required = plan([WEATHER, TIME], "required", False, "hermes")
    assert required.schema is not None and required.schema["maxItems"] == 1
    named = plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None, "hermes")
    assert named.schema == TIME["function"]["parameters"]


# -- the chat template ---------------------------------------------------------------------------------

# A template with a tools section, written as Qwen2.5's is: tools listed, calls and results as tagged turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees and snow"}]


def _rendered(template: str, renders_tools: bool, tools: list[dict] | None) -> str:
    from gracelm.model.tokenizer import _compiled

    plain = [{"role": m["role"], "content": m.get("content") or ""} for m in HISTORY]
    history = [(m.get("tool_calls"), m.get("tool_call_id")) for m in HISTORY]
    messages = template_messages(plain, history, tools, renders_tools)
    return _compiled(template).render(messages=messages, tools=tools if renders_tools else None,
                                      add_generation_prompt=True)


def test_a_template_with_a_tools_section_gets_the_tools_and_the_history() -> None:
    text = _rendered(TOOLS_TEMPLATE, True, [WEATHER])
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>get_weather {"city": "Oslo", "unit": "c"}</tool_call>' in text
    assert "<|im_start|>tool\n-3 degrees and snow[call_1]<|im_end|>" in text


def test_a_template_without_tools_gets_the_default_section_and_the_history_in_its_call_form() -> None:
    from tests.tiny_models import CHATML_TEMPLATE

    text = _rendered(CHATML_TEMPLATE, False, [WEATHER])
    section = DEFAULT_TOOLS_PROMPT.format(tools=json.dumps(WEATHER["function"]))
    assert text.startswith(f"<|im_start|>system\n{section}<|im_end|>\n<|im_start|>user\nWeather in Oslo?")
    assert ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "c"}}]</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n-3 degrees and snow\n</tool_response><|im_end|>" in text


# Arguments a client may send back: cut off at max_tokens, a JSON array, plain text, a JSON string.
UNPARSED_ARGUMENTS = ['{"city": "Os', "[1, 2]", "not json", '"Oslo"']


def _history_with_arguments(arguments: str) -> tuple[list[dict], list]:
    plain = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": ""}]
    calls = [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]
    return plain, [(None, None), (calls, None)]


@pytest.mark.parametrize("arguments", UNPARSED_ARGUMENTS)
def test_history_call_arguments_other_than_an_object_reach_the_template_as_the_string(arguments: str) -> None:
    from gracelm.model.tokenizer import _compiled
    from tests.tiny_models import CHATML_TEMPLATE

    plain, history = _history_with_arguments(arguments)
    messages = template_messages(plain, history, [WEATHER], True)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == arguments
    text = _compiled(TOOLS_TEMPLATE).render(messages=messages, tools=[WEATHER])
    assert f"<tool_call>get_weather {json.dumps(arguments)}</tool_call>" in text
    as_it_is = "{% for c in messages[1].tool_calls %}{{ c.function.arguments }}{% endfor %}"
    assert _compiled(as_it_is).render(messages=messages) == arguments
    messages = template_messages(plain, history, [WEATHER], False)
    text = _compiled(CHATML_TEMPLATE).render(messages=messages)
    listed = json.dumps([{"name": "get_weather", "arguments": arguments}])
    assert f"<|im_start|>assistant\n<tool_call>{listed}</tool_call><|im_end|>" in text


# -- the answer's shapes -------------------------------------------------------------------------------

def _reassembled(deltas: list) -> tuple[str, list[dict]]:
    """Content and calls joined from stream deltas the way OpenAI's clients join them."""
    content, calls = "", []
    for delta in deltas:
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index == len(calls) and piece.type == "function" and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            else:
                assert piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    return content, calls


NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(("tool_choice", "text"), [
    ("auto", 'Checking. <tool_call>[{"name": "get_time", "arguments": {"zone": 3}}]</tool_call>'),
    ("required", '[{"name": "get_time", "arguments": {"zone": 3}}]'),
    (NAMED_TIME, '{"zone": 3}'),
])
def test_streamed_deltas_reassemble_to_the_plain_message(tool_choice, text: str) -> None:
    tools_plan = plan([WEATHER, TIME], tool_choice, None, "smollm2")
    message, reason = final_message(text, "stop", tools_plan)
    assert reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_time", {"zone": 3})]
    assert message.tool_calls[0].id.startswith("call_")
    for step in (1, 2, 5):
        streamed = StreamedChoice(tools_plan)
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        deltas = [d for i, p in enumerate(pieces) for d in streamed.deltas(p, i == len(pieces) - 1)]
        content, calls = _reassembled(deltas)
        assert content == (message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert streamed.finish_reason("stop") == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = ('<tool_call>[{"name": "get_time", "arguments": {"zone": 1}}, '
            '{"name": "get_time", "arguments": {}}]</tool_call>')
    message, _ = final_message(text, "stop", plan([TIME], "auto", False, "smollm2"))
    assert [c.function.arguments for c in message.tool_calls] == ['{"zone": 1}']


def test_a_cut_call_keeps_finish_reason_length_and_without_tools_nothing_is_parsed() -> None:
    message, reason = final_message("<tool_call>[{", "length", plan([TIME], "auto", None, "smollm2"))
    assert reason == "length" and message.tool_calls is None and message.content == "<tool_call>[{"
    text = '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>'
    message, reason = final_message(text, "stop", plan([TIME], "none", None, "smollm2"))
    assert reason == "stop" and message.content == text and message.tool_calls is None


# -- against a real server -----------------------------------------------------------------------------

# Bounded values: a random-weight model writes whatever the constraint lets it, so strings are enums.
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "The forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Paris", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"}},
        "required": ["city", "days", "metric"], "additionalProperties": False}}}
ALERTS = {"type": "function", "function": {
    "name": "get_alerts", "parameters": {"type": "object", "properties": {
        "level": {"type": "string", "enum": ["low", "high"]}}, "required": ["level"],
        "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server():
    from tests.server_process import ServerProcess
    from tests.tiny_models import tiny_model

    # The default tools section is long in a 512-token vocabulary: a longer context than the default.
    model = tiny_model("llama", max_position_embeddings=2048)
    with ServerProcess(model, "--max-model-len", "2048", "--served-model-name", "any",
                       env={"OMP_WAIT_POLICY": "PASSIVE"}) as process:
        yield process
        process.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in (FORECAST, ALERTS) if t["function"]["name"] == name)


def _check_calls(calls, names: set[str]) -> None:
    import jsonschema

    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_named_choice_calls_that_tool_with_valid_arguments(client, seed: int) -> None:
    answer = client.chat.completions.create(
        model="any", messages=USER, tools=[FORECAST, ALERTS], seed=seed, temperature=1.0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_alerts"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_alerts"})


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_required_choice_makes_valid_calls(client, seed: int) -> None:
    answer = client.chat.completions.create(
        model="any", messages=USER, tools=[FORECAST, ALERTS], tool_choice="required", seed=seed,
        temperature=1.0, max_tokens=200, parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls: false
    _check_calls(choice.message.tool_calls, {"get_forecast", "get_alerts"})


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_forecast"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client, tool_choice) -> None:
    fields = dict(model="any", messages=USER, tools=[FORECAST, ALERTS], tool_choice=tool_choice, seed=7,
                  temperature=1.0, max_tokens=200)
    plain = client.chat.completions.create(**fields).choices[0]
    calls: list[dict] = []
    finish_reason = None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            assert not choice.delta.content
            for piece in choice.delta.tool_calls or []:
                if piece.id is not None:  # a call's first delta: its index, id, type and name
                    assert piece.index == len(calls) and piece.type == "function" and piece.function.name
                    calls.append({"name": piece.function.name, "arguments": piece.function.arguments or ""})
                else:  # then pieces of its arguments
                    assert piece.function.name is None and piece.function.arguments
                    calls[piece.index]["arguments"] += piece.function.arguments
    assert finish_reason == plain.finish_reason == "tool_calls"
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in plain.message.tool_calls]


def test_a_tool_result_in_the_history_reaches_the_template(server, client) -> None:
    from gracelm.model.tokenizer import Tokenizer
    from tests.tiny_models import tiny_model

    arguments = '{"city": "Oslo", "days": 1, "metric": true}'
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_forecast", "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -3 degrees."}]
    answer = client.chat.completions.create(model="any", messages=history, tools=[FORECAST], max_tokens=1,
                                            tool_choice="none")
    tokenizer = Tokenizer.from_dir(tiny_model("llama", max_position_embeddings=2048))
    plain = [{"role": m["role"], "content": m["content"] or ""} for m in history]
    messages = template_messages(plain, [(m.get("tool_calls"), m.get("tool_call_id")) for m in history], None,
                                 renders_tools=False)
    text = tokenizer.render_chat(messages)
    assert "<|im_start|>user\n<tool_response>\nSnow, -3 degrees.\n</tool_response><|im_end|>" in text
    assert '<tool_call>[{"name": "get_forecast", "arguments": {"city": "Oslo"' in text
    assert answer.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    without = client.chat.completions.create(model="any", messages=history[:2], max_tokens=1)
    assert without.usage.prompt_tokens < answer.usage.prompt_tokens


def test_a_call_cut_off_at_max_tokens_can_be_sent_back(server, client) -> None:
    # LangChain's case: the cut-off call goes back in the history as the answer gave it, then its result.
    named = {"type": "function", "function": {"name": "get_forecast"}}
    cut = client.chat.completions.create(model="any", messages=USER, tools=[FORECAST], tool_choice=named,
                                         max_tokens=3).choices[0]
    assert cut.finish_reason == "length"
    arguments = cut.message.tool_calls[0].function.arguments
    with pytest.raises(ValueError):
        json.loads(arguments)
    result = {"role": "tool", "tool_call_id": cut.message.tool_calls[0].id, "content": "Cut off: try again."}
    history = [*USER, cut.message.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(model="any", messages=history, tools=[FORECAST], max_tokens=1)
    body = {"model": "any", "messages": history, "tools": [FORECAST], "max_tokens": 1}
    ids = httpx.post(f"{server.url}/v1/chat/completions/render", json=body, timeout=60).json()["token_ids"]
    assert answer.usage.prompt_tokens == len(ids)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    listed = json.dumps([{"name": "get_forecast", "arguments": arguments}])
    assert f"<tool_call>{listed}</tool_call>" in text


def test_auto_choice_reads_a_call_the_model_writes(client) -> None:
    # The model is made to write a call in the default section's form; `auto` must read it out.
    written = 'Let me check. <tool_call>[{"name": "get_alerts", "arguments": {"level": "high"}}]</tool_call>'
    fields = dict(model="any", messages=USER, tools=[FORECAST, ALERTS], max_tokens=120,
                  extra_body={"structured_outputs": {"regex": re.escape(written)}})
    choice = client.chat.completions.create(**fields).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    _check_calls(choice.message.tool_calls, {"get_alerts"})
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"level": "high"}
    content, names = "", []
    for chunk in client.chat.completions.create(**fields, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            names += [p.function.name for p in c.delta.tool_calls or [] if p.id is not None]
    assert content == "Let me check. " and names == ["get_alerts"]


def test_tool_fields_refused_name_the_field(client) -> None:
    import openai

    cases = [
        (dict(tools=[{"type": "code_interpreter"}]), "tools.0.type"),
        (dict(tools=[FORECAST], tool_choice={"type": "function", "function": {"name": "get_alerts"}}),
         "tool_choice.function.name"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(messages=[*USER, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": 1}}]}]),
         "messages.1.tool_calls.0.function.arguments"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**{"model": "any", "messages": USER, "max_tokens": 1, **fields})
        assert caught.value.body["param"] == param, caught.value.body
