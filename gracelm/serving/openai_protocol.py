"""OpenAI's request and response shapes (chat completions, completions, models, tokenize, errors) as pydantic
models.

Requests list every field of OpenAI's chat completions and completions APIs and vLLM's and SGLang's extras
(the field's routers add SGLang's to every body they forward); each is
honoured, or refused with a 400 naming it when it asks for something this server does not do
(`request_fields.UNSUPPORTED`; the choice for each field is in docs/api_fields.md). A field that is on
neither list is refused as OpenAI refuses it ("Unrecognized request argument supplied: X"): a typo or a
newer option never passes unnoticed. Known fields are typed strictly, as OpenAI types them (`"n": "2"`,
`"max_tokens": 16.0` or `"logprobs": 1` are refused, not coerced), so that a body is valid exactly when the
published JSON schema says so.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, SerializerFunctionWrapHandler, model_serializer

from gracelm.engine.frontend import MAX_PRIORITY, MIN_PRIORITY


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# Request models: strict types, unknown fields refused (see above).
_REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingFields(BaseModel):
    """Fields both endpoints share; range checks are left to `SamplingParams`, which names the field."""

    model_config = _REQUEST_CONFIG

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # the endpoint decides the default
    prompt_logprobs: int | None = None
    echo: bool = False
    request_id: str | None = None
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)  # lower runs first (vLLM's extra)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # SGLang's extras
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    rid: str | None = None
    return_hidden_states: bool | Literal["last"] = False
    return_routed_experts: bool = False
    return_cached_tokens_details: bool = False
    lora_path: str | list[str | None] | None = None
    session_id: str | None = None
    session_params: dict[str, Any] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    custom_params: dict[str, Any] | None = None
    images_config: dict[str, Any] | None = None
    extra_key: str | list[str] | None = None
    ngram_corpus_id: str | None = None
    custom_labels: dict[str, str] | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None

    @property
    def keeps_stop_str(self) -> bool:
        """vLLM's `include_stop_str_in_output` and SGLang's `no_stop_trim` ask the same."""
        return self.include_stop_str_in_output or self.no_stop_trim

    @property
    def named_id(self) -> str | None:
        """The client's name for the request: vLLM's `request_id` or SGLang's `rid` (`refuse_unsupported`
        refuses the two when they differ)."""
        return self.request_id or self.rid

    @property
    def include_usage(self) -> bool:
        """Whether a streamed request asked for the usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether a streamed request asked for the usage in every chunk (vLLM's option)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    # An earlier answer's thinking, under either name it was given (a client sends the message back whole).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingFields):
    # In the published schema, so that its readers (and the schema fuzzer's first phase) have one valid body.
    model_config = ConfigDict(**_REQUEST_CONFIG, json_schema_extra={
        "examples": [{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    # SGLang's chat extras
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False
    input_ids: list[int] | None = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    use_audio_in_video: bool = False
    task: str | None = None


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(**_REQUEST_CONFIG, json_schema_extra={
        "examples": [{"prompt": "Once upon a time", "max_tokens": 8}]})

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy completions endpoint
    logprobs: int | None = None
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a prompt, or chat messages through the chat template."""

    model_config = _REQUEST_CONFIG

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class RenderedRequest(BaseModel):
    """vLLM's render answer (its `GenerateRequest`): a request as the engine would run it, token ids in."""

    request_id: str
    token_ids: list[int]
    features: None = None  # multimodal placeholders: prompts here are text only
    sampling_params: dict[str, Any]
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


class RenderedRequests(RootModel[list[RenderedRequest]]):
    """The completions render answer: one rendered request per prompt."""


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST_CONFIG

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# A field a reasoning parser sets, left out of answers that have none (as without a parser).
_UNLESS_NONE = Field(default=None, exclude_if=lambda value: value is None)


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = _UNLESS_NONE


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class PromptLogprob(BaseModel):
    """vLLM's `prompt_logprobs` entry of one candidate token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: per prompt token (None for the first), its candidates by token id.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


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
    # The thinking, under the name clients read and under vLLM's newer name (`reasoning_parsers.py`).
    reasoning_content: str | None = _UNLESS_NONE
    reasoning: str | None = _UNLESS_NONE


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


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
    reasoning_content: str | None = _UNLESS_NONE
    reasoning: str | None = _UNLESS_NONE


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


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
    root: str | None = None  # what the served name stands for: the model's path
    parent: str | None = None  # the model an adapter derives from; None for a base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Files and batches (the Batch API): the objects as OpenAI shapes them.


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(**_REQUEST_CONFIG, json_schema_extra={
        "examples": [{"input_file_id": "file-abc", "endpoint": "/v1/chat/completions",
                      "completion_window": "24h"}]})

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


class BatchErrorEntry(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorEntry]


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchInputTokensDetails(BaseModel):
    cached_tokens: int


class BatchOutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: BatchInputTokensDetails
    output_tokens: int
    output_tokens_details: BatchOutputTokensDetails
    total_tokens: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: BatchUsage | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
