"""A chat request's prompt: its messages through the chat template (the model's, or the request's
`chat_template`), with vLLM's options — `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`, `documents`, `add_special_tokens`, `truncate_prompt_tokens` — and the text chat
`echo` puts before the answer.

A template variable the template never reads (a key of `chat_template_kwargs`, `documents`,
`reasoning_effort`) is refused with a 400 naming it: the template would drop it without a word.
"""

from __future__ import annotations

from typing import Any

import jinja2

from gracelm.entrypoints import tool_calls
from gracelm.entrypoints.api_errors import APIError
from gracelm.entrypoints.openai_protocol import ChatCompletionRequest, ChatMessage
from gracelm.entrypoints.request_fields import truncate_prompt
from gracelm.model.tokenizer import Tokenizer, template_variables


def prompt_ids(tokenizer: Tokenizer, req: ChatCompletionRequest, max_model_len: int,
               tools: list[dict] | None = None) -> list[int]:
    """The token ids the request's conversation renders to, with `tools` and the tool history
    (`tool_calls.template_messages`)."""
    template = req.chat_template or tokenizer.chat_template
    renders_tools = bool(template) and "tools" in _read_variables(template)
    messages = tool_calls.template_messages([message_dict(m, i) for i, m in enumerate(req.messages)],
                                            [(m.tool_calls, m.tool_call_id) for m in req.messages], tools,
                                            renders_tools)
    tools = tools if renders_tools else None
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false (the final "
                                "message is continued, no new turn is opened)",
                           param="continue_final_message")
    variables = _variables(req, template)
    try:
        text = tokenizer.render_chat(messages, req.add_generation_prompt, tools,
                                     chat_template=req.chat_template, **variables)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
        param = "chat_template" if req.chat_template else "messages"
        raise APIError(400, f"the messages do not fit the chat template: {exc}", param=param) from None
    if req.continue_final_message:
        text = _cut_after_final(text, messages[-1]["content"])
    ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    return truncate_prompt(ids, req.truncate_prompt_tokens, max_model_len)


def echo_text(req: ChatCompletionRequest) -> str:
    """What chat `echo` puts before each answer: the final message's content, when that message is of the
    role that answers (the assistant's, or any with add_generation_prompt false)."""
    if not req.echo:
        return ""
    final = req.messages[-1]
    if req.add_generation_prompt and final.role != "assistant":
        return ""
    return text_of(final, len(req.messages) - 1)


def message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates read it."""
    plain: dict[str, Any] = {"role": message.role, "content": text_of(message, index)}
    if message.name is not None:
        plain["name"] = message.name
    return plain


def text_of(message: ChatMessage, index: int) -> str:
    """A message's content as text; content parts other than text are refused, this server reads text."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{index}]: only text content parts are supported, got "
                                f"{part.get('type')!r}", param=f"messages.{index}.content")
        texts.append(part["text"])
    return "".join(texts)


def _variables(req: ChatCompletionRequest, template: str | None) -> dict[str, Any]:
    asked: dict[str, tuple[str, Any]] = {}  # variable -> (the field that set it, value)
    for key, value in (req.chat_template_kwargs or {}).items():
        asked[key] = (f"chat_template_kwargs.{key}", value)
    if req.documents is not None:
        asked["documents"] = ("documents", req.documents)
    if req.reasoning_effort is not None:
        asked["reasoning_effort"] = ("reasoning_effort", req.reasoning_effort)
    if not asked:
        return {}
    read = _read_variables(template) if template else frozenset()
    for key, (field, _) in asked.items():
        if key not in read:
            raise APIError(400, f"{field}: the chat template does not read `{key}`, so it would have no "
                                f"effect", param=field, code="unsupported_parameter")
    return {key: value for key, (_, value) in asked.items()}


def _read_variables(template: str) -> frozenset[str]:
    try:
        return template_variables(template)
    except jinja2.TemplateSyntaxError as exc:
        raise APIError(400, f"the chat template does not parse: {exc}", param="chat_template") from None


def _cut_after_final(text: str, final: str) -> str:
    """The rendered conversation up to the end of the final message's content: that turn stays open."""
    end = text.rfind(final) if final else -1
    if end < 0:
        raise APIError(400, "continue_final_message: the chat template does not write the final message's "
                            "content as it is", param="continue_final_message")
    return text[:end + len(final)]
