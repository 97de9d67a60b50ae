"""The fields of a Gemma 2 or Gemma 3 text model's `ModelConfig` that the Llama family lacks, read from a
Hugging Face `config.json` (`hf_fields`) or from a GGUF file's metadata as llama.cpp writes and reads it
(`gguf_fields`); what the engine cannot honour is refused by name. Imports no torch: the frontend reads
configs too. The model itself: `gemma.py`.
"""

from __future__ import annotations

from typing import Any

from gracelm.config import UnsupportedModelError, rope_type

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
ACTIVATION = "gelu_pytorch_tanh"
_SLIDING, _FULL = "sliding_attention", "full_attention"
# transformers' defaults where a config.json leaves a field out (Gemma2Config, Gemma3TextConfig).
_DEFAULT_SOFTCAPS = {GEMMA2: (50.0, 30.0), GEMMA3: (None, None)}
_DEFAULT_PATTERN = {GEMMA2: 2, GEMMA3: 6}  # every n-th layer global, the others sliding
_DEFAULT_LOCAL_THETA = 10_000.0
# llama.cpp's architectures; the layer counts of the 27B models, whose attention scale llama.cpp takes from
# hidden_size / heads (their query_pre_attn_scalar), not from head_dim: a GGUF file does not store it.
GGUF_ARCHITECTURES = {"gemma2": GEMMA2, "gemma3": GEMMA3}
_GGUF_27B_LAYERS = {GEMMA2: 46, GEMMA3: 62}


def hf_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The Gemma fields of `ModelConfig` (with its rope, activation and window as Gemma reads them)."""
    _refuse_unsupported(hf, arch)
    attn_cap, final_cap = _DEFAULT_SOFTCAPS[arch]
    window = hf.get("sliding_window", 4096) or None
    fields = {
        "hidden_act": hf.get("hidden_activation") or ACTIVATION,
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
        "attn_logit_softcapping": hf.get("attn_logit_softcapping", attn_cap),
        "final_logit_softcapping": hf.get("final_logit_softcapping", final_cap),
        "sliding_window": window,
        "sliding_layers": _sliding_layers(hf, arch, window),
    }
    if arch == GEMMA3:
        fields.update(_gemma3_rope(hf))
    return fields


def _refuse_unsupported(hf: dict[str, Any], arch: str) -> None:
    features = []
    if hf.get("attention_bias"):
        features.append("attention_bias (biases of q/k/v and o_proj)")
    if hf.get("use_bidirectional_attention"):
        features.append("use_bidirectional_attention (gracelm attends causally)")
    if arch == GEMMA3 and hf.get("attn_logit_softcapping") is not None:
        features.append("attn_logit_softcapping, which transformers' Gemma 3 does not apply")
    if features:
        raise UnsupportedModelError(f"{arch} with {'; '.join(features)} is not supported")


def _sliding_layers(hf: dict[str, Any], arch: str, window: int | None) -> tuple[bool, ...]:
    """Which layers attend within the window: `layer_types`, else every layer but each n-th (transformers 4's
    `sliding_window_pattern`)."""
    layers = hf["num_hidden_layers"]
    every = hf.get("sliding_window_pattern") or _DEFAULT_PATTERN[arch]
    types = hf.get("layer_types") or [_FULL if (i + 1) % every == 0 else _SLIDING for i in range(layers)]
    unknown = sorted(set(types) - {_SLIDING, _FULL})
    if unknown or len(types) != layers:
        raise UnsupportedModelError(f"{arch}: layer_types {unknown or types} not supported; each layer "
                                    f"is {_SLIDING} or {_FULL}")
    return tuple(kind == _SLIDING and window is not None for kind in types)


def _gemma3_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's two ropes: the global layers' (theta and scaling), the sliding ones' theta. transformers 5
    nests them in `rope_parameters` by layer type; older configs keep `rope_theta`, `rope_scaling` and
    `rope_local_base_freq` at the top level."""
    nested = hf.get("rope_parameters")
    if isinstance(nested, dict) and _FULL in nested:
        full, local = nested.get(_FULL) or {}, nested.get(_SLIDING) or {}
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": hf.get("rope_local_base_freq", _DEFAULT_LOCAL_THETA)}
    if rope_type(local) != "default":
        raise UnsupportedModelError(f"{GEMMA3}: rope scaling {rope_type(local)!r} of the sliding layers is "
                                    "not supported")
    scaling = {key: value for key, value in full.items() if key != "rope_theta"}
    return {"rope_theta": full.get("rope_theta", 1_000_000.0),
            "rope_scaling": scaling if rope_type(scaling) != "default" else None,
            "rope_local_theta": local.get("rope_theta", _DEFAULT_LOCAL_THETA)}


def gguf_fields(metadata: dict[str, Any], gguf_arch: str, hidden: int, heads: int, head_dim: int,
                layers: int) -> dict[str, Any]:
    """The Gemma fields from a GGUF file's metadata, with llama.cpp's defaults for what its converter does not
    write: the attention scale (head_dim's, the 27B's hidden / heads), Gemma 2's caps (50 and 30), which
    layers slide (every 2nd / 6th global), Gemma 3's local rope theta (10,000)."""
    arch = GGUF_ARCHITECTURES[gguf_arch]

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{gguf_arch}.{name}", default)

    attn_cap, final_cap = _DEFAULT_SOFTCAPS[arch]
    window = key("attention.sliding_window", 4096 if arch == GEMMA2 else None) or None
    fields = {
        "hidden_act": ACTIVATION,
        "query_pre_attn_scalar": hidden // heads if layers == _GGUF_27B_LAYERS[arch] else head_dim,
        "attn_logit_softcapping": key("attn_logit_softcapping", attn_cap) if arch == GEMMA2 else None,
        "final_logit_softcapping": key("final_logit_softcapping", final_cap),
        "sliding_window": window,
        "sliding_layers": _gguf_sliding_layers(key("attention.sliding_window_pattern"), arch, layers, window),
    }
    if arch == GEMMA3:
        fields["rope_local_theta"] = key("rope.freq_base_swa", _DEFAULT_LOCAL_THETA)
    return fields


def _gguf_sliding_layers(pattern: int | list[bool] | None, arch: str, layers: int,
                         window: int | None) -> tuple[bool, ...]:
    """llama.cpp's `sliding_window_pattern`: a period n (every n-th layer global) or a flag per layer."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{arch}: sliding_window_pattern has {len(pattern)} flags for {layers} layers")
        return tuple(bool(flag) and window is not None for flag in pattern)
    every = pattern or _DEFAULT_PATTERN[arch]
    return tuple((i + 1) % every != 0 and window is not None for i in range(layers))
