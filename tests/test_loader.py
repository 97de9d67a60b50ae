"""Loading Hugging Face directories: dtypes, sharded weights, tied embeddings, and a clear error for each
way a model path can be wrong."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gracelm.config import UnsupportedModelError
from gracelm.model.attention import allocate_kv_cache
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.llama import LlamaForCausalLM
from gracelm.model.loader import load_model
from gracelm.model.model_files import ModelLoadError, ModelNotFoundError
from tests.tiny_models import make_tiny_model, tiny_model


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    """A private copy of the tiny Llama directory, free to damage."""
    return Path(shutil.copytree(tiny_model("llama"), tmp_path / "model"))


def logits_of(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    dtype = model.output_embedding().dtype
    kv_caches = allocate_kv_cache(model.config, num_blocks=4, block_size=16, dtype=dtype)
    positions = torch.arange(len(tokens))
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=positions,
        slot_mapping=positions.clone(),
        query_lens=[len(tokens)],
        seq_lens=[len(tokens)],
        block_tables=torch.tensor([[0]]),
        logits_indices=positions.clone(),
    )
    return model(batch, kv_caches)


def test_loads_a_float32_directory_ready_for_inference() -> None:
    directory = tiny_model("llama")
    loaded = load_model(directory)
    assert loaded.dtype == torch.float32  # auto: the checkpoint's own precision
    assert loaded.name == directory.name and loaded.path == directory
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert not loaded.model.training
    params = list(loaded.model.parameters())
    assert all(not p.requires_grad and not p.is_meta and p.dtype == torch.float32 for p in params)
    expected = load_file(directory / "model.safetensors")
    assert torch.equal(loaded.model.state_dict()["model.layers.1.mlp.down_proj.weight"],
                       expected["model.layers.1.mlp.down_proj.weight"])
    assert loaded.tokenizer.encode("the cat", add_special_tokens=False)


def test_tied_embeddings_share_one_matrix() -> None:
    loaded = load_model(tiny_model("qwen3", tie_word_embeddings=True), dtype="float32")
    assert "lm_head.weight" not in loaded.model.state_dict()
    assert loaded.model.output_embedding() is loaded.model.model.embed_tokens.weight


# auto's half precision: bfloat16 where the CPU computes it natively, float32 where it would be emulated.
HALF = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_dtype_of_a_half_precision_checkpoint(tmp_path: Path, dtype: torch.dtype) -> None:
    directory = Path(shutil.copytree(tiny_model("llama"), tmp_path / "half"))
    weights = load_file(directory / "model.safetensors")
    save_file({name: t.to(dtype) for name, t in weights.items()}, directory / "model.safetensors")
    loaded = load_model(directory)
    assert loaded.dtype == HALF
    assert {p.dtype for p in loaded.model.parameters()} == {HALF}


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_explicit_dtype_casts_the_weights(name: str, dtype: torch.dtype) -> None:
    loaded = load_model(tiny_model("qwen2"), dtype=name)
    assert loaded.dtype == dtype
    assert {p.dtype for p in loaded.model.parameters()} == {dtype}
    tokens = [1, 2, 3, 4, 5, 6]
    exact = logits_of(load_model(tiny_model("qwen2"), dtype="float32").model, tokens)
    torch.testing.assert_close(logits_of(loaded.model, tokens), exact, rtol=0, atol=0.1)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    single = tiny_model("mistral")
    sharded = Path(shutil.copytree(single, tmp_path / "sharded"))
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="60KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    whole, parts = load_model(single).model, load_model(sharded).model
    assert whole.state_dict().keys() == parts.state_dict().keys()
    assert all(torch.equal(t, parts.state_dict()[name]) for name, t in whole.state_dict().items())
    tokens = [3, 1, 4, 1, 5]
    torch.testing.assert_close(logits_of(parts, tokens), logits_of(whole, tokens), rtol=0, atol=0)


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelNotFoundError, match=f"{missing} does not exist") as info:
        load_model(missing)
    assert isinstance(info.value, FileNotFoundError)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"{tmp_path} has no config.json"):
        load_model(tmp_path)


def test_directory_without_weights(model_copy: Path) -> None:
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=f"{model_copy} has no \\*.safetensors weights"):
        load_model(model_copy)


def test_truncated_safetensors(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    with pytest.raises(ModelLoadError, match=f"{weights} is not a readable safetensors file .*truncated"):
        load_model(model_copy)


def test_corrupt_safetensors(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    weights.write_bytes(b"\x00not a safetensors file" * 100)
    with pytest.raises(ModelLoadError, match=f"{weights} is not a readable safetensors file"):
        load_model(model_copy)


def test_missing_tensors_are_named(model_copy: Path) -> None:
    weights = load_file(model_copy / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"], weights["model.norm.weight"]
    save_file(weights, model_copy / "model.safetensors")
    names = "model.layers.1.mlp.down_proj.weight, model.norm.weight"
    with pytest.raises(ModelLoadError, match=f"missing tensors: {names}"):
        load_model(model_copy)


def test_tensor_of_the_wrong_shape(model_copy: Path) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    misfit = r"model.layers.0.mlp.down_proj.weight is \[64, 128\], the config needs \[64, 96\]"
    with pytest.raises(ModelLoadError, match=f"do not fit the config: {misfit}"):
        load_model(model_copy)


def test_unsupported_architecture(model_copy: Path) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture GPT2LMHeadModel") as info:
        load_model(model_copy)
    message = str(info.value)
    assert str(model_copy) in message
    assert all(arch in message for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                            "Qwen3ForCausalLM"))


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path / "yarn", "llama", rope_theta=10000.0,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="unsupported rope scaling 'yarn'; supported: default"):
        load_model(directory)


def test_unsupported_dtype() -> None:
    choices = "auto, float32, bfloat16, float16"
    with pytest.raises(ModelLoadError, match=f"unsupported dtype 'int8'; choose {choices}"):
        load_model(tiny_model("llama"), dtype="int8")


def test_default_model_is_the_quantized_smollm2_gguf_in_half_precision() -> None:
    loaded = load_model(None)
    assert loaded.path.suffix == ".gguf" and loaded.name == loaded.path.stem
    assert loaded.dtype == HALF  # auto: a quantized file runs in half precision
    assert {p.dtype for p in loaded.model.parameters()} == {HALF}
    question = {"role": "user", "content": "What is the capital of France?"}
    prompt = loaded.tokenizer.apply_chat_template([question])
    kv_caches = allocate_kv_cache(loaded.config, num_blocks=4, block_size=16, dtype=HALF)
    tokens, new = list(prompt), list(prompt)
    for _ in range(8):  # greedy: the prompt in one call, then one token a call
        positions = torch.arange(len(tokens) - len(new), len(tokens))
        batch = ForwardBatch(torch.tensor(new), positions, positions.clone(), [len(new)], [len(tokens)],
                             torch.arange(4)[None], torch.tensor([len(new) - 1]))
        new = [int(loaded.model(batch, kv_caches).argmax())]
        tokens += new
    assert loaded.tokenizer.decode(tokens[len(prompt):]).startswith("The capital of France is Paris")
