"""Gemma 2 and Gemma 3 text decoders (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`) on the Llama family's
modules (`llama.py`), with Hugging Face's parameter names, so that loading, freezing (stacked q/k/v and
gate/up, low-bit forms), tensor parallelism and pooling treat them as they treat Llama. What Gemma defines
otherwise, as transformers computes it:

- the token embeddings times sqrt(hidden_size), that factor rounded to the model's dtype first;
- RMS norms scaling by (1 + weight), in float32 (`GemmaRMSNorm`), four a layer: before and after the
  attention, before and after the MLP; Gemma 3's q and k norms are of the same kind. (llama.cpp's converter
  stores 1 + weight: `gguf_loader.py` takes the 1 off again.);
- a GeLU (tanh approximation) MLP;
- attention scores scaled by query_pre_attn_scalar ** -0.5, soft-capped by Gemma 2
  (`attention.LayerAttention`);
- sliding-window layers between global ones; Gemma 3's sliding layers rotate with their own rope theta, its
  global ones with the config's rope scaling;
- logits soft-capped where the config says (`final_logit_softcapping`).

The compiled decode steps (`decode_graph.py`) export Llama's layer with one rope and one mask; Gemma is served
eagerly (`LlamaModel.graph_refusal`). The config's fields: `gemma_config.py`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from gracelm.config import SUPPORTED_ARCHITECTURES, ModelConfig
from gracelm.model.attention import AttentionMetadata, LayerAttention, soft_cap
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.gemma_config import ACTIVATION
from gracelm.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, rms_normalised
from gracelm.model.rope import inverse_frequencies, rope_cos_sin

GRAPH_REFUSAL = ("Gemma's layers (soft-capped scores, sliding windows, two ropes) are not in the compiled "
                 "decode step")


class GemmaRMSNorm(nn.Module):
    """Normalises and scales by (1 + weight) in float32, then casts to the input's dtype, as transformers
    does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalised(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, sliding: bool) -> None:
        super().__init__(config)
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.attention = LayerAttention(config.query_pre_attn_scalar**-0.5, config.attn_logit_softcapping,
                                        sliding)


class GemmaMLP(LlamaMLP):
    @staticmethod
    def activation(gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.sliding = config.sliding_layers[index]
        self.self_attn = GemmaAttention(config, self.sliding)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(LlamaModel):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.window = config.sliding_window if any(config.sliding_layers) else None
        # Not weights: from the config, on the CPU even under a `meta` device context. The embedding factor
        # is a float32 tensor cast to the embeddings' dtype at use, as transformers rounds it.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5, device="cpu"),
                             persistent=False)
        local = (None if config.rope_local_theta is None else
                 dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None))
        self.register_buffer("local_inv_freq", None if local is None else inverse_frequencies(local),
                             persistent=False)
        self.graph_refusal = GRAPH_REFUSAL

    @staticmethod
    def decoder_layer(config: ModelConfig, index: int) -> nn.Module:
        return GemmaDecoderLayer(config, index)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        """Llama's, the sliding layers rotated with their own rope where they have one."""
        local = (cos, sin)
        if self.local_inv_freq is not None:
            local = rope_cos_sin(self.local_inv_freq, positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, *(local if layer.sliding else (cos, sin)), kv_cache, meta)
        return x


class GemmaForCausalLM(LlamaForCausalLM):
    decoder = GemmaModel
    activations = (ACTIVATION,)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Llama's float32 logits, soft-capped where the config caps them."""
        logits = super().forward(batch, kv_caches)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else soft_cap(logits, cap)


def causal_lm_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module of `config`'s family."""
    gemma = SUPPORTED_ARCHITECTURES[config.architecture].get("gemma_layer", False)
    return GemmaForCausalLM if gemma else LlamaForCausalLM
