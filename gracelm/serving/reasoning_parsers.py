"""Reasoning output (`--reasoning-parser`): a reasoning model's thinking, written between `<think>` and
`</think>`, set apart from its answer, as vLLM's and SGLang's parsers of the same names do.

Where an output starts is read from the end of its prompt first, whatever the parser: a prompt that ends
with `<think>` (and blanks) opened the thinking, so the output starts inside it (DeepSeek-R1's and newer
Qwen templates); one that ends with `</think>` closed it (`chat_template_kwargs: {"enable_thinking":
false}` writes an empty thinking), so the whole output is answer. Otherwise the parser decides:

- `qwen3`: the output thinks only if it starts with `<think>`; any other start is all answer.
- `deepseek_r1`: the output starts inside the thinking, with or without a `<think>` of its own (DeepSeek-R1
  leaves it out at times).

Once thinking, everything up to `</think>` is reasoning and everything after it is answer; an output cut off
before `</think>` is all reasoning (so that a stream and a whole answer agree: a stream cannot take back the
reasoning it has sent). `auto` picks `deepseek_r1` for a template whose generation prompt opens the
thinking or that is DeepSeek's, else `qwen3`.

The tags must be single tokens of the vocabulary, and not special ones (which a decode leaves out of the
text): the engine core waits for `</think>` by its id before it applies a structured output
(`thinking_span.py`), and the text is read here. A model without them is refused at start.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from gracelm.thinking_span import ThinkingSpan

if TYPE_CHECKING:  # the server's options name the parsers (`NAMES`) before any tokenizer is wanted
    from gracelm.model.tokenizer import Tokenizer

QWEN3 = "qwen3"
DEEPSEEK_R1 = "deepseek_r1"
AUTO = "auto"
NAMES = (QWEN3, DEEPSEEK_R1, AUTO)
OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"
# DeepSeek's chat templates name the assistant's turn with this marker.
_DEEPSEEK_ASSISTANT = "<｜Assistant｜>"
# How far back from the prompt's end a think tag counts as the generation prompt's own.
_PROMPT_TAIL_TOKENS = 16


class Phase(enum.Enum):
    OPENING = "opening"  # not yet known whether the output starts with `<think>`
    THINKING = "thinking"
    ANSWER = "answer"


@dataclasses.dataclass(frozen=True)
class ReasoningPlan:
    """How one request's output is read: the phase it starts in, the phase an output that does not start
    with `<think>` is in (for OPENING), the thinking as the engine core sees it (None: no thinking), whether
    the text is read apart (SGLang's `separate_reasoning`; else it is all content) and whether the answer
    shows the reasoning it read (vLLM's `include_reasoning`). The tokens are counted either way."""

    phase: Phase
    otherwise: Phase
    span: ThinkingSpan | None
    separated: bool = True
    shown: bool = True

    def reader(self) -> ReasoningReader:
        return ReasoningReader(self if self.separated else NO_REASONING)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output's reasoning (None if it has none) and answer."""
        reasoning, answer = self.reader().read(text, last=True)
        return reasoning or None, answer

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        return 0 if self.span is None else self.span.reasoning_tokens(token_ids)


NO_REASONING = ReasoningPlan(Phase.ANSWER, Phase.ANSWER, None)


class ReasoningReader:
    """One choice's text, in pieces, read as reasoning and answer: each piece gives the reasoning and the
    answer it completes. A piece that may be the start of a tag is held back until the next piece tells,
    or the output ends."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self._phase = plan.phase
        self._otherwise = plan.otherwise
        self._held = ""

    def read(self, text: str, last: bool = False) -> tuple[str, str]:
        """The reasoning and the answer that `text`, the next piece, completes (`last`: the output's last
        piece, after which nothing is held back)."""
        reasoning, answer = self._feed(text)
        if not last:
            return reasoning, answer
        held, self._held = self._held, ""
        if self._phase is Phase.OPENING:
            self._phase = self._otherwise
        return (reasoning + held, answer) if self._phase is Phase.THINKING else (reasoning, answer + held)

    def _feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        if self._phase is Phase.OPENING:
            if text.startswith(OPEN_TAG):
                text, self._phase = text[len(OPEN_TAG):], Phase.THINKING
            elif OPEN_TAG.startswith(text):
                self._held = text
                return "", ""
            else:
                self._phase = self._otherwise
        if self._phase is Phase.ANSWER:
            return "", text
        reasoning, closed, answer = text.partition(CLOSE_TAG)
        if closed:
            self._phase = Phase.ANSWER
            return reasoning, answer
        kept = len(text) - _tag_start(text, CLOSE_TAG)
        self._held = text[kept:]
        return text[:kept], ""


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """A server's parser (`--reasoning-parser`, resolved) and the ids of the model's think tags."""

    name: str
    open_id: int
    close_id: int

    def plan(self, prompt_ids: list[int], tokenizer: Tokenizer) -> ReasoningPlan:
        """How the output of `prompt_ids` is read (see the module's text)."""
        tail = prompt_ids[-_PROMPT_TAIL_TOKENS:]
        tags = [i for i, token in enumerate(tail) if token in (self.open_id, self.close_id)]
        if tags and not tokenizer.decode(tail[tags[-1] + 1:], skip_special_tokens=False).strip():
            if tail[tags[-1]] == self.close_id:
                return NO_REASONING
            return ReasoningPlan(Phase.THINKING, Phase.THINKING, ThinkingSpan(end=self.close_id))
        if self.name == QWEN3:
            return ReasoningPlan(Phase.OPENING, Phase.ANSWER,
                                 ThinkingSpan(end=self.close_id, opener=self.open_id))
        return ReasoningPlan(Phase.OPENING, Phase.THINKING, ThinkingSpan(end=self.close_id))


def resolve(name: str | None, tokenizer: Tokenizer) -> ReasoningParser | None:
    """The parser `--reasoning-parser NAME` stands for with this model (None: none); raises `ValueError`
    naming what the model lacks."""
    if name is None:
        return None
    ids = [_tag_id(tokenizer, tag, name) for tag in (OPEN_TAG, CLOSE_TAG)]
    chosen = _for_template(tokenizer) if name == AUTO else name
    return ReasoningParser(chosen, *ids)


def _tag_id(tokenizer: Tokenizer, tag: str, name: str) -> int:
    token_id = tokenizer.token_to_id(tag)
    if token_id is None:
        raise ValueError(f"--reasoning-parser {name}: the model's vocabulary has no {tag} token, so it "
                         f"writes no thinking this parser reads")
    added = tokenizer.backend.get_added_tokens_decoder().get(token_id)
    if added is not None and added.special:
        raise ValueError(f"--reasoning-parser {name}: {tag} is a special token of this model, which the "
                         f"text of an answer leaves out, so its thinking could not be read")
    return token_id


def _for_template(tokenizer: Tokenizer) -> str:
    import jinja2  # here, as the tokenizer: `NAMES` is read before any template is

    template = tokenizer.chat_template or ""
    if _DEEPSEEK_ASSISTANT in template:
        return DEEPSEEK_R1
    messages = [{"role": "user", "content": "hi"}]
    try:
        opening = tokenizer.render_chat(messages, add_generation_prompt=True)
        closed = tokenizer.render_chat(messages, add_generation_prompt=False)
    except (ValueError, jinja2.TemplateError):  # no template, or one this probe does not fit
        return QWEN3
    generation_prompt = opening.removeprefix(closed)
    return DEEPSEEK_R1 if generation_prompt.rstrip().endswith(OPEN_TAG) else QWEN3
