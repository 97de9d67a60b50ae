"""The request fields that constrain tokens, read into `SamplingParams`' terms: OpenAI's `response_format`
and `logit_bias`, vLLM's `structured_outputs`, `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, `allowed_token_ids` and `bad_words`.

At most one structured-output constraint per request; `constraint_fields` names the field it came from, and
the request's route has it compiled (`grammar_checker.py`, off this process) before the request is admitted,
so that a schema or grammar the engine could not follow is a 400 naming its field instead of a failed
request later. Whitespace in generated JSON is always compact (`", "`, `": "`), so
`disable_any_whitespace` may only be true (and `request_fields.py` refuses `guided_whitespace_pattern`
and any `guided_decoding_backend` but llguidance).
"""

from __future__ import annotations

import json
from typing import Any

from gracelm.serving.api_errors import APIError
from gracelm.serving.openai_protocol import SamplingFields
from gracelm.structured_output import StructuredOutputs

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
    guided_json, regex, grammar = req.guided_json, req.guided_regex, req.guided_grammar
    found = [(name, c) for name, c in (
        ("response_format", _response_format(req.response_format)),
        ("structured_outputs", _vllm_structured_outputs(req.structured_outputs)),
        ("guided_json", None if guided_json is None else StructuredOutputs.of_json_schema(guided_json)),
        ("guided_regex", None if regex is None else StructuredOutputs(regex=regex)),
        ("guided_choice", _choice(req.guided_choice, "guided_choice")),
        ("guided_grammar", None if grammar is None else StructuredOutputs(grammar=grammar)),
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
