"""`--task embed` on the families beyond Llama: a mixture of experts (Mixtral) and Gemma 2 and 3 (their
windows crossed by the longer texts), each served for embeddings by the offline `Engine` from a tiny random
checkpoint, every vector equal to transformers' `AutoModel` last hidden state of the same tokens, pooled at
the last token and normalised (cosine >= 0.9999), over texts of mixed lengths prefilled in chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from gracelm import Engine
from tests.test_gemma import VARIANTS as GEMMA_VARIANTS
from tests.test_moe import FAMILIES as MOE_FAMILIES
from tests.tiny_models import tiny_model

TEXTS = ["the cat", "a quick red dog jumps over the old stone because the river is blue " * 2, "night"]
MODELS = {"mixtral": ("mixtral", MOE_FAMILIES["mixtral"]), **GEMMA_VARIANTS}


@pytest.mark.parametrize("name", list(MODELS))
def test_embeddings_equal_transformers_last_hidden_state(name: str) -> None:
    arch, overrides = MODELS[name]
    path = tiny_model(arch, **overrides)
    with Engine(str(path), task="embed", dtype="float32", max_num_batched_tokens=16, num_threads=1) as engine:
        outputs = engine.embed(TEXTS, use_tqdm=False)
    reference = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    assert max(len(output.prompt_token_ids) for output in outputs) > 16  # chunked, and past Gemma's window
    for output in outputs:
        with torch.no_grad():
            hidden = reference(torch.tensor([output.prompt_token_ids])).last_hidden_state[0, -1]
        ours = torch.tensor(output.embedding)
        assert F.cosine_similarity(ours, F.normalize(hidden, dim=0), dim=0).item() >= 0.9999
        assert abs(ours.norm().item() - 1) < 1e-4
