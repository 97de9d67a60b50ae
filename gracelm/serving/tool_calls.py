"""Tool calling on the chat endpoint: the request's `tools`, `tool_choice` and `parallel_tool_calls` checked,
the tools and the tool history put to the chat template, the JSON schema a forced choice is generated
under, and the calls read back out of each choice's text, in OpenAI's shapes: the whole message of a plain
answer (`final_message`) and the deltas of a stream (`StreamedChoice`). A choice that made calls and ended by
itself ends with `finish_reason: "tool_calls"`; one cut by max_tokens keeps `length`.

- `none` (the default without tools): no tools rendered, nothing parsed; the output is all content.
- `auto` (the default with tools): tools rendered; the model's family parser reads any calls out of the text.
- `required`: tools rendered; the output is generated under a JSON schema (a list of one or more calls,
  each `{"name": one of the tools, "arguments": that tool's parameters}`), so it always parses and matches.
- named (`{"type": "function", "function": {"name": ...}}`): the output is generated under that tool's
  parameters schema; it is the call's arguments, given out as they come.

`parallel_tool_calls: false` allows one call: `required` lists at most one, `auto` keeps the first.

A chat template without a tools section (SmolLM2's, for one) gets the default tools section
(`DEFAULT_TOOLS_PROMPT`) in its system message: the tools as JSON and SmolLM2's call form,
`<tool_call>[...]</tool_call>`, the form the smollm2 parser reads. Its tool history is written the same
way: an assistant's calls as that form in its content, a tool's result as a user message in
`<tool_response>` tags (Hermes' convention), since such a template has no turn of its own for either.

A history call's arguments may be any string, as OpenAI takes them: a client sends back what the model
wrote, a call cut off at max_tokens included. A JSON object reaches the template as the object; anything
else (cut-off JSON, an array, plain text) as the string itself, which a template's `| tojson` writes as a JSON
string and a template that tests `is string` (Qwen3's) writes as it is. The default call form writes it as
a JSON string, so the list of calls stays JSON whatever the arguments.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import pydantic
from pydantic import BaseModel, ConfigDict

from gracelm.sampling_params import SamplingParams
from gracelm.serving import tool_parsers
from gracelm.serving.api_errors import APIError, validated
from gracelm.serving.openai_protocol import (
    AssistantMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from gracelm.serving.reasoning_parsers import NO_REASONING, ReasoningPlan
from gracelm.serving.tool_parsers import (
    ArgumentsPart,
    Call,
    CallListParser,
    Content,
    Event,
    ToolParser,
    merged,
)
from gracelm.structured_output import StructuredOutputs

DEFAULT_TOOLS_PROMPT = """You can call functions. These are the functions you may call, with their \
parameters as JSON Schema:
<tools>
{tools}
</tools>

To call one or more of them, answer with only a JSON list of the calls between tags, like this:
<tool_call>[{{"name": "function name", "arguments": {{"parameter": "value"}}}}]</tool_call>
If no function fits, answer in plain text."""

_STRICT = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str = pydantic.Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT

    type: str
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    type: str
    function: FunctionName


class HistoryFunction(BaseModel):
    model_config = _STRICT

    name: str
    arguments: str  # any string, as OpenAI takes it; a JSON object when the model's call was whole


class HistoryCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = _STRICT

    id: str
    type: Literal["function"] = "function"
    function: HistoryFunction


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What one request's tool fields ask for."""

    tools: list[dict] | None  # given to the chat template; None: no tools rendered
    new_parser: Callable[[], ToolParser] | None  # a parser per choice; None: the output is all content
    schema: dict | None  # the JSON schema the output is generated under (required and named choices)
    parallel: bool

    def reader(self) -> CallReader | None:
        return None if self.new_parser is None else CallReader(self.new_parser(), self.parallel)


NO_TOOLS = ToolPlan(tools=None, new_parser=None, schema=None, parallel=True)


def plan(tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None,
         parser_name: str) -> ToolPlan:
    """The plan of a request's tool fields; a 400 naming the field for anything malformed or unknown.
    `parser_name`: the model's family parser (`--tool-call-parser`, resolved)."""
    checked = [_tool(t, i) for i, t in enumerate(tools or [])]
    choice = tool_choice if tool_choice is not None else ("auto" if checked else "none")
    parallel = parallel_tool_calls is not False
    if choice == "none":
        return NO_TOOLS
    if not checked:
        raise APIError(400, f"tool_choice {_short(choice)} needs tools; none were given", param="tool_choice")
    rendered = [t.model_dump(exclude_none=True) for t in checked]
    if choice == "auto":
        return ToolPlan(rendered, tool_parsers.PARSERS[parser_name], None, parallel)
    if choice == "required":
        return ToolPlan(rendered, CallListParser, _calls_schema(checked, parallel), parallel)
    function = _named(choice, checked)
    return ToolPlan(rendered, lambda: NamedCallParser(function.name), _parameters(function), parallel)


