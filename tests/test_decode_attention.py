"""The fused paged decode-attention kernel (`gracelm/model/decode_attention.py`, built from
`gracelm/csrc/paged_decode_attention.cpp`) against a float64 reference over the same cached values: within
1e-3 in bfloat16 and 1e-5 in float32, on paged caches whose blocks are shuffled, sequences of mixed lengths
(one token, a block's worth and one either side, several hundred), GQA, MQA and plain multi-head, head
sizes the kernel specialises (64, 128: in bfloat16 its `vdpbf16ps` path where the CPU has AVX512_BF16) and
others (32, 80, 72: whole and partial lanes), blocks of 16 and of 5 tokens. Bad arguments raise an error
naming the kernel; the layers use it for decode tokens only. Every test runs at each of the kernel's
instruction-set levels this CPU runs (AVX-512 BF16, AVX-512, AVX2, the baseline), the higher ones masked
(`cpu_features.py`). The kernel is part of the install (scripts/bootstrap.sh builds it): where it is
missing these tests fail, not skip."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

import gracelm.cpu_features as cpu_features
from gracelm.model import decode_attention
from gracelm.model.attention import AttentionMetadata, paged_attention
from gracelm.model.forward_batch import ForwardBatch

TOLERANCE = {torch.bfloat16: 1e-3, torch.float32: 1e-5}
LENGTHS = [1, 15, 16, 17, 300, 40, 2, 129]
# Each level, by what is masked to reach it.
MASKS = {"avx512_bf16": [], "avx512": ["avx512_bf16"], "avx2": ["avx512"], "baseline": ["avx2"]}
SERVED = decode_attention.ISA_NAMES[decode_attention.isa()]
LEVELS = list(MASKS)[list(MASKS).index(SERVED):]


@pytest.fixture(autouse=True, params=LEVELS)
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    with cpu_features.masking(MASKS[request.param]):
        assert decode_attention.ISA_NAMES[decode_attention.isa()] == request.param
        yield request.param


def paged_inputs(lengths: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, a cache with every sequence's blocks drawn from a shuffled pool (block 0 unused, as padding),
    the block tables (padded with 0) and the lengths."""
    generator = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(length / block_size) for length in lengths]
    num_blocks = sum(per_seq) + 3
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=generator).to(dtype)
    pool = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = torch.zeros(len(lengths), max(per_seq) + 1, dtype=torch.long)
    for row, count in enumerate(per_seq):
        tables[row, :count] = torch.tensor([pool.pop() for _ in range(count)])
    q = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype)
    return q, cache, tables, torch.tensor(lengths)


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Each sequence's keys and values gathered in order, attended in float64; query head h reads KV head
    h // (heads / kv_heads)."""
    kv_heads, block_size, head_dim = cache.shape[1], cache.shape[3], cache.shape[4]
    per_kv = q.shape[1] // kv_heads
    out = []
    for row, length in enumerate(lengths.tolist()):
        blocks = tables[row, : math.ceil(length / block_size)]
        kv = cache.index_select(2, blocks).double().reshape(2, kv_heads, -1, head_dim)[:, :, :length]
        keys, values = kv[0].repeat_interleave(per_kv, 0), kv[1].repeat_interleave(per_kv, 0)
        scores = torch.einsum("hd,htd->ht", q[row].double(), keys) * scale
        out.append(torch.einsum("ht,htd->hd", scores.softmax(-1), values))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (9, 3, 64), (8, 2, 128), (4, 4, 64), (6, 1, 32), (4, 2, 80), (3, 3, 72)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_fused_decode_attention_equals_the_reference(dtype: torch.dtype, heads: int, kv_heads: int,
                                                     head_dim: int, block_size: int) -> None:
    q, cache, tables, lengths = paged_inputs(LENGTHS, heads, kv_heads, head_dim, block_size, dtype)
    tables = tables[:, :-1]  # a view, not contiguous: as the engine may slice its tables
    scale = head_dim ** -0.5
    got = decode_attention.paged_decode_attention(q, cache, tables, lengths, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    error = (got.double() - reference(q, cache, tables, lengths, scale)).abs().max().item()
    assert error < TOLERANCE[dtype], error


def test_a_sequence_gets_the_same_bits_whatever_its_batch_and_threads() -> None:
    """Each (sequence, KV head) is one task summed in one order: neither the rows beside it nor the thread
    count change a bit."""
    q, cache, tables, lengths = paged_inputs(LENGTHS, 9, 3, 64, 16, torch.bfloat16)
    together = decode_attention.paged_decode_attention(q, cache, tables, lengths, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for row in range(len(LENGTHS)):
            alone = decode_attention.paged_decode_attention(q[row:row + 1], cache, tables[row:row + 1],
                                                            lengths[row:row + 1], 0.125)
            assert torch.equal(alone[0], together[row])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: {**a, "lengths": torch.tensor([0, 5])}, "has length 0"),
    (lambda a: {**a, "lengths": torch.tensor([5, 10_000])}, "has length 10000"),
    (lambda a: {**a, "tables": a["tables"].fill_(10_000)}, "outside the cache"),
    (lambda a: {**a, "q": a["q"].float()}, "dtypes differ"),
    (lambda a: {**a, "q": a["q"].half(), "cache": a["cache"].half()}, "bfloat16 or float32 only"),
    (lambda a: {**a, "tables": a["tables"].int()}, "must be int64"),
    (lambda a: {**a, "q": a["q"][:, :4]}, "head counts"),
])
def test_bad_arguments_raise_an_error_naming_the_kernel(change, message: str) -> None:
    q, cache, tables, lengths = paged_inputs([3, 20], 9, 3, 64, 16, torch.bfloat16)
    args = change({"q": q, "cache": cache, "tables": tables, "lengths": lengths})
    with pytest.raises(RuntimeError, match=f"paged_decode_attention.*{message}"):
        decode_attention.paged_decode_attention(args["q"], args["cache"], args["tables"], args["lengths"],
                                                0.1)


