"""What `/openapi.json` says beyond what FastAPI sees by itself: the request body of each generation route
(parsed by the route, not by FastAPI, for its own error messages and JSON-only content types), every
status a route can answer with OpenAI's error body, and the bodies of the probes. The schema is what the
fuzzing test (`tests/test_schema_fuzz.py`) holds the server to: an undocumented status is a failure there.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from gracelm.entrypoints.openai_protocol import ErrorResponse

_REF_TEMPLATE = "#/components/schemas/{model}"

# Every error status the server answers, with OpenAI's error body; a route lists those it can give.
_ERRORS: dict[int, str] = {
    400: "Invalid request: not JSON, a field of the wrong type, a value out of range or over a limit, a "
         "prompt that does not fit the context (`param` names the field).",
    401: "Missing or wrong API key (only when the server has one).",
    404: "The `model` asked for is not the one served.",
    413: "The request body exceeds `--max-request-body-bytes`.",
    415: "The body is not declared as JSON (`Content-Type`).",
    500: "A bug (a generic message and an error id; the details are in the server's log), or the engine "
         "died while serving the request.",
    503: "The server takes no new requests (draining, stopping) or too many wait to start "
         "(`--max-waiting-requests`); `Retry-After` says when to retry. Also a request aborted by a stop.",
}


class HealthStatus(BaseModel):
    status: str
    state: str


class Readiness(BaseModel):
    ready: bool
    state: str


class VersionInfo(BaseModel):
    version: str


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


def generation(answer: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a generation route: `answer` as JSON, or SSE chunks when `stream` is true."""
    ok = {"model": answer, "description": "The answer; with `stream: true`, server-sent events of chunks, "
                                          "then `data: [DONE]`.",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {200: ok, **errors(400, 401, 404, 413, 415, 500, 503)}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra=` of a route that parses `model` from its JSON body itself. The nested models'
    schemas go to the schema's components when the app's schema is built (`install_openapi`)."""
    schema = model.model_json_schema(ref_template=_REF_TEMPLATE)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI) -> None:
    """Makes the app's OpenAPI schema keep the models nested in `json_body` bodies in its components, where
    their references point."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path in schema["paths"].values():
                for operation in path.values():
                    content = operation.get("requestBody", {}).get("content", {})
                    for media in content.values():
                        media["schema"] = dict(media["schema"])  # the route's own dict stays whole
                        components.update(media["schema"].pop("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
