"""OpenAI's Responses API (`POST /v1/responses`) as pydantic models: the create request, the input items it
reads, the response object and its output items.

The request lists every field of OpenAI's create request; each is honoured, or refused with a 400 naming it
when it asks for something this server does not do (`UNSUPPORTED`, through `request_fields.refuse_fields`,
the mechanism chat and completions use; docs/responses.md gives the choice for each). A field on no list is
refused as OpenAI refuses it ("Unrecognized request argument supplied: X"), and known fields are typed
strictly, as `openai_protocol`'s requests are.

Input items are read one by one (`responses_request.py`) into the models below, so that a 400 names the
item and field at fault (`input.3.call_id`) rather than a union's every branch.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gracelm.serving.request_fields import Unsupported, one_of, unset

_REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)
# OpenAI's bounds on metadata, which a response echoes and keeps.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class TextConfig(BaseModel):
    model_config = _REQUEST_CONFIG

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_obfuscation: bool | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(**_REQUEST_CONFIG, json_schema_extra={
        "examples": [{"input": "Hello", "max_output_tokens": 8}]})

    # honoured
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    # accepted: no effect on the output by definition
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, str] | None = None  # Codex CLI's: its own ids, for a provider's logs
    max_tool_calls: int | None = None
    background: bool | None = None
    # honoured at their no-op values only (`UNSUPPORTED`)
    background_options: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    conversation: str | dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    include: list[str] | None = None
    moderation: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    truncation: str | None = None


# What `reasoning` may say here: no effort, and a summary of the reasoning (Codex CLI asks for `summary:
# "auto"`), which is honoured by more than it asks: with a reasoning parser, the whole reasoning, in the
# reasoning items' `content`; without one, no output is reasoning.
_REASONING_ACCEPTED = {"effort": (None, "none"), "summary": (None, "auto", "concise", "detailed"),
                       "generate_summary": (None, "auto", "concise", "detailed")}
# What `include` may ask for: the encrypted content of reasoning items, which here is none, since their
# text is given in the clear (Codex CLI asks for it).
_INCLUDE_ACCEPTED = ("reasoning.encrypted_content",)


def _no_reasoning(value: Any) -> bool:
    """`reasoning` asking for nothing this server could not give (`_REASONING_ACCEPTED`)."""
    return value is None or (isinstance(value, dict) and all(
        v in _REASONING_ACCEPTED.get(k, (None,)) for k, v in value.items()))


def _nothing_to_include(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(v in _INCLUDE_ACCEPTED for v in value))


UNSUPPORTED: dict[str, Unsupported] = {
    "background_options": Unsupported(unset, "background options (completion windows, continuations) are "
                                             "not supported"),
    "access_programs": Unsupported(one_of({"cyber": "standard"}), "only the standard access program exists"),
    "context_management": Unsupported(unset, "context management (compaction) is not supported"),
    "conversation": Unsupported(unset, "conversations are not supported; use previous_response_id"),
    "image": Unsupported(unset, "image inputs are not supported"),
    "include": Unsupported(_nothing_to_include, "no additional output data (logprobs, tool outputs) is "
                                                "returned; reasoning.encrypted_content alone is accepted"),
    "moderation": Unsupported(unset, "moderation is not supported"),
    "prompt": Unsupported(unset, "saved prompt templates are not supported"),
    "prompt_cache_options": Unsupported(unset, "prompt cache options are not supported; the prefix cache "
                                               "is automatic"),
    "prompt_cache_retention": Unsupported(one_of("in_memory"),
                                          'only "in_memory" retention exists (the prefix cache)'),
    "reasoning": Unsupported(_no_reasoning, "reasoning effort is not supported (a summary is accepted: "
                                            "with --reasoning-parser the reasoning comes whole, in "
                                            "reasoning items)"),
    "service_tier": Unsupported(one_of("auto", "default"), 'only the "auto" and "default" tiers exist'),
    "top_logprobs": Unsupported(one_of(0), "logprobs are not returned by the Responses API here"),
    "truncation": Unsupported(one_of("disabled"), 'only "disabled" truncation exists: an input over the '
                                                  "context is a 400"),
}
UNSUPPORTED_IN_TEXT: dict[str, Unsupported] = {
    "verbosity": Unsupported(one_of("medium"), 'only the default verbosity, "medium", exists'),
}
UNSUPPORTED_IN_STREAM_OPTIONS: dict[str, Unsupported] = {
    "include_obfuscation": Unsupported(one_of(False), "stream obfuscation is not supported"),
}


# -- input items --------------------------------------------------------------------------------------

class InputMessage(BaseModel):
    """A message item: the easy form (`{"role", "content"}`) or a typed one, an earlier output included."""

    model_config = _REQUEST_CONFIG

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(BaseModel):
    """A call the model made, given back with its result (`FunctionCallOutputItem`)."""

    model_config = _REQUEST_CONFIG

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class ReasoningItem(BaseModel):
    """An earlier output's reasoning item, given back (Codex CLI sends every output item back). Taken and
    left out of the prompt, as chat templates leave out earlier answers' thinking and as OpenAI drops it
    from the context after the turn it served."""

    model_config = _REQUEST_CONFIG

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


UNSUPPORTED_IN_CALLS: dict[str, Unsupported] = {
    "namespace": Unsupported(unset, "tool namespaces are not supported"),
    "caller": Unsupported(one_of({"type": "direct"}), "only direct calls exist (no programmatic tool "
                                                      "calling)"),
}


class FunctionTool(BaseModel):
    """A function tool as the Responses API lists it: flat, where chat nests it under `function`."""

    model_config = ConfigDict(**_REQUEST_CONFIG, populate_by_name=True)

    type: Literal["function"]
    name: str = Field(min_length=1)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None
    async_: bool | None = Field(None, alias="async")


UNSUPPORTED_IN_TOOLS: dict[str, Unsupported] = {
    "defer_loading": Unsupported(one_of(False), "deferred tool loading (tool search) is not supported"),
    "allowed_callers": Unsupported(one_of(["direct"]), "only direct calls exist (no programmatic tool "
                                                       "calling)"),
    "output_schema": Unsupported(unset, "output schemas of functions are not supported"),
    "async_": Unsupported(one_of(False), "asynchronous function calls are not supported"),
}


# -- the response object ------------------------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    """A function call of the model, as an output item."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    """A reasoning model's thinking, as an output item (`--reasoning-parser`): its whole text in `content`,
    no summary, nothing encrypted."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallOutput | ReasoningOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # the prefix cache's hits are not counted per request
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # without a reasoning parser a model's thinking is output text


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseErrorInfo(BaseModel):
    """A failed response's `error`. Its code is OpenAI's `server_error` (the SDK knows a fixed set of codes);
    the `error` event before it carries this server's own code (docs/responses.md, "Streaming")."""

    code: Literal["server_error"] = "server_error"
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    """`GET /v1/responses/{id}/input_items`: the items the response was generated from, instructions left
    out (as OpenAI lists them)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
