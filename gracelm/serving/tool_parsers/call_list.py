"""A JSON list of calls, `[{"name": ..., "arguments": {...}}, ...]`, at the start of the output or after a
marker: what a `required` tool choice's constraint makes the model write, and Mistral's format after its
`[TOOL_CALLS]` token (`mistral`). Text before the marker and after the list is content."""

from __future__ import annotations

import re

from gracelm.serving.tool_parsers.base import (
    Content,
    Event,
    ToolParser,
    calls_of,
    decode_prefix,
    held_back,
)

# The start of a list of call objects: only that, at the start of the output, is read as one.
_LIST_START = re.compile(r"\s*\[\s*\{")
_LIST_START_SO_FAR = re.compile(r"\s*(\[\s*)?")


class CallListParser(ToolParser):
    name = "call_list"
    marker: str | None = None  # text that announces a list anywhere in the output

    def __init__(self) -> None:
        self._buffer = ""
        self._at_start = True
        self._opened: str | None = None  # while in a list: the text that opened it (given back if no calls)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._buffer:
            if self._opened is not None:
                decoded = decode_prefix(self._buffer)
                if decoded is None:
                    return events
                value, end = decoded
                calls = calls_of(value) if isinstance(value, list) else None
                events.extend(calls or [Content(self._opened + self._buffer[:end])])
                self._buffer, self._opened = self._buffer[end:], None
            elif self._at_start:
                if _LIST_START_SO_FAR.fullmatch(self._buffer):
                    return events  # blanks or `[` so far: a list may yet begin
                self._at_start = False
                if _LIST_START.match(self._buffer):
                    self._opened = ""
            elif self.marker is None:
                events.append(Content(self._buffer))
                self._buffer = ""
            else:
                at = self._buffer.find(self.marker)
                if at < 0:
                    keep = held_back(self._buffer, self.marker)
                    events.append(Content(self._buffer[:keep]))
                    self._buffer = self._buffer[keep:]
                    return events
                events.append(Content(self._buffer[:at]))
                self._buffer, self._opened = self._buffer[at + len(self.marker):], self.marker
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = [Content((self._opened or "") + self._buffer)]
        self._buffer, self._opened, self._at_start = "", None, True
        return events


class MistralParser(CallListParser):
    """Mistral's format: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (vLLM's parser name:
    `mistral`). `[TOOL_CALLS]` is a control token, which the text given to clients leaves out, so a list of
    calls at the very start of the output is read as calls too."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
