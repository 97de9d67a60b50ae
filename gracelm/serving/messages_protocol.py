"""Anthropic's Messages API shapes (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as pydantic models,
and the choice made for each of its request fields (docs/messages.md says why for each).

Requests are typed strictly with unknown fields refused, as the OpenAI requests are
(`openai_protocol.py`). Every field of Anthropic's create request is listed (the beta API's too), each
honoured or, where it asks for what this server cannot do, refused with a 400 naming it (`UNSUPPORTED` and
the block and tool tables, through `request_fields.refuse_fields`); a value that asks for nothing is
accepted. Content blocks, tools and `tool_choice` are read block by block (`messages_request.py`) so that a
refusal names the block's place and type rather than a union's branches.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gracelm.serving.request_fields import Unsupported, one_of, unset

_REQUEST = ConfigDict(extra="forbid", strict=True)


class CacheControl(BaseModel):
    """A prompt-caching breakpoint. The prefix cache keeps every full block of every prompt, as long as its
    room is not needed, whatever the breakpoints and their ttl say: what either asks for happens already."""

    model_config = _REQUEST

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = _REQUEST

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(BaseModel):
    """A call the assistant made, in the history."""

    model_config = _REQUEST

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(BaseModel):
    """A call's result, in a user message; `content` is text or text blocks."""

    model_config = _REQUEST

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class ThinkingBlock(BaseModel):
    """An earlier answer's thinking (`--reasoning-parser`), in the history: taken and left out of the prompt,
    as Anthropic leaves earlier turns' thinking out of the context and chat templates leave it out."""

    model_config = _REQUEST

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


# The content blocks a request may hold; any other type (image, document, redacted thinking, server tools'
# blocks) is refused naming its place.
BLOCKS: dict[str, type[BaseModel]] = {"text": TextBlock, "tool_use": ToolUseBlock,
                                      "tool_result": ToolResultBlock, "thinking": ThinkingBlock}

UNSUPPORTED_IN_BLOCKS: dict[str, Unsupported] = {
    "citations": Unsupported(unset, "citations are not supported"),
    "caller": Unsupported(one_of({"type": "direct"}), "only direct calls exist here (no code execution)"),
    "toolset_name": Unsupported(unset, "toolsets (MCP servers) are not supported"),
}


class CustomTool(BaseModel):
    """A client tool: the model may call it with an input matching `input_schema`."""

    model_config = _REQUEST

    name: str = Field(min_length=1)
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    description: str | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # honoured where the input is generated under the schema (`messages_request`)
    input_examples: list[dict[str, Any]] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    allowed_callers: list[str] | None = None


UNSUPPORTED_IN_TOOLS: dict[str, Unsupported] = {
    "input_examples": Unsupported(unset, "input examples are not supported"),
    "defer_loading": Unsupported(one_of(False), "tool search (deferred tools) is not supported"),
    # A call's input is always streamed as it is generated: that is what true asks, false asks it buffered.
    "eager_input_streaming": Unsupported(one_of(True), "tool input is streamed as it is generated"),
    "allowed_callers": Unsupported(one_of(["direct"]), "only direct calls exist here (no code execution)"),
}


class ToolChoice(BaseModel):
    model_config = _REQUEST

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool of type "tool"
    disable_parallel_tool_use: bool | None = None


class Metadata(BaseModel):
    model_config = _REQUEST

    user_id: str | None = None  # an end user's id, for abuse monitoring: no effect on the output


class OutputFormat(BaseModel):
    model_config = _REQUEST

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = _REQUEST

    format: OutputFormat | None = None
    effort: str | None = None


class Message(BaseModel):
    model_config = _REQUEST

    # "system": a system turn inside the conversation (the mid-conversation-system beta, which Claude Code
    # sends), its text blocks only
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """`/v1/messages/count_tokens`: the fields that make a prompt."""

    model_config = ConfigDict(**_REQUEST, json_schema_extra={
        "examples": [{"model": "any", "messages": [{"role": "user", "content": "Hello"}]}]})

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    speed: str | None = None
    # the beta API's
    context_management: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None


