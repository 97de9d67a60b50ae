"""bench/model_shapes.py: the published shapes as their configs count parameters, and a small file of the
same kind read back by gracelm's own loader: its shape, finite logits over the padded vocabulary, weights of
the intended spread, and the default model's tokenizer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from bench.model_shapes import SHAPES, WEIGHT_STD, Shape, make_gguf, tensor_specs
from gracelm.model.gguf_reader import read_gguf
from gracelm.model.loader import load_model
from gracelm.model.model_files import default_model_path
from gracelm.model.tokenizer import Tokenizer
from tests.test_gguf import run_prefill

# Each model's parameter count as its safetensors weights total it: a mistyped width or count shows here.
PUBLISHED_PARAMETERS = {"llama-3.2-1b": 1_235_814_400, "smollm2-1.7b": 1_711_376_384,
                        "qwen3-4b": 4_022_468_096, "llama-3.1-8b": 8_030_261_248,
                        "qwen3-embedding-0.6b": 595_776_512, "qwen3-30b-a3b": 30_532_122_624}
DEFAULT_TOKENS = 49_152
TEXT = "Hello, world! The quick brown fox jumps over the lazy dog. <|im_start|>user\nÇa va? 12345"


def small(name: str) -> Shape:
    """`name`'s kind (architecture, tie, rope scaling) at small widths, 2 layers, and a vocabulary past the
    default model's, so that the token list is padded."""
    return replace(SHAPES[name], layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                   vocab=DEFAULT_TOKENS + 848)


@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes_count_the_published_parameters(name: str) -> None:
    specs = tensor_specs(SHAPES[name], Q.Q4_1, Q.Q8_0)
    assert sum(int(np.prod(s.shape)) for s in specs if s.name != "rope_freqs.weight") == \
        PUBLISHED_PARAMETERS[name]


@pytest.fixture(scope="module")
def default_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


# llama-3.1-8b: untied, Llama 3 rope scaling; qwen3-4b: q/k norms, heads wider than hidden / heads.
@pytest.mark.parametrize("name, layer_type", [("llama-3.1-8b", Q.Q4_1), ("qwen3-4b", Q.Q8_0)])
def test_a_small_file_loads_and_runs(tmp_path: Path, default_tokenizer: Tokenizer, name: str,
                                     layer_type: Q) -> None:
    shape = small(name)
    made = make_gguf(shape, tmp_path / "m.gguf", layer_type)
    loaded = load_model(made.path, dtype="float32")
    config = loaded.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (256, 512, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)
    assert config.vocab_size == shape.vocab and config.tie_word_embeddings == shape.tied
    assert config.rope_theta == shape.rope_theta and config.rms_norm_eps == pytest.approx(shape.rms_eps)
    assert config.qk_norm == (shape.arch == "qwen3")
    assert (config.rope_scaling or {}).get("factor") == shape.llama3_rope_factor

    logits = run_prefill(loaded.model, default_tokenizer.encode(TEXT)[:12])
    assert logits.shape == (12, shape.vocab)
    assert torch.isfinite(logits).all() and logits.std() > 0

    ids = default_tokenizer.encode(TEXT)
    assert loaded.tokenizer.encode(TEXT) == ids
    assert loaded.tokenizer.decode(ids) == default_tokenizer.decode(ids)
    assert loaded.tokenizer.decode(ids, skip_special_tokens=False) == TEXT
    assert loaded.tokenizer.eos_token_ids == default_tokenizer.eos_token_ids
    assert loaded.tokenizer.chat_template == default_tokenizer.chat_template


@pytest.mark.parametrize("layer_type", [Q.Q4_1, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_blocks_dequantize_to_the_intended_spread(tmp_path: Path, layer_type: Q) -> None:
    made = make_gguf(replace(small("llama-3.2-1b"), layers=1), tmp_path / "m.gguf", layer_type)
    gguf_file = read_gguf(made.path)
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        info = gguf_file.tensors[name]
        values = dequantize(gguf_file.raw_tensor(info), info.ggml_type)
        assert values.shape == info.shape
        # Q4_0 has no minimum to centre its quants (0..15, less 8): they lean by half a step, 0.11 std.
        assert abs(values.mean()) < 0.15 * WEIGHT_STD and values.std() == pytest.approx(WEIGHT_STD, rel=0.05)
    assert gguf_file.tensors["blk.0.ffn_down.weight"].ggml_type == layer_type
    assert gguf_file.tensors["token_embd.weight"].ggml_type == Q.Q8_0  # the default model's
    assert made.size == made.path.stat().st_size
