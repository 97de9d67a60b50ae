"""Rotary position embedding (RoPE) of the Llama family, with the `linear` and `llama3` frequency scalings."""

from __future__ import annotations

import math
from typing import Any

import torch

from gracelm.config import ModelConfig, UnsupportedModelError, rope_type

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The [head_dim / 2] float32 rotation speeds, computed exactly as transformers does so logits match."""
    kind = rope_type(config.rope_scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    dim = config.head_dim
    # Explicit device: the model may be built under a `meta` device context, and this buffer is not loaded.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


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
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [T, 1, head_dim] for the tokens' positions, computed once per forward for all layers
    and already shaped to broadcast over the heads (no per-layer reshaping). The sine's first half is negated,
    which turns the rotate-half of HF weights into a plain roll."""
    freqs = positions.to(torch.float32)[:, None, None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] by the per-token angles of `rope_cos_sin` (the rotate-half convention of
    HF weights): x * cos + rotate_half(x) * sin, where rotate_half(x) * sin = roll(x, half) * signed_sin."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rolled, signed_sin)
