"""Checkpoints that store q/k/v as one matrix and gate/up as one (Phi-3 and Phi-4: `qkv_proj` and
`gate_up_proj`; in llama.cpp's GGUF, `attn_qkv` and an `ffn_up` of gate then up rows), split by rows into
the parts the Llama-family module has. The module stacks them again when it freezes (`llama.FrozenLinear`),
so every kernel path and the tensor-parallel split see the usual q/k/v and gate/up; a row split of a GGUF
tensor is a byte range of its blocks (each row is whole blocks), so its 4- and 8-bit forms stay the file's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import torch

from gracelm.config import SUPPORTED_ARCHITECTURES, ModelConfig

if TYPE_CHECKING:  # gguf-py's import is of no use to a directory's load
    from gracelm.model.gguf_reader import GGUFFile

# Fused name -> its parts, in row order; Hugging Face names (after `self_attn.`/`mlp.`) and GGUF kinds.
_HF_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_GGUF_PARTS = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")}
_HF_FUSED_RE = re.compile(rf"(.*\.)({'|'.join(map(re.escape, _HF_PARTS))})\.weight")
_GGUF_FUSED_RE = re.compile(rf"(blk\.\d+\.)({'|'.join(_GGUF_PARTS)})\.weight")


def has_fused_projections(config: ModelConfig) -> bool:
    return SUPPORTED_ARCHITECTURES[config.architecture]["fused_projections"]


def _part_rows(config: ModelConfig, parts: int) -> list[int]:
    """Rows of each part: q, k, v (three parts) or gate, up (two)."""
    if parts == 3:
        kv = config.num_key_value_heads * config.head_dim
        return [config.num_attention_heads * config.head_dim, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def split_hf(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each fused matrix replaced by its parts (views of its rows)."""
    if not has_fused_projections(config):
        return state
    split = {}
    for name, tensor in state.items():
        match = _HF_FUSED_RE.fullmatch(name)
        sizes = _part_rows(config, len(_HF_PARTS[match.group(2)])) if match else []
        if sum(sizes) != tensor.shape[0]:
            split[name] = tensor  # not fused as the config says: the loader names the misfit
            continue
        prefix, parts = match.group(1), _HF_PARTS[match.group(2)]
        rows = tensor.split(sizes)
        split.update({f"{prefix}{part}.weight": t for part, t in zip(parts, rows, strict=True)})
    return split


def split_gguf(gguf: GGUFFile, config: ModelConfig) -> GGUFFile:
    """`gguf` with each fused tensor's entry replaced by one entry per part, each its range of rows."""
    if not has_fused_projections(config):
        return gguf
    tensors = {}
    for name, info in gguf.tensors.items():
        match = _GGUF_FUSED_RE.fullmatch(name)
        sizes = _part_rows(config, len(_GGUF_PARTS[match.group(2)])) if match else []
        if len(info.shape) != 2 or sum(sizes) != info.shape[0]:
            tensors[name] = info  # not fused (an `ffn_up` beside its `ffn_gate`), or a misfit named later
            continue
        prefix, parts = match.group(1), _GGUF_PARTS[match.group(2)]
        start = 0
        for part, rows in zip(parts, sizes, strict=True):
            part_name = f"{prefix}{part}.weight"
            tensors[part_name] = info.part(part_name, start, (rows, info.shape[1]))
            start += rows
    return dataclasses.replace(gguf, tensors=tensors)
