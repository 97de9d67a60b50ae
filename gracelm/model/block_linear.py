"""A GGUF file's 4-bit and 8-bit matrices (Q4_0, Q4_1, Q8_0) multiplied in 8-bit integers on AVX-512 VNNI:
`torch.ops.gracelm.block_matmul`, built from `gracelm/csrc/block_matmul.cpp` into `gracelm._kernels`.

The weights stay in the file's blocks: 32 consecutive inputs of an output with a scale s and a minimum m,
w = s·q + m for unsigned q (0..15 in 4 bits; 8 bits: the file's signed q + 128, with m = −128·s). Q4_0
gives m = −8·s, Q4_1 its own m, all float16 as in the file, so the weights are the file's, value for
value. The activations are rounded per block of 32 to 8 bits (q_x = round(x/d), d = max|x|/127, as
llama.cpp rounds them for these blocks), so that a block's 32 products are one exact int32 sum of
`vpdpbusd` (4 products per lane, 64 per instruction), and

    sum over a block of w·x = s·d·sum(q·q_x) + m·d·sum(q_x)

scaled and accumulated in float32. Why: torch's int4 kernel (`quantized_linear.py`) dequantizes the whole
weight again for every 4 rows, so its cost grows with the rows from the first, and dense bfloat16 is
bound by its multiply-adds at a batch of decode steps; this kernel reads the 4-bit bytes once per step
for every row and does twice bfloat16's multiply-adds per instruction. Its error is the activations'
8-bit rounding beside the file's own 4-bit one (`bench/perplexity.py` measures the model's: llama.cpp's
to the fourth digit).

It serves decode steps of any count (`MAX_ROWS`, `quantized_linear.rows_for`): it takes less time than
bfloat16 oneDNN at every row count measured, most at few rows, where reading the weights decides. By default
(`--dense-weights auto`) it serves prompts too, as llama.cpp does, and the model holds no dense copy; with a
dense copy (`--dense-weights on`) prompts of 16 tokens or more take it (`low_bit_gate.py`): their logits
choose a reply's first token, where the small default model has near ties that 8-bit activations can flip.
The figures: bench/RESULTS.md, "Weight kernels"; the design: docs/performance.md, "Weight kernels".

On a CPU with AMX (Sapphire Rapids and later; `amx_rows`), calls of 16 rows or more of bfloat16 activations by
4-bit weights take a second kernel (`gracelm/csrc/block_matmul_amx.cpp`): each record is dequantized to
bfloat16 (s·q + m rounded once, the dense bfloat16 copy's value), its 16 values per output a table that
`vpermw` indexes by the nibbles, and the tile unit multiplies it by the activations as they are, 16 rows a
tile, summing each output's whole row in float32 (`tdpbf16ps`). The 8-bit kernel cannot use the tile unit
well: a block's scales must be applied to each block's sums apart, and 16 x 16 sums stored and scaled per
block of 32 inputs cost more than the tile unit saves. Dequantizing costs the same at any row count, so the
AMX kernel wins from 16 rows on, more as the rows grow. Its error is the weights' bfloat16 rounding, the dense
path's, instead of the activations' 8-bit one; so on such a CPU a row's bits depend on whether its call has 16
low-bit rows (a decode step of 16 sequences or more), as they do where torch's int4 kernel hands larger steps
to the dense weights (`--deterministic` runs dense weights throughout). The 8-bit logits head stays on the
8-bit kernel (its 8-bit values have no 16-entry table).

The layout (`gracelm/csrc/block_pack.cpp` packs it): the outputs in tiles of 16 (one vector of sums; a
last tile of fewer padded with zeros), each tile's blocks in input order, a record per (tile, block): the
16 × 32 q as 8 vectors of 64 bytes, vector j holding inputs 4j..4j+3 of every output (4 bits: vectors 2h
and 2h + 1 as the low and high nibbles of the same 64 bytes), then the 16 scales and the 16 minimums in
float16: 320 bytes for 512 weights in 4 bits (5 bits a weight, Q4_1's own), 576 in 8 bits. A thread reads
its tiles' records front to back.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

import gracelm.cpu_features as cpu_features
from gracelm.model.gguf_int4 import BITS
from gracelm.model.kernel_library import LOADED

# Inputs per block (GGUF's block size for these types) and outputs per tile.
BLOCK = 32
TILE = 16
# Decode steps of at most this many rows use the kernel: every size measured (a step has at most
# --max-num-seqs rows).
MAX_ROWS = 1024
# Part of the key of cached forms and compiled graphs: a change of `pack` must change it.
LAYOUT = "blocks-1"

if LOADED:
    @torch.library.register_fake("gracelm::block_matmul")
    def _(x: torch.Tensor, packed: torch.Tensor, out_features: int, bits: int, amx: bool) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))


def serves() -> bool:
    """Whether this CPU runs the kernel (AVX-512 with VNNI, not masked: `cpu_features.py`), with
    gracelm._kernels built."""
    return LOADED and cpu_features.has("avx512_vnni") and torch.ops.gracelm.block_matmul_serves()


def amx_rows() -> int:
    """The least rows of a call that the AMX kernel takes (bfloat16 activations by 4-bit weights; see above),
    0 where it serves none: a CPU without AMX (or with it masked), or an OS that refuses its registers."""
    return _amx_rows(cpu_features.active())


@functools.cache
def _amx_rows(active: frozenset[str]) -> int:
    return torch.ops.gracelm.block_matmul_amx_rows() if "amx" in active and serves() else 0


def record_bytes(bits: int) -> int:
    """Bytes of one (tile, block) record: the q, then float16 scales and minimums."""
    return TILE * BLOCK * bits // 8 + 2 * TILE * 2


class BlockLinear(nn.Module):
    """A [rows, K] weight as `block_matmul` reads it: `packed` uint8 [tiles, K / 32, record bytes]."""

    halves = False  # as `Int4Linear.halves`: never two halves here, 8-bit blocks are multiplied as they are

    def __init__(self, packed: torch.Tensor, rows: int, bits: int) -> None:
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.rows = rows
        self.bits = bits

    @classmethod
    def from_file(cls, raw: np.ndarray, ggml_type: GGMLQuantizationType) -> BlockLinear:
        """From a GGUF matrix's stored bytes [rows, bytes per row], packed in one pass
        (`gracelm/csrc/block_pack.cpp`)."""
        packed = torch.ops.gracelm.block_pack(torch.from_numpy(np.ascontiguousarray(raw)), int(ggml_type))
        return cls(packed, raw.shape[0], BITS[ggml_type])

    @staticmethod
    def pack_into(parts: list[torch.Tensor], ggml_type: GGMLQuantizationType,
                  tensors: dict[str, torch.Tensor]) -> None:
        """Writes into `tensors` (as `stored_form_of` shapes them, whatever they held) the form of `parts`,
        GGUF matrices' stored bytes uint8 [rows, bytes per row] stacked by rows in this order (every part but
        the last whole tiles): each part packed straight into its range of tiles, so a stack is its parts'
        records one after another, with no copy of its own."""
        packed, tile = tensors["packed"], 0
        for i, raw in enumerate(parts):
            tiles = -(-raw.shape[0] // TILE)
            assert i == len(parts) - 1 or raw.shape[0] % TILE == 0, "a partial tile before the last part"
            torch.ops.gracelm.block_pack_into(raw.contiguous(), int(ggml_type), packed[tile:tile + tiles])
            tile += tiles
        assert tile == packed.shape[0], (tile, tuple(packed.shape))

    @staticmethod
    def stored_form_of(shape: tuple[int, int], ggml_type: GGMLQuantizationType
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shapes and dtypes of `tensors()` for a GGUF matrix of `shape` [rows, columns], `ggml_type`."""
        rows, columns = shape
        return {"packed": ((-(-rows // TILE), columns // BLOCK, record_bytes(BITS[ggml_type])), torch.uint8)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                     ggml_type: GGMLQuantizationType) -> BlockLinear:
        """From what a cache entry keeps (`tensors()`)."""
        return cls(tensors["packed"], shape[0], BITS[ggml_type])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed}

    # Stacks are kept whole where they are made once (a cache entry holds q/k/v and gate/up stacked), their
    # parts views of them: stacking those parts again is a view too, not a second copy of the weights.
    stacks_as_views = True

    @staticmethod
    def stacked(parts: list[BlockLinear]) -> BlockLinear | None:
        """The parts stacked by rows (a fused q/k/v or gate/up), or None where they cannot be: of one width
        and one bit count, every part but the last whole tiles. Parts that are consecutive views of one
        tensor (`split_rows`) give a view of it."""
        if len(parts) == 1:
            return parts[0]
        if (any(p.rows % TILE for p in parts[:-1]) or len({p.packed.shape[1:] for p in parts}) > 1
                or len({p.bits for p in parts}) > 1):
            return None
        rows = sum(p.rows for p in parts)
        whole = _whole_of(parts)
        return BlockLinear(whole if whole is not None else torch.cat([p.packed for p in parts]), rows,
                           parts[0].bits)

    def split_rows(self, rows: list[int]) -> list[BlockLinear]:
        """The weight's consecutive parts of `rows` rows each (every part but the last whole tiles), as views
        of its records."""
        parts, tile = [], 0
        for count in rows:
            tiles = -(-count // TILE)
            parts.append(BlockLinear(self.packed[tile:tile + tiles], count, self.bits))
            tile += tiles
        assert tile == self.packed.shape[0] and sum(rows) == self.rows, (rows, self.rows)
        return parts

    def to_dtype(self, dtype: torch.dtype) -> BlockLinear:
        """Itself: it computes in float32 and answers in the activations' dtype, whichever."""
        return self

    def describe(self) -> str:
        amx = amx_rows()
        return ("the file's blocks x 8-bit activations (AVX-512 VNNI, gracelm._kernels)"
                + (f", 4-bit ones x bfloat16 activations in calls of >= {amx} rows (AMX)" if amx else ""))

    @staticmethod
    def layout() -> str:
        """The kind of its cache entries and part of its compiled graphs' key."""
        return LAYOUT

    @staticmethod
    def path() -> str:
        """The short name of its kernels, for /metrics."""
        return "blocks-vnni" + ("+amx" if amx_rows() else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amx = amx_rows() > 0
        return torch.ops.gracelm.block_matmul(x.contiguous(), self.packed, self.rows, self.bits, amx)


def _whole_of(parts: list[BlockLinear]) -> torch.Tensor | None:
    """The records of `parts` as one tensor without a copy, where each part's records follow the previous
    part's in one storage (views made by `split_rows`); else None."""
    first = parts[0].packed
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for part in parts:
        packed = part.packed
        if (not packed.is_contiguous() or packed.untyped_storage().data_ptr() != storage
                or packed.data_ptr() != end):
            return None
        end += packed.nbytes
    tiles = sum(part.packed.shape[0] for part in parts)
    return first.as_strided((tiles, *first.shape[1:]), first.stride())
