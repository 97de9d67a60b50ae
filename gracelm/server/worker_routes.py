"""The routes the field's routers call on each worker they route to, in the shapes of the engines the routers
were written for, so that several gracelm servers can stand behind sglang-router or vllm-router:

- SGLang's `/server_info` and `/model_info` (and their older names `/get_server_info`, `/get_model_info`):
  sglang-router names a worker's model by them (`served_model_name`, else `model_path`) at its start;
  vllm-router reads `kv_block_size` from `/get_server_info` for its KV-aware policy.
- SGLang's `/get_load`, a list with an entry per data-parallel rank, which sglang-router sums (`num_tokens`)
  for its power-of-two policy and its `/get_loads`; vLLM's `/load`.
- vLLM's `/tokenizer_info`, and its render routes (`serving/serving_render.py`), which vllm-router calls
  before each request.
- SGLang's `POST /flush_cache`, which sglang-router and vllm-router send to every worker: it empties the
  prefix cache, refused (409) while requests are unfinished in the engine.
- SGLang's `/health_generate`: a one-token generation through the engine (an embedding model's server:
  the embedding of one token), admitted as any request is (the drain waits for it, a stopping server refuses
  it): 200 when a token (a vector) came, 503 otherwise.

vllm-router 0.1.17 reads `/get_load` in SGLang's former shape (`{"load": N}`), which sglang-router 0.3.2, like
SGLang's servers today, no longer answers; one route cannot answer both, and this one answers SGLang's
current shape. vllm-router shows a load of -1 for such a worker, as it does for vLLM's own servers (which have
no `/get_load`).

Behind `--api-key`, as the `/v1` routes and `/tokenize`: the server and model information (the model's
path, the server's configuration; SGLang keeps them behind its key, and sglang-router sends its key), the
tokenizer's information, the render routes (vllm-router forwards the client's key) and `/flush_cache` (it
changes the server's state). Open, as `/health` and `/metrics`: the loads (figures `/metrics` shows already;
vllm-router asks for them without its key) and `/health_generate` (a probe, which carries no key; SGLang
leaves its `/health*` open too).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.errors import EngineDeadError
from gracelm.lifecycle.server_state import AdmissionRefused, ServerState
from gracelm.sampling_params import SamplingParams
from gracelm.server.openapi_docs import (
    HealthStatus,
    ModelInfo,
    RankLoads,
    ServerInfo,
    ServerLoad,
    TokenizerInfo,
    answers,
    json_body,
    plain_text,
    probe,
)
from gracelm.server.ops_routes import package_version
from gracelm.serving import serving_render, serving_tokenize
from gracelm.serving.api_errors import APIError
from gracelm.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RenderedRequest,
    RenderedRequests,
)
from gracelm.serving.request_client import HttpClient, RequestClient
from gracelm.serving.request_fields import parse_request
from gracelm.serving.serving_base import engine_dead_error
from gracelm.serving.serving_chat import ServingChat
from gracelm.serving.serving_completion import ServingCompletion
from gracelm.serving.serving_options import ServingOptions

# How long `/health_generate` waits for its token, as SGLang's does: a server that cannot give one token in
# this time is not fit to take requests.
HEALTH_GENERATE_TIMEOUT_S = 20.0

# Made at import, while the engine core loads (`openapi_docs.json_body`).
_CHAT_BODY = json_body(ChatCompletionRequest)
_COMPLETION_BODY = json_body(CompletionRequest)


def worker_routers(engine: AsyncEngine, state: ServerState, served: ServingOptions, chat: ServingChat,
                   completion: ServingCompletion, auth: list[Depends]) -> list[APIRouter]:
    """Every route of the routers' worker contract, each router with its API-key choice (above)."""
    return [info_router(engine, served, auth), load_router(engine, state), cache_router(engine, auth),
            health_generate_router(completion), render_router(chat, completion, auth)]


def info_router(engine: AsyncEngine, served: ServingOptions, auth: list[Depends]) -> APIRouter:
    """SGLang's server and model information, and vLLM's tokenizer information."""
    router = APIRouter(dependencies=auth)

    async def server_info() -> dict:
        stats = await _stats(engine)
        return _server_info(engine, served, stats["kv_blocks_total"]).model_dump()

    async def model_info() -> dict:
        return _model_info(engine).model_dump()

    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, server_info, methods=["GET"], responses=answers(ServerInfo, 401, 500))
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info, methods=["GET"], responses=answers(ModelInfo, 401, 500))

    @router.get("/tokenizer_info", responses=answers(TokenizerInfo, 401, 500))
    async def tokenizer_info() -> dict:
        return serving_tokenize.tokenizer_info(engine)

    return router


