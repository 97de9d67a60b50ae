"""One generation request as the engine core sees it: tokens in, tokens out, and where its KV cache lives."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gracelm.model_step import PooledSum, PromptLogprobs
from gracelm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # a fault of this request alone (its sampling or stop checks raised)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's `finish_reason` of a finished state ("stop", "length", "abort", "error"), else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)  # identity semantics: two requests are never "equal", and both can sit in a set
class Request:
    """A single sequence (the frontend fans `SamplingParams.n` out into n requests, so `n` is ignored here).

    `num_computed_tokens` counts the tokens whose keys and values are in the KV cache. A request that has
    just sampled a token has `num_tokens - 1` computed: the new token is fed to the model next step.
    `block_hashes` caches the chained hash of each full block of `all_token_ids`; the token sequence only
    ever grows, so the chain stays valid across steps and across preemption.

    A request that asks for prompt logprobs gathers them in `prompt_logprobs` as its prefill chunks compute
    them, `num_prompt_logprobs` positions so far (a recompute after a preemption does not compute them
    again), until its first token carries them out; the field is None before and after.

    An embedding request (`pooling` set: "last", "mean" or "cls") samples no token: its prefill computes
    the final hidden states of its `pooled_positions`, gathered in `pooled` as the chunks run (positions
    below `num_pooled` were gathered before a preemption), and it finishes with their pooled vector once
    its last prompt token is computed.

    `priority`: a lower value runs first (vLLM's convention); requests of equal priority run first come,
    first served, by `arrival_order`, which the scheduler sets when it queues the request.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | None = None  # the stop_token_ids entry that ended the request; None for eos
    prompt_logprobs: PromptLogprobs | None = None
    num_prompt_logprobs: int = 0
    pooling: str | None = None
    pooled: PooledSum | None = None
    num_pooled: int = 0
    arrival_order: int = 0
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        if self.sampling_params.prompt_logprobs is not None and not self.output_token_ids:
            self.prompt_logprobs = PromptLogprobs()

    @property
    def gathers_prompt_logprobs(self) -> bool:
        """Whether prefill must still compute prompt logprobs: then it may not take cached blocks, which
        have no logits."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens - 1

    @property
    def takes_cached_prefix(self) -> bool:
        """Whether prefill may skip cached blocks: not while it must compute rows of them (prompt logprobs,
        or pooled positions other than the last)."""
        return not self.gathers_prompt_logprobs and self.pooling in (None, "last")

    @property
    def pooled_positions(self) -> range:
        """The prompt positions an embedding request's pooling takes (none for a generation request)."""
        if self.pooling is None:
            return range(0)
        if self.pooling == "last":
            return range(self.num_prompt_tokens - 1, self.num_prompt_tokens)
        return range(0, 1 if self.pooling == "cls" else self.num_prompt_tokens)

    def add_pooled(self, part: PooledSum | None, computed: int) -> None:
        """Gathers a chunk's pooled sum; the positions below `computed` are pooled from now on."""
        if part is not None:
            if self.pooled is None:
                self.pooled = part
            else:
                self.pooled.add(part)
        self.num_pooled = max(self.num_pooled, computed)

    def add_prompt_logprobs(self, more: PromptLogprobs) -> None:
        assert self.prompt_logprobs is not None
        self.prompt_logprobs.extend(more)
        self.num_prompt_logprobs += len(more.logprobs)

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs gathered, once: the first token carries them."""
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def held_stop_ids(self) -> list[int]:
        """The stop tokens the next token may not be: all of them while fewer than `min_tokens` tokens are
        generated, none after."""
        params = self.sampling_params
        if len(self.output_token_ids) >= params.min_tokens:
            return []
        eos = () if params.ignore_eos else self.eos_token_ids
        return [*eos, *params.stop_token_ids]

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens; a live list kept by the request (read it, never mutate it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason
