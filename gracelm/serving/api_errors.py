"""Errors with the right status, in the shape of the API whose path was asked: OpenAI's,
`{"error": {"message", "type", "param", "code"}}`, everywhere but under the paths of `ERROR_SHAPES`
(Anthropic's Messages API: `{"type": "error", "error": {"type", "message"}}`). The choice is made by path
where the error is answered (the handlers here, the guards' middleware), so that a route raises one
`APIError` whatever API it serves."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gracelm.lifecycle.server_state import AdmissionRefused
from gracelm.serving.openai_protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# OpenAI's error types by status; clients (the official SDKs) map statuses to exception classes. A 429 is
# OpenAI's limit on requests ("requests"; its limit on tokens would be "tokens").
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "requests", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error the client gets as an OpenAI error body; raised anywhere in a route."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=_TYPES.get(self.status, "invalid_request_error"),
                         param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self, path: str = "") -> JSONResponse:
        """The answer to a request of `path`, in the shape of the API that serves it."""
        return JSONResponse(error_shape(path)(self), status_code=self.status, headers=self.headers)


# Anthropic's error types by status (its SDKs pick exception classes by status, and show the type).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_body(error: APIError) -> dict:
    """`error` in Anthropic's shape, which has no `param`: the message names the field at fault, first
    when it does not already."""
    fallback = "api_error" if error.status >= 500 else "invalid_request_error"
    message = error.message
    if error.param is not None and error.param not in message:
        message = f"{error.param}: {message}"
    kind = _ANTHROPIC_TYPES.get(error.status, fallback)
    return {"type": "error", "error": {"type": kind, "message": message}}


# The error shape of each API served under its own paths (a prefix: the path itself and those below it);
# any other path answers OpenAI's.
ERROR_SHAPES: dict[str, Callable[[APIError], dict]] = {"/v1/messages": anthropic_body}


def error_shape(path: str) -> Callable[[APIError], dict]:
    """How an error on `path` is shaped."""
    for prefix, shape in ERROR_SHAPES.items():
        if path == prefix or path.startswith(prefix + "/"):
            return shape
    return APIError.body


_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+) ")


def from_value_error(exc: ValueError) -> APIError:
    """A 400 for an invalid value; `SamplingParams` names the field first ("SamplingParams.top_p must...")."""
    message = str(exc)
    m = _SAMPLING_FIELD.match(message)
    return APIError(400, message, param=m.group(1) if m else None, code="invalid_value")


def from_validation_error(exc: pydantic.ValidationError) -> APIError:
    """A 400 naming the first offending field, or saying the body is not JSON."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    unknown = [".".join(map(str, e["loc"])) for e in exc.errors() if e["type"] == "extra_forbidden"]
    if unknown:  # OpenAI's words, which clients match
        plural = "s" if len(unknown) > 1 else ""
        return APIError(400, f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}",
                        param=unknown[0], code="unrecognized_argument")
    param = ".".join(str(part) for part in first["loc"]) or None
    message = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
    return APIError(400, message, param=param, code="invalid_value")


ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


def validated(model: type[ModelT], value: Any, where: str) -> ModelT:
    """`value` (a part of a request: a tool, a message, an item) read as `model`; a 400 naming the field at
    fault below `where` (`tools.2.function.name`), an unknown one in OpenAI's words."""
    try:
        return model.model_validate(value)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join([where, *(str(part) for part in first["loc"])])
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {field}", param=field,
                           code="unrecognized_argument") from None
        raise APIError(400, f"{field}: {first['msg']}", param=field, code="invalid_value") from None


def install_error_handlers(app: FastAPI) -> None:
    """Makes every error the app can produce, ours or the framework's, leave in the shape of the API whose
    path was asked (`error_shape`)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(AdmissionRefused)
    async def _refused(request: Request, exc: AdmissionRefused) -> JSONResponse:
        headers = {"Retry-After": "1", **({"Connection": "close"} if exc.close else {})}
        return APIError(503, str(exc), code=exc.code, headers=headers).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return APIError(400, str(first.get("msg", "invalid request")), param=param,
                        code="invalid_value").response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, _http_message(request, exc), code=_HTTP_CODES.get(exc.status_code),
                        headers=exc.headers).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return unexpected_error(request.url.path).response(request.url.path)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def _http_message(request: Request, exc: StarletteHTTPException) -> str:
    """The framework's own errors in words that name what was asked: its "Not Found" says neither the
    method nor the path, which a client that built a wrong URL needs to see."""
    asked = f"{request.method} {request.url.path}"
    if exc.status_code == 404 and exc.detail == "Not Found":
        return f"no route {asked} on this server (the API is under /v1; GET /openapi.json lists every route)"
    if exc.status_code == 405:
        allowed = exc.headers.get("Allow") if exc.headers else None
        return f"{asked} is not allowed" + (f"; this path takes {allowed}" if allowed else "")
    return str(exc.detail)


def unexpected_error(path: str) -> APIError:
    """A 500 for a bug: the client gets a generic message and an id, the log the traceback under that id
    (an exception's text may carry internals, such as paths or values of other requests). Call it from
    an `except` block."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    logger.exception("unexpected error %s while serving %s", error_id, path)
    return APIError(500, f"internal server error (id {error_id}); the details are in the server's log",
                    code="internal_error")
