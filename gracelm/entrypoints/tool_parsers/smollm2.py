"""SmolLM2-Instruct's format: one `<tool_call>` tag holding a JSON list of calls,
`<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`, the form its function-calling training data
(Synth-APIGen) uses. Its chat template has no tools section, so the tools are presented by the default
section (`gracelm.entrypoints.tool_calls.DEFAULT_TOOLS_PROMPT`), which asks for this form; vLLM has no
parser of this name."""

from __future__ import annotations

from gracelm.entrypoints.tool_parsers.tagged import TaggedParser


class SmolLM2Parser(TaggedParser):
    name = "smollm2"
