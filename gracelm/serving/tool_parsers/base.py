"""What every tool-call parser shares: the events it reads out of a model's text, and the JSON checks.

A parser is fed the generated text in pieces, as the engine streams it, and answers with events: `Content`
(plain text for the client) and `Call` (one whole tool call). A plain answer is the same parser fed the
whole text at once, so a stream and a plain answer read the same calls from the same text. A call is given
out once its JSON is complete: its arguments come in one piece, always valid JSON. Text that looks like a
call but does not parse as one is given back as content, never dropped.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

_DECODER = json.JSONDecoder()


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text; more may follow in `ArgumentsPart`s


@dataclasses.dataclass(frozen=True)
class ArgumentsPart:
    """More of the last call's arguments: for a call whose name is known before its arguments are
    written (a named tool choice), the arguments are given out as they come."""

    text: str


Event = Content | Call | ArgumentsPart


class ToolParser:
    """Base of the family parsers: `feed` each new piece of text, then `finish` once at the end."""

    name = ""

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def parse(self, text: str) -> list[Event]:
        """The events of a whole text, merged (`merged`)."""
        return merged([*self.feed(text), *self.finish()])


def merged(events: list[Event]) -> list[Event]:
    """Adjacent content joined, argument parts joined to their call and empty content dropped: the same
    text read in any pieces gives the same list."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, ArgumentsPart):
            last = out[-1]
            assert isinstance(last, Call), "arguments come after their call"
            out[-1] = Call(last.name, last.arguments + event.text)
            continue
        if isinstance(event, Content):
            if not event.text:
                continue
            if out and isinstance(out[-1], Content):
                out[-1] = Content(out[-1].text + event.text)
                continue
        out.append(event)
    return out


def calls_of(value: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[Call] | None:
    """The calls in a decoded JSON value: one `{"name": str, <arguments key>: object}` or a list of them;
    None if it is not that shape (then the text is content)."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        key = next((k for k in arguments_keys if k in item), None)
        arguments = {} if key is None else item[key]
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(Call(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def decode_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after blanks) and where it ends, or None if there is none
    complete yet."""
    start = len(text) - len(text.lstrip())
    try:
        return _DECODER.raw_decode(text, start)
    except ValueError:
        return None


def held_back(text: str, marker: str) -> int:
    """Where the longest end of `text` that could begin `marker` starts: the text after it must wait for
    more before it can be given out as content."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)
