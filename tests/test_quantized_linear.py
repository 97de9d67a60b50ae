"""Low-bit weights for decode steps (`model/quantized_linear.py`, `model/gguf_int4.py`): GGUF's Q4_0 and
Q4_1 blocks read into torch's int4 kernel's form hold gguf's own dequantized values exactly; the kernel's
matmul equals the dequantized one up to float32 rounding with float32 scales, and stays within the
rounding of bfloat16 scales as served, each row computed as if alone; `FrozenLinear` picks the kernel by the
number of rows (seen in the profiler) and can be forced to one. For both low-bit forms (`FORMS`: torch's
int4 kernel, and the blocks' 8-bit-activation kernel of `model/block_linear.py`, whose own matmul
tests are in test_block_linear.py): the form is cached; a 4-bit GGUF model serves decode steps through it,
in bfloat16 and in float32 chosen by `--dtype auto` (an engine says so in its log), short prompts too,
longer ones through the dense weights, each sequence's rows as alone beside others; a float32 asked for
and `--quantization none` keep dense weights; on the default model the greedy tokens agree with the dense
path where the dense logits do not nearly tie."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gracelm import Engine, SamplingParams, cpu_features
from gracelm.model.attention import allocate_kv_cache
from gracelm.model.block_linear import MAX_ROWS as BLOCK_MAX_ROWS
from gracelm.model.block_linear import BlockLinear, amx_rows
from gracelm.model.block_linear import serves as block_serves
from gracelm.model.file_hash import content_hash
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.gguf_int4 import input_copies, int4_blocks
from gracelm.model.kernel_library import LOADED
from gracelm.model.llama import (
    FrozenLinear,
    LlamaForCausalLM,
    describe_linear_kernels,
    long_prompts_differ,
    set_int4_max_rows,
)
from gracelm.model.loader import LoadedModel, load_model
from gracelm.model.low_bit_gate import SHORT_PROMPT
from gracelm.model.model_files import ModelLoadError
from gracelm.model.quantized_linear import (
    GROUP_SIZE,
    HALVES_MAX_ROWS,
    INT4_MAX_ROWS,
    Int4Linear,
    LowBitForm,
    int4_rows_for,
)
from gracelm.model.weight_cache import entry_path
from tests.test_default_model import greedy_batch
from tests.test_gguf import VOCAB, gguf_layout, hf_model, write_gguf

INT4_OP = "aten::_weight_int4pack_mm_for_cpu"
# Each low-bit form (`--quantization`) and the op it runs. The blocks' kernel needs AVX-512 VNNI: skipped on
# a CPU without it, never where gracelm._kernels is missing (a broken build fails).
BLOCK_OP = "gracelm::block_matmul"
FORM_OPS = {"blocks": BLOCK_OP, "int4": INT4_OP}
no_vnni = pytest.mark.skipif(LOADED and not torch.ops.gracelm.block_matmul_serves(),
                             reason="this CPU lacks AVX-512 VNNI")
FORMS = [pytest.param("blocks", marks=no_vnni), "int4"]
# (rows, columns): rows that fill the kernel's 64-row blocks, rows it pads (to 16) and rows it does not.
SHAPES = [(128, 576), (40, 96), (200, 64), (48, 32)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64]  # across INT4_MAX_ROWS
BF16_UNIT_ROUNDOFF = 2.0**-8
# Block types the int4 kernel takes: 4-bit ones, and Q8_0 as two 4-bit halves.
BLOCK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]

NATIVE_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_native_bf16 = pytest.mark.skipif(not NATIVE_BF16, reason="bfloat16 is emulated on this CPU")
# What `--dtype auto` runs a 4-bit model in here, and the dense bfloat16 kernel.
SERVED_DTYPE = torch.bfloat16 if NATIVE_BF16 else torch.float32
DENSE_BF16 = "bfloat16 oneDNN" if NATIVE_BF16 else "bfloat16 F.linear"
DENSE_OP = "mkldnn::_linear_pointwise" if NATIVE_BF16 else "aten::linear"


def quantized(shape: tuple[int, int], qtype: Q, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random weights in GGUF blocks of `qtype` (gguf-py's own quantizer), and gguf's dequantization."""
    weights = np.random.default_rng(seed).normal(0.0, 0.05, shape).astype(np.float32)
    weights[:, :GROUP_SIZE] += 0.03  # a block whose values are not centred on zero: Q4_1's minimum counts
    blocks = gguf.quants.quantize(weights, qtype)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(shape))


