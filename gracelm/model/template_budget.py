"""A budget for rendering a chat template that a request brought (`chat_template`, with
`--trust-request-chat-template`): its time and the size of what it builds are bounded, and going beyond
either is `BudgetExceeded`, a client's mistake (a 400), never the server's time or memory.

jinja2's sandbox keeps a template from reaching Python's internals, not from spending: a 104-byte template
of nested `range(800)` loops took 20 s, `{{ "ab " * 6000000 }}` 2 GB. So on top of the model templates'
sandbox (`tokenizer.py`): repetition (`*`) and powers (`**`) may not build more than `max_chars`
characters (or items), `range` yields at most `MAX_RANGE` numbers, the rendered text is at most `max_chars`,
and the rendering thread is traced (`sys.settrace`, that thread only) against a deadline of `seconds`. The
environment does not optimize: jinja2 folds constant expressions as it compiles (or reads a template's
variables), in C where no deadline reaches (`9 ** 9 ** 9`), so they are left to the render, bounded.
Tracing costs the render several times its time: the budget is for a request's template alone, never the
model's own. The caller renders off the event loop (a thread), so the loop serves meanwhile.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The most numbers a `range` in a request's template may yield (jinja2's own sandbox allows 100,000).
MAX_RANGE = 10_000


class BudgetExceeded(Exception):
    """A request's template went beyond its budget; the message says which bound."""


@dataclass(frozen=True)
class TemplateBudget:
    seconds: float = 1.0
    max_chars: int = 1 << 20

    def render(self, template: jinja2.Template, context: dict[str, Any]) -> str:
        """`template` (compiled by `bounded_environment`) rendered within this budget."""
        deadline = time.monotonic() + self.seconds
        previous = sys.gettrace()
        sys.settrace(_tracer(deadline, self.seconds))
        try:
            text = template.render(context)
        finally:
            sys.settrace(previous)
        if len(text) > self.max_chars:
            raise BudgetExceeded(f"the chat template rendered {len(text)} characters; at most "
                                 f"{self.max_chars}")
        return text


def _tracer(deadline: float, seconds: float) -> Callable:
    def trace(frame: FrameType, event: str, arg: object) -> Callable | None:
        if time.monotonic() > deadline:
            raise BudgetExceeded(f"the chat template took more than {seconds:g} s to render")
        return trace

    return trace


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with repetition, powers and ranges bounded (`max_chars`)."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, max_chars: int, **options: Any) -> None:
        super().__init__(**options)
        self.max_chars = max_chars
        self.globals["range"] = _bounded_range

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, str | list | tuple) and isinstance(count, int) \
                        and len(sequence) * count > self.max_chars:
                    raise BudgetExceeded(f"the chat template repeats {len(sequence)} items {count} times; at "
                                         f"most {self.max_chars} in all")
        if operator == "**" and isinstance(right, int) and abs(right) > 256:
            raise BudgetExceeded(f"the chat template raises to the power {right}; at most 256")
        return super().call_binop(context, operator, left, right)


def _bounded_range(*args: int) -> range:
    numbers = range(*args)
    if len(numbers) > MAX_RANGE:
        raise BudgetExceeded(f"the chat template asks for a range of {len(numbers)} numbers; at most "
                             f"{MAX_RANGE}")
    return numbers


@functools.cache
def bounded_environment(configure: Callable[[jinja2.Environment], None], max_chars: int
                        ) -> jinja2.Environment:
    """A bounded sandbox set up as the model templates' (`configure`: its filters and globals)."""
    env = _BoundedEnvironment(max_chars, trim_blocks=True, lstrip_blocks=True, optimized=False,
                              extensions=[jinja2.ext.loopcontrols])
    configure(env)
    env.globals["range"] = _bounded_range  # after `configure`: whatever it set, the bounded range
    return env
