"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks each token's top-k experts,
and the MLP's output is their outputs weighted by the router.

Routing, as each family defines it in transformers: the router's logits (a linear of the hidden state) go
through a softmax over every expert in float32, the top k are kept, and where the config says so
(`norm_topk_prob`; Mixtral always, since its softmax over the top-k logits is the same) renormalised to sum
to 1. Qwen2-MoE adds a shared expert that every token takes, scaled by the sigmoid of its own gate.

Batched by expert: a step's (token, expert) pairs are sorted by expert, and each expert that some token
picked runs once over all of its tokens, so that a step reads each active expert's weights once; an expert
no token picked is not run. Each token's outputs are added in expert order, whatever else is in the step, so
a row's result does not depend on its neighbours (the expert matmuls take the batch-invariant mode's row
tiles like every other linear: `batch_invariant.py`).

Each expert is a gate/up/down MLP of its own (`make_mlp`), under Hugging Face's per-expert names
(`mlp.experts.<e>.gate_proj`), so it freezes, stacks gate and up and takes a GGUF file's low-bit forms as a
dense MLP does (`expert_weights.py` gives every checkpoint layout those names). A low-bit form's gate marks
the step's rows (`low_bit_gate.py`); an expert's call has some of them, so its linears share a gate of the
block's own, given the marks of its tokens before each call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from gracelm.config import ModelConfig
from gracelm.model.low_bit_gate import Int4Gate
from gracelm.model.quantized_linear import Int4Choice

# Why a compiled decode step cannot serve a mixture of experts (`LlamaModel.graph_refusal`).
GRAPH_REFUSAL = ("a mixture of experts: which experts a step runs depends on its tokens, which an exported "
                 "graph cannot follow")


def route(logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's routing weights [tokens, k] (float32) and experts [tokens, k], from the router's logits."""
    weights, experts = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: `gate` (the router), `experts`, and Qwen2-MoE's `shared_expert` with its
    `shared_expert_gate`; Hugging Face's names."""

    def __init__(self, config: ModelConfig, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        width = config.moe_intermediate_size
        self.experts = nn.ModuleList(make_mlp(width) for _ in range(config.num_experts))
        self.shared_expert: nn.Module | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = make_mlp(config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        # Once frozen with low-bit forms: the model's gate, marked over the step's rows, and the experts'.
        self.row_gates: tuple[Int4Gate, Int4Gate] | None = None

    def fuse_gate_up(self, int4: Int4Choice | None = None) -> None:
        """Stacks gate and up of every expert (and of the shared one), as a dense MLP does."""
        for mlp in self._mlps():
            mlp.fuse_gate_up(int4)

    def share_gate(self, model_gate: Int4Gate, expert_linears: Iterable[nn.Module]) -> None:
        """Gives the frozen experts' linears a gate of their own, marked before each expert's call with its
        tokens' marks in `model_gate`."""
        experts_gate = Int4Gate(model_gate.max_rows, model_gate.halves_max_rows)
        for linear in expert_linears:
            linear.int4_gate = experts_gate
        self.row_gates = (model_gate, experts_gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self._routed(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts' weighted outputs summed per token, each active expert run once over its tokens."""
        pairs = experts.flatten().argsort(stable=True)  # (token, slot) pairs, expert by expert
        counts = torch.bincount(experts.flatten(), minlength=len(self.experts)).tolist()
        tokens, pair_weights = pairs // self.top_k, weights.flatten().index_select(0, pairs)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows, weight = tokens[start:start + count], pair_weights[start:start + count]
            start += count
            if self.row_gates is not None:
                self.row_gates[1].mark_rows_of(self.row_gates[0], rows)
            y = self.experts[expert](x.index_select(0, rows))
            out.index_add_(0, rows, (y * weight.unsqueeze(1)).to(out.dtype))
        return out

    def _mlps(self) -> list[nn.Module]:
        return [*self.experts, *([self.shared_expert] if self.shared_expert is not None else [])]
