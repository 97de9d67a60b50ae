"""vLLM's render routes, `POST /v1/chat/completions/render` and `POST /v1/completions/render`: a request
checked and turned into what the engine would run (its prompt's token ids after the chat template, its
sampling), answered without running it, in vLLM's shape (`RenderedRequest`, vLLM's `GenerateRequest`).

vllm-router renders every request on its workers before it picks one (its cache-aware policy matches the
token ids), and tokenizes it through `/tokenize` where rendering fails. The body goes through the chat and
completions endpoints' own planning (`ServingChat.plan`, `ServingCompletion.plan`) and each prompt through
the engine's one check (`check_prompt`), so a render is refused exactly where the generation would be.
"""

from __future__ import annotations

import msgspec

from gracelm.engine.frontend import PromptError, check_prompt
from gracelm.sampling_params import SamplingParams
from gracelm.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RenderedRequest,
    RenderedRequests,
    SamplingFields,
)
from gracelm.serving.request_client import RequestClient
from gracelm.serving.serving_base import ServingBase, prompt_error, prompt_ids_named
from gracelm.serving.serving_chat import ServingChat
from gracelm.serving.serving_completion import ServingCompletion


async def render_chat(chat: ServingChat, req: ChatCompletionRequest,
                      client: RequestClient) -> RenderedRequest:
    """The chat request `req` as it would run; raises `APIError` where the generation would."""
    plan = await chat.plan(req)
    request_id = client.request_id(req.named_id, "chatcmpl")
    return _rendered(chat, req, [plan.prompt_ids], plan.params, request_id, "messages")[0]


async def render_completion(completion: ServingCompletion, req: CompletionRequest,
                            client: RequestClient) -> RenderedRequests:
    """The completions request `req` as it would run, a rendered request per prompt; raises `APIError` where
    the generation would."""
    plan = await completion.plan(req)
    request_id = client.request_id(req.named_id, "cmpl")
    return RenderedRequests(_rendered(completion, req, plan.prompts, plan.params, request_id, "prompt"))


def _rendered(serving: ServingBase, req: SamplingFields, prompts: list[list[int]], params: SamplingParams,
              request_id: str, prompt_param: str) -> list[RenderedRequest]:
    engine = serving.engine
    assert engine.config.max_model_len is not None
    # Every field, defaults included, as vLLM writes its sampling parameters.
    sampling = msgspec.to_builtins(msgspec.structs.asdict(params), str_keys=True)
    rendered = []
    for index, (engine_id, ids) in enumerate(zip(prompt_ids_named(request_id, len(prompts)), prompts,
                                                 strict=True)):
        try:
            check_prompt(ids, engine.config.max_model_len, engine.model_config.vocab_size, params.max_tokens)
        except PromptError as exc:
            raise prompt_error(exc, prompt_param, index, len(prompts)) from None
        rendered.append(RenderedRequest(
            request_id=engine_id, token_ids=ids, sampling_params=sampling, model=serving.model_name,
            stream=req.stream, stream_options=req.stream_options, cache_salt=req.cache_salt,
            priority=req.priority, kv_transfer_params=req.kv_transfer_params))
    return rendered
