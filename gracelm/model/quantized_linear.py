"""A GGUF file's low-bit matrices for decode steps and short prompts: which form serves them (`form_for`: the
blocks' 8-bit-activation kernel of `block_linear.py` where the CPU has AVX-512 VNNI, else torch's int4
kernel), how many rows of a call they serve at most (`rows_for`; which rows: `low_bit_gate.py`), and torch's
form itself: 4-bit weights in the form of its CPU weight-only kernel (`aten._weight_int4pack_mm_for_cpu`).

The form: a [N, K] weight cut along K into groups of `GROUP_SIZE`; each group of a row has a scale s and a
zero z, and w = s·(q − 8) + z for the 4-bit q in 0..15. GGUF's own 4-bit blocks are such groups, so they
load value for value (`model/gguf_int4.py`), never through a dense copy. The kernel takes q two to a byte
in a blocked layout of its own (`_convert_weight_to_int4pack_for_cpu`: blocks of 64 rows with AVX-512, 32
with AVX2; `layout_id` tells layouts apart, since a cached copy must match the running kernel), and s and z
in the dtype of the activations.

Scales in bfloat16: on x86 the kernel is vectorised for bfloat16 activations only (AVX-512 and AVX2 alike);
float32 ones and scales (which would hold the file's float16 scales exactly) run its scalar fallback, slower
even than the dense bfloat16 matmul. So a float32 model's linears round their activations to bfloat16 for the
kernel and widen its output back (`KERNEL_DTYPE`): a CPU without native bfloat16 (AVX2: Zen 3, say) runs its
models in float32, and there the kernel beats float32 MKL streaming the weights (`int4_serves`). Scales and
zeros are kept in float32 (exact) until `FrozenLinear` casts them to bfloat16. Rounded to bfloat16 they change
the weights somewhat more than rounding the dequantized weights to bfloat16 does (the dense bfloat16 path),
both a small fraction of the file's own 4-bit quantisation error.

Few rows only: the kernel computes 4 rows at a time and reads (and dequantizes) the whole weight for each 4
rows, while oneDNN's bfloat16 matmul costs about the same from 1 to 16 rows: two passes over a quarter of the
bytes still beat one dense pass, a third does not. On whole decode steps of the default model int4 wins
through 8 rows and loses from 9 (bench/RESULTS.md, "Weight kernels"). Hence `INT4_MAX_ROWS` = 8, a constant of
the kernels' structure rather than a start-up measurement (which would cost start-up time and, on a shared
machine, measure the neighbours); `bench/forward.py --int4` measures the crossover again on another kind of
machine.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from gracelm.model.block_linear import MAX_ROWS as BLOCK_MAX_ROWS
from gracelm.model.block_linear import BlockLinear
from gracelm.model.block_linear import serves as block_serves
from gracelm.model.gguf_int4 import input_copies, int4_blocks
from gracelm.model.kernel_library import LOADED
from gracelm.model.low_bit_gate import Int4Gate

# The activations' and scales' dtype of the kernel's vectorised path: other activations are cast to it.
KERNEL_DTYPE = torch.bfloat16
# Inputs per scale and zero: GGUF's Q4_0/Q4_1 block size.
GROUP_SIZE = 32
# Steps of at most this many rows use the int4 kernel, larger ones the dense weight (see above).
INT4_MAX_ROWS = 8
# The same against float32 MKL, for a float32 model on a CPU whose bfloat16 is emulated (`int4_rows_for`).
INT4_MAX_ROWS_FLOAT32 = 32
# An 8-bit matrix's two 4-bit halves in a bfloat16 model: at most this many rows (`halves_rows_for`).
HALVES_MAX_ROWS = 2
# The kernel needs whole multiples of 16 rows; a weight of another height is padded with zero rows.
_ROW_MULTIPLE = 16
# Rows per block of the packed layout at most (AVX-512): stacked parts other than the last must fill blocks.
_PACK_BLOCK_ROWS = 64
# Ignored on CPU, but the op checks it.
_INNER_K_TILES = 8


class Int4Linear(nn.Module):
    """A [rows, K] weight as the int4 kernel reads it: `packed` uint8 [rows padded to 16, K / 2] and
    `scales_zeros` [K / GROUP_SIZE, rows padded, 2] (scale, zero) in the dtype the kernel computes in."""

    stacks_as_views = False  # (`BlockLinear.stacks_as_views`) its scales are laid out by group, then row

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, rows: int, input_copies: int = 1
                 ) -> None:
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)
        self.rows = rows
        # The kernel's K is the input's this many times over (an 8-bit matrix as two 4-bit halves,
        # `gguf_int4.py`): the input is repeated to match.
        self.input_copies = input_copies

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, input_copies: int = 1
             ) -> Int4Linear:
        """From q [N, K] (integers 0..15) and float32 scales and zeros [N, K / GROUP_SIZE]; K is the input's
        width times `input_copies`."""
        rows = q.shape[0]
        pad = -rows % _ROW_MULTIPLE
        if pad:  # q = 8 with scale and zero 0: rows of zeros
            q = F.pad(q, (0, 0, 0, pad), value=8)
            scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(),
                                                                    _INNER_K_TILES)
        return cls(packed, torch.stack([scales.T, zeros.T], dim=-1).contiguous(), rows, input_copies)

    @classmethod
    def from_file(cls, raw: np.ndarray, ggml_type: GGMLQuantizationType) -> Int4Linear:
        """From a GGUF matrix's stored bytes [rows, bytes per row] (`gguf_int4.int4_blocks`)."""
        return cls.pack(*int4_blocks(raw, ggml_type), input_copies(ggml_type))

    @classmethod
    def pack_into(cls, parts: list[torch.Tensor], ggml_type: GGMLQuantizationType,
                  tensors: dict[str, torch.Tensor]) -> None:
        """Writes into `tensors` (as `stored_form_of` shapes them) the form of `parts`, GGUF matrices' stored
        bytes uint8 [rows, bytes per row] stacked by rows (`stacked`). torch's packer makes tensors of its
        own, so the form is made apart and copied in."""
        whole = cls.stacked([cls.from_file(raw.numpy(), ggml_type) for raw in parts])
        assert whole is not None, "parts that do not stack"
        for name, tensor in whole.tensors().items():
            tensors[name].copy_(tensor)

    @staticmethod
    def stored_form_of(shape: tuple[int, int], ggml_type: GGMLQuantizationType
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shapes and dtypes of `tensors()`, as `pack` makes them, for a GGUF matrix of `shape` [rows,
        columns] and `ggml_type` (the kernel's K: the columns times `input_copies`)."""
        rows, columns = shape[0] + -shape[0] % _ROW_MULTIPLE, shape[1] * input_copies(ggml_type)
        return {"packed": ((rows, columns // 2), torch.uint8),
                "scales_zeros": ((columns // GROUP_SIZE, rows, 2), torch.float32)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                     ggml_type: GGMLQuantizationType) -> Int4Linear:
        """From what a cache entry keeps (`tensors()`)."""
        return cls(tensors["packed"], tensors["scales_zeros"], shape[0], input_copies(ggml_type))

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a cache entry keeps (`from_tensors`)."""
        return {"packed": self.packed, "scales_zeros": self.scales_zeros}

    @staticmethod
    def stacked(parts: list[Int4Linear]) -> Int4Linear | None:
        """The parts stacked by rows (a fused q/k/v or gate/up), or None where the packed layout cannot be:
        every part but the last must fill whole blocks of the layout, unpadded."""
        if len(parts) == 1:
            return parts[0]
        if (any(p.rows % _PACK_BLOCK_ROWS for p in parts[:-1]) or len({p.packed.shape[1] for p in parts}) > 1
                or len({p.input_copies for p in parts}) > 1):
            return None
        return Int4Linear(torch.cat([p.packed for p in parts]), torch.cat([p.scales_zeros for p in parts], 1),
                          sum(p.rows for p in parts), parts[0].input_copies)

    @property
    def halves(self) -> bool:
        """Whether this is an 8-bit matrix as two 4-bit halves (twice a 4-bit matrix's work per call)."""
        return self.input_copies > 1

    def to_dtype(self, dtype: torch.dtype) -> Int4Linear:
        """With scales and zeros in `dtype`, the dtype of the activations it will multiply."""
        return Int4Linear(self.packed, self.scales_zeros.to(dtype), self.rows, self.input_copies)

    def describe(self) -> str:
        return f"int4 (group {GROUP_SIZE}, {str(self.scales_zeros.dtype).removeprefix('torch.')} scales)"

    @staticmethod
    def layout() -> str:
        """The kind of its cache entries and part of its compiled graphs' key."""
        return f"int4-{layout_id()}"

    @staticmethod
    def path() -> str:
        """The short name of its kernel, for /metrics."""
        return "int4"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T in the scales' dtype, returned in x's (a no-op cast where they agree)."""
        kernel_input = x.to(self.scales_zeros.dtype)
        if self.input_copies > 1:
            kernel_input = kernel_input.repeat(1, self.input_copies)
        out = _int4_matmul(kernel_input.contiguous(), self.packed, GROUP_SIZE, self.scales_zeros)
        return (out if out.shape[1] == self.rows else out[:, : self.rows]).to(x.dtype)


# torch's kernel, through gracelm's op where the library is built (`gracelm/csrc/int4_matmul.cpp`: a compiled
# decode graph calls it as it is).
_int4_matmul = torch.ops.gracelm.int4_matmul if LOADED else torch.ops.aten._weight_int4pack_mm_for_cpu
if LOADED:
    @torch.library.register_fake("gracelm::int4_matmul")
    def _(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], scales_zeros.shape[1]))


# A matrix's low-bit form: the file's blocks for the 8-bit-activation kernel, or torch's int4 kernel's.
LowBitForm = BlockLinear | Int4Linear


def form_for(quantization: str) -> type[LowBitForm] | None:
    """The low-bit form `quantization` (`config.QUANTIZATION_CHOICES`) asks for on this CPU: "auto" the
    8-bit-activation kernel where it runs (AVX-512 VNNI), else torch's int4 kernel; "blocks" the former
    (refused by name where it cannot run); "int4" the latter; "none" neither."""
    if quantization == "none":
        return None
    if quantization == "int4" or (quantization == "auto" and not block_serves()):
        return Int4Linear
    if not block_serves():
        raise ValueError("--quantization blocks needs a CPU with AVX-512 VNNI and gracelm._kernels built; "
                         "this one runs --quantization int4 (torch's int4 kernel)")
    return BlockLinear


@dataclass(frozen=True)
class Int4Choice:
    """The 4-bit forms of a model's linears, by module, and the gate they share: what freezing gives the
    `FrozenLinear`s."""

    forms: Mapping[nn.Module, LowBitForm]
    gate: Int4Gate

    @classmethod
    def of(cls, model: nn.Module, by_name: Mapping[str, LowBitForm], max_rows: int, dtype: torch.dtype
           ) -> Int4Choice:
        """From the 4-bit forms of `model`'s weights by name (`<module name>.weight`), for a model of
        `dtype`."""
        forms = {module: by_name[f"{name}.weight"] for name, module in model.named_modules()
                 if f"{name}.weight" in by_name}
        return cls(forms, Int4Gate(max_rows, halves_rows_for(dtype)))

    def stacked(self, modules: list[nn.Module]) -> LowBitForm | None:
        """The modules' weights stacked by rows, in 4 bits; None unless each has a 4-bit form (and the forms
        stack)."""
        parts = [self.forms.get(module) for module in modules]
        if any(part is None for part in parts) or len({type(part) for part in parts}) > 1:
            return None
        return type(parts[0]).stacked(parts)


def int4_serves(dtype: torch.dtype, dtype_asked: str) -> bool:
    """Whether a CPU model of `dtype` takes 4-bit forms: a bfloat16 one, or a float32 one whose dtype was
    chosen for it (`--dtype auto` on a CPU whose bfloat16 is emulated), its activations rounded to
    bfloat16 in the kernel's calls. A float32 asked for keeps the file's values exactly, through the dense
    weights: the parity with transformers rests on it."""
    return dtype == KERNEL_DTYPE or (dtype == torch.float32 and dtype_asked == "auto")


def int4_rows_for(dtype: torch.dtype) -> int:
    """The rows up to which a model of `dtype` uses its 4-bit forms. Against float32 MKL on an AVX2 CPU
    (`bench/forward.py --int4` on an AVX2 CPU): int4 wins over dense float32 weights through 32 rows and
    loses from 48, since float32 reads twice bfloat16's bytes and the crossover lies further out
    (bench/RESULTS.md, "Weight kernels")."""
    return INT4_MAX_ROWS_FLOAT32 if dtype == torch.float32 else INT4_MAX_ROWS


def rows_for(dtype: torch.dtype, form: type[LowBitForm]) -> int:
    """The rows up to which a model of `dtype` uses its forms of type `form` in decode steps: the blocks' at
    every size measured (`block_linear.MAX_ROWS`), torch's int4 ones up to their crossover
    (`int4_rows_for`)."""
    return BLOCK_MAX_ROWS if form is BlockLinear else int4_rows_for(dtype)


def halves_rows_for(dtype: torch.dtype) -> int | None:
    """The rows up to which an 8-bit matrix's halves (`Int4Linear.halves`: twice a 4-bit matrix's work)
    serve a model of `dtype`, where tighter than its other forms'. Against bfloat16 oneDNN, which streams a
    large matrix near the machine's bandwidth, the default model's logits head as halves makes whole decode
    steps faster at 1 and 2 rows only. Against float32 MKL, which reads four bytes a weight, they win as
    every form does: None. The figures: bench/RESULTS.md, "Weight kernels"."""
    return HALVES_MAX_ROWS if dtype == KERNEL_DTYPE else None


@functools.cache
def layout_id() -> str:
    """A fingerprint of the running kernel's packed layout (it depends on the CPU's vector width and may
    change with torch): a probe of a full block and a partial one, over several groups of inputs, packed and
    hashed. Random values: a periodic probe packed alike where the layouts move values within their period
    (AVX2's and the baseline's did), and a cache entry of the one was then read by the other."""
    probe = torch.randint(0, 16, (112, 4 * GROUP_SIZE), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, _INNER_K_TILES)
    return hashlib.sha256(packed.numpy().tobytes()).hexdigest()[:12]
