"""Fused paged attention of decode tokens on the CPU: `torch.ops.gracelm.paged_decode_attention`, built from
`gracelm/csrc/paged_decode_attention.cpp` into `gracelm._kernels` when the package is installed
(`setup.py`).

One query token per sequence attends the sequence's cached context, read block by block straight from the
paged cache: no gathered copy of the keys, no masked padding up to the longest sequence, one pass for the
scores and one for the values, float32 sums throughout (from bfloat16 keys by `vdpbf16ps` where the CPU has
AVX512_BF16). One task per (sequence, KV head) serves every query head of that KV head (GQA), so each key and
value row is read once. It replaces the decode path of `attention.py:_group_attention` (gathered keys, a bf16
`bmm`, a masked softmax, an `embedding_bag` over the values) where it applies (`applies`); why a hand-written
kernel: docs/architecture.md, "Decode attention".
"""

from __future__ import annotations

import torch

from gracelm.model.kernel_library import LOADED

DTYPES = (torch.bfloat16, torch.float32)

if LOADED:
    @torch.library.register_fake("gracelm::paged_decode_attention")
    def _(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
          scale: float) -> torch.Tensor:
        return q.new_empty(q.shape, dtype=torch.float32)


def applies(kv_cache: torch.Tensor, batch_invariant: bool = False) -> bool:
    """Whether decode tokens over `kv_cache` (a layer's) are attended by the fused kernel: not in
    batch-invariant mode, which keeps its own row-invariant computation."""
    return LOADED and not batch_invariant and kv_cache.device.type == "cpu" and kv_cache.dtype in DTYPES


def describe(kv_cache: torch.Tensor, batch_invariant: bool) -> str:
    """How decode tokens over `kv_cache` are attended, for the log."""
    if applies(kv_cache, batch_invariant):
        return "fused CPU kernel (gracelm._kernels)"
    if batch_invariant:
        return "unfused (deterministic mode's own computation)"
    why = "gracelm._kernels is not built" if not LOADED else f"{kv_cache.dtype} cache on {kv_cache.device}"
    return f"unfused ({why})"


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, head_dim] (one decode token per sequence, the cache's dtype) attends the first
    `seq_lens[b]` tokens of the blocks `block_tables[b]` of `kv_cache` [2, kv_heads, blocks, block_size,
    head_dim] -> [B, heads, head_dim] float32."""
    return torch.ops.gracelm.paged_decode_attention(q.contiguous(), kv_cache, block_tables.contiguous(),
                                                    seq_lens.contiguous(), scale)
