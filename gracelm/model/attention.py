"""Paged attention: the KV cache, its layout, and attention of a mixed prefill/decode batch over it.

Layout of one layer's cache: `[2, num_kv_heads, num_blocks, block_size, head_dim]` (K then V). Head-major,
so that gathering a sequence's blocks (`index_select` on the block dimension) directly yields the
`[kv_heads, tokens, head_dim]` operands of the attention matmuls: no transposing copy of the context.
A token's slot `block_id * block_size + offset` indexes dim 1 of `cache[i].view(kv_heads, -1, head_dim)`.

Decode tokens (query length 1) of all sequences: on the CPU, with a bfloat16 or float32 cache, the fused
kernel of `decode_attention.py` attends them straight from the cache blocks, every sum in float32
(`QueryGroup.fused`). Elsewhere, and in batch-invariant mode, they go through one batched, masked computation
in the cache's dtype when it is bfloat16 or float32 (`_group_attention`): scores by a batched matmul over
the gathered keys (oneDNN's bf16 `bmm` is several times faster than float32 at these shapes and needs no
converting copy of the cache), values summed by an `embedding_bag` straight from the cache. bf16 products
accumulate in float32; only the scores and probabilities are rounded to bf16, which leaves top-1 agreement
with float32 unchanged. The softmax runs in float32.
Prefill chunks attend in float32. Short chunks that begin their sequence (no context in the cache), all
together, by batched matmuls and a softmax over padded rows (`PrefillBatch`); every other chunk alone, by
`scaled_dot_product_attention` (its bf16 kernel is several times slower on CPU), over its gathered blocks
where it has context (`PrefillSpan`).

A layer may attend otherwise than Llama's (`LayerAttention`: Gemma's, `gemma.py`): its own score scale,
scores soft-capped as `cap * tanh(s / cap)` before the mask, and a sliding window (a row at position p sees
the keys of positions p - window + 1 .. p; `AttentionMetadata.build(..., window=...)` makes those masks once
per step beside the causal ones). Every path applies them: the masked group computation, the batched prefill,
SDPA with a window mask, and where scores are capped an explicit matmul-softmax in place of SDPA (which has
no cap). The fused decode kernel computes neither, so decode tokens of such a layer take `_group_attention`.

Batch-invariant mode (`AttentionMetadata.build(..., batch_invariant=True)`, see `batch_invariant.py`): a
query row's result must not depend on the rows beside it, nor on whether it is a decode token or a row of a
prefill chunk of any length. SDPA's blocking follows the chunk's length, so there every row goes through
the decode computation: a prefill chunk becomes query groups of one sequence and up to `_PREFILL_TILE` rows,
each row masked to its own context. That computation is row-invariant: the score matmul (`score_matmul`)
gives a row the same bits whatever the other rows and the key length (tests/test_deterministic.py), once it
is not too small (`_MIN_SCORE_ROWS`, `_MIN_KEYS`: rows and keys are padded up to them); the softmax and the
value sums are per row, and the padding adds exact zeros.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gracelm.arith import cdiv
from gracelm.config import ModelConfig
from gracelm.model import decode_attention
from gracelm.model.forward_batch import ForwardBatch

# Names the layout below; part of the fingerprint of KV-cache snapshots on disk, so a change of the layout
# must change it.
KV_CACHE_LAYOUT = "[2, kv_heads, blocks, block_size, head_dim] v1"


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer. Zeroed, not empty: padded block-table entries are read (then
    masked), and a NaN in never-written memory would survive the mask as 0 * NaN."""
    shape = (2, config.num_key_value_heads, num_blocks, block_size, config.head_dim)
    if torch.device(device).type == "cpu":
        return [_zero_pages(shape, dtype) for _ in range(config.num_hidden_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor over fresh anonymous memory: the kernel's pages are zero already and are only
    mapped in when first written, so a cache of a gigabyte costs no memset at start (`torch.zeros` would
    write every page). A serving worker then maps the pages in the background, off the
    start and off the steps (`kv_cache_commit.py`). The tensor keeps the mapping alive; it is unmapped with
    the tensor's last reference."""
    count = math.prod(shape)
    if count == 0:  # no memory to map
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layers (K and V)."""
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim
    return per_layer * config.num_hidden_layers * torch.empty((), dtype=dtype).element_size()


# Batch-invariant mode: a prefill chunk is attended in query groups of at most `_PREFILL_TILE` rows (bounding
# one group's scores and value bags: rows x heads x context), and a group's score matmul has at least
# `_MIN_SCORE_ROWS` rows per KV head and `_MIN_KEYS` keys (zero rows, masked keys): smaller products take
# kernels of their own, which round otherwise (MKL's float32 ones for one or two rows, torch's own loop below
# 400 multiply-adds), and a softmax row narrower than a vector register takes a scalar path.
_PREFILL_TILE = 64
_MIN_SCORE_ROWS = 3
_MIN_KEYS = 16
# Chunks up to this long that begin their sequence are attended in a batch (`PrefillBatch`), padded to it;
# longer ones by SDPA (torch's softmax over rows of 16 is several times faster than over rows of 13, hence
# the padding). Longer chunks keep SDPA's rounding: any other float32 rounding of the attention moves a long
# prompt's logits, and a chat answer that sits on a near tie would change (the tests pin such answers;
# docs/performance.md, "Prefill attention").
_BATCHED_PREFILL = 16


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: its scores' scale, their soft cap (None: none), and whether it sees only the
    step's sliding window (`AttentionMetadata.window`) of its context."""

    scale: float
    softcap: float | None = None
    sliding: bool = False

    @property
    def plain(self) -> bool:
        """Scaled dot products, causal over the whole context: what the fused decode kernel computes."""
        return self.softcap is None and not self.sliding


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in transformers' order of operations."""
    return torch.tanh(x / cap).mul_(cap)


@dataclass
class QueryGroup:
    """Sequences whose query rows are attended in a single batched, masked computation: the decode tokens (one
    row per sequence) and, in batch-invariant mode, each tile of a prefill chunk (one sequence, its rows)."""

    rows: torch.Tensor | None  # [B * R] token rows of the queries, by sequence; None: all T tokens, in order
    queries: int  # R, query rows per sequence
    batch_invariant: bool  # each row's result independent of the group (see the constants above)
    block_ids: torch.Tensor  # [B * blocks_per_seq] their block tables, truncated to the longest, flattened
    blocks_per_seq: int
    mask: torch.Tensor  # [1, B, R, 1, blocks_per_seq * block_size] float32: 0 in a row's context, else -inf
    # [kv_heads, B * blocks_per_seq, block_size, head_dim] in the cache's dtype: every layer gathers its keys
    # here. One buffer for all layers, because a fresh tensor of this size per layer costs page faults that
    # made the gather 3x slower than the copy itself.
    keys: torch.Tensor
    slots: torch.Tensor  # [B, blocks_per_seq * block_size] cache slot of each context position
    value_bags: tuple[torch.Tensor, torch.Tensor] | None = None  # see `_value_bags`, made by the first layer
    lengths: torch.Tensor | None = None  # [B] context lengths of a group of decode tokens
    # Attended by the fused kernel (`decode_attention.py`: decode tokens, not in batch-invariant mode), not by
    # `_group_attention`, in the layers that attend plainly (`LayerAttention.plain`)
    fused: bool = False
    window_mask: torch.Tensor | None = None  # as `mask`, and -inf before each row's window (if a window)

    def mask_for(self, layer: LayerAttention) -> torch.Tensor:
        return self.window_mask if layer.sliding else self.mask


@dataclass
class PrefillSpan:
    """One sequence's chunk of several query tokens, possibly after context already in the cache."""

    start: int  # first token row
    length: int  # query tokens
    context: int  # tokens cached before this chunk
    block_ids: torch.Tensor | None  # blocks covering context + chunk; None when there is no context
    mask: torch.Tensor | None  # [length, context + length] bool causal mask offset by context
    # As `mask`, also False before each row's window; None where that is plain causal attention within the
    # chunk (no context, no key out of the window). Set in a window's steps only.
    window_mask: torch.Tensor | None = None


@dataclass
class PrefillBatch:
    """The chunks of at most `_BATCHED_PREFILL` tokens that begin their sequence, each padded at its end to
    that many rows (with copies of its last row), attended together by one causal attention of batched
    matmuls (`_batched_prefill_attention`). Why: one SDPA call per sequence and layer spends a wave of short
    prompts' forward pass in call overhead, and torch's softmax over a row of 13 is several times slower than
    over 16. The padding changes no real row: a padded key lies after every real query of its chunk, where
    the causal mask hides it. Every chunk pads alike and a batched matmul computes each of its matrices alike
    whatever the batch, so a prompt gets the same bits beside others as alone (a chunk alone comes this way
    too, though SDPA would be a little faster for it)."""

    gather: torch.Tensor  # [count * _BATCHED_PREFILL] token rows, chunk after chunk, each padded
    real: torch.Tensor  # [tokens] the real rows' places in that padded order
    rows: torch.Tensor  # [tokens] their token rows, in the same order
    mask: torch.Tensor  # [_BATCHED_PREFILL, _BATCHED_PREFILL] float32: 0 on and below the diagonal, else -inf
    count: int
    window_mask: torch.Tensor | None = None  # as `mask`, and -inf before each row's window (if a window)

    @staticmethod
    def takes(span: PrefillSpan) -> bool:
        return span.context == 0 and span.length <= _BATCHED_PREFILL

    @classmethod
    def of(cls, spans: list[PrefillSpan], device: torch.device, window: int | None = None) -> PrefillBatch:
        """The batch of `spans`, each one it `takes`; with `window`, its masks too."""
        gather, real, rows = [], [], []
        for i, span in enumerate(spans):
            chunk = list(range(span.start, span.start + span.length))
            gather += chunk + [chunk[-1]] * (_BATCHED_PREFILL - span.length)
            real += range(i * _BATCHED_PREFILL, i * _BATCHED_PREFILL + span.length)
            rows += chunk

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        mask = torch.full((_BATCHED_PREFILL, _BATCHED_PREFILL), float("-inf"), device=device).triu_(1)
        window_mask = None
        if window is not None:
            positions = torch.arange(_BATCHED_PREFILL, device=device)
            window_mask = mask.masked_fill(~_in_window(positions, positions, window), float("-inf"))
        return cls(tensor(gather), tensor(real), tensor(rows), mask, len(spans), window_mask)


@dataclass
class AttentionMetadata:
    """Everything the layers need about the batch's shape, derived once per forward, not once per layer."""

    slot_mapping: torch.Tensor
    num_tokens: int
    groups: list[QueryGroup]  # the decode tokens' group first, if any
    prefills: list[PrefillSpan]  # the chunks of several tokens attended alone (none in batch-invariant mode)
    prefill_batch: PrefillBatch | None = None  # the others, attended together
    window: int | None = None  # the sliding window its masks also hold, if any (`LayerAttention.sliding`)

    @classmethod
    def build(cls, batch: ForwardBatch, kv_cache: torch.Tensor, batch_invariant: bool = False,
              decode_kernel: str = "auto", window: int | None = None) -> AttentionMetadata:
        """`kv_cache` is one layer's cache (every layer's has the same shape and dtype). `batch_invariant`:
        every row is attended as a decode row, its result independent of the rest of the batch.
        `decode_kernel`: `--decode-attention` (`config.DECODE_ATTENTION_CHOICES`). `window`: the sliding
        window of the model's sliding layers (None: it has none)."""
        block_size = kv_cache.shape[3]
        starts = [0]
        for q in batch.query_lens:
            starts.append(starts[-1] + q)
        decode_seqs = [i for i, q in enumerate(batch.query_lens) if q == 1]
        groups = [_decode_group(batch, decode_seqs, starts, kv_cache, batch_invariant, decode_kernel, window)
                  ] if decode_seqs else []
        chunked = [i for i, q in enumerate(batch.query_lens) if q > 1]
        if batch_invariant:
            groups += [tile for i in chunked
                       for tile in _prefill_tiles(batch, i, starts[i], kv_cache, window)]
            return cls(batch.slot_mapping, starts[-1], groups, [], window=window)
        spans = [_prefill_span(batch, i, starts[i], block_size, window) for i in chunked]
        together = [span for span in spans if PrefillBatch.takes(span)]
        alone = [span for span in spans if not PrefillBatch.takes(span)]
        prefill_batch = PrefillBatch.of(together, batch.block_tables.device, window) if together else None
        return cls(batch.slot_mapping, starts[-1], groups, alone, prefill_batch, window)


def _in_window(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[queries, keys] True where a key lies within the query's window: transformers' `kv > q - window`."""
    return key_pos[None, :] > query_pos[:, None] - window


def _decode_group(batch: ForwardBatch, seqs: list[int], starts: list[int], kv_cache: torch.Tensor,
                  batch_invariant: bool, kernel: str, window: int | None) -> QueryGroup:
    device = batch.block_tables.device
    index = torch.tensor(seqs, dtype=torch.long, device=device)
    seq_lens = torch.tensor([batch.seq_lens[i] for i in seqs], device=device)
    all_tokens_in_order = len(seqs) == starts[-1]
    rows = None if all_tokens_in_order else torch.tensor([starts[i] for i in seqs], device=device)
    group = _query_group(batch.block_tables.index_select(0, index), seq_lens[:, None], rows, kv_cache,
                         batch_invariant, window)
    group.lengths = seq_lens
    group.fused = decode_attention.applies(kv_cache, batch_invariant, kernel)
    return group


def _prefill_tiles(batch: ForwardBatch, i: int, start: int, kv_cache: torch.Tensor,
                   window: int | None) -> list[QueryGroup]:
    """Sequence i's chunk as query groups of at most `_PREFILL_TILE` rows, each row attending its own
    context, as a decode row at its position would."""
    length, seq_len = batch.query_lens[i], batch.seq_lens[i]
    context = seq_len - length
    device = batch.block_tables.device
    tiles = []
    for first in range(0, length, _PREFILL_TILE):
        last = min(length, first + _PREFILL_TILE)
        visible = torch.arange(context + first + 1, context + last + 1, device=device)  # positions + 1
        rows = torch.arange(start + first, start + last, device=device)
        tiles.append(_query_group(batch.block_tables[i:i + 1], visible[None, :], rows, kv_cache, True,
                                  window))
    return tiles


def _query_group(block_tables: torch.Tensor, visible: torch.Tensor, rows: torch.Tensor | None,
                 kv_cache: torch.Tensor, batch_invariant: bool, window: int | None = None) -> QueryGroup:
    """The group of the sequences of `block_tables` [B, *] whose query rows see `visible` [B, R] context
    positions each (a row at position p sees p + 1); with `window`, its window masks too (a row at p sees
    p - window + 1 .. p)."""
    _, kv_heads, _, block_size, head_dim = kv_cache.shape
    num_seqs, queries = visible.shape
    device = block_tables.device
    blocks_per_seq = cdiv(max(int(visible.max()), _MIN_KEYS if batch_invariant else 0), block_size)
    if blocks_per_seq > block_tables.shape[1]:  # past every table's end: block 0, masked
        block_tables = F.pad(block_tables, (0, blocks_per_seq - block_tables.shape[1]))
    block_ids = block_tables[:, :blocks_per_seq].reshape(-1)
    positions = torch.arange(blocks_per_seq * block_size, device=device)[None, None, :]
    in_context = positions < visible[:, :, None]
    mask = torch.zeros(in_context.shape, dtype=torch.float32, device=device)
    mask.masked_fill_(~in_context, float("-inf"))
    window_mask = None
    if window is not None:
        window_mask = mask.masked_fill(positions < visible[:, :, None] - window, float("-inf"))
        window_mask = window_mask[None, :, :, None, :]
    keys = kv_cache.new_empty((kv_heads, len(block_ids), block_size, head_dim))
    offsets = torch.arange(block_size, device=device)
    slots = (block_ids.view(num_seqs, blocks_per_seq, 1) * block_size + offsets).view(num_seqs, -1)
    return QueryGroup(rows, queries, batch_invariant, block_ids, blocks_per_seq, mask[None, :, :, None, :],
                      keys, slots, window_mask=window_mask)


def _prefill_span(batch: ForwardBatch, i: int, start: int, block_size: int,
                  window: int | None = None) -> PrefillSpan:
    length, seq_len = batch.query_lens[i], batch.seq_lens[i]
    context = seq_len - length
    slides = window is not None and seq_len > window  # some key lies out of some row's window
    if context == 0 and not slides:
        return PrefillSpan(start, length, 0, None, None)
    device = batch.block_tables.device
    key_pos = torch.arange(seq_len, device=device)
    query_pos = torch.arange(context, seq_len, device=device)
    causal = key_pos[None, :] <= query_pos[:, None]
    window_mask = causal & _in_window(query_pos, key_pos, window) if slides else None
    if context == 0:
        return PrefillSpan(start, length, 0, None, None, window_mask)
    block_ids = batch.block_tables[i, : cdiv(seq_len, block_size)]
    window_mask = causal if window_mask is None else window_mask
    return PrefillSpan(start, length, context, block_ids, causal, window_mask)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
    layer: LayerAttention | None = None,
) -> torch.Tensor:
    """Writes k, v [T, kv_heads, head_dim] at their slots, then attends q [T, heads, head_dim] causally to
    each sequence's cached context, as `layer` says (None: scaled by 1 / sqrt(head_dim), no cap, no window).
    Returns [T, heads * head_dim] in q's dtype."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    kv_cache.view(2, kv_heads, -1, head_dim)[:, :, meta.slot_mapping] = (
        torch.stack((k, v)).transpose(1, 2).to(kv_cache.dtype))
    if layer is None:
        layer = LayerAttention(1.0 / math.sqrt(head_dim))
    if layer.sliding and meta.window is None:
        raise ValueError("a sliding-window layer in a step whose metadata was built without the window")
    groups = meta.groups
    if len(groups) == 1 and groups[0].rows is None:
        return _attend(q, kv_cache, groups[0], layer).to(q.dtype)
    out = torch.empty(meta.num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    for group in groups:
        attended = _attend(q.index_select(0, group.rows), kv_cache, group, layer)
        out.index_copy_(0, group.rows, attended.to(q.dtype))
    if meta.prefill_batch is not None:
        attended = _batched_prefill_attention(q, k, v, meta.prefill_batch, layer)
        out.index_copy_(0, meta.prefill_batch.rows, attended.to(q.dtype))
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.length)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_cache, span, layer)
    return out


def _attend(q: torch.Tensor, kv_cache: torch.Tensor, group: QueryGroup,
            layer: LayerAttention) -> torch.Tensor:
    """The group's rows of q [rows, heads, head_dim] attended -> [rows, heads * head_dim], by the fused
    kernel where it serves the group, the layer attends plainly and q has the cache's dtype."""
    if group.fused and layer.plain and q.dtype == kv_cache.dtype:
        tables = group.block_ids.view(group.lengths.shape[0], group.blocks_per_seq)
        out = decode_attention.paged_decode_attention(q, kv_cache, tables, group.lengths, layer.scale)
        return out.view(q.shape[0], -1)
    return _group_attention(q, kv_cache, group, layer)


def _scores(scores: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """Float32 dot products scaled and, where the layer caps them, soft-capped (before the mask, as
    transformers does), in place where it can."""
    scores = scores.mul_(layer.scale)
    return scores if layer.softcap is None else soft_cap(scores, layer.softcap)


def _group_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, group: QueryGroup, layer: LayerAttention
) -> torch.Tensor:
    """q [B * R, heads, head_dim] -> [B * R, heads * head_dim] in the cache's dtype (float32 for a float16
    cache): one masked matmul-softmax-weighted sum for all the group's rows.

    Scores: the keys are gathered (one copy), then one batched matmul. Values: never gathered, an
    `embedding_bag` sums the probability-weighted value rows straight out of the cache, several times faster
    than gathering them for a matmul. Both read bf16 and accumulate in float32."""
    num_rows, num_heads, head_dim = q.shape
    _, kv_heads, num_blocks, block_size, _ = kv_cache.shape
    queries = group.queries
    batch = num_rows // queries
    length = group.blocks_per_seq * block_size
    per_kv = num_heads // kv_heads
    dtype = kv_cache.dtype if kv_cache.dtype in (torch.float32, torch.bfloat16) else torch.float32
    keys = torch.index_select(kv_cache[0], 1, group.block_ids, out=group.keys)
    keys = keys.view(kv_heads * batch, length, head_dim).to(dtype)
    # GQA without repeating K/V: query head h reads KV head h // per_kv, so group the query heads.
    grouped = q.to(dtype).view(batch, queries, kv_heads, per_kv, head_dim)
    score_rows = max(queries, cdiv(_MIN_SCORE_ROWS, per_kv)) if group.batch_invariant else queries
    if score_rows > queries:
        grouped = F.pad(grouped, (0, 0, 0, 0, 0, 0, 0, score_rows - queries))
    grouped = grouped.permute(2, 0, 1, 3, 4).reshape(kv_heads * batch, score_rows * per_kv, head_dim)
    scores = score_matmul(grouped, keys, group.batch_invariant)
    scores = scores.view(kv_heads, batch, score_rows, per_kv, length)
    scores = _scores(scores[:, :, :queries].float(), layer).add_(group.mask_for(layer))
    probs = scores.softmax(dim=-1)  # [kv_heads, B, R, per_kv, length]
    if group.value_bags is None:
        group.value_bags = _value_bags(group.slots, kv_heads, queries * per_kv, num_blocks * block_size)
    indices, offsets = group.value_bags
    values = kv_cache[1].view(-1, head_dim)
    weights = probs.to(values.dtype).reshape(-1)
    out = F.embedding_bag(indices, values, offsets, mode="sum", per_sample_weights=weights)
    out = out.view(kv_heads, batch, queries, per_kv, head_dim).to(dtype)
    return out.permute(1, 2, 0, 3, 4).reshape(num_rows, num_heads * head_dim)


def score_matmul(queries: torch.Tensor, keys: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """queries [G, R, D] x keys [G, L, D] -> [G, R, L]. In batch-invariant mode in float32, products summed
    over D one output at a time rather than MKL's matmul: on a Zen 5 CPU its kernel for 4 rows rounds a row
    otherwise than its kernel for 3 (on Zen 4, from 3 rows on every count agreed). Slower, and only for a
    float32 model in that mode; oneDNN's bfloat16 matmul agrees at every count of rows from 3 on on both."""
    if batch_invariant and queries.dtype == torch.float32:
        return (queries[:, :, None, :] * keys[:, None, :, :]).sum(-1)
    return torch.bmm(queries, keys.transpose(1, 2))


def _value_bags(
    slots: torch.Tensor, kv_heads: int, bags_per_seq: int, slots_per_head: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`embedding_bag` indices and offsets over a layer's value cache seen as [kv_heads * slots, head_dim]
    rows: one bag per (KV head, sequence, query row and query head of that KV head), ordered as the
    probabilities are, each holding the rows of the sequence's context (padding included: its probability is
    0)."""
    batch, length = slots.shape
    heads = torch.arange(kv_heads, device=slots.device).view(kv_heads, 1, 1, 1) * slots_per_head
    indices = (heads + slots.view(1, batch, 1, length)).expand(kv_heads, batch, bags_per_seq, length)
    indices = indices.reshape(-1)
    # Bag i starts at i * length (written so, not as a strided arange, for the exported decode graph's
    # shape arithmetic: `model/decode_graph.py`).
    offsets = torch.arange(kv_heads * batch * bags_per_seq, device=slots.device) * length
    return indices, offsets


def _batched_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PrefillBatch,
                               layer: LayerAttention) -> torch.Tensor:
    """The batch's chunks: their rows of q [T, heads, head_dim] -> [tokens, heads * head_dim] float32, in the
    order of `batch.rows`. GQA without repeating K/V: the query heads of one KV head are its rows."""
    count, longest = batch.count, _BATCHED_PREFILL
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    per_kv = heads // kv_heads

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, h, d] -> [count * kv_heads, h / kv_heads * longest, d]
        x = x.index_select(0, batch.gather).float().view(count, longest, kv_heads, -1, head_dim)
        return x.permute(0, 2, 3, 1, 4).reshape(count * kv_heads, -1, head_dim)

    scores = torch.bmm(padded(q), padded(k).transpose(1, 2))
    mask = batch.window_mask if layer.sliding else batch.mask
    scores = _scores(scores.view(-1, longest, longest), layer).add_(mask)
    probs = scores.softmax(dim=-1).view(count * kv_heads, per_kv * longest, longest)
    out = torch.bmm(probs, padded(v)).view(count, kv_heads, per_kv, longest, head_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(count * longest, heads * head_dim).index_select(0, batch.real)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan,
    layer: LayerAttention,
) -> torch.Tensor:
    """One sequence's chunk: q [L, heads, head_dim] -> [L, heads * head_dim] float32."""
    mask = span.window_mask if layer.sliding else span.mask  # None: causal within the chunk
    if span.block_ids is None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
    else:
        kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
        gathered = kv_cache.index_select(2, span.block_ids).view(2, kv_heads, -1, head_dim)
        seq_len = span.context + span.length
        keys, values = gathered[0, :, :seq_len], gathered[1, :, :seq_len]
    if layer.softcap is not None:
        out = _capped_attention(q.float().transpose(0, 1), keys.float(), values.float(), mask, layer)
        return out.transpose(0, 1).reshape(span.length, -1)
    # 4-D operands (a batch of one): with 3-D ones the CPU takes the unfused math path, 3.5x slower.
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        keys.float()[None],
        values.float()[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=layer.scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(span.length, -1)


def _capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      layer: LayerAttention) -> torch.Tensor:
    """SDPA's computation with the scores soft-capped, which SDPA cannot do: q [heads, L, head_dim], keys and
    values [kv_heads, S, head_dim], mask [L, S] bool (None: causal, S == L) -> [heads, L, head_dim]."""
    heads, length, head_dim = q.shape
    kv_heads, seq_len = keys.shape[0], keys.shape[1]
    if mask is None:
        mask = torch.ones(length, seq_len, dtype=torch.bool, device=q.device).tril_()
    # GQA without repeating K/V: the query heads of KV head g (g * per_kv ..) are its rows.
    scores = _scores(torch.bmm(q.reshape(kv_heads, -1, head_dim), keys.transpose(1, 2)), layer)
    scores = scores.view(kv_heads, -1, length, seq_len).masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).view(kv_heads, -1, seq_len)
    return torch.bmm(probs, values).view(heads, length, head_dim)