def int4_form(blocks: np.ndarray, qtype: Q) -> Int4Linear:
    return Int4Linear.pack(*int4_blocks(blocks, qtype), input_copies(qtype))


def by_input(per_column: torch.Tensor, qtype: Q) -> torch.Tensor:
    """[rows, K] from [rows, K · input_copies]: a Q8_0 weight is its two halves' sum."""
    return per_column.view(per_column.shape[0], input_copies(qtype), -1).sum(1)


def activations(rows: int, columns: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows)).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_blocks_read_as_ggufs_own_dequantized_values(qtype: Q, shape: tuple[int, int]) -> None:
    blocks, reference = quantized(shape, qtype)
    q, scales, zeros = int4_blocks(blocks, qtype)
    assert q.min() >= 0 and q.max() <= 15 and q.shape == (shape[0], shape[1] * input_copies(qtype))
    groups = q.float().view(shape[0], -1, GROUP_SIZE)
    values = (groups - 8) * scales[..., None] + zeros[..., None]
    assert torch.equal(by_input(values.reshape(q.shape), qtype), reference)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_the_kernel_multiplies_the_files_values_with_float32_scales(qtype: Q, shape: tuple[int, int]) -> None:
    """Scales and zeros as loaded (float32, exact): the product is the dequantized one up to float32
    rounding, so the packed layout loses nothing (and a wrong layout would show at once)."""
    blocks, reference = quantized(shape, qtype)
    linear = int4_form(blocks, qtype)
    for rows in ROWS:
        x = activations(rows, shape[1])
        expected = x.double() @ reference.double().T
        bound = 1e-5 * (x.abs().double() @ reference.abs().double().T) + 1e-7
        error = (linear(x).double() - expected).abs()
        assert (error <= bound).all(), f"{rows} rows: {(error - bound).max()}"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_bfloat16_scales_err_only_by_their_rounding(qtype: Q, shape: tuple[int, int]) -> None:
    """As served (bfloat16 activations and scales): each weight is off by at most the rounding of its
    group's scale times |q - 8| plus that of its zero (of each half's, for Q8_0), and the output by that
    and its own rounding."""
    blocks, reference = quantized(shape, qtype)
    q, scales, zeros = int4_blocks(blocks, qtype)
    linear = Int4Linear.pack(q, scales, zeros, input_copies(qtype)).to_dtype(torch.bfloat16)
    per_weight = BF16_UNIT_ROUNDOFF * ((q.double() - 8).abs().view(shape[0], -1, GROUP_SIZE)
                                       * scales.double().abs()[..., None] + zeros.double().abs()[..., None])
    per_weight = by_input(per_weight.reshape(q.shape), qtype)
    for rows in ROWS:
        x = activations(rows, shape[1], torch.bfloat16)
        expected = x.double() @ reference.double().T
        bound = (x.double().abs() @ per_weight.T + BF16_UNIT_ROUNDOFF * expected.abs()
                 + 1e-5 * (x.double().abs() @ reference.double().abs().T))
        error = (linear(x).double() - expected).abs()
        assert (error <= bound).all(), f"{rows} rows: {(error - bound).max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_int4_kernel_computes_each_row_as_if_alone(dtype: torch.dtype) -> None:
    """Rows do not interact (what a batch-invariant mode forcing int4 at every size relies on): each row
    of a call equals the call of that row alone, bit for bit."""
    blocks, _ = quantized((200, 576), Q.Q4_1)
    linear = int4_form(blocks, Q.Q4_1).to_dtype(dtype)
    x = activations(64, 576, dtype)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(64)])
    for rows in ROWS:
        assert torch.equal(linear(x[:rows]), alone[:rows]), rows


