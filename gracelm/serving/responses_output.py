"""A response's output items and its stream's events. The output is built from the chat stream's deltas
(`tool_calls.StreamedChoice`) by one `OutputBuilder`, plain or streamed, so that both give the same items: a
`reasoning` item for a reasoning model's thinking (`--reasoning-parser`; its text as one `reasoning_text`
part), a message item with one `output_text` part per run of text, a `function_call` item per call.
Streamed, each step is an event of OpenAI's sequence (docs/responses.md, "Streaming"), numbered by
`sequence_number`; a response that does not end well (aborted at a drain's deadline, failed, the engine
dead) ends with an `error` event, then `response.failed`.

Apart from `serving_responses.py`, which runs the request: the response object as it is shaped (`shell`,
`ended`, `failed`), whatever ran it — plain, streamed or in the background.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from gracelm.serving.api_errors import APIError
from gracelm.serving.openai_protocol import DeltaMessage, Usage
from gracelm.serving.responses_protocol import (
    FunctionCallOutput,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOutput,
    ReasoningText,
    ResponseErrorInfo,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from gracelm.serving.serving_base import sse_event


def shell(req: ResponsesRequest, response_id: str, model: str, stored: bool) -> ResponseObject:
    """The response object before its output: what the request asked, echoed."""
    text = req.text.model_dump(exclude_none=True) if req.text is not None else {}
    return ResponseObject(
        id=response_id, status="in_progress", instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, max_tool_calls=req.max_tool_calls,
        metadata=req.metadata or {}, model=model, parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id, store=stored, temperature=req.temperature,
        top_p=req.top_p, text={"format": {"type": "text"}, **text}, tool_choice=req.tool_choice or "auto",
        tools=req.tools or [], user=req.user, safety_identifier=req.safety_identifier,
        prompt_cache_key=req.prompt_cache_key,
        service_tier="default" if req.service_tier is not None else None, background=bool(req.background))


def ended(shell: ResponseObject, builder: OutputBuilder, finish_reason: str | None,
          chat_usage: Usage) -> ResponseObject:
    """The response once its output is complete: incomplete when cut by max_output_tokens."""
    cut = finish_reason == "length"
    details = chat_usage.completion_tokens_details
    usage = ResponseUsage(input_tokens=chat_usage.prompt_tokens, output_tokens=chat_usage.completion_tokens,
                          total_tokens=chat_usage.total_tokens, output_tokens_details=OutputTokensDetails(
                              reasoning_tokens=details.reasoning_tokens if details else 0))
    return shell.model_copy(update={
        "status": "incomplete" if cut else "completed", "output": list(builder.items), "usage": usage,
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
        "completed_at": int(time.time())})


def failed(shell: ResponseObject, builder: OutputBuilder, error: APIError) -> ResponseObject:
    """The response that did not end well: the items given so far, and the error as OpenAI's
    `server_error` (the SDK knows a fixed set of codes)."""
    return shell.model_copy(update={"status": "failed", "output": list(builder.items),
                                    "error": ResponseErrorInfo(message=error.message)})

Event = tuple[str, dict[str, Any]]


class OutputBuilder:
    """The output items of one response, from the chat deltas of its text, and the events that build them.
    Text only of blanks is held back until more text comes: blanks around calls make no message."""

    def __init__(self, hex_id: str) -> None:
        self._hex_id = hex_id
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._blank = ""

    def feed(self, deltas: list[DeltaMessage]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            if delta.reasoning_content:
                events += self._reasoning(delta.reasoning_content)
            if delta.content:
                events += self._text(delta.content)
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    events += self._close("completed")
                    self._blank = ""
                    events += self._open_item(FunctionCallOutput(
                        id=f"fc_{uuid.uuid4().hex}", call_id=piece.id, name=piece.function.name or "",
                        arguments="", status="in_progress"))
                if piece.function.arguments:
                    events += self._arguments(piece.function.arguments)
        return events

    def finish(self, finish_reason: str | None) -> list[Event]:
        """The last events: an answer with no item at all is one message, however blank."""
        events: list[Event] = []
        if not self.items:
            events += self._open_message()
            events += self._delta(self._blank)
        return events + self._close("incomplete" if finish_reason == "length" else "completed")

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self._open, ReasoningOutput):
            events += self._close("completed")
            events += self._open_item(ReasoningOutput(id=f"rs_{self._hex_id}_{len(self.items)}",
                                                      status="in_progress", content=[ReasoningText(text="")]))
        assert isinstance(self._open, ReasoningOutput)
        self._open.content[0].text += text
        return [*events, ("response.reasoning_text.delta", {**self._at(), "content_index": 0, "delta": text})]

    def _text(self, text: str) -> list[Event]:
        if isinstance(self._open, OutputMessage):
            return self._delta(text)
        self._blank += text
        if not self._blank.strip():
            return []
        text, self._blank = self._blank, ""
        return self._close("completed") + self._open_message() + self._delta(text)

    def _open_message(self) -> list[Event]:
        message = OutputMessage(id=f"msg_{self._hex_id}_{len(self.items)}", status="in_progress",
                                content=[OutputText(text="")])
        added = self._open_item(message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return added + [("response.content_part.added", {**self._at(), "content_index": 0, "part": part})]

    def _open_item(self, item: OutputItem) -> list[Event]:
        self.items.append(item)
        self._open = item
        shown = item.model_dump()
        if isinstance(item, OutputMessage | ReasoningOutput):
            shown["content"] = []  # its text comes with events of its own
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": shown})]

    def _delta(self, text: str) -> list[Event]:
        assert isinstance(self._open, OutputMessage)
        self._open.content[0].text += text
        if not text:
            return []
        return [("response.output_text.delta", {**self._at(), "content_index": 0, "delta": text,
                                                "logprobs": []})]

    def _arguments(self, piece: str) -> list[Event]:
        assert isinstance(self._open, FunctionCallOutput)
        self._open.arguments += piece
        return [("response.function_call_arguments.delta", {**self._at(), "delta": piece})]

    def _close(self, status: Literal["completed", "incomplete"]) -> list[Event]:
        item = self._open
        if item is None:
            return []
        item.status = status
        events: list[Event]
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [("response.output_text.done", {**self._at(), "content_index": 0, "text": part.text,
                                                     "logprobs": []}),
                      ("response.content_part.done", {**self._at(), "content_index": 0,
                                                      "part": part.model_dump()})]
        elif isinstance(item, ReasoningOutput):
            events = [("response.reasoning_text.done", {**self._at(), "content_index": 0,
                                                        "text": item.content[0].text})]
        else:
            events = [("response.function_call_arguments.done", {**self._at(), "arguments": item.arguments})]
        events.append(("response.output_item.done", {"output_index": len(self.items) - 1,
                                                     "item": item.model_dump()}))
        self._open = None
        return events

    def _at(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.items) - 1}


class Events:
    """One response's SSE events, numbered in order (`sequence_number`), as OpenAI frames them:
    `event: TYPE` then `data: JSON`."""

    def __init__(self, shell: ResponseObject, builder: OutputBuilder) -> None:
        self.shell = shell
        self.builder = builder
        self._next = 0

    def write(self, kind: str, fields: dict[str, Any]) -> str:
        payload = {"type": kind, **fields, "sequence_number": self._next}
        self._next += 1
        return sse_event(kind, payload)

    def lifecycle(self, kind: str, response: ResponseObject | None = None) -> str:
        return self.write(kind, {"response": (response or self.shell).model_dump()})

    def failure(self, error: APIError) -> str:
        """How a response that did not end well ends: the `error` event (our code, message and param), then
        `response.failed` with the items given so far and the error as OpenAI's `server_error`."""
        event = self.write("error", {"code": error.code, "message": error.message, "param": error.param})
        return event + self.lifecycle("response.failed", failed(self.shell, self.builder, error))
