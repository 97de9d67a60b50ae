"""Verifying draft tokens (`engine/speculation.py`): the sampling of a step whose requests may have a logits
row per draft token after their own.

Position by position, every request still verifying samples its row as a plain decode step would: the
penalties, constraints and `min_tokens` read the output so far with the drafts kept before it, each
request's generator advances once, its grammar consumes the token. A draft is kept while it equals the
token sampled at its position; the first token that differs ends the run, as does the last position (the
token after a fully kept draft).

Why this is exact. A draft here is one token, not a distribution: sampling t from the target's
distribution p and keeping the draft d when t == d keeps it with probability p(d), and when it does not,
t is distributed as p without d, renormalised; that is rejection sampling with a proposal that puts all
its mass on d. Each emitted token is the token plain decoding samples at that position from the same
logits with the same random draw: a seeded request draws once per emitted token, in the same order, and
greedy requests take the same argmax. The logprobs are the target's.

Cost: one sampler call per position verified in the step, over the requests still verifying there (a
step without drafts is one call, as before).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gracelm.model_step import ModelStep, SampledToken, SamplingFault

Sampled = SampledToken | SamplingFault
# Samples the given logits rows, one per request of the (sub-)step, in order.
SampleRows = Callable[[torch.Tensor, ModelStep], list[Sampled]]


def verify(logits: torch.Tensor, step: ModelStep, sample_rows: SampleRows) -> list[list[Sampled]]:
    """Each sampling request's run of tokens: the drafts kept, then the token sampled where none is kept.
    `logits` has `step.num_sampling_rows` rows: each request's own, then one per draft token."""
    drafts = step.draft_token_ids or [[] for _ in step.request_ids]
    if not any(drafts):
        return [[token] for token in sample_rows(logits, step)]
    firsts = step.own_rows()
    runs: list[list[Sampled]] = [[] for _ in drafts]
    live = list(range(len(drafts)))
    position = 0
    while live:
        rows = torch.tensor([firsts[i] + position for i in live], dtype=torch.int64, device=logits.device)
        tokens = sample_rows(logits.index_select(0, rows), _at_position(step, live, position))
        kept = []
        for i, token in zip(live, tokens, strict=True):
            runs[i].append(token)
            if (position < len(drafts[i]) and isinstance(token, SampledToken)
                    and token.token_id == drafts[i][position]):
                kept.append(i)
        live, position = kept, position + 1
    return runs


def _at_position(step: ModelStep, requests: list[int], position: int) -> ModelStep:
    """The step as the sampler sees it at a draft position: these requests, each with its first `position`
    drafts as output (all kept, or it would not be verifying there)."""
    outputs = [step.output_token_ids[i] + step.draft_token_ids[i][:position] if position else
               step.output_token_ids[i] for i in requests]
    held = [step.held_stop_ids[i] if len(step.output_token_ids[i]) + position < step.params[i].min_tokens
            else [] for i in requests] if step.held_stop_ids else []
    return ModelStep(step.batch, [step.request_ids[i] for i in requests], [step.params[i] for i in requests],
                     [step.prompt_token_ids[i] for i in requests], outputs, held)
