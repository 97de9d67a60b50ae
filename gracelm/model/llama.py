"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Parameter names equal Hugging Face's, so a HF state dict loads as it is. A plain module: it knows nothing of
serving, scheduling or parallelism; head counts are read from the projections' outputs at run time, so a
tensor-parallel wrapper may shard the q/k/v/o and gate/up/down linears from outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gracelm.config import ModelConfig, UnsupportedModelError
from gracelm.model.attention import AttentionMetadata, paged_attention
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.rope import apply_rope, inverse_frequencies, rope_cos_sin

SUPPORTED_ACTIVATIONS = ("silu",)


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        bias = config.attention_bias
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * head_dim, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, -1, self.head_dim)
        k = self.k_proj(x).view(tokens, -1, self.head_dim)
        v = self.v_proj(x).view(tokens, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(paged_attention(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Not a weight: recomputed from the config (on CPU even under a `meta` device context).
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states after the final norm of the rows `batch.logits_indices`."""
        x = self.embed_tokens(batch.input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, x.dtype)
        meta = AttentionMetadata.build(batch, block_size=kv_caches[0].shape[3])
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x.index_select(0, batch.logits_indices))


class LlamaForCausalLM(nn.Module):
    """With tied embeddings there is no `lm_head` module: the logits reuse `model.embed_tokens.weight`,
    so the state dict has exactly the keys a tied HF checkpoint has."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"unsupported activation {config.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def output_embedding(self) -> torch.Tensor:
        """The [vocab, hidden] matrix that turns hidden states into logits."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Float32 logits [len(batch.logits_indices), vocab]; writes the batch's K/V into `kv_caches`."""
        hidden = self.model(batch, kv_caches)
        return F.linear(hidden, self.output_embedding()).float()
