"""A Responses API request in chat's terms: translated into a chat completions request (input items to
messages, flat function tools to chat's, `text.format` to `response_format`), its `metadata` and
`background` checked. A refusal of the chat planning names the chat field (`max_tokens`,
`messages.3.content`): it is renamed to the field the client sent (`max_output_tokens`, `input.3.content`).

Apart from `serving_responses.py`, which runs and stores the response: this is what the request asks, read
once, in the terms the chat planning checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import pydantic

from gracelm.serving.api_errors import APIError, from_validation_error, validated
from gracelm.serving.openai_protocol import ChatCompletionRequest
from gracelm.serving.request_fields import refuse_fields
from gracelm.serving.responses_protocol import (
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    UNSUPPORTED_IN_CALLS,
    UNSUPPORTED_IN_TOOLS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputMessage,
    ReasoningItem,
    ResponsesRequest,
)

PREVIOUS = "previous_response_id"
# Keys a text part of an input message may have (an earlier output's annotations and logprobs come back
# with it; a cache breakpoint is a hint, the prefix cache is automatic).
_TEXT_PART_KEYS = {"input_text": {"type", "text", "prompt_cache_breakpoint"},
                   "output_text": {"type", "text", "annotations", "logprobs"}}
_NOT_TEXT = {"input_image": "image inputs", "input_file": "file inputs", "input_audio": "audio inputs"}
_JSON_SCHEMA_KEYS = {"type", "name", "schema", "description", "strict"}


# -- the request, in chat's terms ---------------------------------------------------------------------

@dataclasses.dataclass
class _Conversation:
    """The chat messages of a request, and where each came from: the field path of the message (or of its
    text), and of each of its tool calls, as the client sent them."""

    messages: list[dict[str, Any]]
    origins: list[tuple[str, list[str]]]


def given_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as items: a string is one user message."""
    return [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given


def conversation(instructions: str | None, items: list[dict[str, Any]], num_history: int) -> _Conversation:
    conversation = _Conversation([], [])
    if instructions is not None:
        conversation.messages.append({"role": "system", "content": instructions})
        conversation.origins.append(("instructions", []))
    for index, item in enumerate(items):
        where = PREVIOUS if index < num_history else f"input.{index - num_history}"
        _add_item(conversation, item, where)
    return conversation


def _add_item(conversation: _Conversation, item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object (an input item), got {type(item).__name__}",
                       param=where, code="invalid_value")
    kind = item.get("type", "message")
    if kind == "message":
        message = validated(InputMessage, item, where)
        chat_message = {"role": message.role, **_message_text(message, where)}
        conversation.messages.append(chat_message)
        conversation.origins.append((where, []))
    elif kind == "function_call":
        _add_call(conversation, validated(FunctionCallItem, item, where), where)
    elif kind == "reasoning":
        validated(ReasoningItem, item, where)  # taken, not rendered (`ReasoningItem`)
    elif kind == "function_call_output":
        result = validated(FunctionCallOutputItem, item, where)
        refuse_fields(result, UNSUPPORTED_IN_CALLS, f"{where}.")
        tool_message = {"role": "tool", "tool_call_id": result.call_id,
                        "content": _parts_text(result.output, f"{where}.output", ("input_text",))}
        if result.name is not None:
            tool_message["name"] = result.name
        conversation.messages.append(tool_message)
        conversation.origins.append((where, []))
    else:
        raise APIError(400, f"{where}.type: only message, function_call, function_call_output and reasoning "
                            f"items are supported, got {json.dumps(kind)}", param=f"{where}.type",
                       code="unsupported_parameter")


def _add_call(conversation: _Conversation, call: FunctionCallItem, where: str) -> None:
    """A call joins the assistant message before it (chat's form: one message, its text and its calls)."""
    refuse_fields(call, UNSUPPORTED_IN_CALLS, f"{where}.")
    chat_call = {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
    messages, origins = conversation.messages, conversation.origins
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(chat_call)
        origins[-1][1].append(where)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [chat_call]})
        origins.append((where, [where]))


def _message_text(message: InputMessage, where: str) -> dict[str, Any]:
    """A message's text (its refusal apart, for an assistant's earlier answer), its parts joined."""
    if isinstance(message.content, str):
        return {"content": message.content}
    kinds = ("input_text", "output_text", "refusal") if message.role == "assistant" else ("input_text",)
    texts = [p for p in message.content if not (isinstance(p, dict) and p.get("type") == "refusal")]
    refusals = [p for p in message.content if isinstance(p, dict) and p.get("type") == "refusal"]
    fields: dict[str, Any] = {"content": _parts_text(texts, f"{where}.content", kinds)}
    if refusals and message.role == "assistant":
        fields["refusal"] = "".join(str(p.get("refusal", "")) for p in refusals)
    return fields


def _parts_text(parts: str | list[Any], where: str, kinds: tuple[str, ...]) -> str:
    """Text content parts joined; any other part refused, naming it."""
    if isinstance(parts, str):
        return parts
    texts = []
    for index, part in enumerate(parts):
        at = f"{where}.{index}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _NOT_TEXT:
            raise APIError(400, f"{at}.type: {_NOT_TEXT[kind]} are not supported; this server reads text",
                           param=f"{at}.type", code="unsupported_parameter")
        if kind not in kinds:
            raise APIError(400, f"{at}.type must be one of {', '.join(kinds)}, got {json.dumps(kind)}",
                           param=f"{at}.type", code="invalid_value")
        unknown = sorted(set(part) - _TEXT_PART_KEYS.get(kind, {"type", "text"}))
        if unknown:
            raise APIError(400, f"Unrecognized request argument supplied: {at}.{unknown[0]}",
                           param=f"{at}.{unknown[0]}", code="unrecognized_argument")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{at}.text must be a string", param=f"{at}.text", code="invalid_value")
        texts.append(part["text"])
    return "".join(texts)


