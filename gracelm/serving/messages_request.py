"""A Messages request in chat's terms: read into the `ChatCompletionRequest` it asks for (`chat_request`),
which the chat endpoint plans. An error of the chat planning names a chat field; it is renamed to the field
the client sent (`renamed`). Apart from `serving_messages.py`, which runs the request and shapes the answer:
this is what the request asks, read once, in the terms the chat planning checks.

Translation, field by field (docs/messages.md):

- `system` (text or text blocks) is the first message, of the system role; blocks are joined by a blank line,
  as are the text blocks of any message, and consecutive turns of one role (as Anthropic joins them).
- A user message's `tool_result` blocks become tool messages (in their order among its text), their content
  text or text blocks; `is_error: true` is said in the text, which starts `Error: `.
- An assistant message's `tool_use` blocks become its tool calls (the input as the arguments' JSON).
- A final assistant message is a prefill: the answer continues it (`continue_final_message`).
- Tools are function tools whose parameters are the `input_schema`; `tool_choice` `auto`, `any`, `tool` and
  `none` are chat's `auto`, `required`, a named function and `none`; `disable_parallel_tool_use` is
  `parallel_tool_calls: false`. A forced choice (`any`, `tool`) generates the input under the tool's
  schema, which is what `strict: true` asks; under `auto` the model writes its calls freely, so `strict:
  true` is refused there.
- `output_config.format` (`json_schema`) is chat's `response_format` of that schema.
- `stop_sequences`, `temperature`, `top_p`, `top_k` and `metadata.user_id` are chat's `stop`,
  `temperature`, `top_p`, `top_k` and `user`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pydantic
from pydantic import BaseModel

from gracelm.serving.api_errors import APIError, validated
from gracelm.serving.messages_protocol import (
    BLOCKS,
    UNSUPPORTED,
    UNSUPPORTED_IN_BLOCKS,
    UNSUPPORTED_IN_OUTPUT_CONFIG,
    UNSUPPORTED_IN_TOOLS,
    CountTokensRequest,
    CustomTool,
    Message,
    MessagesRequest,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from gracelm.serving.openai_protocol import ChatCompletionRequest
from gracelm.serving.request_fields import refuse_fields

_BLOCK_JOIN = "\n\n"
_ERROR_PREFIX = "Error: "


# -- the request -----------------------------------------------------------------------------------------

def chat_request(req: CountTokensRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request `req` asks for, and the place in `req` of each of its messages (`system` or
    `messages.N`); a 400 naming the field for what cannot be honoured."""
    refuse_fields(req, UNSUPPORTED, "")
    messages, places = _chat_messages(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    body.update(_tool_fields(req))
    if req.output_config is not None:
        refuse_fields(req.output_config, UNSUPPORTED_IN_OUTPUT_CONFIG, "output_config.")
        body.update(_output_format(req))
    if messages[-1]["role"] == "assistant":  # a prefill: the answer continues it
        if messages[-1].get("tool_calls"):
            raise APIError(400, f"{places[-1]}: a final assistant message is continued (a prefill), so it "
                                f"holds text only, no tool_use", param=places[-1], code="invalid_value")
        body.update(continue_final_message=True, add_generation_prompt=False)
    if isinstance(req, MessagesRequest):
        sampling = dict(max_tokens=req.max_tokens, stream=req.stream, stop=req.stop_sequences,
                        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                        user=req.metadata.user_id if req.metadata is not None else None)
        body.update((name, value) for name, value in sampling.items() if value is not None)
    try:
        return ChatCompletionRequest.model_validate(body), places
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"])
        raise renamed(APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value"),
                      places) from None


def _chat_messages(req: CountTokensRequest) -> tuple[list[dict[str, Any]], list[str]]:
    messages, places = [], []
    if req.system is not None:
        messages.append({"role": "system", "content": _system_text(req.system, "system")})
        places.append("system")
    for index, message in enumerate(req.messages):
        where = f"messages.{index}"
        if message.role == "user":
            translated = _user_messages(message, where)
        elif message.role == "system":
            translated = [{"role": "system", "content": _system_text(message.content, f"{where}.content")}]
        else:
            translated = [_assistant(message, where)]
        for chat in translated:
            if messages and _joins(messages[-1], chat):
                messages[-1] = _joined(messages[-1], chat)
            else:
                messages.append(chat)
                places.append(where)
    return messages, places


def _joins(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether two messages in a row are one turn: Anthropic joins consecutive user or assistant turns,
    which chat templates may refuse to render apart. A call's result is a turn of its own."""
    return before["role"] == after["role"] in ("user", "assistant") and not before.get("tool_calls")


def _joined(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    texts = [text for text in (before["content"], after["content"]) if text]
    return {**after, "content": _BLOCK_JOIN.join(texts)}


def _system_text(system: str | list[dict[str, Any]], where: str) -> str:
    """A system prompt's text: the request's `system`, or a system turn's content (`where`: its field)."""
    if isinstance(system, str):
        return system
    blocks = [_block(value, f"{where}.{i}", ("text",)) for i, value in enumerate(system)]
    return _BLOCK_JOIN.join(block.text for block in blocks if isinstance(block, TextBlock))


def _user_messages(message: Message, where: str) -> list[dict[str, Any]]:
    """A user message: its text as one message, each tool result as a tool message, in their order."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for i, value in enumerate(message.content):
        block = _block(value, f"{where}.content.{i}", ("text", "tool_result"))
        if isinstance(block, TextBlock):
            texts.append(block.text)
            continue
        if texts:
            out.append({"role": "user", "content": _BLOCK_JOIN.join(texts)})
            texts = []
        assert isinstance(block, ToolResultBlock)
        out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                    "content": _result_text(block, f"{where}.content.{i}")})
    if texts or not out:
        out.append({"role": "user", "content": _BLOCK_JOIN.join(texts)})
    return out


def _result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        texts = [_block(value, f"{where}.content.{i}", ("text",)) for i, value in enumerate(content)]
        text = _BLOCK_JOIN.join(t.text for t in texts if isinstance(t, TextBlock))
    return _ERROR_PREFIX + text if block.is_error else text


def _assistant(message: Message, where: str) -> dict[str, Any]:
    """An assistant message: its text blocks as the content, its tool_use blocks as its calls; its thinking
    blocks are left out (`ThinkingBlock`)."""
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, calls = [], []
    for i, value in enumerate(message.content):
        block = _block(value, f"{where}.content.{i}", ("text", "tool_use", "thinking"))
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
    chat: dict[str, Any] = {"role": "assistant", "content": _BLOCK_JOIN.join(texts)}
    if calls:
        chat["tool_calls"] = calls
    return chat


def _block(value: Any, where: str, allowed: tuple[str, ...]) -> BaseModel:
    """A content block at `where`, of one of the `allowed` types."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in allowed:
        supported = ", ".join(allowed)
        raise APIError(400, f"{where}.type: {json.dumps(kind)} blocks are not supported here (supported: "
                            f"{supported}); this server reads text and tool calls", param=f"{where}.type",
                       code="unsupported_parameter")
    block = validated(BLOCKS[kind], value, where)
    refuse_fields(block, UNSUPPORTED_IN_BLOCKS, f"{where}.")
    return block


def _tool_fields(req: CountTokensRequest) -> dict[str, Any]:
    """Chat's `tools`, `tool_choice` and `parallel_tool_calls` for the request's tools and choice."""
    tools = [_tool(value, f"tools.{i}") for i, value in enumerate(req.tools or [])]
    choice = validated(ToolChoice, req.tool_choice, "tool_choice") if req.tool_choice is not None else None
    chat_choice = _chat_tool_choice(choice, bool(tools)) if choice is not None else None
    if not tools:  # auto and none without tools: nothing to choose from, nothing rendered
        return {}
    fields: dict[str, Any] = {"tools": [_function(tool) for tool in tools]}
    if choice is not None:
        fields["tool_choice"] = chat_choice
        if choice.disable_parallel_tool_use is not None:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if choice is None or choice.type == "auto":
        for i, tool in enumerate(tools):
            if tool.strict:
                raise APIError(400, f"tools.{i}.strict: true is honoured with tool_choice any or tool, whose "
                                    f"input is generated under the schema; under auto the model writes its "
                                    f"calls freely", param=f"tools.{i}.strict", code="unsupported_parameter")
    return fields


def _function(tool: CustomTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool(value: Any, where: str) -> CustomTool:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (None, "custom"):
        raise APIError(400, f"{where}.type: server tools ({json.dumps(kind)}) are not supported, only client "
                            f"tools (custom)", param=f"{where}.type", code="unsupported_parameter")
    tool = validated(CustomTool, value, where)
    refuse_fields(tool, UNSUPPORTED_IN_TOOLS, f"{where}.")
    return tool


def _chat_tool_choice(choice: ToolChoice, has_tools: bool) -> str | dict[str, Any]:
    if (choice.type == "tool") != (choice.name is not None):
        raise APIError(400, 'tool_choice.name: a choice of type "tool" names the tool, and only it does',
                       param="tool_choice.name", code="invalid_value")
    if choice.type in ("any", "tool") and not has_tools:
        raise APIError(400, f'tool_choice: a choice of type "{choice.type}" needs tools; none were given',
                       param="tool_choice", code="invalid_value")
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _output_format(req: CountTokensRequest) -> dict[str, Any]:
    assert req.output_config is not None
    output = req.output_config.format
    if output is None:
        return {}
    forced = req.tool_choice is not None and req.tool_choice.get("type") in ("any", "tool")
    if forced and req.tools:
        raise APIError(400, "output_config.format: a forced tool_choice (any, tool) generates the tool's "
                            "input under its own schema; the two cannot be combined",
                       param="output_config.format", code="invalid_value")
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "output", "schema": output.json_schema}}}



# The chat fields whose refusal can name them, and the fields of the Messages request that set them.
_RENAMES = {"stop": "stop_sequences", "response_format": "output_config.format",
            "tool_choice.function.name": "tool_choice.name"}
_MESSAGE_PARAM = re.compile(r"^messages\.(\d+)(\.[\w.]*)?$")


def renamed(error: APIError, places: list[str]) -> APIError:
    """`error` of the chat request naming the field of the Messages request (`places`: each chat message's
    place in it), in its `param` and where its message starts with the field."""
    old = error.param
    if old is None:
        return error
    new = _messages_param(old, places)
    if new == old:
        return error
    message = new + error.message[len(old):] if error.message.startswith(old) else error.message
    return APIError(error.status, message, param=new, code=error.code, headers=error.headers)


def _messages_param(param: str, places: list[str]) -> str:
    if param == "continue_final_message":  # the prefill the answer continues: the final message
        return places[-1]
    m = _MESSAGE_PARAM.match(param)
    if m is not None and int(m.group(1)) < len(places):
        return places[int(m.group(1))]
    return _RENAMES.get(param, param)
