"""Fused paged attention of decode tokens on the CPU: `torch.ops.gracelm.paged_decode_attention`, built from
`gracelm/csrc/paged_decode_attention.cpp` into `gracelm._kernels` when the package is installed
(`setup.py`).

One query token per sequence attends the sequence's cached context, read block by block straight from the
paged cache: no gathered copy of the keys, no masked padding up to the longest sequence, one pass for the
scores and one for the values, float32 sums throughout (from bfloat16 keys by `vdpbf16ps` where the CPU has
AVX512_BF16). One task per (sequence, KV head) serves every query head of that KV head (GQA), so each key and
value row is read once. Where it does not apply (`applies`), decode tokens take
`attention.py:_group_attention` (gathered keys, a bf16 `bmm`, a masked softmax, an `embedding_bag` over the
values). Why a hand-written kernel: docs/performance.md, "Decode attention".
"""

from __future__ import annotations

import functools

import torch

import gracelm.cpu_features as cpu_features
from gracelm.model.kernel_library import LOADED

DTYPES = (torch.bfloat16, torch.float32)
# The kernel's instruction-set levels (`Isa` in the C++), by their short names.
ISA_NAMES = ("baseline", "avx2", "avx512", "avx512_bf16")

if LOADED:
    @torch.library.register_fake("gracelm::paged_decode_attention")
    def _(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
          scale: float, isa: int) -> torch.Tensor:
        return q.new_empty(q.shape, dtype=torch.float32)


def applies(kv_cache: torch.Tensor, batch_invariant: bool = False, choice: str = "auto") -> bool:
    """Whether decode tokens over `kv_cache` (a layer's) are attended by the fused kernel: not in
    batch-invariant mode, which keeps its own row-invariant computation, nor where `choice` says unfused."""
    return (LOADED and choice != "unfused" and not batch_invariant and kv_cache.device.type == "cpu"
            and kv_cache.dtype in DTYPES)


def check_choice(choice: str, kv_cache: torch.Tensor, batch_invariant: bool) -> None:
    """Refuses `--decode-attention fused` where the kernel cannot attend `kv_cache`, naming why."""
    if choice == "fused" and not applies(kv_cache, batch_invariant):
        why = _why_unfused(kv_cache, batch_invariant)
        raise ValueError(f"--decode-attention fused cannot serve here: {why}")


def isa() -> int:
    """The kernel's instruction-set level (an index of `ISA_NAMES`): the most that the CPU runs and its
    active features (`cpu_features.py`) allow."""
    return _isa(cpu_features.active())


@functools.cache
def _isa(active: frozenset[str]) -> int:
    allowed = (3 if "avx512_bf16" in active else 2) if "avx512" in active else 1 if "avx2" in active else 0
    return min(allowed, torch.ops.gracelm.paged_decode_attention_isa()) if LOADED else 0


def describe(kv_cache: torch.Tensor, batch_invariant: bool, choice: str = "auto") -> str:
    """How decode tokens over `kv_cache` are attended, for the log."""
    if applies(kv_cache, batch_invariant, choice):
        return f"fused CPU kernel (gracelm._kernels, {ISA_NAMES[isa()]})"
    return f"unfused ({_why_unfused(kv_cache, batch_invariant, choice)})"


def path(kv_cache: torch.Tensor, batch_invariant: bool, choice: str) -> str:
    """The short name of the path, for /metrics."""
    return f"fused-{ISA_NAMES[isa()]}" if applies(kv_cache, batch_invariant, choice) else "unfused"


def _why_unfused(kv_cache: torch.Tensor, batch_invariant: bool, choice: str = "auto") -> str:
    if choice == "unfused":
        return "--decode-attention unfused"
    if batch_invariant:
        return "deterministic mode's own computation"
    return "gracelm._kernels is not built" if not LOADED else f"{kv_cache.dtype} cache on {kv_cache.device}"


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, head_dim] (one decode token per sequence, the cache's dtype) attends the first
    `seq_lens[b]` tokens of the blocks `block_tables[b]` of `kv_cache` [2, kv_heads, blocks, block_size,
    head_dim] -> [B, heads, head_dim] float32."""
    return torch.ops.gracelm.paged_decode_attention(q.contiguous(), kv_cache, block_tables.contiguous(),
                                                    seq_lens.contiguous(), scale, isa())