def constrained(params: SamplingParams, tools: ToolPlan) -> SamplingParams:
    """`params` with a forced choice's JSON schema as their structured-output constraint."""
    if tools.schema is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(400, "tool_choice: a required or named tool choice constrains the output itself; "
                            "it cannot be combined with response_format or structured outputs",
                       param="tool_choice")
    constraint = StructuredOutputs.of_json_schema(tools.schema)  # checked by the route (`grammar_checker.py`)
    return msgspec.structs.replace(params, structured_outputs=constraint)


def _tool(value: Any, index: int) -> Tool:
    where = f"tools.{index}"
    if not isinstance(value, dict):
        raise APIError(400, f"{where} must be an object, got {_short(value)}", param=where)
    if value.get("type") != "function":
        got = _short(value.get("type"))
        raise APIError(400, f'{where}.type: only "function" tools are supported, got {got}',
                       param=f"{where}.type")
    return validated(Tool, value, where)


def _named(choice: Any, tools: list[Tool]) -> FunctionDefinition:
    if isinstance(choice, str):
        raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named function, got '
                            f"{_short(choice)}", param="tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        got = _short(choice.get("type"))
        raise APIError(400, f'tool_choice.type: only "function" is supported, got {got}',
                       param="tool_choice.type")
    named = validated(NamedToolChoice, choice, "tool_choice")
    for tool in tools:
        if tool.function.name == named.function.name:
            return tool.function
    names = ", ".join(t.function.name for t in tools)
    raise APIError(400, f"tool_choice.function.name: {named.function.name!r} is not one of the tools "
                        f"({names})", param="tool_choice.function.name")



def _parameters(function: FunctionDefinition) -> dict:
    """A function's parameters schema; OpenAI reads a function without one as taking no arguments."""
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def _calls_schema(tools: list[Tool], parallel: bool) -> dict:
    """A list of calls, each naming one of `tools` with arguments matching its parameters."""
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": t.function.name},
                                      "arguments": _parameters(t.function)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# -- the chat template ----------------------------------------------------------------------------------

def template_messages(messages: list[dict], history: list[tuple[list[dict] | None, str | None]],
                      tools: list[dict] | None, renders_tools: bool) -> list[dict]:
    """`messages` (role, content, name as the template reads them) with their tool history added:
    `history[i]` is message i's `tool_calls` and `tool_call_id` as the client sent them. Without a tools
    section in the template, the default one and the history in its call form (see the module's text)."""
    out = []
    for index, (message, (calls, call_id)) in enumerate(zip(messages, history, strict=True)):
        message = dict(message)
        if calls:
            message["tool_calls"] = [_history_call(c, index, j) for j, c in enumerate(calls)]
        if call_id is not None:
            message["tool_call_id"] = call_id
        out.append(message if renders_tools else _without_tool_turns(message))
    if tools and not renders_tools:
        out = _with_tools_section(out, tools)
    return out


def _history_call(value: Any, index: int, j: int) -> dict:
    call = validated(HistoryCall, value, f"messages.{index}.tool_calls.{j}")
    function = {"name": call.function.name, "arguments": _history_arguments(call.function.arguments)}
    return {"id": call.id, "type": "function", "function": function}


def _history_arguments(text: str) -> dict | str:
    """A history call's arguments as templates get them: a JSON object as the object, since templates write
    it themselves (`| tojson`), as transformers gives it; anything else (JSON cut off at max_tokens, an
    array, plain text) as the string itself, which OpenAI accepts too."""
    try:
        arguments = json.loads(text)
    except ValueError:
        return text
    return arguments if isinstance(arguments, dict) else text


