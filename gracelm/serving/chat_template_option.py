"""`--chat-template`: a file path or the template's own text, as vLLM reads it; used instead of the
model's chat template by `/v1/chat/completions`."""

from __future__ import annotations

from pathlib import Path


def read_chat_template(value: str) -> str:
    """The template's text: the file's when `value` names one, else `value` itself when it reads as Jinja;
    raises `ValueError` naming what is wrong (a missing file, a template that does not compile)."""
    import jinja2  # only where the option is given: the server's options are read before anything starts

    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the file {value!r}: {exc}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"is neither a file nor a Jinja template: {value!r}")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"does not compile: {exc} (line {exc.lineno})") from None
    return text


def chat_template_problem(value: str | None) -> str | None:
    """What is wrong with a `--chat-template` value (completing "chat_template ..."), or None."""
    if value is None:
        return None
    try:
        read_chat_template(value)
    except ValueError as exc:
        return str(exc)
    return None
