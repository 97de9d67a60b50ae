"""The one input of a model forward: a flat batch of tokens from many sequences over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gracelm.model_step import StepBatch


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
    # [B] each sequence's prompt length (the positions below it are a prompt's). None: a chunk of several
    # tokens is taken for a prompt's, a single token for a decode step.
    prompt_lens: list[int] | None = None

    def low_bit_sequences(self, short_prompt: int) -> list[bool]:
        """Per sequence, whether its new tokens take a model's low-bit forms (`low_bit_gate.py`): decode
        tokens do (one, or a verification's several: `engine/speculation.py`, computed as the same tokens
        decoded one by one would be), and every token of a prompt of fewer than `short_prompt` tokens (a
        chunk of it, or tokens recomputed after a preemption, too); those of longer prompts do not."""
        if self.prompt_lens is None:
            return [q == 1 for q in self.query_lens]
        return [prompt < short_prompt or seq - q >= prompt
                for q, seq, prompt in zip(self.query_lens, self.seq_lens, self.prompt_lens, strict=True)]

    @classmethod
    def from_step_batch(cls, batch: StepBatch, device: torch.device | str = "cpu") -> ForwardBatch:
        """The batch's tensors on `device`, where the model and its KV cache are."""
        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            input_ids=tensor(batch.input_ids),
            positions=tensor(batch.positions),
            slot_mapping=tensor(batch.slot_mapping),
            query_lens=batch.query_lens,
            seq_lens=batch.seq_lens,
            block_tables=tensor(batch.block_tables),
            logits_indices=tensor(batch.logits_indices),
            prompt_lens=batch.prompt_lens,
        )
