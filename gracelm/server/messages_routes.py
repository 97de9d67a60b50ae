"""Anthropic's Messages API behind the API key (`Authorization: Bearer` or `x-api-key`): `POST /v1/messages`
and `POST /v1/messages/count_tokens` (`serving/serving_messages.py`). Errors on these paths leave in
Anthropic's shape (`serving/api_errors.py:error_shape`).

Headers: `anthropic-version` is taken at any value (the SDKs always send one; there is one version of this
API here). Each feature `anthropic-beta` names must be one this server does as asked
(`messages_protocol.ACCEPTED_BETAS`); any other is refused with a 400 naming the header."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from gracelm.server.openapi_docs import json_body
from gracelm.serving.api_errors import APIError
from gracelm.serving.messages_protocol import (
    ACCEPTED_BETAS,
    CountTokensRequest,
    CountTokensResponse,
    ErrorEvent,
    MessagesRequest,
    MessagesResponse,
)
from gracelm.serving.request_client import HttpClient
from gracelm.serving.request_fields import parse_request
from gracelm.serving.serving_chat import ServingChat
from gracelm.serving.serving_messages import ServingMessages

BETA_HEADER = "anthropic-beta"

# Every error status these routes answer, in Anthropic's shape (`ErrorEvent`).
_ERRORS = {
    400: "Invalid request (`invalid_request_error`): not JSON, a field of the wrong type or refused (the "
         "message names it), an `anthropic-beta` feature not supported, a prompt that does not fit.",
    401: "Missing or wrong API key (`authentication_error`; only when the server has one).",
    403: "A browser's request from another site than `--allowed-origins` (`permission_error`).",
    404: "The `model` asked for is not served (`not_found_error`).",
    413: "The request body exceeds `--max-request-body-bytes` (`request_too_large`).",
    415: "The body is not declared as JSON (`invalid_request_error`).",
    429: "The server has enough work (`rate_limit_error`); `Retry-After` says when to retry.",
    500: "A bug, or the engine failed (`api_error`).",
    503: "The server takes no new requests (draining, stopping), or it aborted the request "
         "(`overloaded_error`); `Retry-After` says when to retry.",
}

# Made at import, while the engine core loads (`openapi_docs.json_body`).
_MESSAGES_BODY = json_body(MessagesRequest)
_COUNT_BODY = json_body(CountTokensRequest)


def messages_router(chat: ServingChat, auth: list[Depends]) -> APIRouter:
    """The two routes, over the chat endpoint's planning."""
    messages = ServingMessages(chat)
    router = APIRouter(prefix="/v1", dependencies=[*auth, Depends(check_betas)])

    @router.post("/messages", responses=_answers(MessagesResponse, stream=True), openapi_extra=_MESSAGES_BODY)
    async def create_message(raw_request: Request) -> Response:
        req = await parse_request(raw_request, MessagesRequest)
        answer = await messages.create(req, HttpClient(raw_request))
        return answer if isinstance(answer, Response) else JSONResponse(answer.model_dump())

    @router.post("/messages/count_tokens", responses=_answers(CountTokensResponse, stream=False),
                 openapi_extra=_COUNT_BODY)
    async def count_tokens(raw_request: Request) -> dict:
        req = await parse_request(raw_request, CountTokensRequest)
        return (await messages.count_tokens(req)).model_dump()

    return router


def check_betas(request: Request) -> None:
    """A 400 naming `anthropic-beta` for a feature this server does not do as asked, in Anthropic's own
    words (which clients recognise), then what is supported and how Claude Code leaves its betas out."""
    for header in request.headers.getlist(BETA_HEADER):
        for name in (part.strip() for part in header.split(",")):
            if name and name not in ACCEPTED_BETAS:
                accepted = ", ".join(ACCEPTED_BETAS)
                raise APIError(400, f"Unexpected value(s) `{name}` for the `{BETA_HEADER}` header: this "
                                    f"server does not support that beta feature (supported: {accepted}); "
                                    f"Claude Code sends none of its experimental ones with "
                                    f"CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS=1", param=BETA_HEADER,
                               code="unsupported_parameter")


def _answers(model: type, *, stream: bool) -> dict[int | str, dict[str, Any]]:
    ok: dict[str, Any] = {"model": model}
    if stream:
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
        ok["description"] = ("The message; with `stream: true`, server-sent events (`event: <type>`): "
                             "message_start, each content block's content_block_start, content_block_delta "
                             "and content_block_stop, message_delta and message_stop; or an `error` event "
                             "if the request did not end well.")
    errors = {status: {"model": ErrorEvent, "description": text} for status, text in _ERRORS.items()}
    return {200: ok, **errors}
