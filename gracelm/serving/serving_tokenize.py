"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt (or chat messages, through the chat template as
`/v1/chat/completions` renders them) to token ids, and token ids back to text; and `GET /tokenizer_info`,
the tokenizer as its `tokenizer_config.json` would describe it."""

from __future__ import annotations

from typing import Any

import pydantic

from gracelm.engine.async_engine import AsyncEngine
from gracelm.model.template_budget import TemplateBudget
from gracelm.serving import chat_prompt
from gracelm.serving.api_errors import APIError, from_validation_error
from gracelm.serving.openai_protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

# The server holds a fast tokenizer's serialization only (`model/tokenizer.py`), not the class transformers
# built it as: the class that serialization loads as.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# An added token's entry in `added_tokens_decoder`, as transformers writes it.
_ADDED_TOKEN_KEYS = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")


async def tokenize(engine: AsyncEngine, req: TokenizeRequest, budget: TemplateBudget | None
                   ) -> TokenizeResponse:
    """`budget`: that of a request's own chat template (`chat_prompt.prompt_ids`)."""
    tokenizer = engine.tokenizer
    max_model_len = engine.config.max_model_len
    assert max_model_len is not None
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt")
    if req.prompt is not None:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        try:  # what a chat request would refuse (no messages, say) is the client's error here too
            chat = ChatCompletionRequest.model_validate(
                {"messages": req.messages, "add_generation_prompt": req.add_generation_prompt,
                 "continue_final_message": req.continue_final_message, "chat_template": req.chat_template,
                 "chat_template_kwargs": req.chat_template_kwargs,
                 "add_special_tokens": bool(req.add_special_tokens)})
        except pydantic.ValidationError as exc:
            raise from_validation_error(exc) from None
        ids = await chat_prompt.prompt_ids(tokenizer, chat, max_model_len, budget=budget)
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=max_model_len, token_strs=strs)


def detokenize(engine: AsyncEngine, req: DetokenizeRequest) -> DetokenizeResponse:
    vocab_size = engine.model_config.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is not in [0, {vocab_size})", param="tokens",
                       code="invalid_value")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))


def tokenizer_info(engine: AsyncEngine) -> dict[str, Any]:
    """vLLM's `tokenizer_info`: `tokenizer_config.json`'s keys for the tokenizer this server encodes with,
    its context being the server's `max_model_len`."""
    tokenizer = engine.tokenizer
    added = {str(token_id): {key: getattr(token, key) for key in _ADDED_TOKEN_KEYS}
             for token_id, token in sorted(tokenizer.backend.get_added_tokens_decoder().items())}
    return {"tokenizer_class": TOKENIZER_CLASS, **tokenizer.special_tokens,
            "chat_template": tokenizer.chat_template, "model_max_length": engine.config.max_model_len,
            "added_tokens_decoder": added}
