"""Rotary position embedding (RoPE) of the Llama family, with the `linear`, `llama3` and `longrope` frequency
scalings, over the whole head or its leading `rotary_dim` dims (Phi-4-mini's partial rotary)."""

from __future__ import annotations

import math
from typing import Any

import torch

from gracelm.config import ModelConfig, UnsupportedModelError, rope_type

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The [rotary_dim / 2] float32 rotation speeds, computed exactly as transformers does so logits match."""
    kind = rope_type(config.rope_scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    dim = config.rotary_width
    # Explicit device: the model may be built under a `meta` device context, and this buffer is not loaded.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    scaling = config.rope_scaling or {}
    if kind == "longrope":
        # The short factors: `ModelConfig.context_limit` keeps every sequence within the original context.
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")
        return 1.0 / (short * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor (given, or transformers' default from
    how far the context was stretched), 1 for the other scalings."""
    scaling = config.rope_scaling or {}
    if rope_type(scaling) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: slow frequencies divided by `factor`, fast ones kept, the band between interpolated."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [T, 1, rotary_dim] for the tokens' positions, times `factor`
    (`attention_factor`), computed once per forward for all layers and already shaped to broadcast over the
    heads (no per-layer reshaping). The sine's first half is negated, which turns the rotate-half of HF
    weights into a plain roll."""
    freqs = positions.to(torch.float32)[:, None, None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] by the per-token angles of `rope_cos_sin` (the rotate-half convention of
    HF weights): x * cos + rotate_half(x) * sin, where rotate_half(x) * sin = roll(x, half) * signed_sin.
    Where cos is narrower than a head (partial rotary), the dims past it pass unrotated."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, signed_sin), x[..., rotary:]), dim=-1)
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rolled, signed_sin)
