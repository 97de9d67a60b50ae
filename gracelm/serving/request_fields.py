"""Which request fields this server refuses, and with which values: what a client asks of a field that has no
effect here is answered with a 400 naming the field, never ignored.

A field listed here is refused unless its value asks for nothing (its default or a no-op value, such as
`modalities: ["text"]` or `store: false`). Every field of the request models that is not listed is
honoured (docs/api_fields.md gives the choice for each; tests/test_request_fields.py walks them). Fields
whose work is under way elsewhere (tools) are listed until they are implemented, so that they are refused
rather than silently dropped meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from gracelm.serving.api_errors import APIError


@dataclass(frozen=True)
class Unsupported:
    accepts: Callable[[Any], bool]  # the values that ask for nothing this server lacks
    reason: str


def _unset(value: Any) -> bool:
    return value is None or value in ({}, [], "")


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in values


UNSUPPORTED: dict[str, Unsupported] = {
    # OpenAI's
    "audio": Unsupported(_unset, "audio output is not supported; this server generates text"),
    "modalities": Unsupported(_one_of(["text"]), 'only the "text" modality is supported'),
    "prediction": Unsupported(_unset, "predicted outputs are not supported"),
    "store": Unsupported(_one_of(False), "stored completions are not supported"),
    "service_tier": Unsupported(_one_of("auto", "default"), 'only the "auto" and "default" tiers exist'),
    "verbosity": Unsupported(_unset, "verbosity is not supported"),
    "web_search_options": Unsupported(_unset, "web search is not supported"),
    "moderation": Unsupported(_unset, "moderation is not supported"),
    "prompt_cache_retention": Unsupported(_one_of("in_memory"),
                                          'only "in_memory" retention exists (the prefix cache)'),
    "prompt_cache_options": Unsupported(_unset, "prompt cache options are not supported"),
    "functions": Unsupported(_unset, "functions (deprecated) are not supported; use tools"),
    "function_call": Unsupported(_one_of("none"), "function_call (deprecated) is not supported; use "
                                                  "tool_choice"),
    "suffix": Unsupported(_unset, "suffix (insertion) is not supported"),
    # vLLM's
    "use_beam_search": Unsupported(_one_of(False), "beam search is not supported"),
    "length_penalty": Unsupported(_one_of(1.0), "length_penalty applies to beam search, which is not "
                                                "supported"),
    "mm_processor_kwargs": Unsupported(_unset, "multimodal inputs are not supported"),
    "logits_processors": Unsupported(_unset, "custom logits processors are not supported"),
    "return_token_ids": Unsupported(_one_of(False), "return_token_ids is not supported"),
    "cache_salt": Unsupported(_unset, "cache_salt is not supported"),
    "kv_transfer_params": Unsupported(_unset, "KV transfer (disaggregated serving) is not supported"),
    "vllm_xargs": Unsupported(_unset, "vllm_xargs is not supported"),
    "prompt_embeds": Unsupported(_unset, "prompt embeddings are not supported"),
    # Structured outputs: one backend, and JSON's whitespace is always compact (constraint_fields.py).
    "guided_decoding_backend": Unsupported(_one_of("auto", "guidance", "llguidance"),
                                           "the only structured-output backend is llguidance"),
    "guided_whitespace_pattern": Unsupported(_unset, "guided_whitespace_pattern is not supported: JSON is "
                                                     "generated with compact whitespace"),
}
# Fields of a chat message refused the same way (param `messages.N.field`).
UNSUPPORTED_IN_MESSAGES: dict[str, Unsupported] = {
    "function_call": Unsupported(_unset, "function_call (deprecated) is not supported; use tool_calls"),
    "audio": Unsupported(_unset, "audio is not supported"),
}


def refuse_unsupported(req: BaseModel) -> None:
    """A 400 naming the first field set to a value this server cannot honour."""
    _refuse(req, UNSUPPORTED, "")
    best_of, n = getattr(req, "best_of", None), getattr(req, "n", 1)
    if best_of is not None and best_of != n:
        raise APIError(400, f"best_of is not supported by this server: only best_of equal to n ({n}) is, "
                            f"got {best_of}", param="best_of", code="unsupported_parameter")
    options = getattr(req, "stream_options", None)
    if options is not None and options.include_obfuscation:
        raise APIError(400, "stream_options.include_obfuscation is not supported by this server",
                       param="stream_options.include_obfuscation", code="unsupported_parameter")
    for index, message in enumerate(getattr(req, "messages", None) or []):
        _refuse(message, UNSUPPORTED_IN_MESSAGES, f"messages.{index}.")


def _refuse(model: BaseModel, table: dict[str, Unsupported], prefix: str) -> None:
    for name, rule in table.items():
        if name not in model.model_fields_set:
            continue
        value = getattr(model, name)
        if not rule.accepts(value):
            raise APIError(400, f"{prefix}{name} is not supported by this server: {rule.reason} (got "
                                f"{_short(value)})", param=f"{prefix}{name}", code="unsupported_parameter")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: only the last `keep` tokens of the prompt (-1: of max_model_len)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise APIError(400, f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
                       param="truncate_prompt_tokens", code="invalid_value")
    return ids[-keep:]
