"""What a request's fields may ask, checked before it runs; each refusal is a 400 naming the field.

A body is read into its request model one way, by every route and every batch line (`parse_request`,
`parse_body`): a 400 naming the offending field (`from_validation_error`), and a body not declared as JSON
refused.

Fields this server lacks: a field listed in `UNSUPPORTED` is refused unless its value asks for nothing (its
default or a no-op value, such as `modalities: ["text"]` or `store: false`). Every field of the request
models that is not listed is honoured (docs/api_fields.md gives the choice for each;
tests/test_request_fields.py walks them). Fields whose work is under way elsewhere are listed until they are
implemented, so that they are refused rather than silently dropped meanwhile.

Fields that constrain tokens (`constraint_fields`), read into `SamplingParams`' terms: OpenAI's
`response_format` and `logit_bias`, vLLM's `structured_outputs`, `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, `allowed_token_ids` and `bad_words`, SGLang's `json_schema` / `regex` /
`ebnf`. At most one structured-output
constraint per request; `constraint_fields` names the field it came from, and the request's route has it
compiled (`grammar_checker.py`, off this process) before the request is admitted, so that a schema or
grammar the engine could not follow is a 400 naming its field instead of a failed request later.
Whitespace in generated JSON is always compact (`", "`, `": "`), so `disable_any_whitespace` may only be
true (and `guided_whitespace_pattern` and any `guided_decoding_backend` but llguidance are refused).

What one request may cost (`RequestLimits`), beyond what `SamplingParams` bounds for every engine (`n` ≤ 128,
`logprobs` ≤ 20) and the body size (`--max-request-body-bytes`): its stop strings, in number and in total
length, each refusal naming the option that sets the limit. Stop strings are matched in the server's event
loop for each of the `n` completions after each token. The matching reads each new character once whatever
the stop strings are (`engine/detokenizer.py`), but building their automaton, and keeping it, grows with
their total length.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from pydantic import BaseModel

from gracelm.serving.api_errors import APIError, from_validation_error
from gracelm.serving.openai_protocol import SamplingFields
from gracelm.structured_output import StructuredOutputs

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


def parse_body(body: bytes | str, model: type[ModelT]) -> ModelT:
    """`model` read from a JSON body, or the 400 that names what is wrong with it."""
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


async def parse_request(raw_request: Request, model: type[ModelT]) -> ModelT:
    """`model` read from the body of an HTTP request declared as JSON."""
    _check_json_content_type(raw_request.headers.get("content-type"))
    return parse_body(await raw_request.body(), model)


def _check_json_content_type(content_type: str | None) -> None:
    """A body is read as JSON only when it says it is JSON: a web page may send `text/plain`, a form, or a
    body of no declared type (a `Blob`) to a localhost server without asking it first (no CORS preflight),
    never `application/json`, so anything else is refused instead of obeyed (`guards.py`)."""
    if content_type is None:
        raise APIError(415, "the request body must be JSON (Content-Type: application/json); the request "
                            "declares no Content-Type", param="Content-Type", code="unsupported_media_type")
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got "
                            f"Content-Type: {content_type}", param="Content-Type",
                       code="unsupported_media_type")


@dataclass(frozen=True)
class Unsupported:
    accepts: Callable[[Any], bool]  # the values that ask for nothing this server lacks
    reason: str


def unset(value: Any) -> bool:
    return value is None or value in ({}, [], "")


def one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in values


UNSUPPORTED: dict[str, Unsupported] = {
    # OpenAI's
    "audio": Unsupported(unset, "audio output is not supported; this server generates text"),
    "modalities": Unsupported(one_of(["text"]), 'only the "text" modality is supported'),
    "prediction": Unsupported(unset, "predicted outputs are not supported"),
    "store": Unsupported(one_of(False), "stored completions are not supported"),
    "service_tier": Unsupported(one_of("auto", "default"), 'only the "auto" and "default" tiers exist'),
    "verbosity": Unsupported(unset, "verbosity is not supported"),
    "web_search_options": Unsupported(unset, "web search is not supported"),
    "moderation": Unsupported(unset, "moderation is not supported"),
    "prompt_cache_retention": Unsupported(one_of("in_memory"),
                                          'only "in_memory" retention exists (the prefix cache)'),
    "prompt_cache_options": Unsupported(unset, "prompt cache options are not supported"),
    "functions": Unsupported(unset, "functions (deprecated) are not supported; use tools"),
    "function_call": Unsupported(one_of("none"), "function_call (deprecated) is not supported; use "
                                                  "tool_choice"),
    "suffix": Unsupported(unset, "suffix (insertion) is not supported"),
    # vLLM's
    "use_beam_search": Unsupported(one_of(False), "beam search is not supported"),
    "length_penalty": Unsupported(one_of(1.0), "length_penalty applies to beam search, which is not "
                                                "supported"),
    "mm_processor_kwargs": Unsupported(unset, "multimodal inputs are not supported"),
    "logits_processors": Unsupported(unset, "custom logits processors are not supported"),
    "return_token_ids": Unsupported(one_of(False), "return_token_ids is not supported"),
    "cache_salt": Unsupported(unset, "cache_salt is not supported"),
    "kv_transfer_params": Unsupported(unset, "KV transfer (disaggregated serving) is not supported"),
    "vllm_xargs": Unsupported(unset, "vllm_xargs is not supported"),
    "prompt_embeds": Unsupported(unset, "prompt embeddings are not supported"),
    "media_io_kwargs": Unsupported(unset, "multimodal inputs are not supported"),
    # SGLang's (vllm-router and sglang-router add several at their defaults to every body they forward)
    "stop_regex": Unsupported(unset, "stop_regex is not supported; use stop"),
    "return_hidden_states": Unsupported(one_of(False), "hidden states are not returned"),
    "return_routed_experts": Unsupported(one_of(False), "this server serves no mixture-of-experts model"),
    "return_cached_tokens_details": Unsupported(one_of(False), "return_cached_tokens_details is not "
                                                                "supported"),
    "return_prompt_token_ids": Unsupported(one_of(False), "return_prompt_token_ids is not supported"),
    "return_meta_info": Unsupported(one_of(False), "return_meta_info is not supported"),
    "lora_path": Unsupported(unset, "LoRA adapters are not supported"),
    "session_id": Unsupported(unset, "sessions are not supported"),
    "session_params": Unsupported(unset, "sessions are not supported"),
    "custom_logit_processor": Unsupported(unset, "custom logits processors are not supported"),
    "custom_params": Unsupported(unset, "custom_params (for custom logits processors) is not supported"),
    "images_config": Unsupported(unset, "multimodal inputs are not supported"),
    "max_dynamic_patch": Unsupported(unset, "multimodal inputs are not supported"),
    "min_dynamic_patch": Unsupported(unset, "multimodal inputs are not supported"),
    "use_audio_in_video": Unsupported(one_of(False), "multimodal inputs are not supported"),
    "input_ids": Unsupported(unset, "input_ids is not supported; send messages, or a prompt of token ids "
                                     "to /v1/completions"),
    "task": Unsupported(unset, "task (DeepSeek-V4's quick instructions) is not supported"),
    "extra_key": Unsupported(unset, "extra_key is not supported"),
    "ngram_corpus_id": Unsupported(unset, "n-gram speculation corpora are not supported"),
    "custom_labels": Unsupported(unset, "custom metric labels are not supported"),
    "bootstrap_host": Unsupported(unset, "prefill-decode disaggregation is not supported"),
    "bootstrap_port": Unsupported(unset, "prefill-decode disaggregation is not supported"),
    "bootstrap_room": Unsupported(unset, "prefill-decode disaggregation is not supported"),
    "disagg_prefill_dp_rank": Unsupported(unset, "prefill-decode disaggregation is not supported"),
    # One data-parallel rank: 0 is where every request runs anyway.
    "routed_dp_rank": Unsupported(one_of(0), "this server has one data-parallel rank, 0"),
    "data_parallel_rank": Unsupported(one_of(0), "this server has one data-parallel rank, 0"),
    # Structured outputs: one backend, and JSON's whitespace is always compact (`constraint_fields`).
    "guided_decoding_backend": Unsupported(one_of("auto", "guidance", "llguidance"),
                                           "the only structured-output backend is llguidance"),
    "guided_whitespace_pattern": Unsupported(unset, "guided_whitespace_pattern is not supported: JSON is "
                                                     "generated with compact whitespace"),
}
# Fields of a chat message refused the same way (param `messages.N.field`).
UNSUPPORTED_IN_MESSAGES: dict[str, Unsupported] = {
    "function_call": Unsupported(unset, "function_call (deprecated) is not supported; use tool_calls"),
    "audio": Unsupported(unset, "audio is not supported"),
}


def refuse_unsupported(req: BaseModel) -> None:
    """A 400 naming the first field set to a value this server cannot honour."""
    refuse_fields(req, UNSUPPORTED, "")
    best_of, n = getattr(req, "best_of", None), getattr(req, "n", 1)
    if best_of is not None and best_of != n:
        raise APIError(400, f"best_of is not supported by this server: only best_of equal to n ({n}) is, "
                            f"got {best_of}", param="best_of", code="unsupported_parameter")
    options = getattr(req, "stream_options", None)
    if options is not None and options.include_obfuscation:
        raise APIError(400, "stream_options.include_obfuscation is not supported by this server",
                       param="stream_options.include_obfuscation", code="unsupported_parameter")
    for index, message in enumerate(getattr(req, "messages", None) or []):
        refuse_fields(message, UNSUPPORTED_IN_MESSAGES, f"messages.{index}.")
    named, rid = getattr(req, "request_id", None), getattr(req, "rid", None)
    if named is not None and rid is not None and named != rid:
        raise APIError(400, f"rid ({rid!r}) and request_id ({named!r}) name the request twice, "
                            f"differently; send one", param="rid", code="invalid_value")


def refuse_fields(model: BaseModel, table: dict[str, Unsupported], prefix: str) -> None:
    """A 400 naming the first field of `model` listed in `table` whose value it does not accept (`prefix`:
    where the model sits in the body); each API's request refuses its fields through this."""
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


