"""The Files and Batches routes of OpenAI's Batch API, in OpenAI's shapes so that the official SDK works
unchanged: `POST/GET /v1/files`, `GET/DELETE /v1/files/{id}`, `GET /v1/files/{id}/content`;
`POST/GET /v1/batches`, `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`.

They read and write the batch journal (`batch/journal.py`, in `--state-dir`) in a worker thread, so that a
commit's fsync never holds the event loop, and wake the runner when a batch is created or cancelled.
Without `--state-dir` there is nowhere durable to keep what they would accept: each answers 404
`state_dir_required`, naming the option (docs/batch.md, "Over HTTP").
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from gracelm.batch.journal import CorruptFileError, Journal, NotCancellable
from gracelm.batch.objects import COMPLETION_WINDOW, COMPLETION_WINDOW_S, ENDPOINTS, INPUT_PURPOSE
from gracelm.batch.runner import BatchRunner
from gracelm.lifecycle.faults import faults
from gracelm.server.openapi_docs import answers, errors, json_body
from gracelm.serving.api_errors import APIError
from gracelm.serving.openai_protocol import (
    BatchCreateRequest,
    BatchList,
    BatchObject,
    FileDeleted,
    FileList,
    FileObject,
)
from gracelm.serving.request_fields import parse_request

# OpenAI's bounds on a batch's metadata.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
_CONTENT = {200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                  "description": "The file's bytes."}, **errors(401, 404, 500)}

# Made at import, while the engine core loads (`openapi_docs.json_body`).
_CREATE_BODY = json_body(BatchCreateRequest)


def batch_router(journal: Journal | None, runner: BatchRunner | None) -> APIRouter:
    """The routes, to be included under `/v1` (with its API key); `journal` None: no `--state-dir`."""
    router = APIRouter()
    store = _Store(journal)

    @router.post("/files", responses=answers(FileObject, 400, 401, 404, 413, 500))
    async def upload_file(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> dict:
        if purpose != INPUT_PURPOSE:
            raise APIError(400, f"this server keeps files for batches only: purpose must be "
                                f"{INPUT_PURPOSE!r}, got {purpose!r}", param="purpose", code="invalid_value")
        # Spooled to disk by the form parser beyond 1 MB: streamed into the journal from there.
        record = await store.call(Journal.add_file, file.filename or "upload.jsonl", purpose, file.file)
        return record.to_openai()

    @router.get("/files", responses=answers(FileList, 400, 401, 404, 500))
    async def list_files(purpose: str | None = None, limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
                         order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
                         after: str | None = None) -> dict:
        records, more = await store.call(Journal.list_files, purpose, after, limit, order == "desc")
        return _page([r.to_openai() for r in records], more)

    @router.get("/files/{file_id}", responses=answers(FileObject, 401, 404, 500))
    async def retrieve_file(file_id: str) -> dict:
        return _found(await store.call(Journal.get_file, file_id), "File", file_id).to_openai()

    @router.delete("/files/{file_id}", responses=answers(FileDeleted, 401, 404, 500))
    async def delete_file(file_id: str) -> dict:
        _found(await store.call(Journal.delete_file, file_id) or None, "File", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @router.get("/files/{file_id}/content", response_class=Response, responses=_CONTENT)
    async def file_content(file_id: str) -> Response:
        try:
            content = await store.call(Journal.file_content, file_id)
        except CorruptFileError as exc:
            raise APIError(500, f"{exc}; the file is damaged and cannot be served", code="file_corrupted") \
                from None
        return Response(_found(content, "File", file_id), media_type="application/octet-stream")

    @router.post("/batches", responses=answers(BatchObject, 400, 401, 404, 413, 415, 500),
                 openapi_extra=_CREATE_BODY)
    async def create_batch(raw_request: Request) -> dict:
        req = await parse_request(raw_request, BatchCreateRequest)
        _check_batch_request(req)
        file = _found(await store.call(Journal.get_file, req.input_file_id), "File", req.input_file_id,
                      param="input_file_id")
        if file.purpose != INPUT_PURPOSE:
            raise APIError(400, f"the file {file.id} has purpose {file.purpose!r}; a batch's input must have "
                                f"purpose {INPUT_PURPOSE!r}", param="input_file_id", code="invalid_value")
        window_s = faults().completion_window_s(COMPLETION_WINDOW_S)
        batch = await store.call(Journal.create_batch, req.input_file_id, req.endpoint, req.completion_window,
                                 window_s, req.metadata)
        assert runner is not None
        runner.wake()
        return batch.to_openai()

    @router.get("/batches", responses=answers(BatchList, 400, 401, 404, 500))
    async def list_batches(after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict:
        records, more = await store.call(Journal.list_batches, after, limit)
        return _page([r.to_openai() for r in records], more)

    @router.get("/batches/{batch_id}", responses=answers(BatchObject, 401, 404, 500))
    async def retrieve_batch(batch_id: str) -> dict:
        return _found(await store.call(Journal.get_batch, batch_id), "Batch", batch_id).to_openai()

    @router.post("/batches/{batch_id}/cancel", responses=answers(BatchObject, 401, 404, 409, 500))
    async def cancel_batch(batch_id: str) -> dict:
        try:
            batch = await store.call(Journal.request_cancel, batch_id)
        except NotCancellable as exc:
            raise APIError(409, str(exc), code="batch_not_cancellable") from None
        assert runner is not None
        runner.wake()
        return _found(batch, "Batch", batch_id).to_openai()

    return router


class _Store:
    """The journal's calls, each in a worker thread; without a journal every call is the 404 that names
    `--state-dir`."""

    def __init__(self, journal: Journal | None) -> None:
        self._journal = journal

    async def call(self, method, *args: Any) -> Any:
        if self._journal is None:
            raise APIError(404, "files and batches are kept in the server's state directory: start the "
                                "server with --state-dir DIR to use them", code="state_dir_required")
        return await asyncio.to_thread(method, self._journal, *args)


def _check_batch_request(req: BatchCreateRequest) -> None:
    if req.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {req.endpoint!r}",
                       param="endpoint", code="invalid_value")
    if req.completion_window != COMPLETION_WINDOW:
        raise APIError(400, f"completion_window must be {COMPLETION_WINDOW!r}, got {req.completion_window!r}",
                       param="completion_window", code="invalid_value")
    if req.output_expires_after is not None:
        raise APIError(400, "output_expires_after is not supported by this server: output files are kept "
                            "until deleted", param="output_expires_after", code="unsupported_parameter")
    metadata = req.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                                                  for k, v in metadata.items()):
        raise APIError(400, f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                            f"{MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}",
                       param="metadata", code="invalid_value")


def _found(value: Any, kind: str, object_id: str, param: str = "id") -> Any:
    if value is None:
        raise APIError(404, f"No such {kind} object: {object_id}", param=param, code="not_found")
    return value


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
