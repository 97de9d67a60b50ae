"""Options declared once: a dataclass field made with `option()` carries its default, its help text and its
check, and everything else follows from it — the command-line arguments (`add_arguments`), the keyword
arguments of `Engine(...)` (the dataclass's own), the reading of parsed arguments (`from_args`) and the
validation (`validate`, from `__post_init__`).

A field's type gives its argument's: `bool` becomes `--name/--no-name`, `int`/`float`/`str` (or any of them
`| None`) a typed value, `list[str]` a value that may be given several times or as several words. Checks
refuse non-finite numbers: `nan` passes no comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

# A check returns what is wrong with a value (completing "<name> ..."), or None when it is fine.
Check = Callable[[Any], str | None]


def option(default: Any, help: str, *, check: Check | None = None, choices: Sequence[str] | None = None,
           cli: bool = True) -> Any:
    """A dataclass field that is also an option; `cli=False` keeps it off the command line."""
    metadata = {"help": help, "check": check, "choices": choices, "cli": cli}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def at_least(minimum: float) -> Check:
    def check(value: Any) -> str | None:
        if value is None or (_finite(value) and value >= minimum):
            return None
        return f"must be at least {minimum:g}, got {value!r}"

    return check


def in_range(low: float, high: float) -> Check:
    def check(value: Any) -> str | None:
        if value is None or (_finite(value) and low <= value <= high):
            return None
        return f"must be between {low:g} and {high:g}, got {value!r}"

    return check


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """Seconds of a duration written as seconds (`3600`) or with a unit (`90s`, `30m`, `12h`, `30d`);
    raises `ValueError`."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a duration: give seconds, or a number with s, m, h or d")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def positive_duration(value: Any) -> str | None:
    """The check of an option that is a duration (`duration_s`) longer than 0."""
    try:
        seconds = duration_s(value)
    except ValueError as exc:
        return f"must be a duration: {exc}"
    return None if seconds > 0 else f"must be longer than 0, got {value!r}"


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def validate(instance: Any) -> None:
    """Raises `ValueError` naming the first option whose value its check refuses."""
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        choices = field.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{field.name} must be one of {', '.join(choices)}, got {value!r}")
        check = field.metadata.get("check")
        problem = check(value) if check is not None else None
        if problem is not None:
            raise ValueError(f"{field.name} {problem}")


def add_arguments(group: argparse._ActionsContainer, cls: type) -> None:
    """One argument per option of the dataclass `cls`; absent arguments keep the dataclass's default."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.metadata.get("cli", False):
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _value_type(hints[field.name])
        has_factory = field.default_factory is not dataclasses.MISSING
        default = field.default_factory() if has_factory else field.default
        help_text = field.metadata["help"] + ("" if default in (None, []) else f" (default: {default})")
        common = {"dest": field.name, "default": argparse.SUPPRESS, "help": help_text}
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif kind is list:
            group.add_argument(flag, nargs="+", action=_Extend, metavar="VALUE", **common)
        else:
            group.add_argument(flag, type=kind, choices=field.metadata.get("choices"), **common)


class _Extend(argparse._ExtendAction):
    """Extends the list, and notes the dest and words of this occurrence as `namespace.last_repeated`: a
    word meant as the positional argument after them is read as one of them (`gracelm.cli.main`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        namespace.last_repeated = (self.dest, list(values))


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of `cls` from parsed arguments (those absent keep their defaults); raises `ValueError`."""
    names = {field.name for field in dataclasses.fields(cls)}
    values = {name: value for name, value in vars(args).items() if name in names}
    return cls(**{**values, **overrides})


def _value_type(hint: Any) -> type:
    """The argument type of an option's annotation: bool, list, int, float or str."""
    if typing.get_origin(hint) is list:
        return list
    members = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    for kind in (bool, int, float):
        if members == [kind]:
            return kind
    return str
