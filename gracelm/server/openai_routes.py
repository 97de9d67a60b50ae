"""The OpenAI-compatible routes behind the API key: `/v1/models`, `/v1/chat/completions`, `/v1/completions`
(the Batch API's `/v1/files` and `/v1/batches` join them from `batch_routes.py`), and vLLM's `/tokenize` and
`/detokenize`, which vLLM serves outside `/v1`. Each route reads its body (`parse_request`: a 400, 413 or
415 before any work) and hands it to its serving object (`serving/`)."""

from __future__ import annotations

import pydantic
from fastapi import APIRouter, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from gracelm.engine.async_engine import AsyncEngine
from gracelm.server.openapi_docs import answers, generation, json_body
from gracelm.serving import serving_tokenize
from gracelm.serving.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from gracelm.serving.request_client import HttpClient
from gracelm.serving.request_fields import parse_request
from gracelm.serving.serving_chat import ServingChat
from gracelm.serving.serving_completion import ServingCompletion
from gracelm.serving.serving_options import ServingOptions

# Made at import, while the engine core loads (`openapi_docs.json_body`).
_CHAT_ANSWERS = generation(ChatCompletionResponse, ChatCompletionChunk)
_CHAT_BODY = json_body(ChatCompletionRequest)
_COMPLETION_ANSWERS = generation(CompletionResponse, CompletionResponse)
_COMPLETION_BODY = json_body(CompletionRequest)
_TOKENIZE_BODY = json_body(TokenizeRequest)
_DETOKENIZE_BODY = json_body(DetokenizeRequest)


def openai_router(engine: AsyncEngine, served: ServingOptions, chat: ServingChat,
                  completion: ServingCompletion, auth: list[Depends]) -> APIRouter:
    """`/v1/models`, `/v1/chat/completions` and `/v1/completions`."""
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    # What each served name stands for (vLLM's root: the model's path; no adapters, so no parent).
    card_fields = {"max_model_len": engine.config.max_model_len,
                   "root": engine.model_path}

    @v1.get("/models", responses=answers(ModelList, 401, 500))
    async def models() -> dict:
        cards = [ModelCard(id=name, **card_fields) for name in served.model_names]
        return ModelList(data=cards).model_dump()

    @v1.post("/chat/completions", responses=_CHAT_ANSWERS, openapi_extra=_CHAT_BODY)
    async def chat_completions(raw_request: Request) -> Response:
        req = await parse_request(raw_request, ChatCompletionRequest)
        return _answer(await chat.create(req, HttpClient(raw_request)))

    @v1.post("/completions", responses=_COMPLETION_ANSWERS, openapi_extra=_COMPLETION_BODY)
    async def completions(raw_request: Request) -> Response:
        req = await parse_request(raw_request, CompletionRequest)
        return _answer(await completion.create(req, HttpClient(raw_request)))

    return v1


def tokens_router(engine: AsyncEngine, served: ServingOptions, chat: ServingChat,
                  auth: list[Depends]) -> APIRouter:
    """vLLM's `/tokenize` and `/detokenize`."""
    tokens = APIRouter(dependencies=auth)

    @tokens.post("/tokenize", responses=answers(TokenizeResponse, 400, 401, 404, 413, 415, 500),
                 openapi_extra=_TOKENIZE_BODY)
    async def tokenize(raw_request: Request) -> dict:
        req = await parse_request(raw_request, TokenizeRequest)
        chat.check_model(req.model)
        answer = await serving_tokenize.tokenize(engine, req, served.template_budget)
        return answer.model_dump(exclude_none=True)

    @tokens.post("/detokenize", responses=answers(DetokenizeResponse, 400, 401, 404, 413, 415, 500),
                 openapi_extra=_DETOKENIZE_BODY)
    async def detokenize(raw_request: Request) -> dict:
        req = await parse_request(raw_request, DetokenizeRequest)
        chat.check_model(req.model)
        return serving_tokenize.detokenize(engine, req).model_dump()

    return tokens


def _answer(answer: pydantic.BaseModel | Response) -> Response:
    """A generation route's response: the whole answer as JSON, or the SSE response as it is."""
    return answer if isinstance(answer, Response) else JSONResponse(answer.model_dump())
