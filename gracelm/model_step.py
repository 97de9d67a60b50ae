"""What crosses from the engine to the executor and back for one step: the model's inputs and the sampled
tokens. A module below both the engine and `parallel/`, so that neither imports the other's types (the
executor never sees the scheduler's live requests), and torch-free, so that the scheduler stays so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from gracelm.sampling_params import SamplingParams


class StepBatch(msgspec.Struct, tag=True, array_like=True):
    """The token rows of one forward pass, as plain lists: every tensor-parallel rank receives the same
    lists and turns them into the same tensors (`ForwardBatch.from_step_batch`)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # KV-cache slot of each token: block_id * block_size + offset in the block
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # tokens of context per sequence after the step
    block_tables: list[list[int]]  # padded with 0
    # Rows whose logits are returned: each sampling sequence's last token (and its draft tokens, when it
    # drafted), in batch order, then the prompt positions whose logprobs a request asked for
    # (`ModelStep.prompt_rows`).
    logits_indices: list[int]
    prompt_lens: list[int]  # each sequence's prompt length: the rows before it are a prompt's
    sent_at: float = 0.0  # time.time() on rank 0 when sent: the broadcast latency, seen by a worker


@dataclass
class ModelStep:
    """A step's batch and, for each row of `logits_indices` in order, what its sampling needs. The token
    lists are the requests' own (read them, never mutate them): the penalties read what came before."""

    batch: StepBatch
    request_ids: list[str]
    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    # Per row, the stop tokens it may not sample yet (`SamplingParams.min_tokens`); empty for most rows.
    held_stop_ids: list[list[int]] = field(default_factory=list)
    # The requests whose prompt logprobs this step computes, in the order of their logits rows, which follow
    # the sampling rows.
    prompt_rows: list[PromptRows] = field(default_factory=list)
    # The embedding requests whose pooled positions this step computes, in the order of their rows, which
    # follow the prompt rows: those rows' final hidden states are returned instead of logits.
    pool_rows: list[PoolRows] = field(default_factory=list)
    # Per sampling request, the draft tokens after its last token (`engine/speculation.py`): it has a
    # logits row for each, after its own, and they are verified in order; empty lists when none drafted.
    draft_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_sampling_rows(self) -> int:
        """The logits rows the sampling requests take: one each, and one per draft token."""
        return len(self.request_ids) + sum(len(drafts) for drafts in self.draft_token_ids)

    def own_rows(self) -> list[int]:
        """Each sampling request's own logits row (of its last token): its draft tokens' rows follow it."""
        rows, row = [], 0
        for index in range(len(self.request_ids)):
            rows.append(row)
            row += 1 + (len(self.draft_token_ids[index]) if self.draft_token_ids else 0)
        return rows


@dataclass
class PoolRows:
    """Consecutive rows of one embedding request's pooled prompt positions (`Request.pooled_positions`)."""

    request_id: str
    num_rows: int


@dataclass
class PooledSum:
    """The float32 sum of some pooled rows of one request's hidden states, and how many rows it sums: a
    prompt prefilled in chunks is pooled chunk by chunk."""

    vector: list[float]
    count: int

    def add(self, more: PooledSum) -> None:
        self.vector = [a + b for a, b in zip(self.vector, more.vector, strict=True)]
        self.count += more.count

    def mean(self) -> list[float]:
        return [x / self.count for x in self.vector]


@dataclass
class PromptRows:
    """Consecutive logits rows of one request's prompt positions: row i scores `target_ids[i]`, the prompt
    token that follows its position, with the `num_top` most likely tokens beside it."""

    request_id: str
    target_ids: list[int]
    num_top: int


class PromptLogprobs(msgspec.Struct, array_like=True):
    """The logprobs of consecutive prompt tokens (each given the tokens before it), from the model's raw
    distribution: each token's logprob and rank (1 = most likely), and the top-N tokens with theirs."""

    logprobs: list[float] = msgspec.field(default_factory=list)
    ranks: list[int] = msgspec.field(default_factory=list)
    top_ids: list[list[int]] = msgspec.field(default_factory=list)
    top_logprobs: list[list[float]] = msgspec.field(default_factory=list)

    def extend(self, more: PromptLogprobs) -> None:
        self.logprobs += more.logprobs
        self.ranks += more.ranks
        self.top_ids += more.top_ids
        self.top_logprobs += more.top_logprobs


@dataclass
class StepResult:
    """What rank 0 returns for a step: a run of tokens per sampling request, in order (its token, or a
    fault, after the draft tokens the verification kept), the prompt logprobs of each request of
    `ModelStep.prompt_rows` and the pooled sums of each of `ModelStep.pool_rows`, by request id."""

    sampled: list[list[SampledToken | SamplingFault]]
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    pooled: dict[str, PooledSum] = field(default_factory=dict)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # when the request asked for logprobs
    top_ids: list[int] | None = None  # the top-N alternatives, most likely first
    top_logprobs: list[float] | None = None


@dataclass
class SamplingFault:
    """In place of a row's token: its sampling raised. Only that row's request ends (finish_reason "error");
    the rest of the step stands. `error` is the exception in one line (the traceback is in the core's log)."""

    error: str
