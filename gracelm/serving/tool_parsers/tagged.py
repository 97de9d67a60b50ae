"""Calls written between a start and an end tag, anywhere in the text, each tag holding one call object or
a list of them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3) and
`<tool_call>[{...}, ...]</tool_call>` (SmolLM2). Text around the tags is content."""

from __future__ import annotations

from gracelm.serving.tool_parsers.base import (
    Content,
    Event,
    ToolParser,
    calls_of,
    decode_prefix,
    held_back,
)


class TaggedParser(ToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False  # after a start tag, before its end tag

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            tag = self.end_tag if self._inside else self.start_tag
            at = self._buffer.find(tag)
            if at < 0:
                if not self._inside:  # give out all but what may begin a start tag
                    keep = held_back(self._buffer, tag)
                    events.append(Content(self._buffer[:keep]))
                    self._buffer = self._buffer[keep:]
                return events
            before, self._buffer = self._buffer[:at], self._buffer[at + len(tag):]
            events.extend(self._call(before, closed=True) if self._inside else [Content(before)])
            self._inside = not self._inside

    def finish(self) -> list[Event]:
        # A call left open at the end (the model stopped at its end-of-turn token) still counts if whole.
        events = self._call(self._buffer, closed=False) if self._inside else [Content(self._buffer)]
        self._buffer, self._inside = "", False
        return events

    def _call(self, body: str, closed: bool) -> list[Event]:
        decoded = decode_prefix(body)
        if decoded is not None and not body[decoded[1]:].strip():
            calls = calls_of(decoded[0])
            if calls:
                return list(calls)
        return [Content(self.start_tag + body + (self.end_tag if closed else ""))]


class HermesParser(TaggedParser):
    """Hermes' format, which Qwen2.5 and Qwen3 use too: one `<tool_call>{"name": ..., "arguments": {...}}`
    tag per call (vLLM's parser name: `hermes`)."""

    name = "hermes"


class SmolLM2Parser(TaggedParser):
    """SmolLM2-Instruct's format: one `<tool_call>` tag holding a JSON list of calls, the form its
    function-calling training data (Synth-APIGen) uses. Its chat template has no tools section, so the tools
    are presented by the default section (`serving.tool_calls.DEFAULT_TOOLS_PROMPT`), which asks for this
    form; vLLM has no parser of this name."""

    name = "smollm2"
