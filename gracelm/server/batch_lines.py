"""How a batch line runs: its body is parsed with the online route's request model (`parse_body`: strict
types, unknown fields refused) and answered by the same `ServingChat.create` or `ServingCompletion.create`,
as a `BatchLineClient` (named by the line, admitted by the runner, never disconnected). The answer is
what the route would have sent: 200 and the whole answer, or the error's status and body. One thing
differs: a line cannot stream (the output file holds whole answers), so `stream: true` is a 400 naming it.

A line stopped before its end — the server's drain aborted it at its deadline, or the engine ended — has no
answer: the runner leaves it queued, to run again, never failed.
"""

from __future__ import annotations

from gracelm.batch.journal import Line
from gracelm.batch.runner import LineAnswer
from gracelm.serving.api_errors import APIError, unexpected_error
from gracelm.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from gracelm.serving.request_client import BatchLineClient
from gracelm.serving.request_fields import parse_body
from gracelm.serving.serving_chat import ServingChat
from gracelm.serving.serving_completion import ServingCompletion

# Errors that say the request was stopped, not answered (`serving_base.aborted_error`, `engine_dead_error`).
_STOPPED = ("request_aborted", "engine_dead")


class BatchLines:
    """The runner's `LineExecutor` over the server's two generation endpoints."""

    def __init__(self, chat: ServingChat, completion: ServingCompletion) -> None:
        self._chat = chat
        self._completion = completion

    async def __call__(self, line: Line, line_id: str) -> LineAnswer | None:
        client = BatchLineClient(line_id)
        try:
            if line.url == "/v1/chat/completions":
                chat = parse_body(line.body, ChatCompletionRequest)
                _refuse_stream(chat.stream)
                answer = await self._chat.create(chat, client)
            else:
                completion = parse_body(line.body, CompletionRequest)
                _refuse_stream(completion.stream)
                answer = await self._completion.create(completion, client)
        except APIError as exc:
            return None if exc.code in _STOPPED else LineAnswer(exc.status, exc.body())
        except Exception:
            return LineAnswer(500, unexpected_error(line.url).body())
        return LineAnswer(200, answer.model_dump())


def _refuse_stream(stream: bool) -> None:
    if stream:
        raise APIError(400, "stream is not supported in a batch: its output file holds whole answers",
                       param="stream", code="unsupported_parameter")
