"""Configuration of a model (what the weights are) and of an engine (how it serves them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import gracelm.cpu_features as cpu_features
from gracelm.options import at_least, option, validate

# Hugging Face architecture name -> the family features it needs. Anything else is refused by name.
# `fused_projections`: the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
# (`model/fused_weights.py` splits them at load). `gemma_layer`, `logit_softcapping` and `sliding_layers`:
# Gemma's decoder (`model/gemma.py`, its config `model/gemma_config.py`). The README's table of families is
# written from this one (`model/family_table.py`).
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"attention_bias": False, "qk_norm": False, "fused_projections": False},
    "MistralForCausalLM": {"attention_bias": False, "qk_norm": False, "fused_projections": False},
    "Qwen2ForCausalLM": {"attention_bias": True, "qk_norm": False, "fused_projections": False},
    "Qwen3ForCausalLM": {"attention_bias": False, "qk_norm": True, "fused_projections": False},
    "Phi3ForCausalLM": {"attention_bias": False, "qk_norm": False, "fused_projections": True},
    # Mixture-of-experts families (`model/moe.py`); OLMoE's q/k norms span the whole projection.
    "MixtralForCausalLM": {"attention_bias": False, "qk_norm": False, "fused_projections": False,
                           "experts": True},
    "Qwen2MoeForCausalLM": {"attention_bias": True, "qk_norm": False, "fused_projections": False,
                            "experts": True, "shared_expert": True},
    "Qwen3MoeForCausalLM": {"attention_bias": False, "qk_norm": True, "fused_projections": False,
                            "experts": True},
    "OlmoeForCausalLM": {"attention_bias": False, "qk_norm": True, "fused_projections": False,
                         "experts": True, "qk_norm_per_projection": True},
    "Gemma2ForCausalLM": {"attention_bias": False, "qk_norm": False, "fused_projections": False,
                          "gemma_layer": True, "logit_softcapping": True, "sliding_layers": True},
    "Gemma3ForCausalLM": {"attention_bias": False, "qk_norm": True, "fused_projections": False,
                          "gemma_layer": True, "sliding_layers": True},
}
# Architectures known and refused, with what of theirs the engine cannot honour.
REFUSED_ARCHITECTURES = {
    "GptOssForCausalLM": "gpt-oss: its attention sinks and its MXFP4 expert weights are not supported",
}


# An embedding checkpoint of a family above may name its architecture `<Family>Model` (the decoder without
# the logits head); BERT-like encoders (nomic, bge, e5) are refused by name: gracelm attends causally only.
EMBEDDING_ARCHITECTURES = {arch.removesuffix("ForCausalLM") + "Model": arch
                           for arch in SUPPORTED_ARCHITECTURES}
# Gemma 3's decoder alone is `Gemma3TextModel`: its `Gemma3Model` is the multimodal one, refused by name.
EMBEDDING_ARCHITECTURES["Gemma3TextModel"] = EMBEDDING_ARCHITECTURES.pop("Gemma3Model")
_ENCODERS = ("Bert", "NomicBert", "XLMRoberta", "Roberta", "ModernBert", "NewModel", "GteModel")


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
    rotary_dim: int | None = None  # the leading dims of each head that rope rotates (None: all of them)
    sliding_window: int | None = None  # each token attends to this many tokens at most (None: all)
    # Gemma (`model/gemma_config.py`): which layers the window applies to (None: every layer, which the
    # attention does not apply, so it bounds the context), the scores' scale (query_pre_attn_scalar ** -0.5;
    # None: head_dim's), the tanh soft caps of the scores and of the logits, the sliding layers' rope theta.
    sliding_layers: tuple[bool, ...] | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    qk_norm_per_head: bool = True  # q/k norms over each head; else over the whole projection (OLMoE)
    # Mixture of experts (`model/moe.py`): experts per sparse MLP (0: every MLP dense), those each token is
    # routed to, each expert's width, the shared expert's (0: none), whether the top-k routing weights are
    # renormalised to sum to 1, and the layers whose MLP stays dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()

    def sparse_layer(self, index: int) -> bool:
        """Whether layer `index` has a mixture of experts for its MLP."""
        return self.num_experts > 0 and index not in self.dense_layers

    @property
    def rotary_width(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def context_limit(self) -> tuple[int, str]:
        """The longest sequence computed as the model defines it, and what sets that bound. Past a sliding
        window, or past LongRoPE's original context (where transformers switches every position of the
        sequence to the long factors, keys already cached included), the paged attention would compute
        something else: those lengths are refused, never approximated."""
        limits = [(self.max_position_embeddings, "max_position_embeddings")]
        if self.sliding_window is not None and self.sliding_layers is None:
            limits.append((self.sliding_window, "its sliding window (sliding_window), which gracelm's "
                                                "attention does not apply"))
        if rope_type(self.rope_scaling) == "longrope":
            original = self.rope_scaling["original_max_position_embeddings"]
            limits.append((original, "LongRoPE's original context (original_max_position_embeddings): "
                                     "its long factors are not supported"))
        return min(limits, key=lambda limit: limit[0])

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds the config from a Hugging Face `config.json` dictionary; a Gemma's own fields are added by
        the model's reader (`model/model_files.read_hf_config`, `model/gemma_config.py`)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else f"<none; model_type={hf.get('model_type')!r}>"
        arch = EMBEDDING_ARCHITECTURES.get(arch, arch)
        if arch.startswith(_ENCODERS):
            raise UnsupportedModelError(
                f"{arch} is a BERT-family encoder (as nomic, bge and e5 embedding models are): gracelm "
                f"serves decoder embedding models (Qwen3-Embedding) only"
            )
        if arch in REFUSED_ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported architecture {arch}: {REFUSED_ARCHITECTURES[arch]}")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        features = SUPPORTED_ARCHITECTURES[arch]
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
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
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", 10000.0),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("qkv_bias", features["attention_bias"]) or hf.get("attention_bias")),
            qk_norm=features["qk_norm"],
            rope_scaling=_rope_scaling(hf),
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rotary_dim=_rotary_dim(hf, head_dim),
            sliding_window=(hf.get("sliding_window") or None) if hf.get("use_sliding_window", True) else None,
            qk_norm_per_head=not features.get("qk_norm_per_projection", False),
            **(_experts(hf, arch) if features.get("experts") else {}),
        )


def _experts(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """A mixture-of-experts config's fields (Mixtral names its expert count `num_local_experts`), its
    features the engine cannot honour refused by name."""
    if hf.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{arch}: clip_qkv (q/k/v clamped) is not supported")
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = tuple(i for i in range(layers) if i in hf.get("mlp_only_layers", []) or (i + 1) % step)
    return {"num_experts": hf.get("num_local_experts") or hf["num_experts"],
            "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf.get("moe_intermediate_size") or hf["intermediate_size"],
            "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0),
            # Mixtral's softmax over the top-k logits is the top-k probabilities renormalised.
            "norm_topk_prob": hf.get("norm_topk_prob", arch == "MixtralForCausalLM"),
            "dense_layers": dense}


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """`rope_scaling`, LongRoPE's original context added from the top level where the config keeps it there
    (transformers 4's Phi-3 configs); transformers' own default where neither has it."""
    scaling = hf.get("rope_scaling")
    if rope_type(scaling) != "longrope" or "original_max_position_embeddings" in scaling:
        return scaling
    original = hf.get("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    return {**scaling, "original_max_position_embeddings": original}


def _rotary_dim(hf: dict[str, Any], head_dim: int) -> int | None:
    """How many leading dims of a head rope rotates, as transformers rounds it; None for the whole head.
    transformers 5 may keep `partial_rotary_factor` among the rope parameters only."""
    factor = hf.get("partial_rotary_factor") or (hf.get("rope_scaling") or {}).get("partial_rotary_factor")
    if factor is None or factor >= 1:
        return None
    return int(head_dim * factor)


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    """The scaling kind named by a `rope_scaling` dict (older configs call the key `type`)."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


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


def _size(value: str | int | None) -> str | None:
    if value is None:
        return None
    try:
        parse_size(value)
    except ValueError as e:
        return f"is not a size: {e}"
    return None


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# A GGUF file's 4- and 8-bit blocks also serve, as they are, decode steps on the CPU: "blocks" through the
# 8-bit-activation kernel (AVX-512 VNNI), "int4" through torch's int4 kernel, "auto" the first where the CPU
# runs it; "none": dense weights for every step (`model/quantized_linear.py:form_for`).
QUANTIZATION_CHOICES = ("auto", "blocks", "int4", "none")
DENSE_WEIGHTS_CHOICES = ("auto", "on", "off")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
# How decode tokens are attended (`model/decode_attention.py`): gracelm's fused kernel where it serves
# ("auto"), that kernel or a start-up failure naming why it cannot ("fused"), torch's ops ("unfused").
DECODE_ATTENTION_CHOICES = ("auto", "fused", "unfused")


# What a server does with its model (`model/pooling.py:task_pooling`): auto (an embedding model's files say
# embed, else generate), generate (text), embed (vectors, /v1/embeddings).
TASK_CHOICES = ("auto", "generate", "embed")
# Speculative decoding (`engine/speculation.py`): off, ngram (drafts looked up in the sequence itself) or
# draft (drafts of a smaller model, `speculative_model`).
SPECULATIVE_CHOICES = ("off", "ngram", "draft")


def _cpu_features(names: list[str]) -> str | None:
    bad = cpu_features.unknown(names)
    if not bad:
        return None
    return f"names no maskable CPU feature: {', '.join(bad)} (choose from {', '.join(cpu_features.MASKABLE)})"


@dataclass
class EngineConfig:
    """Everything an engine is started with; shared by `Engine`, `AsyncEngine` and `gracelm serve`. Each
    field is declared once, with its help text and check (`gracelm.options`)."""

    model: str | None = option(None, "a Hugging Face model directory or a .gguf file (default: "
                                     "SmolLM2-135M-Instruct)")
    task: str = option("auto", "what the model serves: generate (text: chat, completions), embed (vectors: "
                               "/v1/embeddings, Engine.embed), auto (embed where the model has "
                               "sentence-transformers' pooling files, else generate)", choices=TASK_CHOICES)
    dtype: str = option("auto", "weights and activations dtype (auto: the checkpoint's precision; half "
                                "precision as bfloat16 where the device computes it natively)",
                        choices=DTYPE_CHOICES)
    quantization: str = option("auto", "low-bit weight kernels for a GGUF file's 4- and 8-bit blocks, "
                                       "on the CPU in bfloat16, or in float32 chosen by --dtype auto "
                                       "(dense weights the rest): blocks (the "
                                       "file's blocks times activations rounded to 8 bits, AVX-512 VNNI, "
                                       "decode steps), int4 (torch's int4 kernel, bfloat16 activations, "
                                       "decode steps of up to 8 sequences), auto (blocks where the CPU has "
                                       "VNNI, else int4), none (dense weights only)",
                               choices=QUANTIZATION_CHOICES)
    dense_weights: str = option("auto", "a dense bfloat16 copy of the 4/8-bit matrices, for prompts of 16 "
                                        "tokens or more: on (memory: about 3.2x a 4-bit file's matrices "
                                        "beside them), off (every row through the file's blocks), auto (off "
                                        "where the blocks kernel serves, one CPU rank, not deterministic; "
                                        "else on)", choices=DENSE_WEIGHTS_CHOICES)
    device: str = option("auto", "where the model, KV cache and sampler run (auto: cuda when torch sees a "
                                 "GPU and tensor_parallel_size is 1, else cpu)", choices=DEVICE_CHOICES)
    tensor_parallel_size: int = option(1, "ranks the model is split over (heads and MLP width must divide "
                                          "by it)", check=at_least(1))
    max_model_len: int | None = option(None, "prompt plus output tokens of one request (default: the "
                                             "model's limit)", check=at_least(1))
    max_num_seqs: int = option(64, "requests run together at most", check=at_least(1))
    max_num_batched_tokens: int = option(2048, "tokens computed per step at most (longer prefills are "
                                               "chunked)", check=at_least(1))
    block_size: int = option(16, "tokens per KV-cache block", check=at_least(1))
    kv_cache_memory: str | int | None = option(None, "KV-cache size, e.g. 2GiB (default: a share of the "
                                                     "available memory, at most 1GiB on a CPU, where it is "
                                                     "committed in the background after start)", check=_size)
    enable_prefix_caching: bool = option(True, "reuse the KV cache of identical prompt prefixes")
    kv_cache_dir: str | None = option(None, "keep the prefix cache across restarts in this directory: saved "
                                            "at a graceful stop, restored at start (default: off)")
    kv_cache_dir_size: str | int = option("4GiB", "bound on the snapshots in --kv-cache-dir, least recently "
                                                  "used blocks dropped first", check=_size)
    kv_cache_save_interval: float = option(0.0, "also save the prefix cache every this many seconds while "
                                                "serving, so a crash loses at most that much (0: off)",
                                           check=at_least(0))
    num_threads: int | None = option(None, "CPU threads of each rank (default: its share of the CPUs "
                                           "this process may run on)", check=at_least(1))
    seed: int = option(0, "seed of requests that have none")
    deterministic: bool = option(False, "batch-invariant computation: a request's tokens (greedy, or "
                                        "sampled with a seed) do not depend on the other requests it is "
                                        "batched with, at some cost in speed")
    speculative: str = option("off", "speculative decoding: ngram (prompt lookup: each step drafts the "
                                     "tokens that followed an earlier occurrence of the sequence's last "
                                     "tokens, and one forward pass verifies them; pays where answers copy "
                                     "their input: edits, rewrites, summaries), draft (a smaller model of "
                                     "the same tokenizer drafts: --speculative-model), off (default; "
                                     "draft when --speculative-model is given)", choices=SPECULATIVE_CHOICES)
    speculative_model: str | None = option(None, "the draft model of --speculative draft: a model directory "
                                                 "or .gguf file of the target's vocabulary, run beside it "
                                                 "with a KV cache of its own (as many blocks as the "
                                                 "target's)")
    num_speculative_tokens: int = option(8, "draft tokens a sequence verifies per step at most (each "
                                            "sequence drafts as many as its last verifications suggest, "
                                            "half of this at first)", check=at_least(1))
    prompt_lookup_min: int = option(2, "ngram: the shortest suffix looked up, in tokens", check=at_least(1))
    prompt_lookup_max: int = option(4, "ngram: the longest suffix looked up (the longest match wins)",
                                    check=at_least(1))
    speculative_max_batch: int = option(16, "speculate only while at most this many requests run (below it, "
                                            "a sequence drafts while it keeps enough of its drafts for the "
                                            "batch's size): larger batches keep the CPU busy, and verifying "
                                            "drafts would slow them", check=at_least(1))
    mask_cpu_features: list[str] = option(
        [], f"CPU features to choose every path as if this CPU lacked: {', '.join(cpu_features.MASKABLE)} "
            "(each masks those built on it too; amx runs a Zen 4's paths on a Sapphire Rapids, avx512 an "
            "AVX2-only CPU's): gracelm's kernels, --dtype auto, torch's own kernels and the compiled decode "
            "steps follow", check=_cpu_features)
    decode_attention: str = option("auto", "how decode tokens are attended: fused (gracelm's kernel; the "
                                           "start fails where it cannot serve), unfused (torch's ops), auto "
                                           "(fused where it serves)", choices=DECODE_ATTENTION_CHOICES)
    enforce_eager: bool = option(False, "never run the compiled decode step (by default a bfloat16 CPU model "
                                        "with 4-bit weights compiles it in the background and keeps it in "
                                        "the cache)")
    shutdown_timeout: float = option(30.0, "seconds running requests may take to finish at a stop (0: abort "
                                           "at once)", check=at_least(0))
    engine_hang_timeout: float = option(60.0, "seconds without step progress, with work pending, before a "
                                              "fatal stop (0: off)", check=at_least(0))
    shutdown_report: str | None = option(None, "write the shutdown report as JSON here")
    nnodes: int = option(1, "machines in the parallel group", check=at_least(1))
    node_rank: int = option(0, "this machine's rank", check=at_least(0))
    dist_init_addr: str | None = option(None, "HOST:PORT of the torch.distributed rendezvous (needed when "
                                              "nnodes > 1)")
    dist_timeout: float = option(60.0, "seconds a tensor-parallel collective waits for the other ranks "
                                       "before the step fails (a stuck rank, a cut link)", check=at_least(1))

    def __post_init__(self) -> None:
        validate(self)
        if not self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (HOST:PORT) is required when nnodes > 1")
        # The ranks' collectives run over gloo on CPU tensors: CUDA ranks would need NCCL, not built.
        if self.device == "cuda" and self.tensor_parallel_size > 1:
            raise ValueError("device cuda (--device) is not supported with tensor_parallel_size > 1 yet: the "
                             "ranks' collectives run on the CPU")
        self._check_kv_cache_dir()
        self._check_dense_weights()
        self._check_speculative()
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    def _check_speculative(self) -> None:
        """A draft model means draft speculation (the default `off` becomes it); it is refused with any other
        method, and draft speculation without one; the ranks of tensor parallelism would each need a shard of
        it: not built, and refused by name."""
        if self.speculative_model is not None and self.speculative == "off":
            self.speculative = "draft"
        if (self.speculative_model is not None) != (self.speculative == "draft"):
            raise ValueError(f"speculative {self.speculative} (--speculative) and speculative_model "
                             f"(--speculative-model) {self.speculative_model}: a draft model is given with, "
                             f"and only with, --speculative draft")
        if self.speculative == "draft" and self.tensor_parallel_size > 1:
            raise ValueError("speculative draft (--speculative-model) is not supported with "
                             "tensor_parallel_size > 1 yet")

    def _check_dense_weights(self) -> None:
        """What needs the dense weights refuses `dense_weights off` by name: they are what tensor parallelism
        splits, what deterministic mode computes with, and all that quantization none has."""
        if self.dense_weights != "off":
            return
        needs = [reason for reason, applies in (
            ("tensor_parallel_size > 1 (the ranks split dense weights)", self.tensor_parallel_size > 1),
            ("deterministic (computed with dense weights)", self.deterministic),
            ("quantization none (dense weights only)", self.quantization == "none"),
            ("device cuda (the blocks kernel is a CPU one)", self.device == "cuda")) if applies]
        if needs:
            raise ValueError(f"dense_weights off (--dense-weights) cannot serve {'; '.join(needs)}")

    def _check_kv_cache_dir(self) -> None:
        if self.kv_cache_dir is None:
            return
        if not self.enable_prefix_caching:
            raise ValueError("kv_cache_dir (--kv-cache-dir) needs enable_prefix_caching: it persists the "
                             "prefix cache")
        # With tensor parallelism each rank saves its shard at the stop; the periodic save copies blocks
        # between steps on rank 0 alone, so it would need the same between the workers' steps: not built,
        # and never silently ignored.
        if self.tensor_parallel_size > 1 and self.kv_cache_save_interval > 0:
            raise ValueError("kv_cache_save_interval (--kv-cache-save-interval) is not supported with "
                             "tensor_parallel_size > 1 yet; --kv-cache-dir is (saved at a graceful stop)")
