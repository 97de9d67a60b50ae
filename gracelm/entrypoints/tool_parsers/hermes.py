"""Hermes' format, which Qwen2.5 and Qwen3 use too:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one tag per call (vLLM's parser name:
`hermes`)."""

from __future__ import annotations

from gracelm.entrypoints.tool_parsers.tagged import TaggedParser


class HermesParser(TaggedParser):
    name = "hermes"
