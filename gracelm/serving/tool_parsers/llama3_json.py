"""Llama 3.1–3.3's JSON format: the whole answer is `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several calls separated by `;` (vLLM's parser name: `llama3_json`). An answer that does
not start with a call object is content; text after the calls is content."""

from __future__ import annotations

import re

from gracelm.serving.tool_parsers.base import Content, Event, ToolParser, calls_of, decode_prefix

PYTHON_TAG = "<|python_tag|>"
_START_SO_FAR = re.compile(r"\s*(<(\|(p(y(t(h(o(n(_(t(a(g(\|>?)?)?)?)?)?)?)?)?)?)?)?)?)?\s*")
_START = re.compile(r"\s*(<\|python_tag\|>)?\s*(?=\{)")
_SEPARATOR = re.compile(r"\s*;")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def __init__(self) -> None:
        self._buffer = ""
        # start: nothing read yet; call: a call object is due; after: a call was read, `;` may follow;
        # text: the rest is content
        self._state = "start"
        self._given_back = ""  # what a call that turns out not to be one is given back with

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._buffer:
            if self._state == "start":
                if _START_SO_FAR.fullmatch(self._buffer):
                    return events
                start = _START.match(self._buffer)
                if start is None:
                    self._state = "text"
                    continue
                self._given_back, self._buffer = self._buffer[:start.end()], self._buffer[start.end():]
                self._state = "call"
            elif self._state == "call":
                if not self._buffer.strip():
                    return events
                decoded = decode_prefix(self._buffer) if self._buffer.lstrip()[0] == "{" else (None, 0)
                if decoded is None:
                    return events
                value, end = decoded
                calls = calls_of(value, ("parameters", "arguments")) if isinstance(value, dict) else None
                if calls is None:
                    self._buffer, self._given_back, self._state = self._given_back + self._buffer, "", "text"
                    continue
                events.extend(calls)
                self._buffer, self._given_back, self._state = self._buffer[end:], "", "after"
            elif self._state == "after":
                if not self._buffer.strip():
                    return events
                separator = _SEPARATOR.match(self._buffer)
                if separator is None:
                    self._state = "text"
                    continue
                self._given_back = self._buffer[:separator.end()]
                self._buffer, self._state = self._buffer[separator.end():], "call"
            else:
                events.append(Content(self._buffer))
                self._buffer = ""
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = [Content(self._given_back + self._buffer)]
        self._buffer, self._state, self._given_back = "", "start", ""
        return events