def _without_tool_turns(message: dict) -> dict:
    calls = message.pop("tool_calls", None)
    message.pop("tool_call_id", None)  # the call form lists no ids: results come in the calls' order
    if calls:
        listed = json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                             for c in calls], ensure_ascii=False)
        text = message.get("content") or ""
        message["content"] = (f"{text}\n" if text else "") + f"<tool_call>{listed}</tool_call>"
    if message["role"] == "tool":
        result = message.get("content") or ""
        return {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"}
    return message


def _with_tools_section(messages: list[dict], tools: list[dict]) -> list[dict]:
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    section = DEFAULT_TOOLS_PROMPT.format(tools=listed)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{section}" if first.get("content") else section
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


# -- the output -----------------------------------------------------------------------------------------

class NamedCallParser(ToolParser):
    """The output of a named choice: the named function's arguments, generated under its schema."""

    name = "named"

    def __init__(self, function: str) -> None:
        self._function = function
        self._started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = [] if self._started else [Call(self._function, "")]
        self._started = True
        return [*events, ArgumentsPart(text)] if text else events

    def finish(self) -> list[Event]:
        return self.feed("")


class CallReader:
    """One choice's text read as content and calls, in pieces; each call gets its OpenAI id. With
    `parallel` false, calls after the first are left out (as `parallel_tool_calls: false` asks)."""

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        self._parser = parser
        self._parallel = parallel
        self.ids: list[str] = []  # the id of each call given out so far
        self._skipping = False  # in a call left out

    def feed(self, text: str) -> list[Event]:
        return self._kept(self._parser.feed(text))

    def finish(self) -> list[Event]:
        return self._kept(self._parser.finish())

    def _kept(self, events: list[Event]) -> list[Event]:
        kept = []
        for event in events:
            if isinstance(event, Call):
                self._skipping = bool(self.ids) and not self._parallel
                if not self._skipping:
                    self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
            elif isinstance(event, Content):
                self._skipping = False
            if not self._skipping:
                kept.append(event)
        return kept


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def final_message(text: str, finish_reason: str | None, plan: ToolPlan,
                  reasoning: ReasoningPlan = NO_REASONING) -> tuple[AssistantMessage, str | None]:
    """The message of a whole choice, and its finish reason: its thinking apart (`reasoning`), and its
    calls read out of the answer after it."""
    thought, text = reasoning.split(text)
    message, finish_reason = _answer_message(text, finish_reason, plan)
    if reasoning.shown:
        message.reasoning_content = message.reasoning = thought
    return message, finish_reason


def _answer_message(text: str, finish_reason: str | None,
                    plan: ToolPlan) -> tuple[AssistantMessage, str | None]:
    reader = plan.reader()
    if reader is None:
        return AssistantMessage(content=text), finish_reason
    events = merged([*reader.feed(text), *reader.finish()])
    calls = [ToolCall(id=call_id, function=FunctionCall(name=e.name, arguments=e.arguments))
             for call_id, e in zip(reader.ids, (e for e in events if isinstance(e, Call)), strict=True)]
    content = "".join(e.text for e in events if isinstance(e, Content))
    if calls and not content.strip():
        content = ""  # only blanks around the calls: no content
    message = AssistantMessage(content=content or None, tool_calls=calls or None)
    return message, _finish_reason(finish_reason, bool(calls))


class StreamedChoice:
    """One choice of a stream: each new piece of its text becomes the deltas to send, in order: its
    thinking (`reasoning`), then the content and calls of its answer."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningPlan = NO_REASONING) -> None:
        self._reader = plan.reader()
        self._thinking = reasoning.reader()
        self._shows_thinking = reasoning.shown

    def deltas(self, text: str, finished: bool) -> list[DeltaMessage]:
        """The deltas of `text`, the choice's next piece (`finished`: its last); at least one, empty if
        nothing is to be sent yet, so that logprobs and the finish reason have a chunk to go in."""
        thought, text = self._thinking.read(text, finished)
        shown = thought if self._shows_thinking else ""
        out = [DeltaMessage(reasoning_content=shown, reasoning=shown)] if shown else []
        return [*out, *self._answer_deltas(text, finished)] or [DeltaMessage()]

    def _answer_deltas(self, text: str, finished: bool) -> list[DeltaMessage]:
        if self._reader is None:
            return [DeltaMessage(content=text)] if text else []
        events = self._reader.feed(text)
        if finished:
            events += self._reader.finish()
        calls = len(self._reader.ids) - sum(isinstance(e, Call) for e in events)  # before these events
        out: list[DeltaMessage] = []
        for event in events:
            if isinstance(event, Content):
                if event.text:
                    out.append(DeltaMessage(content=event.text))
            elif isinstance(event, Call):
                out.append(_call_delta(calls, self._reader.ids[calls], event.name))
                calls += 1
                if event.arguments:
                    out.append(_call_delta(calls - 1, None, None, event.arguments))
            else:
                out.append(_call_delta(calls - 1, None, None, event.text))
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return _finish_reason(reason, bool(self._reader and self._reader.ids))


def _call_delta(index: int, call_id: str | None, name: str | None,
                arguments: str | None = None) -> DeltaMessage:
    """The first delta of a call (id, type, name, empty arguments) or a piece of its arguments."""
    if call_id is not None:
        piece = DeltaToolCall(index=index, id=call_id, type="function",
                              function=DeltaFunctionCall(name=name, arguments=""))
    else:
        piece = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))
    return DeltaMessage(tool_calls=[piece])


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason
