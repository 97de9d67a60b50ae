"""Each request's token constraints in the worker that samples, and the step's mask and bias made of them.

A request with `structured_outputs` has a grammar matcher (llguidance) that follows its output tokens: it
consumes each token the step samples (`advance`), and it is rebuilt from the request's output tokens
whenever the two disagree (a preempted request recomputed, a step whose token was never recorded), so it
never needs to be told about the scheduler's decisions. A matcher is a copy of a template compiled once
per distinct constraint (`GrammarCompiler`, bounded LRU). `bad_words` are tokenized once per request.

A reasoning model's grammar waits for the end of its thinking (`SamplingParams.thinking`): while the output
thinks, its row is not masked by the grammar, and the matcher reads the answer's tokens only. Where thinking
is optional (Qwen3 writes `<think>` itself), the first token may be the opener or what the grammar allows.

Per step, only the rows that have a constraint cost anything: their grammar masks are filled in parallel
(llguidance's executor, outside the GIL) as packed bits, `allowed_token_ids` is ANDed in as packed bits
too, and the result is unpacked once (numpy's table-driven `unpackbits`, far faster than shifting bits with
torch) into the rows' disallowed tokens;
`logit_bias` and the bad words give one sparse bias (-inf for a banned token). When a grammar is complete
it allows only the end-of-sequence tokens, so the request stops there.

Errors belong to their request: a grammar that does not compile, a token the matcher refuses or a row
left with no possible token raises a `ValueError` naming the request, which the worker's containment
turns into that request's fault.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from gracelm.model.sampler import TokenConstraints
from gracelm.model.tokenizer import Tokenizer
from gracelm.sampling_params import SamplingParams
from gracelm.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)

# Distinct constraints whose compiled grammar is kept (clients tend to send the same few schemas).
_GRAMMAR_CACHE_SIZE = 64


def has_constraints(params: SamplingParams) -> bool:
    return bool(params.structured_outputs or params.logit_bias or params.allowed_token_ids
                or params.bad_words)


class GrammarCompiler:
    """Compiles constraints for one tokenizer. The llguidance tokenizer is built at the first constrained
    request (0.5-1 s with SmolLM2's 49,152 tokens, holding the GIL), so that a server never asked for
    structured outputs never pays it, at start-up or later."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lltokenizer: LLTokenizer | None = None
        self._templates: OrderedDict[bytes, LLMatcher] = OrderedDict()

    def matcher(self, constraint: StructuredOutputs) -> LLMatcher:
        """A fresh matcher at the start of the constraint; raises `ValueError` if it does not compile."""
        key = constraint.key
        template = self._templates.get(key)
        if template is None:
            template = LLMatcher(self._llguidance_tokenizer(), constraint.grammar_text(), log_level=0)
            if template.is_error():
                raise ValueError(f"its grammar does not compile: {_first_line(template.get_error())}")
            self._templates[key] = template
            if len(self._templates) > _GRAMMAR_CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return template.deep_copy()

    def _llguidance_tokenizer(self) -> LLTokenizer:
        if self._lltokenizer is None:
            start = time.perf_counter()
            self._lltokenizer = LLTokenizer(self._tokenizer.backend_json(), n_vocab=self._vocab_size,
                                            eos_token=list(self._tokenizer.eos_token_ids))
            logger.info("structured outputs: tokenizer prepared in %.0f ms",
                        1000 * (time.perf_counter() - start))
        return self._lltokenizer


@dataclass
class RequestConstraints:
    """One request's constraint state: its matcher (and how many output tokens it has consumed) and its
    bad words as token sequences."""

    params: SamplingParams
    matcher: LLMatcher | None
    bad_words: list[list[int]]
    consumed: int = 0
    allowed_words: np.ndarray | None = field(default=None, repr=False)  # allowed_token_ids as packed bits
    grammar_active: bool = True  # false while the output thinks: the grammar masks nothing yet
    opener: int | None = None  # a token allowed beside the grammar's: the optional thinking's opener

    def follow(self, compiler: GrammarCompiler, output_token_ids: list[int]) -> None:
        """Brings the matcher to the end of the answer in `output_token_ids` (rebuilding it if it was
        elsewhere)."""
        if self.matcher is None:
            return
        answer = self._answer(output_token_ids)
        self.grammar_active = answer is not None
        if answer is None or self.consumed == len(answer):
            return
        if self.consumed > len(answer):
            assert self.params.structured_outputs is not None
            self.matcher = compiler.matcher(self.params.structured_outputs)
            self.consumed = 0
        self._consume(answer[self.consumed:])

    def _answer(self, output_token_ids: list[int]) -> list[int] | None:
        """The tokens the grammar reads: the output after its thinking; None while it thinks."""
        span = self.params.thinking
        if span is None:
            return output_token_ids
        self.opener = span.opener if span.may_open(output_token_ids) else None
        start = span.answer_start(output_token_ids)
        if start is None:
            return [] if self.opener is not None else None
        return output_token_ids[start:]

    def advance(self, token_ids: list[int]) -> None:
        """The tokens just sampled. After a thinking, `follow` reads them at the next step instead: only
        the whole output tells whether a token ended the thinking."""
        if self.params.thinking is None:
            self._consume(token_ids)

    def _consume(self, token_ids: list[int]) -> None:
        if self.matcher is None:
            return
        for token_id in token_ids:
            if not self.matcher.consume_token(token_id):
                raise ValueError(f"its grammar refused token {token_id}: "
                                 f"{_first_line(self.matcher.get_error())}")
            self.consumed += 1

    @property
    def grammar(self) -> LLMatcher | None:
        """The matcher that masks this step's row: none while the output thinks."""
        return self.matcher if self.grammar_active else None

    def banned(self, output_token_ids: list[int]) -> list[int]:
        """The last token of each bad word whose other tokens end the output."""
        banned = []
        for word in self.bad_words:
            prefix = word[:-1]
            if not prefix or output_token_ids[-len(prefix):] == prefix:
                banned.append(word[-1])
        return banned


class ConstraintStates:
    """The constraint state of every constrained request the worker samples for, by request id."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler = GrammarCompiler(tokenizer, vocab_size)
        self._executor: LLExecutor | None = None
        self._states: dict[str, RequestConstraints] = {}

    def build(self, request_ids: list[str], params: list[SamplingParams],
              output_token_ids: list[list[int]]) -> TokenConstraints | None:
        """The mask and bias of these rows (None when none has a constraint); raises `ValueError` naming
        the request whose constraint fails."""
        rows = [i for i, p in enumerate(params) if has_constraints(p)]
        if not rows:
            return None
        states = {i: self._state(request_ids[i], params[i], output_token_ids[i]) for i in rows}
        masked = [i for i in rows if states[i].grammar is not None or states[i].allowed_words is not None]
        disallowed = self._disallowed(masked, states, request_ids) if masked else None
        keys: list[int] = []
        values: list[float] = []
        for i in rows:
            for token, bias in params[i].logit_bias.items():
                keys.append(i * self._vocab_size + self._known(token, request_ids[i], "logit_bias"))
                values.append(bias)
            for token in states[i].banned(output_token_ids[i]):
                keys.append(i * self._vocab_size + token)
                values.append(-torch.inf)
        every_row = len(masked) == len(params)
        return TokenConstraints(
            mask_rows=None if every_row else torch.tensor(masked, dtype=torch.int64), disallowed=disallowed,
            bias_keys=torch.tensor(keys, dtype=torch.int64) if keys else None,
            bias_values=torch.tensor(values, dtype=torch.float32) if keys else None)

    def advance(self, request_id: str, token_id: int) -> None:
        """The request sampled `token_id`: its matcher consumes it (`ValueError` if it refuses it)."""
        state = self._states.get(request_id)
        if state is not None:
            try:
                state.advance([token_id])
            except ValueError as e:
                raise ValueError(f"request {request_id}: {e}") from None

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._states)

    def _state(self, request_id: str, params: SamplingParams,
               output_token_ids: list[int]) -> RequestConstraints:
        state = self._states.get(request_id)
        try:
            if state is None:
                state = self._states[request_id] = self._new_state(request_id, params)
            state.follow(self._compiler, output_token_ids)
        except ValueError as e:
            self._states.pop(request_id, None)
            raise ValueError(f"request {request_id}: {e}") from None
        return state

    def _new_state(self, request_id: str, params: SamplingParams) -> RequestConstraints:
        matcher = None
        if params.structured_outputs is not None:
            matcher = self._compiler.matcher(params.structured_outputs)
        allowed_words = None
        if params.allowed_token_ids is not None:
            ids = [self._known(t, request_id, "allowed_token_ids") for t in params.allowed_token_ids]
            allowed = np.zeros(allocate_token_bitmask(1, self._vocab_size).shape[1] * 32, dtype=bool)
            allowed[ids] = True
            allowed_words = np.packbits(allowed, bitorder="little").view(np.int32)
        return RequestConstraints(params, matcher, self._bad_words(params.bad_words),
                                  allowed_words=allowed_words)

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it would be written alone and after a space (distinct sequences only)."""
        sequences = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self._tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    sequences[tuple(ids)] = list(ids)
        return list(sequences.values())

    def _disallowed(self, rows: list[int], states: dict[int, RequestConstraints],
                    request_ids: list[str]) -> torch.Tensor:
        """[len(rows), V] bool: what each masked row may not sample."""
        bitmask = allocate_token_bitmask(len(rows), self._vocab_size)  # all allowed
        grammar_rows = [(states[i].grammar, j) for j, i in enumerate(rows) if states[i].grammar is not None]
        if grammar_rows:
            if self._executor is None:
                self._executor = LLExecutor()
            fill_next_token_bitmask_par(self._executor, grammar_rows, bitmask)
        for j, i in enumerate(rows):
            opener = states[i].opener
            if opener is not None:
                bitmask.view(np.uint32)[j, opener // 32] |= np.uint32(1 << (opener % 32))
            if states[i].allowed_words is not None:
                bitmask[j] &= states[i].allowed_words
        empty = np.flatnonzero(~bitmask.any(axis=1))
        if empty.size:
            raise ValueError(f"request {request_ids[rows[empty[0]]]}: no token is allowed by its constraints "
                             f"(structured output and allowed_token_ids)")
        # Little-endian words: bit k of word w is token 32 * w + k.
        bits = np.unpackbits(np.invert(bitmask).view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :self._vocab_size].view(np.bool_))

    def _known(self, token_id: int, request_id: str, field_name: str) -> int:
        if token_id >= self._vocab_size:
            raise ValueError(f"request {request_id}: {field_name} names token {token_id}, outside the "
                             f"vocabulary of {self._vocab_size} tokens")
        return token_id



def _first_line(error: str) -> str:
    """llguidance's messages go on with the grammar and the parser's state: a fault's message is one line."""
    return error.strip().split("\n", 1)[0]
