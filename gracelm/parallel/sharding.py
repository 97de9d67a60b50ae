"""Tensor-parallel sharding of a loaded Llama-family model, applied from outside the model file.

Megatron's split: q/k/v and gate/up are column-parallel (each rank keeps a contiguous slice of their
output rows: its attention heads, its KV heads, its share of the MLP), o and down are row-parallel (each
rank keeps the matching slice of their input columns) and their partial outputs are summed by an
all-reduce. Heads are split in contiguous blocks, so query head h of a rank still reads KV head
h // (heads / kv_heads) of the same rank: grouped-query attention needs no change. The split works on the
loaded model's separate, HF-named linears; the shard is frozen after it (`LlamaModel.freeze`), which stacks
the rank's slices, so its fused q/k/v holds its own heads only.

The embedding is replicated (a lookup costs nothing next to a copy of its rows through an all-gather);
the output head is vocab-parallel: each rank computes the logits of its slice of the vocabulary and only
rank 0, the one that samples, gathers them. On a model of SmolLM2's kind the head is the largest matmul of
a decode step, so splitting it matters more than anything else.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
from torch import nn

from gracelm.arith import cdiv
from gracelm.model.attention import soft_cap
from gracelm.model.batch_invariant import make_batch_invariant
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.llama import FrozenLinear, LlamaForCausalLM
from gracelm.parallel.layout import check_shardable


class CommTimer:
    """Seconds spent in this rank's collectives, for the per-step communication figure."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def add(self, started: float) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1


class RowParallelLinear(nn.Module):
    """A linear over a slice of the input features; the partial products are summed across ranks.

    `in_rank_order` (batch-invariant mode, more than two ranks): gloo's ring all-reduce adds an element's
    partial sums in an order that depends on where the element falls in the tensor, so on the number of rows;
    instead every rank gathers the parts and adds them in rank order. (Two parts are added alike either way.)
    """

    def __init__(self, linear: nn.Linear, timer: CommTimer) -> None:
        super().__init__()
        self.linear = linear
        self.timer = timer
        self.in_rank_order = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        started = time.perf_counter()
        if self.in_rank_order:
            parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, out)
            out = functools.reduce(torch.add, parts)
        else:
            dist.all_reduce(out)
        self.timer.add(started)
        return out


class TensorParallelModel(nn.Module):
    """One rank's shard of a `LlamaForCausalLM`; `forward` returns full logits on rank 0, None elsewhere."""

    def __init__(self, model: LlamaForCausalLM, rank: int, world_size: int) -> None:
        super().__init__()
        check_shardable(model.config, world_size)
        self.rank, self.world_size = rank, world_size
        self.vocab_size = model.config.vocab_size
        self.logit_softcap = model.config.final_logit_softcapping  # Gemma's (`gemma.py`), elementwise
        self.timer = CommTimer()
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                _keep_rows(linear, rank, world_size)
            attn.o_proj = RowParallelLinear(_keep_columns(attn.o_proj, rank, world_size), self.timer)
            mlp.down_proj = RowParallelLinear(_keep_columns(mlp.down_proj, rank, world_size), self.timer)
        self.head = FrozenLinear([_vocab_slice(model.output_embedding(), rank, world_size)])
        if not model.config.tie_word_embeddings:
            del model.lm_head  # its slice was copied out; the full matrix is freed
        self.model = model.model
        # Only now, on this rank's slices: freezing stacks each layer's q/k/v and gate/up shards into one
        # matmul and also reaches the linears inside the `RowParallelLinear`s.
        self.model.freeze()

    def make_batch_invariant(self) -> None:
        """Batch-invariant mode (`model/batch_invariant.py`), the partial sums added in rank order too."""
        make_batch_invariant(self)
        for module in self.modules():
            if isinstance(module, RowParallelLinear):
                module.in_rank_order = self.world_size > 2

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
        hidden = self.model(batch, kv_caches)
        logits = self.head(hidden).float()
        if self.logit_softcap is not None:
            logits = soft_cap(logits, self.logit_softcap)
        gathered = [torch.empty_like(logits) for _ in range(self.world_size)] if self.rank == 0 else None
        started = time.perf_counter()
        dist.gather(logits, gathered, dst=0)
        self.timer.add(started)
        if gathered is None:
            return None
        return torch.cat(gathered, dim=-1)[:, : self.vocab_size]


def _shard_bounds(size: int, rank: int, world_size: int) -> slice:
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


def _keep_rows(linear: nn.Linear, rank: int, world_size: int) -> None:
    rows = _shard_bounds(linear.out_features, rank, world_size)
    # clone: a view would keep the whole matrix alive.
    linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    # The model's o and down projections have no bias; one would have to be added once, not per rank.
    assert linear.bias is None, "a row-parallel linear with a bias is not supported"
    columns = _shard_bounds(linear.in_features, rank, world_size)
    linear.weight = nn.Parameter(linear.weight[:, columns].clone(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
    return linear


def _vocab_slice(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of the [vocab, hidden] head, zero-padded so every rank's slice has the same size
    (the gather needs equal shapes; the padding logits are cut off on rank 0)."""
    vocab = weight.shape[0]
    part = cdiv(vocab, world_size)
    rows = weight[rank * part: min((rank + 1) * part, vocab)]
    head = torch.zeros(part, weight.shape[1], dtype=weight.dtype)
    head[: rows.shape[0]] = rows
    return head
