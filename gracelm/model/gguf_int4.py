"""GGUF's 4-bit blocks (Q4_0, Q4_1) read straight into the int4 kernel's form (`model/quantized_linear.py`),
value for value: a block is 32 consecutive weights of a row, one float16 scale d (and, for Q4_1, a float16
minimum m) and 16 bytes of 4-bit q, the low nibbles the block's first 16 weights, the high ones the next 16.

    Q4_0: w = d·(q − 8)          -> scale d, zero 0
    Q4_1: w = d·q + m = d·(q − 8) + (m + 8d)   -> scale d, zero m + 8d

d and m are exact in float32, and so is m + 8d unless the two differ by more than 2^13 in magnitude (never
in a real block; the rounding would then be float32's).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

# Bytes before the 16 bytes of q in a block: d, or d and m (float16 each).
_HEADER_BYTES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}
INT4_TYPES = tuple(_HEADER_BYTES)


def int4_blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [rows, K] (uint8, 0..15), float32 scales and zeros [rows, K / 32] of a matrix's blocks; `raw` is its
    stored bytes, [rows, bytes per row] (`GGUFFile.raw_tensor`)."""
    header = _HEADER_BYTES[ggml_type]
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(rows, -1, header + 16)
    d = _float16_field(blocks, 0)
    nibbles = blocks[..., header:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(rows, -1)
    if ggml_type == GGMLQuantizationType.Q4_0:
        return q, d, torch.zeros_like(d)
    return q, d, _float16_field(blocks, 2) + 8 * d


def _float16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block, as float32 [rows, blocks]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()
