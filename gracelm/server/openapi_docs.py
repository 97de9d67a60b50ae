"""What `/openapi.json` says beyond what FastAPI sees by itself: the request body of each generation route
(parsed by the route, not by FastAPI, for its own error messages and JSON-only content types), every
status a route can answer with OpenAI's error body, and the bodies of the probes. The schema is what the
fuzzing test (`tests/test_schema_fuzz.py`) holds the server to: an undocumented status is a failure there.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, RootModel
from pydantic.json_schema import JsonSchemaMode

from gracelm.serving.openai_protocol import ErrorResponse

_REF_TEMPLATE = "#/components/schemas/{model}"

# Every error status the server answers, with OpenAI's error body; a route lists those it can give.
_ERRORS: dict[int, str] = {
    400: "Invalid request: not JSON, a field of the wrong type, a value out of range or over a limit, a "
         "prompt that does not fit the context (`param` names the field); or a `Host` not in "
         "`--allowed-hosts`.",
    401: "Missing or wrong API key (only when the server has one).",
    403: "A browser's request from another site than `--allowed-origins` (`Origin`, `Sec-Fetch-Site`).",
    404: "The `model` asked for is not the one served; the file or batch named does not exist; or (files and "
         "batches) the server keeps no state directory (`--state-dir`).",
    409: "The batch is at its end, or finalizing, and cannot be cancelled; or (`/flush_cache`) requests are "
         "running or waiting, whose blocks the cache would keep.",
    413: "The request body exceeds `--max-request-body-bytes` (a file upload: `--max-upload-bytes`).",
    415: "The body is not declared as JSON (`Content-Type`).",
    429: "The server has enough work: the request would pass `--max-num-queued-reqs` sequences in flight, "
         "or it waited `--max-queue-wait` without starting (then aborted). OpenAI's rate-limit error "
         "(`rate_limit_exceeded`); `Retry-After` says when to retry; the connection stays open.",
    500: "A bug (a generic message and an error id; the details are in the server's log), or the engine "
         "died while serving the request.",
    503: "The server takes no new requests (draining, stopping); `Retry-After` says when to retry. Also a "
         "request aborted by a stop.",
}


# What the guards answer, before any route (`_add_guard_answers`).
_GUARD_STATUSES = (400, 403)


class HealthStatus(BaseModel):
    status: str
    state: str


class Readiness(BaseModel):
    ready: bool
    state: str


class VersionInfo(BaseModel):
    version: str


class ServerInfo(BaseModel):
    """SGLang's `/server_info` (its server arguments and scheduler figures), with the fields sglang-router
    reads and vllm-router's `kv_block_size`."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    is_generation: bool
    architectures: list[str]
    tp_size: int
    dp_size: int
    nnodes: int
    page_size: int  # tokens per KV-cache block
    kv_block_size: int  # the same, under vllm-router's name
    context_length: int
    max_total_num_tokens: int  # the KV cache's size in tokens (SGLang's scheduler figure)
    max_total_tokens: int  # the same, under SGLang's option's name
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    disable_radix_cache: bool
    dtype: str
    kv_cache_dtype: str
    random_seed: int
    disaggregation_mode: str
    version: str


class ModelInfo(BaseModel):
    """SGLang's `/model_info`."""

    model_path: str
    tokenizer_path: str
    is_generation: bool
    architectures: list[str]
    preferred_sampling_params: str | None = None
    weight_version: str
    has_image_understanding: bool
    has_audio_understanding: bool


class RankLoad(BaseModel):
    """SGLang's `/get_load` entry of one data-parallel rank: requests running or waiting, and tokens (those
    the KV cache holds for them, and the waiting requests' own)."""

    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int


class RankLoads(RootModel[list[RankLoad]]):
    """SGLang's `/get_load` answer: an entry per data-parallel rank (one here)."""


class ServerLoad(BaseModel):
    """vLLM's `/load`: the requests the server is handling, admitted and not yet answered."""

    server_load: int


class TokenizerInfo(BaseModel):
    """vLLM's `/tokenizer_info`: the tokenizer as its `tokenizer_config.json` would describe it."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that can answer these error statuses."""
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}


def answers(model: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route answering `model`, or these error statuses."""
    return {200: {"model": model}, **errors(*statuses)}


def plain_text(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route answering plain text (with `response_class=Response`, so that FastAPI
    adds no JSON answer of its own), or these error statuses."""
    return {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **errors(*statuses)}


def probe(model: type[BaseModel], unhealthy: str) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a probe: `model` both as 200 and as 503 (`unhealthy` says when)."""
    return {200: {"model": model}, 503: {"model": model, "description": unhealthy}, **errors(500)}


def generation(answer: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a generation route: `answer` as JSON, or with `stream: true` server-sent events
    whose data are `chunk`s, an error body if the request did not end well, then `[DONE]`."""
    payload = {"anyOf": [_schema(chunk, "serialization"), _schema(ErrorResponse, "serialization")]}
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json", "contentSchema": payload}}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    ok = {"model": answer, "content": {"text/event-stream": {"schema": event}},
          "description": "The answer; with `stream: true`, server-sent events: the chunks, an error body if "
                         "the request did not end well, then `[DONE]`."}
    return {200: ok, **errors(400, 401, 404, 413, 415, 429, 500, 503)}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra=` of a route that parses `model` from its JSON body itself. The nested models'
    schemas go to the schema's components when the app's schema is built (`install_openapi`). A schema takes
    milliseconds to make: the route modules make theirs as module constants, so that they are made when the
    HTTP stack is imported, in a thread beside the engine core's load (`server/api_server.py`), and not while
    the app is built after the core is ready."""
    schema = _schema(model, "validation")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _schema(model: type[BaseModel], mode: JsonSchemaMode) -> dict[str, Any]:
    """`model`'s JSON schema with its nested models as `$defs` that refer to the components (`install_openapi`
    moves them there)."""
    return model.model_json_schema(ref_template=_REF_TEMPLATE, mode=mode)


def install_openapi(app: FastAPI) -> None:
    """Makes the app's OpenAPI schema keep the models nested in the schemas of `json_body` and `generation`
    in its components, where their references point."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = copy.deepcopy(build())  # the routes' own dicts (`openapi_extra`, `responses`) stay whole
            _move_defs(schema["paths"], schema.setdefault("components", {}).setdefault("schemas", {}))
            _add_guard_answers(schema["paths"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema


def _add_guard_answers(paths: dict[str, Any]) -> None:
    """The guards' refusals (`server/guards.py`: a `Host` not allowed, a browser's request from another site)
    come before any route, so every route can answer them."""
    body = {"application/json": {"schema": {"$ref": _REF_TEMPLATE.format(model=ErrorResponse.__name__)}}}
    for operations in paths.values():
        for operation in operations.values():
            for status in _GUARD_STATUSES:
                answer = {"description": _ERRORS[status], "content": body}
                operation["responses"].setdefault(str(status), answer)


def _move_defs(node: Any, components: dict[str, Any]) -> None:
    """Moves every `$defs` under `node` to `components`; a model FastAPI documented already keeps FastAPI's
    schema (the same model)."""
    if isinstance(node, list):
        for item in node:
            _move_defs(item, components)
    elif isinstance(node, dict):
        for name, definition in node.pop("$defs", {}).items():
            components.setdefault(name, definition)
        for value in node.values():
            _move_defs(value, components)
