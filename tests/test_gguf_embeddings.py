"""Embedding models from GGUF files, as llama.cpp's converter writes Qwen3-Embedding: a tiny random Qwen3
whose `qwen3.pooling_type` says how to pool. The task is found from the file; each vector equals transformers'
pooled, normalised final hidden state of the same weights in float32 (cosine >= 0.9999) over inputs of mixed
lengths prefilled in chunks; a logits matrix the file holds is not loaded; a pooling type that is no
embedding fails the start naming it, and a server of such a file answers the official client.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import openai
import pytest
import torch
import torch.nn.functional as F

from gracelm import Engine
from gracelm.engine.errors import EngineStartupError
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.model.loader import load_model
from gracelm.model.tokenizer import Tokenizer
from tests.server_process import ServerProcess
from tests.test_gguf import gguf_layout, hf_model, write_gguf

TEXTS = ["the cat", "a quick red dog jumps over the old stone because the river is blue " * 3, "night"]
# llama.cpp's pooling type -> what transformers' hidden states are pooled by.
POOLINGS = {gguf.PoolingType.LAST: lambda h: h[-1], gguf.PoolingType.MEAN: lambda h: h.mean(0),
            gguf.PoolingType.CLS: lambda h: h[0]}


def _write(directory: Path, pooling: gguf.PoolingType | None, tied: bool = True
           ) -> tuple[Path, torch.nn.Module]:
    """A Qwen3 GGUF in F32 with `pooling` in its metadata (none where None), and its transformers model."""
    model = hf_model("qwen3", tie_word_embeddings=tied)
    heads = (model.config.num_attention_heads, model.config.num_key_value_heads)
    metadata = None if pooling is None else {"pooling_type": pooling}
    path = write_gguf(directory / "embed.gguf", gguf_layout(model, "qwen3"), gguf.GGMLQuantizationType.F32,
                      arch="qwen3", heads=heads, metadata=metadata)
    return path, model


@torch.no_grad()
def _reference(model: torch.nn.Module, ids: list[int], pooling: gguf.PoolingType) -> torch.Tensor:
    hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(POOLINGS[pooling](hidden), dim=0)


def _assert_close(vector: list[float], reference: torch.Tensor) -> None:
    ours = torch.tensor(vector)
    assert ours.shape == reference.shape
    assert F.cosine_similarity(ours, reference, dim=0).item() >= 0.9999
    assert abs(ours.norm().item() - 1) < 1e-4


@pytest.mark.parametrize("pooling", list(POOLINGS), ids=lambda p: p.name)
def test_vectors_equal_transformers_pooled_as_the_file_says(tmp_path, pooling):
    path, model = _write(tmp_path, pooling)
    with Engine(str(path), dtype="float32", max_num_batched_tokens=16, num_threads=1) as engine:
        assert engine.pooling is not None and engine.config.task == "embed"  # found from the file
        outputs = engine.embed(TEXTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outputs) > 16  # one input prefilled in several chunks
    for output in outputs:
        _assert_close(output.embedding, _reference(model, output.prompt_token_ids, pooling))


def test_a_file_without_pooling_type_generates_unless_asked_to_embed(tmp_path):
    path, model = _write(tmp_path, None)
    with Engine(str(path), dtype="float32", num_threads=1) as engine:
        assert engine.pooling is None and engine.config.task == "generate"
    with Engine(str(path), dtype="float32", num_threads=1, task="embed") as engine:
        [output] = engine.embed(["the cat sat"], use_tqdm=False)
    _assert_close(output.embedding, _reference(model, output.prompt_token_ids, gguf.PoolingType.LAST))


def test_the_logits_matrix_of_the_file_is_not_loaded(tmp_path):
    path, _ = _write(tmp_path, gguf.PoolingType.LAST, tied=False)
    generating, embedding = (load_model(path, dtype="float32", embedding=e) for e in (False, True))
    assert "lm_head.weight" in generating.model.state_dict()
    assert not any(name.startswith("lm_head") for name in embedding.model.state_dict())


@pytest.mark.parametrize("pooling", [gguf.PoolingType.NONE, gguf.PoolingType.RANK], ids=lambda p: p.name)
def test_a_pooling_type_that_is_no_embedding_fails_the_start(tmp_path, pooling):
    path, _ = _write(tmp_path, pooling)
    process = ServerProcess(path, "--dtype", "float32", wait_ready=False)
    try:
        assert process.wait_exit(120) == ExitCode.STARTUP_FAILURE
        assert f"its pooling_type is {pooling.name}" in process.log()
    finally:
        process.close_log()


def test_an_embedding_model_found_from_its_file_is_refused_with_tensor_parallelism(tmp_path):
    """The core reads the task from the file (the frontend starts it without reading the file), and refuses
    the file's embedding model on two ranks before it loads anything."""
    model = hf_model("qwen3", num_key_value_heads=2)  # two ranks split its heads
    path = write_gguf(tmp_path / "embed.gguf", gguf_layout(model, "qwen3"), gguf.GGMLQuantizationType.F32,
                      arch="qwen3", heads=(2, 2), metadata={"pooling_type": gguf.PoolingType.LAST})
    with pytest.raises(EngineStartupError, match="embedding model .* tensor_parallel_size must be 1"):
        Engine(str(path), dtype="float32", num_threads=1, tensor_parallel_size=2)


def test_a_server_of_the_file_answers_the_official_client(tmp_path):
    path, model = _write(tmp_path, gguf.PoolingType.LAST)
    with ServerProcess(path, "--served-model-name", "embed", "--dtype", "float32", "--stats-interval", "0",
                       env={"OMP_WAIT_POLICY": "PASSIVE"}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.embeddings.create(model="embed", input=TEXTS[:2])
    tokenizer = Tokenizer.from_gguf(path)
    ids = [tokenizer.encode(text) for text in TEXTS[:2]]
    assert [item.index for item in answer.data] == [0, 1]
    for item, item_ids in zip(answer.data, ids, strict=True):
        _assert_close(item.embedding, _reference(model, item_ids, gguf.PoolingType.LAST))

