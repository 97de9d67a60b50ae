"""A matmul called on a fixed count of rows whatever the rows given: the linears of the batch-invariant mode
(`batch_invariant.py`), where a kernel's result for a row must not depend on how many rows it was given."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class RowTiles:
    """`matmul(x)` for x [M, in] as ceil(M / tile) calls of exactly `tile` rows, the last one padded with zero
    rows (for M = 0, one call of no row: nothing to compute, the result's shape)."""

    def __init__(self, tile: int) -> None:
        self.tile = tile

    def __call__(self, matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0:
            return matmul(x)
        padding = -rows % self.tile
        if padding:
            x = F.pad(x, (0, 0, 0, padding))
        if rows + padding == self.tile:  # one call, no concatenation
            return matmul(x)[:rows]
        return torch.cat([matmul(part) for part in x.split(self.tile)])[:rows]
