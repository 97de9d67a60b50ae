"""A mixture-of-experts checkpoint's expert weights under the names the model has (`moe.py`): one
gate/up/down MLP per expert, `model.layers.<n>.mlp.experts.<e>.gate_proj.weight`, and the router
`mlp.gate`.

What the files hold instead:
- Hugging Face's hub checkpoints: Mixtral's `block_sparse_moe.gate` and
  `block_sparse_moe.experts.<e>.w1/w2/w3` (gate, down, up); Qwen-MoE's and OLMoE's names are the model's
  own. transformers 5 keeps the experts of a layer as 3-D tensors in memory, `mlp.experts.gate_up_proj`
  [experts, 2 x width, hidden] (gate rows, then up) and `mlp.experts.down_proj` [experts, hidden, width]; a
  checkpoint saved so is split into views.
- llama.cpp's GGUF: each layer's experts stacked as 3-D tensors `ffn_gate_exps`, `ffn_up_exps`,
  `ffn_down_exps` [experts, rows, columns]. An expert's matrix is a contiguous byte range of its blocks, so
  each becomes an entry of its own (`ffn_gate_exp<e>`), which then takes every path a dense matrix takes:
  dequantized, or its blocks as the file has them (as `fused_weights.split_gguf` splits fused matrices).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import torch

from gracelm.config import ModelConfig

if TYPE_CHECKING:  # gguf-py's import is of no use to a directory's load
    from gracelm.model.gguf_reader import GGUFFile

_MIXTRAL_RE = re.compile(r"(.*\.)block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HF_STACKED_RE = re.compile(r"(.*\.mlp\.experts\.)(gate_up_proj|down_proj)(\.weight)?")
_GGUF_STACKED_RE = re.compile(r"(blk\.\d+\.)ffn_(gate|up|down)_exps\.weight")
_GGUF_EXPERT_RE = re.compile(r"ffn_(gate|up|down)_exp(\d+)")


def split_hf_experts(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every expert weight under the model's per-expert names (views where it is split)."""
    if not config.num_experts:
        return state
    renamed = {}
    for name, tensor in state.items():
        mixtral, stacked = _MIXTRAL_RE.fullmatch(name), _HF_STACKED_RE.fullmatch(name)
        if mixtral:
            part = mixtral.group(2)
            expert, _, kind = part.rpartition(".")
            part = f"{expert}.{_MIXTRAL_PARTS[kind]}" if expert else part
            renamed[f"{mixtral.group(1)}mlp.{part}.weight"] = tensor
        elif stacked and tensor.dim() == 3:
            renamed.update(_per_expert(stacked.group(1), stacked.group(2), tensor))
        else:
            renamed[name] = tensor
    return renamed


def _per_expert(prefix: str, kind: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if kind == "down_proj":
        return {f"{prefix}{e}.down_proj.weight": t for e, t in enumerate(tensor.unbind(0))}
    gates, ups = tensor.chunk(2, dim=1)
    return {f"{prefix}{e}.{part}.weight": t for part, parts in (("gate_proj", gates), ("up_proj", ups))
            for e, t in enumerate(parts.unbind(0))}


def split_gguf_experts(gguf: GGUFFile, config: ModelConfig) -> GGUFFile:
    """`gguf` with each layer's stacked expert tensor replaced by one entry per expert, its byte range."""
    if not config.num_experts:
        return gguf
    tensors = {}
    for name, info in gguf.tensors.items():
        match = _GGUF_STACKED_RE.fullmatch(name)
        if match is None or len(info.shape) != 3:
            tensors[name] = info  # a misfit is named by the model's shape check
            continue
        for e in range(info.shape[0]):
            part = f"{match.group(1)}ffn_{match.group(2)}_exp{e}.weight"
            tensors[part] = info.part(part, e, info.shape[1:])
    return dataclasses.replace(gguf, tensors=tensors)


def gguf_expert_part(kind: str) -> str | None:
    """The Hugging Face name (after `model.layers.<n>.`) of a split GGUF expert entry's kind, or None."""
    match = _GGUF_EXPERT_RE.fullmatch(kind)
    return None if match is None else f"mlp.experts.{match.group(2)}.{match.group(1)}_proj"


def gguf_expert_stacks(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """The GGUF kinds of each expert's gate and up, which the model stacks by rows."""
    return tuple((f"ffn_gate_exp{e}", f"ffn_up_exp{e}") for e in range(config.num_experts))
