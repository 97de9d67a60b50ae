"""The Responses API's routes, included under `/v1` (behind its API key): `POST /v1/responses` (served by
`serving/serving_responses.py`), and for stored responses `GET` and `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items` and `POST /v1/responses/{id}/cancel`.

Stored responses live in the state directory's journal (`serving/response_store.py`); its reads and writes
run in a worker thread. Without `--state-dir` nothing is stored, so every id is unknown (404). Only a
background response can be cancelled, while it runs; any other answers OpenAI's 400.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from gracelm.batch.journal import Journal
from gracelm.options import duration_s
from gracelm.server.openapi_docs import answers, errors, json_body
from gracelm.serving.request_client import HttpClient
from gracelm.serving.request_fields import parse_request
from gracelm.serving.response_store import ResponseStore
from gracelm.serving.responses_protocol import (
    InputItemList,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from gracelm.serving.server_config import ServerConfig
from gracelm.serving.serving_chat import ServingChat
from gracelm.serving.serving_responses import ServingResponses

# A streamed response: OpenAI's typed events, each `event: TYPE` and `data: JSON` (docs/responses.md).
_EVENTS = {"type": "object", "required": ["event", "data"],
           "properties": {"event": {"type": "string"},
                          "data": {"type": "string", "contentMediaType": "application/json"}}}
_CREATED = {200: {"model": ResponseObject, "content": {"text/event-stream": {"schema": _EVENTS}},
                  "description": "The response; with `stream: true`, server-sent events: OpenAI's event "
                                 "sequence, ended by `response.completed`, `response.incomplete` or "
                                 "`response.failed`."},
            **errors(400, 401, 404, 413, 415, 429, 500, 503)}

# Made at import, while the engine core loads (`openapi_docs.json_body`).
_BODY = json_body(ResponsesRequest)


def responses_router(chat: ServingChat, journal: Journal | None, settings: ServerConfig) -> APIRouter:
    """The routes over `journal` (None: no `--state-dir`; nothing stored), bounded as `settings` say."""
    max_age_s = duration_s(settings.stored_response_max_age)
    store = ResponseStore(journal, settings.max_stored_responses, max_age_s)
    if store.enabled:  # at the start, before any request
        store.settle()
        store.prune()
    serving = ServingResponses(chat, store)
    router = APIRouter()

    @router.post("/responses", responses=_CREATED, openapi_extra=_BODY)
    async def create_response(raw_request: Request) -> Response:
        req = await parse_request(raw_request, ResponsesRequest)
        answer = await serving.create(req, HttpClient(raw_request))
        return answer if isinstance(answer, Response) else JSONResponse(answer.model_dump())

    @router.get("/responses/{response_id}", responses=answers(ResponseObject, 401, 404, 500))
    async def retrieve_response(response_id: str) -> dict:
        return (await serving.stored(response_id)).response

    @router.delete("/responses/{response_id}", responses=answers(ResponseDeleted, 401, 404, 500))
    async def delete_response(response_id: str) -> dict:
        await serving.delete(response_id)
        return ResponseDeleted(id=response_id).model_dump()

    @router.get("/responses/{response_id}/input_items", responses=answers(InputItemList, 400, 401, 404, 500))
    async def input_items(response_id: str, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                          order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
                          after: str | None = None) -> dict:
        stored = await serving.stored(response_id)
        return _page(stored.input_items, limit, order == "desc", after)

    @router.post("/responses/{response_id}/cancel", responses=answers(ResponseObject, 400, 401, 404, 500))
    async def cancel_response(response_id: str) -> dict:
        return await serving.cancel(response_id)

    return router


def _page(items: list[dict[str, Any]], limit: int, newest_first: bool, after: str | None) -> dict:
    """A page of a response's input items, each with its place as its id where it came without one."""
    listed = [_listed(item, index) for index, item in enumerate(items)]
    if newest_first:
        listed.reverse()
    if after is not None:
        ids = [item["id"] for item in listed]
        listed = listed[ids.index(after) + 1:] if after in ids else []
    page = listed[:limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=len(listed) > limit).model_dump()


def _listed(item: dict[str, Any], index: int) -> dict[str, Any]:
    """An input item as OpenAI lists it: an id (its place, where it came without one), and a message's text
    as a content part."""
    listed = {**item, "id": item.get("id") or f"item_{index}"}
    if item.get("type", "message") == "message" and isinstance(item.get("content"), str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        listed.update(type="message", content=[{"type": kind, "text": item["content"]}])
    return listed