def chat_request(req: ResponsesRequest, conversation: _Conversation) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": conversation.messages, "stream": bool(req.stream)}
    optional = {"model": req.model, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls, "user": req.user,
                "tools": [_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
                "tool_choice": _chat_tool_choice(req.tool_choice),
                "response_format": _response_format(req.text.format if req.text else None)}
    body.update({k: v for k, v in optional.items() if v is not None})
    try:
        return ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


def _chat_tool(value: Any, index: int) -> dict[str, Any]:
    where = f"tools.{index}"
    if not isinstance(value, dict) or value.get("type") != "function":
        got = json.dumps(value.get("type")) if isinstance(value, dict) else type(value).__name__
        raise APIError(400, f'{where}.type: only "function" tools are supported, got {got}',
                       param=f"{where}.type", code="unsupported_parameter")
    tool = validated(FunctionTool, value, where)
    try:
        refuse_fields(tool, UNSUPPORTED_IN_TOOLS, f"{where}.")
    except APIError as exc:  # the field's Python name is `async_`
        raise _renamed(exc, "async_", "async") from None
    function = tool.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Chat's form of a tool choice: a function named flat (`{"type", "name"}`) is nested under `function`;
    the strings are the same."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise APIError(400, f'tool_choice.type: only "function" (or "none", "auto", "required") is '
                            f"supported, got {json.dumps(choice.get('type'))}", param="tool_choice.type",
                       code="unsupported_parameter")
    unknown = sorted(set(choice) - {"type", "name"})
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: tool_choice.{unknown[0]}",
                       param=f"tool_choice.{unknown[0]}", code="unrecognized_argument")
    return {"type": "function", "function": {"name": choice.get("name")}}


def _response_format(text_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's `response_format` of `text.format`: the JSON schema's fields are nested under `json_schema`."""
    if text_format is None or text_format.get("type") == "text":
        return None
    if text_format.get("type") != "json_schema":
        return text_format  # json_object as chat has it; another type is refused there, naming text.format
    unknown = sorted(set(text_format) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: text.format.{unknown[0]}",
                       param=f"text.format.{unknown[0]}", code="unrecognized_argument")
    spec = {k: v for k, v in text_format.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
                       param="metadata", code="invalid_value")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise APIError(400, f"metadata: keys are at most {MAX_METADATA_KEY} characters and values "
                                f"at most {MAX_METADATA_VALUE}", param=f"metadata.{key[:MAX_METADATA_KEY]}",
                           code="invalid_value")


def check_background(req: ResponsesRequest, can_store: bool) -> None:
    """A background response is stored (polled with GET) and not streamed."""
    if not can_store:
        raise APIError(400, "background: a background response is kept in the server's state directory, and "
                            "this server runs without one: start it with --state-dir DIR", param="background",
                       code="state_dir_required")
    if req.store is False:
        raise APIError(400, "store: a background response must be stored (store: true)", param="store",
                       code="invalid_value")
    if req.stream:
        raise APIError(400, "stream: a background response is not streamed here; poll GET /v1/responses/{id}",
                       param="stream", code="unsupported_parameter")



# -- the chat fields' names, renamed --------------------------------------------------------------------

@contextlib.contextmanager
def named_as_sent(origins: list[tuple[str, list[str]]]) -> Iterator[None]:
    """An `APIError` of the chat planning names the field the client sent instead of chat's."""
    try:
        yield
    except APIError as exc:
        if exc.param is not None:
            raise _renamed(exc, exc.param, _responses_param(exc.param, origins)) from None
        raise


def _renamed(exc: APIError, old: str, new: str) -> APIError:
    if exc.param is None or old == new:
        return exc
    param = exc.param.replace(old, new, 1)
    return APIError(exc.status, exc.message.replace(old, new), param=param, code=exc.code,
                    headers=exc.headers)


_CALL = re.compile(r"^tool_calls\.(\d+)(?:\.function)?(.*)$")


def _responses_param(param: str, origins: list[tuple[str, list[str]]]) -> str:
    head, _, rest = param.partition(".")
    if head == "max_tokens":
        return "max_output_tokens"
    if head == "response_format":
        return "text.format"
    if head == "tools":
        return re.sub(r"^tools\.(\d+)\.function\b", r"tools.\1", param)
    if param.startswith("tool_choice.function"):
        return "tool_choice" + param[len("tool_choice.function"):]
    if head != "messages":
        return param
    index, _, rest = rest.partition(".")
    if not index.isdigit() or int(index) >= len(origins):
        return "input"
    where, calls = origins[int(index)]
    m = _CALL.match(rest)
    if m is not None and int(m.group(1)) < len(calls):
        where, rest = calls[int(m.group(1))], m.group(2).lstrip(".")
    if where in (PREVIOUS, "instructions") or not rest:
        return where
    return f"{where}.{rest}"
