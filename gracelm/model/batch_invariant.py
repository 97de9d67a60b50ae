"""Batch-invariant computation (`--deterministic`): every row of a forward pass gets the bits it would get
computed alone, so a request's tokens do not depend on what else is in its batches.

What varies otherwise, found by comparing rows bit for bit on this project's machine (each finding is a test
in tests/test_deterministic.py):
- Linears: oneDNN (bfloat16) and MKL (float32) choose their kernel and blocking by the number of rows M, and a
  row's result changes with it: MKL's float32 kernel has kernels of its own for one and for two rows;
  oneDNN's bfloat16 one, on a Zen 4 CPU, gives a row the same bits for every M from 1 to 32 (from 33 on it
  depends on M and the shape), while on a Zen 5 one the [576, 1536] down projection of the default model
  changes between M = 1, 2..6 and 7 on. So every matmul here has exactly `ROW_TILE` rows
  (`row_tiles.RowTiles`), the last tile padded with zero rows: one kernel shape, in which a row's place and
  its neighbours change nothing. A long prefill runs as many calls.
- Attention: SDPA's blocking follows the prefill chunk's length, which follows the step's token budget and the
  other requests. In this mode every query row, decode or prefill, goes through the same row-invariant
  computation (`attention.py`, `AttentionMetadata.build(..., batch_invariant=True)`).
- Sampling (`sampler.py`, in every mode): a seeded row draws from its own generator, and a row's top-k prefix
  and top logprobs are taken at its own width, not its batch's.
What does not vary: norms, RoPE and activations are row-wise.
"""

from __future__ import annotations

from torch import nn

from gracelm.model.llama import FrozenLinear, LlamaModel
from gracelm.model.row_tiles import RowTiles

# Rows of every matmul call, the last tile padded: oneDNN's bfloat16 kernels kept a row's bits up to 32 rows
# on a Zen 4 CPU, and a call of a fixed count of rows is one kernel on any.
ROW_TILE = 32


def make_batch_invariant(module: nn.Module) -> None:
    """Switches a frozen model (or a tensor-parallel shard of one) to batch-invariant computation: its frozen
    linears run in row tiles and its decoders attend every row alike."""
    for child in module.modules():
        if isinstance(child, FrozenLinear):
            # Both libraries take kernels of their own for some counts of rows (see above).
            child.row_tiles = RowTiles(ROW_TILE)
        elif isinstance(child, LlamaModel):
            child.batch_invariant = True

