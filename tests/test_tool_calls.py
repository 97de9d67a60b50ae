"""Tool calling: each family's parser (whole, and streamed split at every character boundary), the request's
tool fields checked, the chat template given the tools and the tool history, and — against a real server
through the official `openai` client — named, required and auto choices, streamed and not."""

from __future__ import annotations

import json

import pytest

from gracelm.entrypoints import tool_parsers
from gracelm.entrypoints.api_errors import APIError
from gracelm.entrypoints.tool_call_output import StreamedChoice, final_message
from gracelm.entrypoints.tool_calls import DEFAULT_TOOLS_PROMPT, plan, template_messages
from gracelm.entrypoints.tool_parsers import Call, Content, merged

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


def test_history_call_arguments_must_be_a_json_object() -> None:
    bad = [(
        [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}], None)]
    with pytest.raises(APIError) as caught:
        template_messages([{"role": "assistant", "content": ""}], bad, None, True)
    assert caught.value.param == "messages.0.tool_calls.0.function.arguments"


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
