"""Where a reasoning model's thinking ends in its output, by token ids: what the engine core's token
constraints wait for (a structured output constrains the answer, never the thinking) and what the frontend
counts as reasoning tokens. Torch-free, so that both sides read the same definition.

The text of the same output is read by `serving/reasoning_parsers.py`; the two agree because the think
tags are single tokens of the vocabulary (the parser refuses a model whose tags are not).
"""

from __future__ import annotations

import msgspec


class ThinkingSpan(msgspec.Struct, frozen=True, kw_only=True):
    """The thinking at the start of an output that the prompt did not close: it ends with the token `end`
    (`</think>`). `opener` None: the output starts inside the thinking (the prompt opened it, or the parser
    reads it so: DeepSeek-R1). `opener` set (`<think>`, Qwen3): the output thinks only if its first token is
    the opener; any other first token starts the answer at once."""

    end: int
    opener: int | None = None

    def answer_start(self, token_ids: list[int]) -> int | None:
        """The index of the answer's first token in `token_ids`; None while the output is still thinking, or
        has not yet said whether it thinks."""
        if self.opener is not None and (not token_ids or token_ids[0] != self.opener):
            return 0 if token_ids else None
        try:
            return token_ids.index(self.end) + 1
        except ValueError:
            return None

    def may_open(self, token_ids: list[int]) -> bool:
        """Whether the next token may be the opener: the output has not begun and thinking is optional."""
        return self.opener is not None and not token_ids

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids` are thinking, its tags included."""
        start = self.answer_start(token_ids)
        return len(token_ids) if start is None else start
