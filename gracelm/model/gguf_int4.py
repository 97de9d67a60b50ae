"""GGUF's 4-bit blocks (Q4_0, Q4_1) and 8-bit ones (Q8_0) read straight into the forms of the kernels that
multiply them, value for value: a block is 32 consecutive weights of a row, one float16 scale d (and, for
Q4_1, a float16 minimum m) and its q: 16 bytes of 4-bit q, the low nibbles the block's first 16 weights,
the high ones the next 16; or, for Q8_0, 32 signed bytes.

For the 8-bit-activation kernel (`model/block_linear.py`, `file_blocks`): w = d·q + m with unsigned q,
scale and minimum in float16 as the file holds them.

    Q4_0: w = d·(q − 8)          -> scale d, minimum −8d
    Q4_1: w = d·q + m            -> scale d, minimum m
    Q8_0: w = d·q = d·(q + 128) − 128d   -> q + 128, scale d, minimum −128d

−8d and −128d are exact in float16 (powers of two) unless they overflow it (`BlockLinear.pack` refuses).

For torch's int4 kernel (`model/quantized_linear.py`, `int4_blocks`), 8-bit blocks as two 4-bit halves:

    Q4_0: w = d·(q − 8)          -> scale d, zero 0
    Q4_1: w = d·q + m = d·(q − 8) + (m + 8d)   -> scale d, zero m + 8d
    Q8_0: w = d·q, q + 128 = 16·hi + lo -> w = 16d·(hi − 8) + d·(lo − 8) + 8d

A Q8_0 matrix [N, K] thus becomes a 4-bit one [N, 2K]: the hi halves of every block (scale 16d, zero 0),
then the lo halves (scale d, zero 8d), which multiplies the input written twice, [x, x]
(`input_copies`): exactly the file's weights, for twice a 4-bit matrix's work — a quarter of the bytes
the dense bfloat16 copy reads, and the kernel at few rows is bound by them.

d and m are exact in float32, and so is m + 8d unless the two differ by more than 2^13 in magnitude (never
in a real block; the rounding would then be float32's); 16d and 8d are exact.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

# Bytes before the q in a block: d, or d and m (float16 each).
_HEADER_BYTES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 2}
INT4_TYPES = tuple(_HEADER_BYTES)
# Bits of q by type.
BITS = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}


def input_copies(ggml_type: GGMLQuantizationType) -> int:
    """How many times the kernel's input repeats x for a matrix of `ggml_type`: twice for Q8_0's halves."""
    return 2 if ggml_type == GGMLQuantizationType.Q8_0 else 1


def file_blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [rows, K] (uint8: 0..15, or 0..255 for Q8_0), float16 scales and minimums [rows, K / 32] of a
    matrix's blocks, w = scale·q + minimum; `raw` is its stored bytes, [rows, bytes per row]."""
    header, blocks, rows = _HEADER_BYTES[ggml_type], _blocks(raw, ggml_type), raw.shape[0]
    d = _float16_field(blocks, 0)
    if ggml_type == GGMLQuantizationType.Q8_0:
        q = (blocks[..., header:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8).reshape(rows, -1)
        minimums = d * -128
    else:
        nibbles = blocks[..., header:]
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(rows, -1)
        minimums = d * -8 if ggml_type == GGMLQuantizationType.Q4_0 else _float16_field(blocks, 2)
    return q, d, minimums


def int4_blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [rows, K · input_copies] (uint8, 0..15), float32 scales and zeros [rows, K · input_copies / 32] of
    a matrix's blocks; `raw` is its stored bytes, [rows, bytes per row] (`GGUFFile.raw_tensor`)."""
    q, d, minimums = file_blocks(raw, ggml_type)
    d = d.float()
    if ggml_type == GGMLQuantizationType.Q8_0:
        return (torch.cat([q >> 4, q & 15], dim=1), torch.cat([16 * d, d], dim=1),
                torch.cat([torch.zeros_like(d), 8 * d], dim=1))
    return q, d, minimums.float() + 8 * d


def _blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """A matrix's stored bytes as uint8 [rows, blocks, bytes per block]."""
    block_bytes = _HEADER_BYTES[ggml_type] + (32 if ggml_type == GGMLQuantizationType.Q8_0 else 16)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(raw.shape[0], -1, block_bytes)


def _float16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block, [rows, blocks]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1)
