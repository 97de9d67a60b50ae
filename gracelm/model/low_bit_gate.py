"""Which rows of a step's matmuls take a model's low-bit forms (`quantized_linear.py`) and which its dense
weights, where it holds both (`--dense-weights on`, or torch's int4 forms; without a dense copy every row
takes the forms): `Int4Gate`, shared by the model's `FrozenLinear`s and told the rows per forward pass.

The rule is each sequence's own, never its neighbours' in the step, so that a request's logits do not
depend on which others share its step (the forms' kernels compute each row alike however many there are):
a decode token takes the low-bit forms, and so does every token of a prompt shorter than `SHORT_PROMPT`;
the tokens of longer prompts take the dense weights.

Why short prompts. A reply's first token is chosen by its prompt's logits, where the small default model has
near ties that the blocks' 8-bit activations flip (`block_linear.py`); so long prompts take the dense weights,
which read 4x the bytes of the 4-bit blocks. For a prompt of a few tokens that read is most of its forward
pass, and of a lone request's time to first token, so short prompts take the blocks, as llama.cpp multiplies
every prompt (bench/RESULTS.md, "Weight kernels"). 16: the KV cache's default block, so that a short prompt
never fills a cached block alone; its block holds decode tokens too, as every request's generated text in the
cache does.

Why a prompt's whole length, not its chunk's: a prompt whose head the prefix cache served computes only
its tail, and must take the same weights for it as it took for the whole, or the same request sent twice
would answer otherwise.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

# Prompts of fewer tokens than this take the low-bit forms with the decode tokens (see above).
SHORT_PROMPT = 16


@dataclass(frozen=True)
class RowSplit:
    """A step's rows, some taking the low-bit forms and the others the dense weights."""

    mask: torch.Tensor  # [rows] bool: True where a row takes the low-bit forms
    low: torch.Tensor  # int64 indices of those rows
    dense: torch.Tensor  # int64 indices of the others

    @classmethod
    def of(cls, mask: torch.Tensor) -> RowSplit | bool:
        """True where every row takes the low-bit forms, False where none does."""
        low = mask.nonzero().squeeze(1)
        if low.numel() in (0, mask.numel()):
            return low.numel() > 0
        return cls(mask, low, (~mask).nonzero().squeeze(1))

    def combine(self, low: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """The rows' outputs in their order, from those of the low rows and of the dense rows."""
        out = dense.new_empty((self.mask.numel(), dense.shape[1]))
        out.index_copy_(0, self.low, low.to(out.dtype))
        return out.index_copy_(0, self.dense, dense)


class Int4Gate:
    """When low-bit forms serve: for at most `max_rows` rows of a call (0: never; `sys.maxsize`: every row
    of every call), and, once a model shares the gate among its linears (`Int4Choice`), for the rows the
    model marks at each forward pass (`mark`, then `select` for the logits rows)."""

    def __init__(self, max_rows: int, halves_max_rows: int | None = None) -> None:
        self.max_rows = max_rows
        self.halves_max_rows = halves_max_rows  # a tighter bound for 8-bit halves, if any (`halves_rows_for`)
        self.rows: RowSplit | bool = True  # those marked; True: every row of a call, False: none

    def bound(self, halves: bool) -> int:
        """The most rows a form admits; `halves`: it is an 8-bit matrix's two 4-bit halves."""
        if self.max_rows == sys.maxsize or not halves or self.halves_max_rows is None:
            return self.max_rows
        return min(self.max_rows, self.halves_max_rows)

    def mark(self, low_sequences: list[bool], query_lens: list[int]) -> None:
        """The step's rows, sequence by sequence (`query_lens` of them each): those of the sequences marked
        True take the low-bit forms (`ForwardBatch.low_bit_sequences`)."""
        if all(low_sequences) or not any(low_sequences):
            self.rows = all(low_sequences)
            return
        mask = torch.tensor(low_sequences).repeat_interleave(torch.tensor(query_lens))
        self.rows = RowSplit.of(mask)

    def select(self, indices: torch.Tensor) -> None:
        """Keeps the marks of the rows `indices` only, in that order: the rows the logits head computes."""
        if isinstance(self.rows, RowSplit):
            self.rows = RowSplit.of(self.rows.mask.index_select(0, indices))

    def mark_rows_of(self, gate: Int4Gate, indices: torch.Tensor) -> None:
        """The marks of `gate`'s rows `indices`, in that order: for a call on some of the step's rows (the
        tokens of one expert, `moe.py`)."""
        marked = gate.rows
        self.rows = (RowSplit.of(marked.mask.index_select(0, indices)) if isinstance(marked, RowSplit)
                     else marked)

    def low_rows(self, rows: int, halves: bool = False, call_rows: int | None = None) -> RowSplit | bool:
        """Which of a matmul's `rows` rows take the low-bit form: all (True), none (False) or a split; none
        where the form's calls would have more rows than it admits (`call_rows` each where fixed, else as
        many as it is given)."""
        if self.max_rows == sys.maxsize:
            return True
        marked = self.rows
        if isinstance(marked, RowSplit) and marked.mask.numel() != rows:
            raise ValueError(f"the gate's marks cover {marked.mask.numel()} rows; this call has {rows}")
        if marked is False:
            return False
        count = rows if marked is True else marked.low.numel()
        return marked if (call_rows or count) <= self.bound(halves) else False
