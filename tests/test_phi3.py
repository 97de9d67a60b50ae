"""Phi-3 and Phi-4 (`Phi3ForCausalLM`) beyond the logits (`tests/test_model_parity.py`, `tests/test_gguf.py`):
a real server of a tiny Phi-3 answers a chat through the official `openai` client and stops clean; the
context is bounded where the model's sliding window or LongRoPE's original context ends (the engine's
default is capped there, a longer `--max-model-len` refused at start with exit 3 naming it); the config's
partial rotary is read from either place transformers keeps it.
"""

from __future__ import annotations

import openai
import pytest

from gracelm import Engine
from gracelm.config import ModelConfig
from gracelm.lifecycle.exit_codes import ExitCode
from tests.server_process import ServerProcess
from tests.tiny_models import tiny_model

MODEL = "tiny-phi3"
SHAPE = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096}


def test_a_phi3_server_answers_a_chat_through_openai() -> None:
    with ServerProcess(tiny_model("phi3"), "--served-model-name", MODEL, "--dtype", "float32",
                       "--stats-interval", "0") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "the quick red dog"}])
        assert answer.choices[0].message.content
        assert answer.usage.completion_tokens > 0
        assert answer.choices[0].finish_reason in ("length", "stop")


def test_the_context_ends_at_the_sliding_window() -> None:
    with Engine(str(tiny_model("phi3", sliding_window=64)), dtype="float32", num_threads=1) as engine:
        assert engine.config.max_model_len == 64


def test_a_max_model_len_past_the_sliding_window_is_refused_at_start() -> None:
    process = ServerProcess(tiny_model("phi3", sliding_window=64), "--max-model-len", "128", wait_ready=False)
    try:
        assert process.wait_exit(120) == ExitCode.STARTUP_FAILURE
        assert "exceeds the model's limit of 64 tokens: its sliding window" in process.log()
    finally:
        process.close_log()


@pytest.mark.parametrize("hf, limit, bound", [
    ({}, 4096, "max_position_embeddings"),
    ({"sliding_window": 2047}, 2047, "sliding window"),
    ({"sliding_window": 8192}, 4096, "max_position_embeddings"),
    # Phi-4-mini's config.json (transformers 4): the original context at the top level.
    ({"original_max_position_embeddings": 1024, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}}, 1024, "LongRoPE"),
], ids=["none", "sliding-window", "window-past-the-context", "longrope"])
def test_context_limit(hf: dict, limit: int, bound: str) -> None:
    got, why = ModelConfig.from_hf_config({**SHAPE, **hf}).context_limit()
    assert got == limit and bound in why


@pytest.mark.parametrize("hf", [{"partial_rotary_factor": 0.75},
                                {"rope_scaling": {"rope_type": "longrope", "partial_rotary_factor": 0.75,
                                                  "short_factor": [1.0] * 6, "long_factor": [1.0] * 6}}],
                         ids=["top-level", "among-rope-parameters"])
def test_partial_rotary_factor(hf: dict) -> None:
    assert ModelConfig.from_hf_config({**SHAPE, **hf}).rotary_dim == 12  # of a head of 16


def test_qwen2s_unused_sliding_window_bounds_nothing() -> None:
    config = ModelConfig.from_hf_config({**SHAPE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
                                         "use_sliding_window": False})
    assert config.context_limit() == (4096, "max_position_embeddings")
