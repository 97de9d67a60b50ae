"""The blocks' 8-bit-activation matmul (`gracelm/model/block_linear.py`, built from
`gracelm/csrc/block_matmul.cpp`): GGUF's Q4_0, Q4_1 and Q8_0 blocks read as scale·q + minimum hold gguf's
own dequantized values exactly; the kernel computes its arithmetic (activations rounded to 8 bits per block
of 32, exact integer sums, float32 scaling) up to float32 rounding, so it errs from the exact product of the
file's weights by no more than that rounding's bound; on a CPU with AMX, calls of 16 rows or more of
bfloat16 activations by 4-bit weights compute theirs (`block_matmul_amx.cpp`: the weights dequantized to
bfloat16, float32 sums) up to float32 rounding; on whole and partial tiles of outputs, rows across its
chunks and groups, bfloat16 and float32 activations; each row computed as if alone in any call its kernel
serves, whatever the threads; stacked forms equal their parts; bad arguments raise an error naming the
kernel. The kernel is part of the install (scripts/bootstrap.sh builds it): where it is missing these tests
fail; only a CPU without AVX-512 VNNI skips them, and one without AMX the AMX kernel's cases (they then
check the 8-bit one)."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

import gracelm.cpu_features as cpu_features
from gracelm.model.block_linear import BLOCK, BlockLinear, amx_rows, record_bytes
from gracelm.model.gguf_int4 import BITS, file_blocks
from gracelm.model.kernel_library import LOADED

pytestmark = pytest.mark.skipif(LOADED and not torch.ops.gracelm.block_matmul_serves(),
                                reason="this CPU lacks AVX-512 VNNI")

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
# (outputs, inputs): whole tiles of 16 outputs (an even and an odd number), a partial last tile, a single
# block of inputs, a long row.
SHAPES = [(64, 576), (48, 64), (40, 96), (200, 32), (17, 1536)]
# Across the kernel's chunks: of 8 rows and one tile below 24 rows, of 6 rows and two tiles from 24 on; the
# AMX kernel's groups of 16 rows from 16 on, summed 4 groups at a time (129: 9 groups, the last of 1 row).
ROWS = [1, 2, 3, 7, 8, 9, 15, 16, 23, 24, 33, 129]
# Each test on the 8-bit kernel alone (AMX masked) and, where this CPU has AMX, with the AMX kernel taking
# the calls of enough rows: on such a CPU the first serves only the calls of fewer rows otherwise.
KERNELS = ["vnni", "amx"] if LOADED and amx_rows() else ["vnni"]


@pytest.fixture(autouse=True, params=KERNELS)
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    with cpu_features.masking(["amx"] if request.param == "vnni" else []):
        yield request.param


def amx_serves(rows: int, qtype: Q, dtype: torch.dtype) -> bool:
    """Whether a call of `rows` rows of `dtype` by `qtype` weights goes to the AMX kernel here."""
    return 0 < amx_rows() <= rows and BITS[qtype] == 4 and dtype == torch.bfloat16


def quantized(shape: tuple[int, int], qtype: Q, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random weights in GGUF blocks of `qtype` (gguf-py's own quantizer), and gguf's dequantization."""
    weights = np.random.default_rng(seed).normal(0.0, 0.05, shape).astype(np.float32)
    weights[:, :BLOCK] += 0.03  # a block whose values are not centred on zero: Q4_1's minimum counts
    blocks = gguf.quants.quantize(weights, qtype)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(shape))


def activations(rows: int, columns: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed + rows))
    x[:, BLOCK : 2 * BLOCK] *= 20  # blocks of very different ranges: each has its own scale
    if columns > 2 * BLOCK:
        x[0, 2 * BLOCK : 3 * BLOCK] = 0  # a block of zeros: no scale to divide by
    return x.to(dtype)


def rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations as the kernel rounds them: q = round(x · 127 / max|x|) per block of 32 (to nearest
    even), and each block's scale max|x| / 127, float64 [rows, K] and [rows, K / 32]."""
    blocks = x.float().view(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / max|x| rounded once to float32, as the CPU divides (torch's float32 `127 / amax` multiplies by a
    # reciprocal, which may land one unit off and move a product across a rounding tie).
    inverse = torch.where(amax > 0, (127 / amax.double()).float(), torch.zeros_like(amax))
    q = torch.round(blocks * inverse)
    return q.view_as(x).double(), (amax / 127).squeeze(-1).double()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_blocks_read_as_ggufs_own_dequantized_values(qtype: Q, shape: tuple[int, int]) -> None:
    blocks, expected = quantized(shape, qtype)
    q, scales, minimums = file_blocks(blocks, qtype)
    assert q.dtype == torch.uint8 and int(q.max()) < 2 ** BITS[qtype]
    assert scales.dtype == minimums.dtype == torch.float16
    scales, minimums = (t.float().repeat_interleave(BLOCK, 1) for t in (scales, minimums))
    weights = scales * q.float() + minimums
    assert torch.equal(weights, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_kernel_computes_its_arithmetic_within_float32_rounding(qtype: Q, shape: tuple[int, int],
                                                                    dtype: torch.dtype) -> None:
    """Against float64 over the same rounded activations and the file's weights; and against the exact
    product of the unrounded activations, within the rounding's own bound: each activation moves by at
    most half its block's scale, so an output by at most sum over blocks of scale / 2 · sum |w|. The AMX
    kernel's calls: against float64 over the activations as they are and the weights rounded as it rounds
    them (scale·q + minimum to float32 in one rounding, then to bfloat16)."""
    blocks, weights = quantized(shape, qtype)
    form = BlockLinear.from_file(blocks, qtype)
    q_weights, scales_w, minimums_w = file_blocks(blocks, qtype)
    amx_weights = (scales_w.double().repeat_interleave(BLOCK, 1) * q_weights.double()
                   + minimums_w.double().repeat_interleave(BLOCK, 1)).float().bfloat16().double()
    for rows in ROWS:
        x = activations(rows, shape[1], dtype)
        out = form(x)
        assert out.shape == (rows, shape[0]) and out.dtype == dtype
        unit = 2.0**-8 if dtype == torch.bfloat16 else 0.0  # the output's own rounding
        if amx_serves(rows, qtype, dtype):
            ours = x.double() @ amx_weights.T
            assert ((out.double() - ours).abs() <= 1e-5 * ours.abs().max() + unit * ours.abs()).all(), rows
            continue
        q, scales = rounded(x)
        ours = (q * scales.repeat_interleave(BLOCK, 1)) @ weights.double().T
        scale = ours.abs().max()
        assert ((out.double() - ours).abs() <= 1e-5 * scale + unit * ours.abs()).all(), rows
        bound = (scales / 2) @ weights.abs().double().view(shape[0], -1, BLOCK).sum(-1).T
        exact = x.double() @ weights.double().T
        assert ((out.double() - exact).abs() <= bound + 1e-5 * scale + unit * ours.abs()).all(), rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_each_row_is_computed_as_if_alone_whatever_the_threads(dtype: torch.dtype) -> None:
    """A row of a call of 37 rows gets the bits it gets alone, on one thread: alone in a call of one row
    from the 8-bit kernel, and from the AMX kernel, where it serves 37 rows, beside other rows up to its
    least count (a call's own rows never meet)."""
    blocks, _ = quantized((200, 576), Q.Q4_1)
    form = BlockLinear.from_file(blocks, Q.Q4_1)
    x = activations(37, 576, dtype)
    together = form(x)
    others = activations(amx_rows() - 1, 576, dtype, seed=1) if amx_serves(len(x), Q.Q4_1, dtype) \
        else x[:0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([form(torch.cat([x[i : i + 1], others]))[:1] for i in range(len(x))])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)


def test_no_rows_give_no_rows() -> None:
    blocks, _ = quantized((40, 96), Q.Q8_0)
    assert BlockLinear.from_file(blocks, Q.Q8_0)(torch.zeros(0, 96)).shape == (0, 40)


def test_stacked_forms_equal_their_parts_where_the_tiles_stack() -> None:
    parts = [BlockLinear.from_file(quantized((rows, 96), Q.Q4_1, seed=rows)[0], Q.Q4_1)
             for rows in (32, 48, 40)]
    stacked = BlockLinear.stacked(parts)
    x = activations(5, 96)
    assert stacked is not None and stacked.rows == 120
    assert torch.equal(stacked(x), torch.cat([part(x) for part in parts], dim=1))
    assert BlockLinear.stacked([parts[2], parts[0]]) is None  # a partial tile before the last part
    eight_bit = BlockLinear.from_file(quantized((32, 96), Q.Q8_0)[0], Q.Q8_0)
    assert BlockLinear.stacked([parts[0], eight_bit]) is None  # 4 and 8 bits


def test_a_stack_split_into_parts_stacks_again_as_a_view_of_itself() -> None:
    """What the cache keeps stacked (`gguf_loader._cache_entries`) is served as views: split, its parts
    equal the matrices packed alone, and stacked again they are the same records, not a copy; parts of
    different tensors are copied."""
    parts = [BlockLinear.from_file(quantized((rows, 96), Q.Q4_1, seed=rows)[0], Q.Q4_1)
             for rows in (32, 48, 40)]
    whole = BlockLinear.stacked(parts)
    assert whole is not None
    views = whole.split_rows([32, 48, 40])
    x = activations(5, 96)
    for view, part in zip(views, parts, strict=True):
        assert view.rows == part.rows and torch.equal(view.packed, part.packed)
        assert torch.equal(view(x), part(x))
        assert view.packed.untyped_storage().data_ptr() == whole.packed.untyped_storage().data_ptr()
    again = BlockLinear.stacked(views)
    assert again is not None and again.packed.data_ptr() == whole.packed.data_ptr()
    assert again.packed.shape == whole.packed.shape and torch.equal(again(x), whole(x))
    assert BlockLinear.stacked([views[0], views[2]]).packed.data_ptr() != whole.packed.data_ptr()  # apart
    assert BlockLinear.stacked(parts).packed.data_ptr() != whole.packed.data_ptr()  # of separate tensors


def test_the_stored_form_is_what_pack_makes() -> None:
    for qtype in TYPES:
        form = BlockLinear.from_file(quantized((40, 96), qtype)[0], qtype)
        [(shape, dtype)] = BlockLinear.stored_form_of((40, 96), qtype).values()
        assert form.packed.shape == shape == (3, 3, record_bytes(BITS[qtype])) and form.packed.dtype == dtype


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_packer_writes_the_records_the_layout_describes(qtype: Q, shape: tuple[int, int]) -> None:
    """`block_pack` (C++, one pass) against the layout written out in torch, record for record."""
    blocks = quantized(shape, qtype, seed=shape[0])[0]
    assert torch.equal(BlockLinear.from_file(blocks, qtype).packed, reference_records(blocks, qtype))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_out_variant_packer_writes_every_byte_of_its_output(qtype: Q, shape: tuple[int, int]) -> None:
    """`block_pack_into` (the allocating `block_pack` wraps it) into a buffer of garbage gives the records
    of the layout, the padding lanes of a last partial tile zeros: it relies on no zeroed buffer."""
    blocks = quantized(shape, qtype, seed=shape[0])[0]
    raw = torch.from_numpy(blocks)
    [(stored_shape, dtype)] = BlockLinear.stored_form_of(shape, qtype).values()
    out = torch.full(stored_shape, 0xA5, dtype=dtype)
    torch.ops.gracelm.block_pack_into(raw, int(qtype), out)
    assert torch.equal(out, torch.ops.gracelm.block_pack(raw, int(qtype)))
    assert torch.equal(out, reference_records(blocks, qtype))


@pytest.mark.parametrize("qtype", TYPES)
def test_a_stack_is_packed_as_its_parts_records_one_after_another(qtype: Q) -> None:
    """`BlockLinear.pack_into`: each part straight into its range of tiles of a view (here of a larger buffer
    of garbage, as a cache file's mapping is), the last part's partial tile padded with zeros: the records
    of the parts packed apart and stacked, and not a byte beside the view."""
    rows = (32, 48, 40)
    blocks = [quantized((count, 96), qtype, seed=count)[0] for count in rows]
    [(shape, dtype)] = BlockLinear.stored_form_of((sum(rows), 96), qtype).values()
    buffer = torch.full((shape[0] * shape[1] * shape[2] + 24,), 0x5A, dtype=dtype)
    view = buffer[8:-16].view(shape)
    BlockLinear.pack_into([torch.from_numpy(b) for b in blocks], qtype, {"packed": view})
    stacked = BlockLinear.stacked([BlockLinear.from_file(b, qtype) for b in blocks])
    assert stacked is not None and torch.equal(view, stacked.packed)
    assert torch.equal(view, torch.cat([reference_records(b, qtype) for b in blocks]))
    assert (buffer[:8] == 0x5A).all() and (buffer[-16:] == 0x5A).all()


def test_the_out_variant_refuses_a_destination_of_another_form() -> None:
    raw = torch.from_numpy(quantized((40, 96), Q.Q4_1)[0])
    [(shape, _)] = BlockLinear.stored_form_of((40, 96), Q.Q4_1).values()
    bad = {
        "tiles": torch.empty((shape[0] - 1, *shape[1:]), dtype=torch.uint8),
        "record bytes": torch.empty((*shape[:2], record_bytes(8)), dtype=torch.uint8),
        "dtype": torch.empty(shape, dtype=torch.int8),
        "contiguous": torch.empty((shape[0], shape[1], 2 * shape[2]), dtype=torch.uint8)[..., ::2],
    }
    for out in bad.values():  # keyed by what each destination gets wrong
        with pytest.raises(RuntimeError, match="block_pack: out must be contiguous uint8"):
            torch.ops.gracelm.block_pack_into(raw, int(Q.Q4_1), out)


def reference_records(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """The records of `block_linear.py`'s layout, built from the file's values in torch ops: the outputs in
    tiles of 16 (the last padded with zeros), per (tile, block) vector j of inputs 4j..4j+3 of every output
    (4 bits: vectors 2h and 2h + 1 as low and high nibbles), then the 16 scales and the 16 minimums."""
    q, scales, minimums = file_blocks(raw, qtype)
    rows, columns = q.shape
    pad = -rows % 16
    q, scales, minimums = (F.pad(t, (0, 0, 0, pad)) for t in (q, scales, minimums))
    tiles, blocks = (rows + pad) // 16, columns // BLOCK
    vectors = q.view(tiles, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4)  # [tile, block, j, output, input]
    if BITS[qtype] == 4:
        vectors = vectors[:, :, 0::2] | (vectors[:, :, 1::2] << 4)
    tails = torch.stack([scales, minimums]).view(2, tiles, 16, blocks).permute(1, 3, 0, 2).contiguous()
    return torch.cat([vectors.reshape(tiles, blocks, -1), tails.view(torch.uint8).reshape(tiles, blocks, -1)],
                     dim=2)


def test_a_minimum_that_overflows_float16_is_refused() -> None:
    blocks = quantized((16, BLOCK), Q.Q8_0)[0].copy()
    blocks[3, :2] = np.frombuffer(np.float16(600.0).tobytes(), dtype=np.uint8)  # row 3's scale: 600
    with pytest.raises(RuntimeError, match="minimum overflows float16"):
        BlockLinear.from_file(blocks, Q.Q8_0)


def test_bad_arguments_raise_an_error_naming_the_kernel() -> None:
    form = BlockLinear.from_file(quantized((40, 96), Q.Q4_1)[0], Q.Q4_1)
    x = activations(3, 96)
    matmul = torch.ops.gracelm.block_matmul
    bad = {
        "bits": lambda: matmul(x, form.packed, 40, 5, False),
        "records": lambda: matmul(x, form.packed, 40, 8, False),
        "inputs": lambda: matmul(activations(3, 64), form.packed, 40, 4, False),
        "outputs": lambda: matmul(x, form.packed, 49, 4, False),
        "too few outputs": lambda: matmul(x, form.packed, 32, 4, False),
        "dtype": lambda: matmul(x.half(), form.packed, 40, 4, False),
        "packed dtype": lambda: matmul(x, form.packed.view(torch.int8), 40, 4, False),
        "contiguous": lambda: matmul(activations(3, 192)[:, ::2], form.packed, 40, 4, False),
        "dims": lambda: matmul(x[None], form.packed, 40, 4, False),
    }
    for call in bad.values():  # keyed by what each call gets wrong
        with pytest.raises(RuntimeError, match="block_matmul"):
            call()
