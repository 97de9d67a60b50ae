"""A GGUF file's model shape (`ModelConfig`) from its metadata, llama.cpp's key names read into Hugging
Face's. Imports no torch (the one table it checks is compared with numpy), so the frontend can read it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf.quants import dequantize

from gracelm.config import REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from gracelm.model.gemma_config import GGUF_ARCHITECTURES as GEMMA_GGUF_ARCHITECTURES
from gracelm.model.gemma_config import gguf_fields as gemma_gguf_fields
from gracelm.model.gguf_reader import GGUFFile

# GGUF `general.architecture` -> Hugging Face architecture. llama.cpp writes Mistral models as "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    **GEMMA_GGUF_ARCHITECTURES,
}
# llama.cpp writes Mixtral as "llama", with experts (`llama.expert_count`).
LLAMA_WITH_EXPERTS = "MixtralForCausalLM"
# Known and refused, with what of theirs the engine cannot honour.
REFUSED_GGUF_ARCHITECTURES = {"gpt-oss": REFUSED_ARCHITECTURES["GptOssForCausalLM"]}
# Whether llama.cpp renormalises the top-k routing weights of a family whose file does not say
# (`{arch}.expert_weights_norm`), as transformers' configs of these families do; Mixtral is written as
# "llama".
_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# llama.cpp's table of Llama 3 rope scaling factors, and LongRoPE's two tables of factors (Phi-3 and Phi-4):
# not weights, folded into the config instead.
ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
NOT_WEIGHTS = (ROPE_FREQS, *LONGROPE_FACTORS.values())


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    """The model's shape from the GGUF metadata; refuses architectures this runtime does not run."""
    md = gguf.metadata
    gguf_arch = md.get("general.architecture")
    arch = GGUF_ARCHITECTURES.get(gguf_arch)
    if gguf_arch in REFUSED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{gguf.path}: unsupported GGUF architecture {gguf_arch!r}: "
                                    f"{REFUSED_GGUF_ARCHITECTURES[gguf_arch]}")
    if arch is None:
        supported = ", ".join(f"{g} ({hf})" for g, hf in GGUF_ARCHITECTURES.items())
        raise UnsupportedModelError(
            f"{gguf.path}: unsupported GGUF architecture {gguf_arch!r}; supported: {supported}"
        )
    if gguf_arch == "llama" and md.get("llama.expert_count", 0) > 0:
        arch = LLAMA_WITH_EXPERTS
    elif gguf_arch == "llama" and "mistral" in str(md.get("general.name", "")).lower():
        arch = "MistralForCausalLM"

    def key(name: str, default: Any = None) -> Any:
        value = md.get(f"{gguf_arch}.{name}", default)
        if value is None:
            raise ValueError(f"{gguf.path}: GGUF metadata lacks {gguf_arch}.{name}")
        return value

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    rotary_dim = key("rope.dimension_count", head_dim)
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{gguf.path}: GGUF file has no token_embd.weight tensor")
    eos = md.get("tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        architecture=arch,
        vocab_size=embed.shape[0],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=key("rope.freq_base", 10000.0),
        max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias=SUPPORTED_ARCHITECTURES[arch]["attention_bias"] or "blk.0.attn_q.bias" in gguf.tensors,
        qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
        rope_scaling=_rope_scaling(gguf, gguf_arch, hidden // heads if heads else 0),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        sliding_window=key("attention.sliding_window", 0) or None,  # llama.cpp writes 0 for none
        qk_norm_per_head=not SUPPORTED_ARCHITECTURES[arch].get("qk_norm_per_projection", False),
        **(_experts(key, gguf_arch) if SUPPORTED_ARCHITECTURES[arch].get("experts") else {}),
    )
    if gguf_arch not in GEMMA_GGUF_ARCHITECTURES:
        return config
    gemma = gemma_gguf_fields(md, gguf_arch, hidden, heads, head_dim, config.num_hidden_layers)
    return dataclasses.replace(config, **gemma)


def _experts(key: Callable[..., Any], gguf_arch: str) -> dict[str, Any]:
    """A mixture of experts' shape, as llama.cpp's converter writes it: every layer sparse."""
    return {"num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
            "moe_intermediate_size": key("expert_feed_forward_length", key("feed_forward_length")),
            "shared_expert_intermediate_size": key("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": bool(key("expert_weights_norm", _EXPERT_WEIGHTS_NORM[gguf_arch]))}


def _rope_scaling(gguf: GGUFFile, gguf_arch: str, default_head_dim: int) -> dict[str, Any] | None:
    md = gguf.metadata
    kind = md.get(f"{gguf_arch}.rope.scaling.type", "none")
    factor = md.get(f"{gguf_arch}.rope.scaling.factor")
    if LONGROPE_FACTORS["long_factor"] in gguf.tensors:
        return _longrope_scaling(gguf, gguf_arch)
    if ROPE_FREQS in gguf.tensors:
        return _llama3_scaling(gguf, gguf_arch, md.get(f"{gguf_arch}.rope.dimension_count", default_head_dim))
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise UnsupportedModelError(f"{gguf.path}: unsupported rope scaling {kind!r}; supported: linear, llama3")


def _longrope_scaling(gguf: GGUFFile, gguf_arch: str) -> dict[str, Any]:
    """LongRoPE's parameters as llama.cpp keeps them: the factors as tensors, the attention factor and the
    original context as metadata."""
    md = gguf.metadata
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for key, name in LONGROPE_FACTORS.items():
        info = gguf.tensors.get(name)
        if info is None:
            raise UnsupportedModelError(f"{gguf.path}: LongRoPE's {name} is missing beside its other factors")
        scaling[key] = dequantize(gguf.raw_tensor(info), info.ggml_type).astype(np.float64).tolist()
    original = md.get(f"{gguf_arch}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"{gguf.path}: GGUF metadata lacks {gguf_arch}.rope.scaling.original_context_length")
    scaling["original_max_position_embeddings"] = original
    scaling["attention_factor"] = md.get(f"{gguf_arch}.rope.scaling.attn_factor")
    return scaling


def _llama3_scaling(gguf: GGUFFile, gguf_arch: str, rotary_dim: int) -> dict[str, Any]:
    """Recovers Llama 3's rope scaling parameters from the per-frequency factors llama.cpp stores instead.

    The file keeps only `rope_freqs` (how much each frequency is slowed down). Every Llama 3.x release uses
    low/high frequency factors 1 and 4 over an original context of 8192; the largest factor is the scaling
    factor. The parameters are accepted only if they reproduce the stored table.
    """
    info = gguf.tensors[ROPE_FREQS]
    table = dequantize(gguf.raw_tensor(info), info.ggml_type).astype(np.float64)
    md = gguf.metadata
    scaling = {
        "rope_type": "llama3",
        "factor": float(table.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": md.get(f"{gguf_arch}.rope.scaling.original_context_length", 8192),
    }
    theta = md.get(f"{gguf_arch}.rope.freq_base", 10000.0)
    expected = llama3_slowdowns(theta, rotary_dim, scaling)
    if expected.shape != table.shape or not np.allclose(expected, table, rtol=1e-4):
        raise UnsupportedModelError(
            f"{gguf.path}: its rope_freqs table matches no Llama 3 rope scaling; unsupported rope scaling"
        )
    return scaling


def llama3_slowdowns(theta: float, rotary_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency slowdown of Llama 3 scaling, as llama.cpp's converter tabulates it."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    slowdown = np.where(wavelen > old_context / low, factor, medium)
    return np.where(wavelen < old_context / high, 1.0, slowdown)