class MessagesRequest(CountTokensRequest):
    """`/v1/messages`."""

    model_config = ConfigDict(**_REQUEST, json_schema_extra={
        "examples": [{"model": "any", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}]})

    max_tokens: int
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: what either asks for
    container: dict[str, Any] | str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    # the beta API's
    billing_policy: dict[str, Any] | None = None
    compaction: dict[str, Any] | None = None
    fallback_credit_token: dict[str, Any] | str | None = None
    fallbacks: list[dict[str, Any]] | dict[str, Any] | None = None
    thread: dict[str, Any] | None = None


UNSUPPORTED: dict[str, Unsupported] = {
    "max_tokens": Unsupported(lambda value: value != 0, "max_tokens 0 (warming the prompt cache without an "
                                                        "answer) is not supported; the prefix cache fills "
                                                        "as requests run"),
    "thinking": Unsupported(one_of({"type": "disabled"}), "extended thinking is not supported"),
    "speed": Unsupported(one_of("standard"), 'only the "standard" speed exists'),
    "container": Unsupported(unset, "containers (code execution) are not supported"),
    "inference_geo": Unsupported(unset, "this server runs where it runs; no region can be chosen"),
    "diagnostics": Unsupported(unset, "prompt-cache diagnostics are not supported"),
    "context_management": Unsupported(unset, "context management is not supported"),
    "mcp_servers": Unsupported(unset, "MCP servers are not supported"),
    "billing_policy": Unsupported(unset, "billing policies are not supported"),
    "compaction": Unsupported(unset, "compaction is not supported"),
    "fallback_credit_token": Unsupported(unset, "fallbacks are not supported"),
    "fallbacks": Unsupported(unset, "fallbacks are not supported"),
    "thread": Unsupported(unset, "threads are not supported"),
}
UNSUPPORTED_IN_OUTPUT_CONFIG: dict[str, Unsupported] = {
    # "high" is Anthropic's default effort (Claude Code sends it): asks for no change.
    "effort": Unsupported(one_of("high"), 'only the default effort, "high", exists'),
}

# `anthropic-beta` features this server does as asked (the header names them, comma-separated); any other
# is refused naming the header. The SDK sends none by default; Claude Code sends several.
ACCEPTED_BETAS: dict[str, str] = {
    "claude-code-20250219": "names the client; asks for no behaviour",
    "fine-grained-tool-streaming-2025-05-14": "tool input is streamed as it is generated",
    "interleaved-thinking-2025-05-14": "applies to thinking, which is refused unless disabled",
    "prompt-caching-2024-07-31": "the prefix cache is automatic",
    "token-counting-2024-11-01": "/v1/messages/count_tokens is served",
    "output-128k-2025-02-19": "max_tokens is bounded by the context only",
    # Betas that only open request fields: each field is honoured or refused by name when it is sent.
    "oauth-2025-04-20": "opens Anthropic's own sign-in; this server checks its own key, in either header",
    "context-management-2025-06-27": "opens context_management, refused by name when sent",
    "mcp-client-2025-04-04": "opens mcp_servers, refused by name when sent",
    "files-api-2025-04-14": "opens file sources in content blocks, refused by name when sent",
    "effort-2025-11-24": "opens output_config.effort, whose default alone is accepted",
    "mid-conversation-system-2026-04-07": "opens system turns inside messages, refused by name when sent",
}


# Answers


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(BaseModel):
    """A reasoning model's thinking (`--reasoning-parser`), before the answer's blocks. Its signature is
    empty: the text is the model's own, in the clear, with nothing to verify."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ThinkingContent | TextContent | ToolUseContent]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


# Stream events (`event: <type>`, `data: <the event>`), in the order they come.


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse  # no content yet, stop_reason null, output_tokens 0


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ThinkingContent | TextContent | ToolUseContent  # empty: text "", input {}, thinking ""


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: ThinkingDelta | TextDelta | InputJsonDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None = None


class OutputUsage(BaseModel):
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: OutputUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class ErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, ... (`api_errors.anthropic_body`)
    message: str


class ErrorEvent(BaseModel):
    """An error: the body of an error answer, and the last event of a stream that did not end well."""

    type: Literal["error"] = "error"
    error: ErrorDetail
