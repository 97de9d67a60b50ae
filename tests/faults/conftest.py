"""The fault matrix's models: the tiny llama, and for tensor parallelism one with 8 attention heads and 4
KV heads (splittable in two), each made once per session."""

from __future__ import annotations

import pytest

from tests.tiny_models import tiny_model


@pytest.fixture(scope="session")
def model() -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="session")
def tp_model() -> str:
    return str(tiny_model("llama", num_attention_heads=8, num_key_value_heads=4))
