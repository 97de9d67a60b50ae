"""Tool-call output parsers, one module per format (a family's parser is a few lines of it), and the choice
of one for a model.

`--tool-call-parser NAME` picks one by vLLM's name (`hermes`, `llama3_json`, `mistral`; `smollm2` has no
vLLM counterpart); `auto`, the default, reads the chat template: a template that renders no tools gets the
default tools section, which asks for SmolLM2's `<tool_call>[...]</tool_call>` form (`smollm2`); otherwise
the call syntax the template itself writes or teaches names the family.
"""

from __future__ import annotations

from gracelm.serving.tool_parsers.base import ArgumentsPart, Call, Content, Event, ToolParser, merged
from gracelm.serving.tool_parsers.call_list import CallListParser, MistralParser
from gracelm.serving.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from gracelm.serving.tool_parsers.tagged import HermesParser, SmolLM2Parser

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, SmolLM2Parser)
}
AUTO = "auto"
NAMES = (AUTO, *PARSERS)

__all__ = ["PARSERS", "NAMES", "AUTO", "ArgumentsPart", "Call", "CallListParser", "Content", "Event",
           "ToolParser", "merged", "parser_for_template", "resolve"]


def resolve(name: str, chat_template: str | None) -> str:
    """The parser `--tool-call-parser NAME` stands for with this chat template."""
    # Imported here: the server's options name the parsers (`NAMES`) before any template is read.
    from gracelm.model.tokenizer import template_variables

    if name != AUTO:
        return name
    renders_tools = bool(chat_template) and "tools" in template_variables(chat_template or "")
    return parser_for_template(chat_template, renders_tools)


def parser_for_template(chat_template: str | None, renders_tools: bool) -> str:
    """The parser name `auto` stands for, given the model's chat template and whether it renders tools."""
    if not chat_template or not renders_tools:
        return SmolLM2Parser.name
    if MistralParser.marker in chat_template:
        return MistralParser.name
    if PYTHON_TAG in chat_template or '"parameters"' in chat_template:
        return Llama3JsonParser.name
    return HermesParser.name  # `<tool_call>` (Qwen2.5, Qwen3, Hermes) and the most common otherwise