def kernels_run(linear: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, set[str]]:
    """The output, and the names of the operators that computed it (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = linear(x)
    return out, {event.key for event in profile.key_averages()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_frozen_linear_picks_the_kernel_by_rows_and_can_be_forced(dtype: torch.dtype) -> None:
    """In float32 too: the int4 form takes bfloat16 activations and answers in float32."""
    blocks, reference = quantized((128, 576), Q.Q4_1)
    bias = torch.randn(128).to(dtype)
    frozen = FrozenLinear([reference.to(dtype)], [bias], int4_form(blocks, Q.Q4_1))
    dense = FrozenLinear([reference.to(dtype)], [bias])
    assert frozen.int4_max_rows == INT4_MAX_ROWS and frozen.int4.scales_zeros.dtype == torch.bfloat16
    for max_rows in (INT4_MAX_ROWS, 0, sys.maxsize):  # as measured, never, always
        frozen.int4_max_rows = max_rows
        for rows in ROWS:
            x = activations(rows, 576, dtype)
            out, ops = kernels_run(frozen, x)
            assert out.dtype == dtype
            chosen = frozen.int4(x) + bias if rows <= max_rows else dense(x)
            assert (INT4_OP in ops) == (rows <= max_rows), (max_rows, rows, ops)
            assert torch.equal(out, chosen)
            assert not torch.equal(out, frozen.int4(x) + bias if rows > max_rows else dense(x))


def test_stacked_forms_equal_their_parts_where_the_layout_stacks() -> None:
    parts = [quantized(shape, Q.Q4_0, seed) for seed, shape in enumerate([(64, 96), (128, 96), (40, 96)])]
    forms = [int4_form(blocks, Q.Q4_0) for blocks, _ in parts]
    stacked = Int4Linear.stacked(forms)
    assert stacked is not None and stacked.rows == 232
    x = activations(3, 96)
    assert torch.equal(stacked(x), torch.cat([form(x) for form in forms], dim=1))
    # A part of 40 rows fills no whole block of the packed layout: only the last may be one.
    assert Int4Linear.stacked([forms[2], forms[0]]) is None


def tiny_gguf(path: Path, qtype: Q, seed: int = 3) -> Path:
    """A tiny Llama in 4-bit blocks, tied: its logits head is the 4-bit embedding (padded: the vocabulary
    is no multiple of 16)."""
    assert VOCAB % 16
    return write_gguf(path, gguf_layout(hf_model("llama", seed=seed), "llama"), qtype)


def decode_logits(model: LlamaForCausalLM, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Logits of a prefill of `rows` sequences of 6 tokens (dense: more than INT4_MAX_ROWS rows), then
    of 3 decode steps of `rows` rows."""
    block = 16
    caches = allocate_kv_cache(model.config, rows, block, dtype)
    tables = torch.arange(rows)[:, None]
    tokens = torch.randint(0, VOCAB, (rows, 9), generator=torch.Generator().manual_seed(1))
    logits = []
    for start, length in ((0, 6), (6, 1), (7, 1), (8, 1)):
        positions = torch.arange(start, start + length).repeat(rows)
        batch = ForwardBatch(
            input_ids=tokens[:, start : start + length].reshape(-1), positions=positions,
            slot_mapping=tables.repeat_interleave(length) * block + positions, query_lens=[length] * rows,
            seq_lens=[start + length] * rows, block_tables=tables,
            logits_indices=torch.arange(1, rows + 1) * length - 1)
        logits.append(model(batch, caches))
    return torch.stack(logits)


