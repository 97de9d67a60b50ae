"""A chat choice's text with tool calls read out of it, in OpenAI's shapes: the whole message of a plain
answer (`final_message`) and the deltas of a stream (`StreamedChoice`). A choice that made calls and ended
by itself ends with `finish_reason: "tool_calls"`; one cut by max_tokens keeps `length`."""

from __future__ import annotations

from gracelm.serving.openai_protocol import (
    AssistantMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from gracelm.serving.tool_calls import ToolPlan
from gracelm.serving.tool_parsers import Call, Content, merged


def final_message(text: str, finish_reason: str | None,
                  plan: ToolPlan) -> tuple[AssistantMessage, str | None]:
    """The message of a whole choice, and its finish reason."""
    reader = plan.reader()
    if reader is None:
        return AssistantMessage(content=text), finish_reason
    events = merged([*reader.feed(text), *reader.finish()])
    calls = [ToolCall(id=call_id, function=FunctionCall(name=e.name, arguments=e.arguments))
             for call_id, e in zip(reader.ids, (e for e in events if isinstance(e, Call)), strict=True)]
    content = "".join(e.text for e in events if isinstance(e, Content))
    if calls and not content.strip():
        content = ""  # only blanks around the calls: no content
    message = AssistantMessage(content=content or None, tool_calls=calls or None)
    return message, _finish_reason(finish_reason, bool(calls))


class StreamedChoice:
    """One choice of a stream: each new piece of its text becomes the deltas to send, in order."""

    def __init__(self, plan: ToolPlan) -> None:
        self._reader = plan.reader()

    def deltas(self, text: str, finished: bool) -> list[DeltaMessage]:
        """The deltas of `text`, the choice's next piece (`finished`: its last); at least one, empty if
        nothing is to be sent yet, so that logprobs and the finish reason have a chunk to go in."""
        if self._reader is None:
            return [DeltaMessage(content=text) if text else DeltaMessage()]
        events = self._reader.feed(text)
        if finished:
            events += self._reader.finish()
        calls = len(self._reader.ids) - sum(isinstance(e, Call) for e in events)  # before these events
        out: list[DeltaMessage] = []
        for event in events:
            if isinstance(event, Content):
                if event.text:
                    out.append(DeltaMessage(content=event.text))
            elif isinstance(event, Call):
                out.append(_call_delta(calls, self._reader.ids[calls], event.name))
                calls += 1
                if event.arguments:
                    out.append(_call_delta(calls - 1, None, None, event.arguments))
            else:
                out.append(_call_delta(calls - 1, None, None, event.text))
        return out or [DeltaMessage()]

    def finish_reason(self, reason: str | None) -> str | None:
        return _finish_reason(reason, bool(self._reader and self._reader.ids))


def _call_delta(index: int, call_id: str | None, name: str | None,
                arguments: str | None = None) -> DeltaMessage:
    """The first delta of a call (id, type, name, empty arguments) or a piece of its arguments."""
    if call_id is not None:
        piece = DeltaToolCall(index=index, id=call_id, type="function",
                              function=DeltaFunctionCall(name=name, arguments=""))
    else:
        piece = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))
    return DeltaMessage(tool_calls=[piece])


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason
