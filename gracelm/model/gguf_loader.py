"""A model from a single GGUF file: config from its metadata, dequantized weights under Hugging Face names,
and its tokenizer, the last two converted once and then kept in the cache directory."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from gracelm.config import ModelConfig, UnsupportedModelError
from gracelm.model.file_hash import content_hash
from gracelm.model.gguf_config import ROPE_FREQS, gguf_model_config
from gracelm.model.gguf_reader import GGUFFile, GGUFTensorInfo, read_gguf
from gracelm.model.load_progress import load_progress
from gracelm.model.tokenizer import Tokenizer
from gracelm.model.tokenizer_cache import cached_tokenizer
from gracelm.model.weight_cache import cached_weights
from gracelm.startup_timeline import mark

# The storage types whose dequantization `gguf.quants` implements and this loader is tested with.
SUPPORTED_TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                 "Q5_K", "Q6_K")
)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, weights (dequantized to `dtype`, Hugging Face names) and tokenizer of a GGUF model file.

    The tokenizer and the dequantized weights are converted once per file and dtype, then taken from the
    cache (`tokenizer_cache`, `weight_cache`), keyed by the file's content hash."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}" + (" (a directory)" if path.is_dir() else ""))
    gguf = read_gguf(path)
    config = gguf_model_config(gguf)
    _check_tensor_types(gguf)
    names = {name: _hf_name(gguf, name) for name in gguf.tensors if name != ROPE_FREQS}
    model_hash = content_hash(path)
    mark("model_files")
    tokenizer = cached_tokenizer(model_hash, lambda: Tokenizer.from_gguf(path, metadata=gguf.metadata))
    mark("tokenizer")
    shapes = {hf_name: gguf.tensors[gguf_name].shape for gguf_name, hf_name in names.items()}
    weights = cached_weights(model_hash, dtype, shapes, lambda: _converted(gguf, config, names, dtype))
    mark("weights")
    return config, weights, tokenizer


def _converted(gguf: GGUFFile, config: ModelConfig, names: dict[str, str],
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor dequantized, llama.cpp's rotary layout undone, cast to `dtype`, under its HF name."""
    rotary_heads = _rotary_permuted_heads(gguf, config)
    weights = {}
    for gguf_name, hf_name in load_progress(names.items(), len(names), "converting weights"):
        weight = _dequantized(gguf, gguf.tensors[gguf_name])
        part = gguf_name.split(".")[-2]
        if part in rotary_heads:
            weight = _unpermute_rotary(weight, rotary_heads[part])
        weights[hf_name] = weight.to(dtype)
    return weights


def _check_tensor_types(gguf: GGUFFile) -> None:
    for info in gguf.tensors.values():
        if info.ggml_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
            raise UnsupportedModelError(
                f"{gguf.path}: tensor {info.name} is stored as {info.ggml_type.name}, "
                f"which this loader cannot dequantize; supported: {supported}"
            )


def _hf_name(gguf: GGUFFile, name: str) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_TENSOR_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        raise UnsupportedModelError(f"{gguf.path}: unexpected tensor {name} for a Llama-family model")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def _dequantized(gguf: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    return torch.from_numpy(dequantize(gguf.raw_tensor(info), info.ggml_type))


def _rotary_permuted_heads(gguf: GGUFFile, config: ModelConfig) -> dict[str, int]:
    """Which projections llama.cpp reordered for its rotary layout, with their head counts.

    For its "llama" architecture llama.cpp interleaves the two rotary halves of each q and k head (it
    rotates adjacent pairs; HF weights rotate the first half against the second). Qwen models keep HF's
    layout (llama.cpp's NEOX rope), so nothing is undone for them.
    """
    if gguf.metadata.get("general.architecture") != "llama":
        return {}
    return {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}


def _unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permutation: per head, rows (pair i, half j) go back to (half j, pair i)."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return weight.index_select(0, order)