def description(form: str, dtype: torch.dtype, qtype: Q) -> str:
    """How the log describes a model's low-bit form, for decode steps of how many rows."""
    if form == "blocks":
        amx = f", 4-bit ones x bfloat16 activations in calls of >= {amx_rows()} rows (AMX)" \
            if amx_rows() else ""
        return (f"the file's blocks x 8-bit activations (AVX-512 VNNI, gracelm._kernels){amx} for decode "
                f"tokens and prompts of < {SHORT_PROMPT} tokens, <= {BLOCK_MAX_ROWS} rows a step")
    halves = qtype == Q.Q8_0 and dtype == torch.bfloat16
    return (f"int4 (group 32, bfloat16 scales) for decode tokens and prompts of < {SHORT_PROMPT} tokens, "
            f"<= {int4_rows_for(dtype)} rows a step"
            f"{f' (8-bit matrices as 4-bit halves: <= {HALVES_MAX_ROWS})' if halves else ''}")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_a_4bit_gguf_model_serves_decode_steps_through_its_low_bit_form(tmp_path: Path, qtype: Q,
                                                                        dtype: str, form: str) -> None:
    """In bfloat16, and in what `--dtype auto` gives (float32 where bfloat16 is emulated: the int4 calls
    then round the activations to bfloat16)."""
    path = tiny_gguf(tmp_path / "m.gguf", qtype)
    loaded = load_model(path, dtype=dtype, quantization=form)
    assert loaded.dtype == (torch.bfloat16 if dtype == "bfloat16" else SERVED_DTYPE)
    assert set(loaded.int4) == {name for name, t in loaded.model.state_dict().items() if t.dim() == 2}
    loaded.freeze()
    assert not loaded.int4  # handed over
    dense_kernel = DENSE_BF16 if loaded.dtype == torch.bfloat16 else "float32 F.linear"
    assert describe_linear_kernels(loaded.model).startswith(
        f"{description(form, loaded.dtype, qtype)}, {dense_kernel} above and for longer prompts, "
        f"for {2 * 4 + 1} of {2 * 4 + 1} matmuls")
    dense = load_model(path, dtype="bfloat16", quantization="none")
    assert not dense.int4
    dense.freeze()
    assert describe_linear_kernels(dense.model) == f"{DENSE_BF16} at every batch size (9 matmuls)"
    exact = load_model(path, dtype="float32", quantization="none")
    exact.freeze()
    reference = decode_logits(exact.model, 2, torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        ours = decode_logits(loaded.model, 2, loaded.dtype)
    assert FORM_OPS[form] in {event.key for event in profile.key_averages()}
    dense_error = (decode_logits(dense.model, 2, torch.bfloat16) - reference).abs().max()
    low_bit_error = (ours - reference).abs().max()
    assert reference.abs().max() > 1.0  # far from zero, so that a wrong weight would show
    # Against the file's values in float32, the low-bit path errs about as the dense bfloat16 path does.
    assert low_bit_error <= 3 * dense_error, (low_bit_error, dense_error)


@pytest.mark.parametrize("form", FORMS)
def test_decode_tokens_and_short_prompts_take_the_low_bit_form_longer_prompts_the_dense(tmp_path: Path,
                                                                                     form: str) -> None:
    """By each sequence's whole prompt length, whatever its chunk: a prompt of SHORT_PROMPT tokens or more
    runs dense, its head, a tail of 2 rows (what is left when the prefix cache served its head) and a tail
    of 1 row (shaped like a decode step, but its logits choose the first token: the batch's prompt lengths
    say so); a shorter prompt, however its rows come, and decode tokens run the low-bit form; a step mixing
    the two runs each of its rows as it would run alone, so both kernels."""
    loaded = load_model(tiny_gguf(tmp_path / "m.gguf", Q.Q4_1), dtype="bfloat16", quantization=form)
    loaded.freeze()
    low, long = FORM_OPS[form], SHORT_PROMPT + 4
    assert kernels_of_step(loaded, [4], 0, [long]) & {low, DENSE_OP} == {DENSE_OP}  # a long prompt's head
    assert kernels_of_step(loaded, [2], long - 2, [long]) & {low, DENSE_OP} == {DENSE_OP}  # its tail
    assert kernels_of_step(loaded, [1], long - 1, [long]) & {low, DENSE_OP} == {DENSE_OP}  # a 1-row tail
    assert kernels_of_step(loaded, [6], 0, [6]) & {low, DENSE_OP} == {low}  # a short prompt whole
    short = SHORT_PROMPT - 1
    assert kernels_of_step(loaded, [2], short - 2, [short]) & {low, DENSE_OP} == {low}  # a short one's tail
    assert kernels_of_step(loaded, [1, 1], 6, [6, 4]) & {low, DENSE_OP} == {low}  # two decode tokens
    assert kernels_of_step(loaded, [1, 1], 6) & {low, DENSE_OP} == {low}  # the same, prompt lengths not given
    assert kernels_of_step(loaded, [1, 3], 4, [4, long]) & {low, DENSE_OP} == {low, DENSE_OP}  # both kinds


@no_vnni
def test_a_sequence_gets_the_same_logits_beside_others_as_alone(tmp_path: Path) -> None:
    """Through the blocks' kernels: a decode token and a short prompt (16 low-bit rows together), computed
    in one step and then in one step beside a long prompt's chunk (which runs dense), get bit for bit the
    same logits, so a request's answer does not depend on the others in its step; and each alone too, where
    one kernel serves every count of rows (a CPU without AMX: on one with it, steps of 16 low-bit rows or
    more take the AMX kernel, whose bfloat16 arithmetic differs from the 8-bit one's). (torch's int4 kernel
    serves at most 8 rows: a decode token beside more runs dense.)"""
    loaded = load_model(tiny_gguf(tmp_path / "m.gguf", Q.Q4_1), dtype="bfloat16", quantization="blocks")
    loaded.freeze()
    caches = allocate_kv_cache(loaded.config, 8, 16, loaded.dtype)
    tokens = torch.randint(1, VOCAB, (3, 2 * 16), generator=torch.Generator().manual_seed(2))
    decoding = Sequence(tokens[0], blocks=[0, 1], prompt=5)
    short = Sequence(tokens[1], blocks=[2, 3], prompt=SHORT_PROMPT - 1)
    long = Sequence(tokens[2], blocks=[4, 5], prompt=SHORT_PROMPT + 8)
    run_step(loaded, caches, [(decoding, 0, 5)])  # its prompt, cached
    low_bit = run_step(loaded, caches, [(decoding, 5, 1), (short, 0, short.prompt)])
    together = run_step(loaded, caches, [(decoding, 5, 1), (long, 0, 8), (short, 0, short.prompt)])
    assert torch.equal(together[0], low_bit[0]) and torch.equal(together[2], low_bit[1])
    if amx_rows() == 0:
        alone = [run_step(loaded, caches, [(decoding, 5, 1)]),
                 run_step(loaded, caches, [(short, 0, short.prompt)])]
        assert torch.equal(together[0], alone[0][0]) and torch.equal(together[2], alone[1][0])


@dataclass
class Sequence:
    tokens: torch.Tensor
    blocks: list[int]  # of a cache of 16-token blocks
    prompt: int  # its prompt's length


def run_step(loaded: LoadedModel, caches: list[torch.Tensor], chunks: list[tuple[Sequence, int, int]]
             ) -> torch.Tensor:
    """The logits of the last token of each (sequence, start, length) chunk, computed in one step."""
    sequences = [seq for seq, _, _ in chunks]
    positions = [torch.arange(start, start + length) for _, start, length in chunks]
    pairs = list(zip(sequences, positions, strict=True))
    batch = ForwardBatch(
        input_ids=torch.cat([seq.tokens[p] for seq, p in pairs]), positions=torch.cat(positions),
        slot_mapping=torch.cat([torch.tensor(seq.blocks)[p // 16] * 16 + p % 16 for seq, p in pairs]),
        query_lens=[length for _, _, length in chunks],
        seq_lens=[start + length for _, start, length in chunks],
        block_tables=torch.tensor([seq.blocks for seq in sequences]),
        logits_indices=torch.tensor([length for _, _, length in chunks]).cumsum(0) - 1,
        prompt_lens=[seq.prompt for seq in sequences])
    return loaded.model(batch, caches)


def kernels_of_step(loaded: LoadedModel, query_lens: list[int], start: int,
                    prompt_lens: list[int] | None = None) -> set[str]:
    """The ops a forward of sequences of `query_lens` new tokens after `start` cached ones, of prompts of
    `prompt_lens` tokens (None: not given), each over its own two blocks of a fresh cache, runs."""
    caches = allocate_kv_cache(loaded.config, 2 * len(query_lens), 16, loaded.dtype)
    rows = sum(query_lens)
    positions = torch.tensor([start + i for q in query_lens for i in range(q)])
    slots = torch.tensor([seq * 32 + start + i for seq, q in enumerate(query_lens) for i in range(q)])
    batch = ForwardBatch(input_ids=torch.arange(rows) + 1, positions=positions, slot_mapping=slots,
                         query_lens=query_lens, seq_lens=[start + q for q in query_lens],
                         block_tables=torch.arange(2 * len(query_lens)).view(-1, 2),
                         logits_indices=torch.tensor(query_lens).cumsum(0) - 1, prompt_lens=prompt_lens)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loaded.model(batch, caches)
    return {event.key for event in profile.key_averages()}


@no_vnni
def test_long_prompts_take_kernels_of_their_own_beside_a_dense_copy_or_the_tile_unit_only(tmp_path: Path
                                                                                         ) -> None:
    """What the warm-up's long prompt is for (`parallel/warmup.py`): the file's blocks alone multiply a long
    prompt with the very ops of a short one, unless the tile unit takes its calls (its attention is SDPA,
    whose first call the warm-up leaves to the first long prompt); a dense copy serves it."""
    path = tiny_gguf(tmp_path / "m.gguf", Q.Q4_1)
    long, short = [SHORT_PROMPT + 4], [4]
    alone = load_model(path, dtype="bfloat16", quantization="blocks", dense_weights="off")
    alone.freeze()
    assert long_prompts_differ(alone.model) == (amx_rows() > 0)
    if not amx_rows():
        long_ops, short_ops = kernels_of_step(alone, long, 0, long), kernels_of_step(alone, short, 0, short)
        assert BLOCK_OP in long_ops & short_ops
        assert long_ops - short_ops == {"aten::scaled_dot_product_attention",
                                        "aten::_scaled_dot_product_flash_attention_for_cpu"}
    beside = load_model(path, dtype="bfloat16", quantization="blocks", dense_weights="on")
    beside.freeze()
    assert long_prompts_differ(beside.model)
    dense_ops = {"mkldnn::_linear_pointwise", "aten::linear"}
    assert dense_ops & kernels_of_step(beside, long, 0, long) and not dense_ops & kernels_of_step(
        beside, short, 0, short)
    dense = load_model(path, dtype="bfloat16", quantization="none")
    dense.freeze()
    assert long_prompts_differ(dense.model)


def test_8bit_halves_serve_bfloat16_steps_of_few_rows_only(tmp_path: Path) -> None:
    """A Q8_0 matrix's halves take twice a 4-bit matrix's work: in bfloat16 they serve steps of at most
    HALVES_MAX_ROWS rows (`quantized_linear.halves_rows_for`), where a 4-bit model's forms serve up to
    INT4_MAX_ROWS."""
    eight_bit = load_model(tiny_gguf(tmp_path / "q8.gguf", Q.Q8_0), dtype="bfloat16", quantization="int4")
    eight_bit.freeze()
    assert INT4_OP in kernels_of_step(eight_bit, [1] * HALVES_MAX_ROWS, 6)
    assert INT4_OP not in kernels_of_step(eight_bit, [1] * (HALVES_MAX_ROWS + 1), 6)
    four_bit = load_model(tiny_gguf(tmp_path / "q4.gguf", Q.Q4_1), dtype="bfloat16", quantization="int4")
    four_bit.freeze()
    assert INT4_OP in kernels_of_step(four_bit, [1] * INT4_MAX_ROWS, 6)


@no_vnni
def test_the_blocks_serve_decode_steps_of_any_count_8bit_matrices_too(tmp_path: Path) -> None:
    """The blocks' kernel multiplies Q8_0 blocks as they are (no halves): 4- and 8-bit matrices alike serve
    decode steps of one row and of 130 (beyond torch's int4 crossover and the graphs) with no dense
    matmul at all."""
    for qtype in (Q.Q8_0, Q.Q4_1):
        loaded = load_model(tiny_gguf(tmp_path / f"{qtype.name}.gguf", qtype), dtype="bfloat16",
                            quantization="blocks")
        loaded.freeze()
        assert loaded.model.model.int4_gate.max_rows == BLOCK_MAX_ROWS
        for rows in (1, 130):
            ops = kernels_of_step(loaded, [1] * rows, 6)
            assert BLOCK_OP in ops and not {"mkldnn::_linear_pointwise", "aten::linear"} & ops, rows


def test_float32_asked_and_none_keep_dense_weights(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "m.gguf", Q.Q4_1)
    loaded = load_model(path, dtype="float32")
    assert not loaded.int4
    loaded.freeze()
    assert describe_linear_kernels(loaded.model) == "float32 F.linear at every batch size (9 matmuls)"
    with pytest.raises(ModelLoadError, match="quantization 'awq'; choose auto, blocks, int4, none"):
        load_model(path, quantization="awq")


def test_dense_weights_off_where_no_low_bit_form_serves_is_refused_saying_why(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "m.gguf", Q.Q4_1)
    with pytest.raises(ModelLoadError, match="--dense-weights off cannot serve .*no low-bit form serves it"):
        load_model(path, dtype="float32", dense_weights="off")


@pytest.mark.skipif(not (LOADED and block_serves()), reason="the blocks kernel does not serve on this CPU")
def test_the_blocks_the_model_stacks_are_the_cache_entrys_records_not_a_copy(tmp_path: Path) -> None:
    """q/k/v and gate/up, stacked by the model (one matmul each), are views of the stacks the cache keeps:
    on a cold start (the entry just written) and a warm one (mapped from it), the weights are held once."""
    path = tiny_gguf(tmp_path / "m.gguf", Q.Q4_1, seed=12)  # a cold cache
    for _ in ("cold", "warm"):
        loaded = load_model(path, dtype="bfloat16", quantization="blocks", dense_weights="off")
        parts = dict(loaded.int4)
        loaded.freeze()
        stacks = [module for module in loaded.model.modules()
                  if isinstance(module, FrozenLinear) and len(module.output_sizes) > 1]
        assert len(stacks) == 2 * loaded.config.num_hidden_layers, stacks
        q_proj = parts["model.layers.0.self_attn.q_proj.weight"].packed
        layer0 = [s for s in stacks if s.int4.packed.untyped_storage().data_ptr()
                  == q_proj.untyped_storage().data_ptr()]
        assert len(layer0) == 1 and layer0[0].int4.packed.data_ptr() == q_proj.data_ptr()
        assert layer0[0].int4.rows == sum(layer0[0].output_sizes)


@pytest.mark.parametrize("form", FORMS)
def test_the_low_bit_form_is_cached_and_a_damaged_entry_rebuilt(tmp_path: Path, form: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    path = tiny_gguf(tmp_path / "m.gguf", Q.Q4_1, seed=11)  # a file of its own: a cold cache
    layout = {"blocks": BlockLinear, "int4": Int4Linear}[form].layout()
    entry = entry_path(content_hash(path), layout)
    assert not entry.exists()
    # Copied: a cold start too serves the entry's mapping once written, and the entry is truncated below.
    cold = copy.deepcopy(load_model(path, dtype="bfloat16", quantization=form).int4)
    assert entry.is_file()
    # a hit, mapped from the entry
    assert_same_forms(load_model(path, dtype="bfloat16", quantization=form).int4, cold)
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2])  # no mapping of it is left: touching one now would fault
    with caplog.at_level(logging.WARNING, logger="gracelm.model.weight_cache"):
        rebuilt = load_model(path, dtype="bfloat16", quantization=form).int4
    assert f"converted-weights cache entry {entry} is unreadable" in caplog.text
    assert entry.read_bytes() == data
    assert_same_forms(rebuilt, cold)


def test_the_int4_layouts_of_every_vector_level_here_are_told_apart() -> None:
    """Each of ATen's vector levels this CPU runs (`ATEN_CPU_CAPABILITY`: the baseline, AVX2, AVX-512) in a
    process of its own: where two pack a real-shaped random matrix apart, their `layout_id`s differ, so a
    cache entry of the one is never read by the other (AVX2's and the baseline's once shared one id, and a
    CPU without AVX2 read AVX2's packing as its own)."""
    code = ("import hashlib, torch\n"
            "from gracelm.model.quantized_linear import layout_id\n"
            "seeded = torch.Generator().manual_seed(5)\n"
            "q = torch.randint(0, 16, (272, 576), generator=seeded, dtype=torch.int32)\n"
            "packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)\n"
            "print(layout_id(), hashlib.sha256(packed.numpy().tobytes()).hexdigest())\n")
    levels = ["default", "avx2", "avx512"][:1 + ("avx2" in cpu_features.detected())
                                           + ("avx512" in cpu_features.detected())]
    seen = {}
    for level in levels:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": level},
                             capture_output=True, text=True, check=True).stdout.split()
        seen[level] = (out[0], out[1])
    for a in levels:
        for b in levels:
            assert (seen[a][0] == seen[b][0]) == (seen[a][1] == seen[b][1]), (a, b, seen)


def assert_same_forms(forms: dict[str, LowBitForm], expected: dict[str, LowBitForm]) -> None:
    assert forms.keys() == expected.keys()
    for name, form in expected.items():
        assert type(forms[name]) is type(form) and forms[name].rows == form.rows
        assert forms[name].tensors().keys() == form.tensors().keys()
        for part, tensor in form.tensors().items():
            assert torch.equal(forms[name].tensors()[part], tensor)


def test_an_engine_logs_its_linear_kernels(tmp_path: Path, capfd: pytest.CaptureFixture,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """From `--quantization` (here `Engine(quantization=...)`) to the core's log; and its attention's."""
    path = tiny_gguf(tmp_path / "m.gguf", Q.Q4_1)
    caplog.set_level(logging.INFO)  # the core logs at its parent's level
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    auto = "the file's blocks x 8-bit activations" if LOADED and torch.ops.gracelm.block_matmul_serves() \
        else "int4 (group 32, bfloat16 scales)"
    for quantization, kernels in (("auto", auto), ("int4", "int4 (group 32, bfloat16 scales)"),
                                  ("none", f"{DENSE_BF16} at every batch size")):
        with Engine(str(path), dtype="bfloat16", quantization=quantization, num_threads=1,
                    kv_cache_memory="4MiB") as engine:
            out = engine.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        log = capfd.readouterr().err
        assert f"rank 0 linear kernels: {kernels}" in log, log[-2000:]
        assert "rank 0 decode attention: fused CPU kernel (gracelm._kernels, " in log, log[-2000:]


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at"]


def forced_logits(loaded: LoadedModel, tokens: list[int], prompt_length: int) -> torch.Tensor:
    """Logits of each position from the prompt's last on: the prompt in one step, then one token per step
    (one row: int4 where the model has it)."""
    block = 16
    blocks = -(-len(tokens) // block)
    caches = allocate_kv_cache(loaded.config, blocks, block, loaded.dtype)

    def step(start: int, chunk: list[int]) -> torch.Tensor:
        positions = torch.arange(start, start + len(chunk))
        batch = ForwardBatch(input_ids=torch.tensor(chunk), positions=positions, slot_mapping=positions,
                             query_lens=[len(chunk)], seq_lens=[start + len(chunk)],
                             block_tables=torch.arange(blocks)[None],
                             logits_indices=torch.tensor([len(chunk) - 1]))
        return loaded.model(batch, caches)[0]

    logits = [step(0, tokens[:prompt_length])]
    logits += [step(i, [tokens[i]]) for i in range(prompt_length, len(tokens) - 1)]
    return torch.stack(logits)


@pytest.mark.timeout(600)
def test_default_model_greedy_tokens_agree_with_the_dense_path() -> None:
    """In the dtype `--dtype auto` gives (bfloat16, or float32 where bfloat16 is emulated), teacher-forced on
    the dense path's own greedy continuations (so that one flip does not derail the rest): the low-bit
    path's (`--quantization auto`: the blocks' kernel where the CPU has VNNI) top token is the dense one's
    at least 90 % of the time (measured in bfloat16 over 6 prompts, 40 tokens each: 230 of 240 with the
    blocks' kernel, within 0.5; 232-236 with torch's int4 kernel, within 0.25), and it differs only where
    the dense logits nearly tie (1.0 allowed)."""
    loaded = load_model(None)
    loaded.freeze()
    low_bit_rows = loaded.model.model.int4_gate.max_rows
    agree, total = 0, 0
    for prompt in PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        set_int4_max_rows(loaded.model, 0)
        tokens = ids + greedy_batch(loaded, [ids], 24)[0]
        dense = forced_logits(loaded, tokens, len(ids))
        set_int4_max_rows(loaded.model, low_bit_rows)
        int4 = forced_logits(loaded, tokens, len(ids))
        dense_top, int4_top = dense.argmax(-1), int4.argmax(-1)
        agree += int((dense_top == int4_top).sum())
        total += len(dense_top)
        rows = torch.arange(len(dense_top))
        margins = dense[rows, dense_top] - dense[rows, int4_top]
        assert (margins < 1.0).all(), (prompt, margins.max())
    assert agree >= 0.9 * total, (agree, total)


def test_a_bad_quantization_is_refused_by_name() -> None:
    from gracelm.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of auto, blocks, int4, none, got 'awq'"):
        EngineConfig(quantization="awq")

