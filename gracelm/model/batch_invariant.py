"""Batch-invariant computation (`--deterministic`): every row of a forward pass gets the bits it would get
computed alone, so a request's tokens do not depend on what else is in its batches.

What varies otherwise, found by comparing rows bit for bit on this project's machine (each finding is a test
in tests/test_deterministic.py):
- Linears: oneDNN (bfloat16) and MKL (float32) choose their blocking by the number of rows M, and a row's
  result changes with it. oneDNN's bfloat16 kernel gives a row the same bits for every M from 1 to 32 (from
  33 on, it depends on M and the shape); MKL's float32 one has kernels of its own for one and for two rows.
  So every matmul here has at most `ROW_TILE` rows (`RowTiledMatmul`); for MKL exactly that many, the last
  tile padded with zero rows (one kernel shape, in which a row's place and its neighbours change nothing).
  A decode step of up to 32 sequences then runs exactly as by default; a long prefill runs as many calls.
- Attention: SDPA's blocking follows the prefill chunk's length, which follows the step's token budget and the
  other requests. In this mode every query row, decode or prefill, goes through the same row-invariant
  computation (`attention.py`, `AttentionMetadata.build(..., batch_invariant=True)`).
- Sampling (`sampler.py`, in every mode): a seeded row draws from its own generator, and a row's top-k prefix
  and top logprobs are taken at its own width, not its batch's.
What does not vary: norms, RoPE and activations are row-wise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gracelm.model.llama import FrozenLinear, LlamaModel

# Rows of one matmul call at most. oneDNN's bfloat16 kernel gives a row the same bits for every M up to 32
# (from 33 rows on it blocks otherwise), so batches of up to 32 rows run exactly as by default; larger ones
# run as several calls.
ROW_TILE = 32


class RowTiledMatmul:
    """`matmul(x)` for x [M, in] as ceil(M / tile) calls of `tile` rows, the last one padded with zero rows
    if `pad` (for M = 0, one call of no row: nothing to compute, the result's shape). Without `pad` the last
    call has the rows that are left: for a kernel that computes a row alike for every M up to `tile`."""

    def __init__(self, matmul: Callable[[torch.Tensor], torch.Tensor], tile: int, pad: bool) -> None:
        self.matmul = matmul
        self.tile = tile
        self.pad = pad

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0 or (rows <= self.tile and not self.pad):
            return self.matmul(x)
        padding = -rows % self.tile if self.pad else 0
        if padding:
            x = F.pad(x, (0, 0, 0, padding))
        if rows + padding == self.tile:  # one call, no concatenation
            return self.matmul(x)[:rows]
        return torch.cat([self.matmul(part) for part in x.split(self.tile)])[:rows]


def make_batch_invariant(module: nn.Module) -> None:
    """Switches a frozen model (or a tensor-parallel shard of one) to batch-invariant computation: its frozen
    linears run in row tiles and its decoders attend every row alike."""
    for child in module.modules():
        if isinstance(child, FrozenLinear):
            # The oneDNN-packed bfloat16 kernel needs no padding; MKL's float32 one takes other kernels for
            # one and for two rows, so there every call has exactly `ROW_TILE` rows.
            child.invariant_matmul = RowTiledMatmul(child.matmul, ROW_TILE, pad=child.packed is None)
        elif isinstance(child, LlamaModel):
            child.batch_invariant = True
