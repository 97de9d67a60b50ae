"""Batch-invariant computation (`--deterministic`): every row of a forward pass gets the bits it would get
computed alone, so a request's tokens do not depend on what else is in its batches.

What varies otherwise, found by comparing rows bit for bit on this project's machine:
- Linears: oneDNN (bfloat16) and MKL (float32) pick their kernel and blocking by the number of rows M, and a
  row's result changes with it (in bfloat16 above 32 rows; in float32 between 1, 2 and more rows). Here every
  linear runs in tiles of exactly `ROW_TILE` rows, the last one padded with zero rows: one kernel shape, and
  within it a row's result does not depend on its place in the tile nor on the other rows (tested).
- Attention: SDPA's blocking follows the prefill chunk's length, which follows the step's token budget and the
  other requests. In this mode every query row, decode or prefill, goes through the same row-invariant
  computation (`attention.py`, `AttentionMetadata.build(..., batch_invariant=True)`).
What does not vary: norms, RoPE and activations are row-wise, and the sampler draws a seeded request's
numbers from its own generator and reduces each row alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# Rows of every linear's matmul in this mode. Chosen by measurement (see docs/architecture.md, "Deterministic
# mode"): a tile's cost barely grows with its rows up to here, so a small batch pays little for the padding,
# and a large one runs as several tiles.
ROW_TILE = 32


def in_row_tiles(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """`linear(x)` for x [M, in], computed as ceil(M / tile) calls of exactly `tile` rows each (for M = 0,
    one call of no row: nothing to compute, the result's shape)."""
    rows = x.shape[0]
    if rows == 0:
        return linear(x)
    padded = -(-rows // tile) * tile
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, *x.shape[1:])))
    out = torch.cat([linear(x[start:start + tile]) for start in range(0, padded, tile)])
    return out[:rows]


def make_batch_invariant(module: nn.Module, tile: int = ROW_TILE) -> None:
    """Switches a frozen model (or a tensor-parallel shard of one) to batch-invariant computation: its frozen
    linears (`FrozenLinear.row_tile`) run in row tiles and its decoders (`LlamaModel.batch_invariant`) attend
    every row alike. (By attribute: `llama.py` imports this module.)"""
    for child in module.modules():
        if hasattr(child, "row_tile"):
            child.row_tile = tile
        if hasattr(child, "batch_invariant"):
            child.batch_invariant = True
