"""Mistral's format: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (vLLM's parser name: `mistral`).

`[TOOL_CALLS]` is a control token, which the text given to clients leaves out, so a list of calls at the
very start of the output is read as calls too."""

from __future__ import annotations

from gracelm.entrypoints.tool_parsers.call_list import CallListParser


class MistralParser(CallListParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
