"""The Embeddings API's route, included under `/v1` behind the API key: `POST /v1/embeddings`, served by
`serving/serving_embedding.py` on a server of an embedding model (`--task embed`; a generation model answers
a 400 naming `model`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.params import Depends

from gracelm.server.openapi_docs import answers, json_body
from gracelm.serving.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from gracelm.serving.request_client import HttpClient
from gracelm.serving.request_fields import parse_request
from gracelm.serving.serving_embedding import ServingEmbedding

# Made at import, while the engine core loads (`openapi_docs.json_body`).
_BODY = json_body(EmbeddingRequest)


def embeddings_router(embedding: ServingEmbedding, auth: list[Depends]) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=auth)

    @router.post("/embeddings", responses=answers(EmbeddingResponse, 400, 401, 404, 413, 415, 429, 500, 503),
                 openapi_extra=_BODY)
    async def create_embeddings(raw_request: Request) -> dict:
        req = await parse_request(raw_request, EmbeddingRequest)
        return (await embedding.create(req, HttpClient(raw_request))).model_dump()

    return router
