"""OpenAI's request and response shapes (chat completions, completions, models, errors) as pydantic models.

Requests accept OpenAI's fields plus vLLM's extra sampling fields; unknown fields are ignored, as vLLM does,
so that clients sending newer OpenAI options still get an answer. Known fields are typed strictly, as OpenAI
types them (`"n": "2"`, `"max_tokens": 16.0` or `"logprobs": 1` are refused, not coerced), so that a body is
valid exactly when the published JSON schema says so.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# Request models: strict types, unknown fields ignored (see above).
_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share; range checks are left to `SamplingParams`, which names the field."""

    model_config = _REQUEST_CONFIG

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed request asked for the usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy completions endpoint
    logprobs: int | None = None
    echo: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: first its index, id, type and name, then pieces of its arguments
    (index only). Unset fields are left out, as OpenAI sends them: clients join the pieces field by field."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler(self))


def _without_none(value: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in value.items() if v is not None}


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """Both the plain answer and each streamed chunk: OpenAI uses the same object for the two."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "gracelm"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
