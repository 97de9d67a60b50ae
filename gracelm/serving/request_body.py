"""Reading a request's JSON body into its request model, the one way every route and every batch line does
it: a 400 naming the offending field (`from_validation_error`), and a body not declared as JSON refused."""

from __future__ import annotations

from typing import TypeVar

import pydantic
from fastapi import Request

from gracelm.serving.api_errors import APIError, from_validation_error

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
