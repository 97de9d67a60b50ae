"""A chat request's prompt: its messages through the chat template (the model's, or the request's
`chat_template`), with vLLM's options — `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`, `documents`, `add_special_tokens`, `truncate_prompt_tokens` — and the text chat
`echo` puts before the answer.

A template variable the template never reads (a key of `chat_template_kwargs`, `documents`,
`reasoning_effort`) is refused with a 400 naming it: the template would drop it without a word.

A request's own `chat_template` is code the server runs: refused (a 400 naming it) unless the server runs
with `--trust-request-chat-template` (vLLM's flag), and then rendered within a budget of time and size
(`model/template_budget.py`), in a thread: the event loop serves meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jinja2

from gracelm.model.template_budget import BudgetExceeded, TemplateBudget
from gracelm.model.tokenizer import Tokenizer, template_variables
from gracelm.serving import tool_calls
from gracelm.serving.api_errors import APIError
from gracelm.serving.openai_protocol import ChatCompletionRequest, ChatMessage
from gracelm.serving.request_fields import truncate_prompt


async def prompt_ids(tokenizer: Tokenizer, req: ChatCompletionRequest, max_model_len: int,
                     tools: list[dict] | None = None, budget: TemplateBudget | None = None) -> list[int]:
    """The token ids the request's conversation renders to, with `tools` and the tool history
    (`tool_calls.template_messages`). `budget`: that of a request's own template; None refuses one."""
    if req.chat_template is None:
        return _prompt_ids(tokenizer, req, max_model_len, tools, None)
    if budget is None:
        raise APIError(400, "a request's own chat_template is refused: the server runs the template it was "
                            "started with (--chat-template, or the model's) unless it was started with "
                            "--trust-request-chat-template", param="chat_template", code="invalid_value")
    return await asyncio.to_thread(_prompt_ids, tokenizer, req, max_model_len, tools, budget)


def _prompt_ids(tokenizer: Tokenizer, req: ChatCompletionRequest, max_model_len: int,
                tools: list[dict] | None, budget: TemplateBudget | None) -> list[int]:
    template = req.chat_template or tokenizer.chat_template
    renders_tools = bool(template) and "tools" in _read_variables(template, budget)
    messages = tool_calls.template_messages([message_dict(m, i) for i, m in enumerate(req.messages)],
                                            [(m.tool_calls, m.tool_call_id) for m in req.messages], tools,
                                            renders_tools)
    tools = tools if renders_tools else None
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false (the final "
                                "message is continued, no new turn is opened)",
                           param="continue_final_message")
    variables = _variables(req, template, budget)
    try:
        text = tokenizer.render_chat(messages, req.add_generation_prompt, tools,
                                     chat_template=req.chat_template, budget=budget, **variables)
    except BudgetExceeded as exc:
        raise APIError(400, f"{exc} (a request's template's budget)", param="chat_template",
                       code="template_budget_exceeded") from None
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, OverflowError) as exc:
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


def _variables(req: ChatCompletionRequest, template: str | None, budget: TemplateBudget | None
               ) -> dict[str, Any]:
    asked: dict[str, tuple[str, Any]] = {}  # variable -> (the field that set it, value)
    for key, value in (req.chat_template_kwargs or {}).items():
        asked[key] = (f"chat_template_kwargs.{key}", value)
    if req.documents is not None:
        asked["documents"] = ("documents", req.documents)
    if req.reasoning_effort is not None:
        asked["reasoning_effort"] = ("reasoning_effort", req.reasoning_effort)
    if not asked:
        return {}
    read = _read_variables(template, budget) if template else frozenset()
    for key, (field, _) in asked.items():
        if key not in read:
            raise APIError(400, f"{field}: the chat template does not read `{key}`, so it would have no "
                                f"effect", param=field, code="unsupported_parameter")
    return {key: value for key, (_, value) in asked.items()}


def _read_variables(template: str, budget: TemplateBudget | None) -> frozenset[str]:
    """`budget`: the request's template's (None: the server's own template)."""
    try:
        return template_variables(template, budget)
    except (jinja2.TemplateSyntaxError, ValueError) as exc:
        raise APIError(400, f"the chat template does not parse: {exc}", param="chat_template") from None


def _cut_after_final(text: str, final: str) -> str:
    """The rendered conversation up to the end of the final message's content: that turn stays open."""
    end = text.rfind(final) if final else -1
    if end < 0:
        raise APIError(400, "continue_final_message: the chat template does not write the final message's "
                            "content as it is", param="continue_final_message")
    return text[:end + len(final)]
