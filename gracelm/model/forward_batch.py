"""The one input of a model forward: a flat batch of tokens from many sequences over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Tokens of B sequences laid end to end, sequence by sequence (T tokens in all).

    Each sequence contributes `query_lens[i]` new tokens: a prefill chunk (many) or a decode step (one).
    Its keys and values live in KV-cache blocks listed by its row of `block_tables`; the new tokens' K/V
    are written at `slot_mapping` (slot = block_id * block_size + offset in block) before attention reads
    the first `seq_lens[i]` slots of the sequence.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]  # [B] new tokens per sequence in this call
    seq_lens: list[int]  # [B] tokens of context per sequence after this call (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    logits_indices: torch.Tensor  # [K] int64, rows of T whose logits are returned (e.g. each last token)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)
