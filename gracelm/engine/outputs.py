"""What the engines return: vLLM-shaped request and completion outputs.

Outputs flow as deltas from the engine core to the consumer: each `RequestOutput` the output processor makes
holds only what is new since the last one. A consumer that wants the whole answer so far (the offline
`Engine`, `AsyncEngine.generate` by default) adds the deltas up with `RequestOutput.add`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token at one generated position: its logprob, rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request, cumulative so far.

    `finish_reason` is None while it runs, then "stop" (EOS, a stop token or a stop string), "length",
    "abort" or "error" (a fault of this request in the engine: it ended, the engine serves on).
    `stop_reason` is the stop string or stop token id that ended it, if any. `logprobs` has, for
    each generated token, a dict from token id to `Logprob` holding the sampled token and the top-N ones.
    `prompt_logprobs` (when asked for) has the same for each prompt token, None for the first (vLLM's
    shape); the first delta of the completion carries it.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Appends a later delta of the same completion."""
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.cumulative_logprob is not None:
            self.cumulative_logprob = delta.cumulative_logprob  # a running total already
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class RequestOutput:
    """A request's output: as a delta, `outputs` holds the completions that moved, each with what is new."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))

    def add(self, delta: RequestOutput) -> None:
        """Adds a later delta of the same request into this output (completions matched by index)."""
        by_index = {o.index: o for o in self.outputs}
        for part in delta.outputs:
            if part.index in by_index:
                by_index[part.index].add(part)
            else:
                self.outputs.append(copy.deepcopy(part))
        self.outputs.sort(key=lambda o: o.index)
        self.finished = delta.finished
        self.metrics = delta.metrics

    def copy(self) -> RequestOutput:
        return copy.deepcopy(self)