def load_router(engine: AsyncEngine, state: ServerState) -> APIRouter:
    """SGLang's `/get_load` and vLLM's `/load`, from the engine's and the server's own counts."""
    router = APIRouter()

    @router.get("/get_load", responses=answers(RankLoads, 500))
    async def get_load() -> list[dict]:
        stats = await _stats(engine)
        held = (stats["kv_blocks_total"] - stats["kv_blocks_free"]) * stats["kv_block_size"]
        running, waiting = stats["num_running"], stats["num_waiting"]
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                 "num_tokens": held + stats["num_waiting_tokens"]}]

    @router.get("/load", responses=answers(ServerLoad, 500))
    async def load() -> dict:
        return {"server_load": state.num_active}

    return router


def cache_router(engine: AsyncEngine, auth: list[Depends]) -> APIRouter:
    """SGLang's `POST /flush_cache`."""
    router = APIRouter(dependencies=auth)

    @router.post("/flush_cache", response_class=Response, responses=plain_text(401, 409, 500))
    async def flush_cache() -> Response:
        try:
            result = await engine.reset_prefix_cache()
        except EngineDeadError as exc:
            raise engine_dead_error(exc) from None
        if not result["reset"]:
            raise APIError(409, f"the prefix cache is flushed only when no request is running or waiting: "
                                f"{result['num_unfinished']} are; retry once they end",
                           code="requests_running")
        return Response("Cache flushed.\n", media_type="text/plain")

    return router


def health_generate_router(completion: ServingCompletion) -> APIRouter:
    """SGLang's `/health_generate`."""
    router = APIRouter()
    unhealthy = f"No token: the server takes no requests, or none came in {HEALTH_GENERATE_TIMEOUT_S:g} s."

    @router.get("/health_generate", responses=probe(HealthStatus, unhealthy))
    async def health_generate(raw_request: Request) -> JSONResponse:
        ok = await _generates_a_token(completion, HttpClient(raw_request))
        state = completion.state.lifecycle.value
        return JSONResponse({"status": "ok" if ok else "unhealthy", "state": state},
                            status_code=200 if ok else 503)

    return router


def render_router(chat: ServingChat, completion: ServingCompletion, auth: list[Depends]) -> APIRouter:
    """vLLM's render routes; their bodies are the generation routes' own."""
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    statuses = (400, 401, 404, 413, 415, 500)

    @v1.post("/chat/completions/render", responses=answers(RenderedRequest, *statuses),
             openapi_extra=_CHAT_BODY)
    async def render_chat(raw_request: Request) -> dict:
        req = await parse_request(raw_request, ChatCompletionRequest)
        return (await serving_render.render_chat(chat, req, HttpClient(raw_request))).model_dump()

    @v1.post("/completions/render", responses=answers(RenderedRequests, *statuses),
             openapi_extra=_COMPLETION_BODY)
    async def render_completion(raw_request: Request) -> list:
        req = await parse_request(raw_request, CompletionRequest)
        return (await serving_render.render_completion(completion, req, HttpClient(raw_request))).model_dump()

    return v1


async def _generates_a_token(completion: ServingCompletion, client: RequestClient) -> bool:
    """Whether a one-token request, admitted and run as any completions request is, gives its token within
    `HEALTH_GENERATE_TIMEOUT_S`. Its prompt is token 0, as SGLang's: any id of the vocabulary will do."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    request_id = client.request_id(None, "health")
    embedding = completion.engine.pooling is not None
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            run = await completion.start(client, [[0]], params, request_id, "prompt", api=None,
                                         embedding=embedding)
            final = await completion.final_output(client, run)
    except (APIError, AdmissionRefused, TimeoutError):
        return False
    return any(output.token_ids or output.embedding for output in final.outputs)


def _server_info(engine: AsyncEngine, served: ServingOptions, num_blocks: int) -> ServerInfo:
    config = engine.config
    assert config.max_model_len is not None
    model_path = engine.model_path
    num_tokens = num_blocks * config.block_size
    return ServerInfo(
        model_path=model_path, tokenizer_path=model_path, served_model_name=served.model_name,
        is_generation=engine.pooling is None, architectures=[engine.model_config.architecture],
        tp_size=config.tensor_parallel_size, dp_size=1, nnodes=config.nnodes, page_size=config.block_size,
        kv_block_size=config.block_size, context_length=config.max_model_len, max_total_num_tokens=num_tokens,
        max_total_tokens=num_tokens, max_running_requests=config.max_num_seqs,
        max_prefill_tokens=config.max_num_batched_tokens, chunked_prefill_size=config.max_num_batched_tokens,
        disable_radix_cache=not config.enable_prefix_caching, dtype=config.dtype, kv_cache_dtype="auto",
        random_seed=config.seed, disaggregation_mode="null", version=package_version())


def _model_info(engine: AsyncEngine) -> ModelInfo:
    model_path = engine.model_path
    return ModelInfo(model_path=model_path, tokenizer_path=model_path, is_generation=True,
                     architectures=[engine.model_config.architecture], weight_version="default",
                     has_image_understanding=False, has_audio_understanding=False)


async def _stats(engine: AsyncEngine) -> dict:
    """The engine core's stats; a 500 naming the engine's death when it is gone."""
    try:
        return await engine.stats()
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