def decode_step(batch_invariant: bool) -> tuple[AttentionMetadata, torch.Tensor, list[torch.Tensor]]:
    """Decode tokens of two sequences (3 and 9 tokens of context) of a 4-head, 2-KV-head layer."""
    cache = torch.randn(2, 2, 16, 4, 16)
    lengths = [3, 9]
    tables = torch.tensor([[5, 0, 0], [7, 2, 11]])
    positions = torch.tensor(lengths) - 1
    batch = ForwardBatch(input_ids=torch.zeros(2, dtype=torch.long), positions=positions,
                         slot_mapping=tables[torch.arange(2), positions // 4] * 4 + positions % 4,
                         query_lens=[1, 1], seq_lens=lengths, block_tables=tables,
                         logits_indices=torch.arange(2))
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    return AttentionMetadata.build(batch, cache, batch_invariant), cache, [q, k, v]


def test_the_layers_attend_decode_tokens_with_the_kernel_and_the_unfused_path_agrees() -> None:
    meta, cache, (q, k, v) = decode_step(batch_invariant=False)
    assert meta.groups[0].fused
    fused = paged_attention(q, k, v, cache.clone(), meta)
    meta.groups[0].fused = False  # the unfused path, over the same cache
    unfused = paged_attention(q, k, v, cache.clone(), meta)
    assert (fused - unfused).abs().max().item() < 1e-5


def test_batch_invariant_mode_keeps_its_own_decode_path() -> None:
    meta, _, _ = decode_step(batch_invariant=True)
    assert not any(group.fused for group in meta.groups)


def test_the_unfused_choice_keeps_the_kernel_out_and_the_fused_one_is_refused_where_it_cannot_serve(
        ) -> None:
    meta, cache, _ = decode_step(batch_invariant=False)
    assert meta.groups[0].fused and decode_attention.applies(cache, False, "fused")
    assert not decode_attention.applies(cache, False, "unfused")
    decode_attention.check_choice("fused", cache, False)
    with pytest.raises(ValueError, match="--decode-attention fused cannot serve here: torch.float16 cache"):
        decode_attention.check_choice("fused", cache.half(), False)
    with pytest.raises(ValueError, match="deterministic"):
        decode_attention.check_choice("fused", cache, True)


def test_the_log_says_how_decode_tokens_are_attended(level: str) -> None:
    cache = torch.zeros(2, 1, 1, 16, 64, dtype=torch.bfloat16)
    fused = decode_attention.describe(cache, batch_invariant=False)
    assert fused == f"fused CPU kernel (gracelm._kernels, {level})"
    assert decode_attention.path(cache, False, "auto") == f"fused-{level}"
    assert decode_attention.describe(cache, batch_invariant=True).startswith("unfused (deterministic")
    assert decode_attention.describe(cache, False, "unfused") == "unfused (--decode-attention unfused)"
    assert decode_attention.path(cache, False, "unfused") == "unfused"
    half = decode_attention.describe(cache.half(), batch_invariant=False)
    assert half == "unfused (torch.float16 cache on cpu)"