# vLLM's `structured_outputs` keys this server follows: one constraint, and options that ask for what it
# does anyway (no fallback to another backend exists; whitespace is never free).
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_NO_OP_OPTIONS = {"disable_fallback": (True, False), "disable_any_whitespace": (True,)}


def constraint_fields(req: SamplingFields, vocab_size: int) -> tuple[dict[str, Any], str | None]:
    """`SamplingParams` keyword arguments for the request's token constraints (only those it sets), and the
    field that set its structured-output constraint, if any (its grammar is still to be checked). Raises a
    400 `APIError` naming the field that cannot be honoured."""
    fields: dict[str, Any] = {}
    name, constraint = _structured_outputs(req)
    if constraint is not None:
        fields["structured_outputs"] = constraint
    if req.logit_bias:
        fields["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    if req.allowed_token_ids is not None:
        _check_ids(req.allowed_token_ids, vocab_size, "allowed_token_ids")
        fields["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        fields["bad_words"] = list(req.bad_words)
    return fields, name


def _structured_outputs(req: SamplingFields) -> tuple[str | None, StructuredOutputs | None]:
    json_schema, regex, grammar = StructuredOutputs.of_json_schema, _regex, _grammar
    found = [(name, c) for name, c in (
        ("response_format", _response_format(req.response_format)),
        ("structured_outputs", _vllm_structured_outputs(req.structured_outputs)),
        ("guided_json", _given(req.guided_json, json_schema)),
        ("guided_regex", _given(req.guided_regex, regex)),
        ("guided_choice", _choice(req.guided_choice, "guided_choice")),
        ("guided_grammar", _given(req.guided_grammar, grammar)),
        ("json_schema", _given(req.json_schema, json_schema)),
        ("regex", _given(req.regex, regex)),
        ("ebnf", _given(req.ebnf, grammar)),
    ) if c is not None]
    if not found:
        return None, None
    if len(found) > 1:
        raise _bad(found[1][0], f"only one structured-output constraint per request; {found[0][0]} is set "
                                f"too")
    name, constraint = found[0]
    if req.min_tokens:  # a grammar complete before N tokens would leave no token allowed at all
        raise _bad("min_tokens", f"min_tokens is not supported together with {name}")
    return name, constraint


def _given(value: Any, make: Callable[[Any], StructuredOutputs]) -> StructuredOutputs | None:
    return None if value is None else make(value)


def _regex(pattern: str) -> StructuredOutputs:
    return StructuredOutputs(regex=pattern)


def _grammar(text: str) -> StructuredOutputs:
    return StructuredOutputs(grammar=text)


def _response_format(value: dict[str, Any] | None) -> StructuredOutputs | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise _bad("response_format", f'type must be "text", "json_object" or "json_schema", got {kind!r}')
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise _bad("response_format", 'a "json_schema" response format needs a json_schema object with a '
                                      'name')
    schema = spec.get("schema")
    if schema is None:  # OpenAI makes the schema optional: any JSON object then
        return StructuredOutputs(json_object=True)
    if not isinstance(schema, dict):
        raise _bad("response_format", "json_schema.schema must be a JSON object")
    return StructuredOutputs.of_json_schema(schema)


def _vllm_structured_outputs(value: dict[str, Any] | None) -> StructuredOutputs | None:
    if value is None:
        return None
    for key, option in value.items():
        if key in _CONSTRAINT_KEYS or option is None:
            continue
        if option not in _NO_OP_OPTIONS.get(key, ()):
            raise _bad("structured_outputs", f"{key}={option!r} is not supported")
    given = {key: value[key] for key in _CONSTRAINT_KEYS if value.get(key) not in (None, False)}
    if len(given) != 1:
        raise _bad("structured_outputs", f"set exactly one of {', '.join(_CONSTRAINT_KEYS)}; got "
                                         f"{sorted(given) or 'none'}")
    key, spec = next(iter(given.items()))
    if key == "json" and isinstance(spec, dict | str):
        return StructuredOutputs.of_json_schema(spec)
    if key == "json_object" and spec is True:
        return StructuredOutputs(json_object=True)
    if key in ("regex", "grammar") and isinstance(spec, str):
        return StructuredOutputs(**{key: spec})
    if key == "choice":
        return _choice(spec, "structured_outputs")
    raise _bad("structured_outputs", f"{key} has the wrong type ({type(spec).__name__})")


def _choice(value: Any, field: str) -> StructuredOutputs | None:
    if value is None:
        return None
    if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
        raise _bad(field, "the choice must be a non-empty list of strings")
    return StructuredOutputs(choice=value)


def _logit_bias(value: dict[str, float], vocab_size: int) -> dict[int, float]:
    bias = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except ValueError:
            raise _bad("logit_bias", f"keys must be token ids, got {json.dumps(key)}") from None
        if not -100 <= amount <= 100:
            raise _bad("logit_bias", f"biases must be between -100 and 100, got {amount} for token {key}")
        bias[token] = float(amount)
    _check_ids(list(bias), vocab_size, "logit_bias")
    return bias


def _check_ids(ids: list[int], vocab_size: int, field: str) -> None:
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise _bad(field, f"token ids must be in [0, {vocab_size}), got {outside[0]}")


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field, code="invalid_value")


@dataclass(frozen=True)
class RequestLimits:
    max_stop_strings: int
    max_stop_chars: int

    def check_stop(self, stop: list[str]) -> None:
        if len(stop) > self.max_stop_strings:
            raise _refused(f"{len(stop)} stop strings exceed this server's limit of {self.max_stop_strings}",
                           "--max-stop-strings")
        total = sum(len(s) for s in stop)
        if total > self.max_stop_chars:
            raise _refused(f"the stop strings' {total} characters exceed this server's limit of "
                           f"{self.max_stop_chars}", "--max-stop-chars")


def _refused(what: str, option: str) -> APIError:
    return APIError(400, f"stop: {what} (set by {option})", param="stop", code="limit_exceeded")
