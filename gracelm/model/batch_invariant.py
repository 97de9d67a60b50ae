"""Batch-invariant computation (`--deterministic`): every row of a forward pass gets the bits it would get
computed alone, so a request's tokens do not depend on what else is in its batches.

What varies otherwise, found by comparing rows bit for bit on this project's machine (`tests/test_deterministic.py`
holds each finding):
- Linears, `x @ W.T`: oneDNN (bfloat16) and MKL (float32) pick their kernel and blocking by the number of rows
  M, and a row's result changes with it (bfloat16: from 33 rows on; float32: between 1, 2 and more rows).
  - bfloat16, oneDNN: the same product computed as `W @ x.T` has the weight's rows as its M, fixed, and the
    batch as its N: there no column's result depends on N (1 to 2048 tried, every shape of the default model),
    so nothing is padded and a decode step costs what it costs by default (`TransposedMatmul`).
  - Otherwise (float32, MKL): every matmul runs in tiles of exactly `ROW_TILE` rows, the last one padded with
    zero rows: one kernel shape, within which a row's result depends neither on its place in the tile nor on
    the other rows (`RowTiledMatmul`).
- Attention: SDPA's blocking follows the prefill chunk's length, which follows the step's token budget and the
  other requests. In this mode every query row, decode or prefill, goes through the same row-invariant
  computation (`attention.py`, `AttentionMetadata.build(..., batch_invariant=True)`).
What does not vary: norms, RoPE and activations are row-wise, and the sampler draws a seeded request's
numbers from its own generator and reduces each row alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gracelm.model.llama import FrozenLinear, LlamaModel

# Rows of every matmul of a `RowTiledMatmul`: a tile's cost barely grows with its rows up to here (the weights'
# reading dominates), so a small batch pays little for the padding, and a large one runs as several tiles.
ROW_TILE = 32


class TransposedMatmul:
    """`x @ W.T + b` as `(W @ x.T).T + b` (oneDNN, bfloat16): the batch is the matmul's N, on which no
    column's result depends."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.mm(self.weight, x.t()).t().contiguous()
        return out if self.bias is None else out.add_(self.bias)


class RowTiledMatmul:
    """`matmul(x)` for x [M, in] as ceil(M / tile) calls of exactly `tile` rows each (for M = 0, one call of no
    row: nothing to compute, the result's shape)."""

    def __init__(self, matmul: Callable[[torch.Tensor], torch.Tensor], tile: int = ROW_TILE) -> None:
        self.matmul = matmul
        self.tile = tile

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0:
            return self.matmul(x)
        padding = -rows % self.tile
        if padding:
            x = F.pad(x, (0, 0, 0, padding))
        if rows + padding == self.tile:  # one call, no concatenation
            return self.matmul(x)[:rows]
        return torch.cat([self.matmul(part) for part in x.split(self.tile)])[:rows]


def make_batch_invariant(module: nn.Module) -> None:
    """Switches a frozen model (or a tensor-parallel shard of one) to batch-invariant computation: its frozen
    linears get a row-invariant matmul and its decoders attend every row alike."""
    for child in module.modules():
        if isinstance(child, FrozenLinear):
            child.invariant_matmul = invariant_matmul(child)
        elif isinstance(child, LlamaModel):
            child.batch_invariant = True


def invariant_matmul(linear: FrozenLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """The row-invariant matmul of `linear`. A oneDNN-packed bfloat16 weight is unpacked for it (the packed copy
    is dropped: `linear.matmul` then runs `F.linear` on the plain weight, the same kernel)."""
    if linear.packed is None:
        return RowTiledMatmul(linear.matmul)
    linear.weight, linear.packed = linear.packed.to_dense(), None
    return TransposedMatmul(linear.weight, linear.bias)
