"""Prompt logprobs: for each prompt position asked for, the logprob and rank of the prompt token that follows
it and the top-N tokens there, from the model's raw distribution (`log_softmax` of the logits, before any
sampling setting), as vLLM's `prompt_logprobs` and OpenAI's completions `echo` with `logprobs` give them."""

from __future__ import annotations

import torch

from gracelm.model.sampler import top_per_row
from gracelm.model_step import PromptLogprobs, PromptRows

# Rows normalised at once: a long prompt chunk's log-softmax is made in pieces, so that it never holds a
# second copy of all its logits.
_PIECE_ROWS = 256


def prompt_logprobs(logits: torch.Tensor, rows: list[PromptRows]) -> dict[str, PromptLogprobs]:
    """`logits` [R, V] holds the rows of `rows` in order (R is the sum of their `target_ids`' lengths)."""
    if not rows:
        return {}
    targets = torch.tensor([t for r in rows for t in r.target_ids], dtype=torch.int64, device=logits.device)
    counts = [r.num_top for r in rows for _ in r.target_ids]  # each logits row's top-N
    num_top = max(counts)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for start in range(0, logits.shape[0], _PIECE_ROWS):
        piece = torch.log_softmax(logits[start:start + _PIECE_ROWS].float(), dim=-1)
        target = targets[start:start + _PIECE_ROWS].unsqueeze(1)
        value = piece.gather(1, target)
        chosen.append(value.squeeze(1))
        ranks.append((piece > value).sum(dim=1) + 1)
        if num_top:
            ids, values = top_per_row(piece, counts[start:start + _PIECE_ROWS], num_top)
            top_values.append(values)
            top_ids.append(ids)
    logprobs, rank_list = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
    tops = (torch.cat(top_ids).tolist(), torch.cat(top_values).tolist()) if num_top else None
    result: dict[str, PromptLogprobs] = {}
    offset = 0
    for r in rows:
        end = offset + len(r.target_ids)
        out = PromptLogprobs(logprobs[offset:end], rank_list[offset:end])
        if tops is not None and r.num_top:
            out.top_ids = [ids[:r.num_top] for ids in tops[0][offset:end]]
            out.top_logprobs = [values[:r.num_top] for values in tops[1][offset:end]]
        else:
            out.top_ids = [[] for _ in range(end - offset)]
            out.top_logprobs = [[] for _ in range(end - offset)]
        result[r.request_id] = out
        offset = end
    return result
