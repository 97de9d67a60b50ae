"""What a structured-output request constrains its text to — a JSON schema, any JSON object, a regular
expression, one of some strings, or a grammar — and that constraint as an llguidance grammar.

For tool calling and any other caller: to constrain a request by a JSON schema, set
`SamplingParams(structured_outputs=StructuredOutputs.of_json_schema(schema))`; this is the path
`response_format: json_schema` takes.

Torch-free: the server has a constraint compiled when the request arrives, in a helper process
(`serving/grammar_checker.py`: a 400 naming the field), the engine core's worker compiles it again
(`model/token_constraints.py`). The grammar library is llguidance, chosen by measurement against
xgrammar (bench/RESULTS.md): both masks cost little beside a decode step, and llguidance is a small wheel
with no dependencies, which reads the `tokenizers` serialization this project already carries and imports
no torch, so the frontend can check grammars; xgrammar needs torch and, on x86-64, triton.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

# JSON as a compact writer produces it: fixed separators, no free whitespace. A small model let loose on
# JSON's optional whitespace tends to write newlines until it runs out of tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Exactly one of the constraints (vLLM's `structured_outputs` names). `json` is a JSON schema written as
    JSON text; `grammar` is Lark or GBNF (llguidance's syntax); `choice` the strings allowed."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"SamplingParams.structured_outputs must set exactly one of json, json_object, "
                             f"regex, choice, grammar; got {given or 'none'}")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) for c in self.choice)):
            raise ValueError("SamplingParams.structured_outputs.choice must be a non-empty list of strings")

    @classmethod
    def of_json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputs:
        """A JSON-schema constraint (the schema as a dict or as JSON text)."""
        return cls(json=schema if isinstance(schema, str) else json.dumps(schema))

    @property
    def key(self) -> bytes:
        """The same bytes for the same constraint: what compiled grammars are cached by."""
        return msgspec.msgpack.encode(self)

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar; raises `ValueError` for a schema that is not JSON."""
        # Imported here: only the processes that compile grammars (the engine core, the grammar checker)
        # make one, and the server's own process, which imports this module before it starts its core,
        # never does.
        from llguidance import LLMatcher, grammar_from

        if self.json is not None or self.json_object:
            schema = '{"type": "object"}' if self.json is None else self.json
            return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_from("choice", self.choice)
        assert self.grammar is not None
        return grammar_from("grammar", self.grammar)  # Lark, or GBNF converted to Lark
