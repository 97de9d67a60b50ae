"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): greedy continuations of 4 prompts computed in one
batch over a paged KV cache equal transformers' greedy `generate` on the same file, token for token."""

from __future__ import annotations

import time

import pytest
import torch

from gracelm.model.attention import allocate_kv_cache
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.loader import LoadedModel, load_model
from gracelm.model.model_files import default_model_path

NEW_TOKENS = 32
BLOCK_SIZE = 16
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module")
def ours() -> tuple[LoadedModel, float]:
    start = time.perf_counter()
    loaded = load_model(None, dtype="float32")
    return loaded, time.perf_counter() - start


@pytest.fixture(scope="module")
def reference() -> tuple[torch.nn.Module, float]:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), time.perf_counter() - start


def greedy_batch(loaded: LoadedModel, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """All prompts prefilled in one forward, then `steps - 1` decode steps for all of them together.
    Each sequence's blocks are interleaved with the others', so no sequence's cache is contiguous."""
    n = len(prompts)
    per_seq = -(-(max(map(len, prompts)) + steps) // BLOCK_SIZE)
    caches = allocate_kv_cache(loaded.config, n * per_seq, BLOCK_SIZE, torch.float32)
    tables = torch.tensor([[seq + n * k for k in range(per_seq)] for seq in range(n)])

    def forward(chunks: list[list[int]], starts: list[int]) -> list[int]:
        positions = [list(range(s, s + len(c))) for s, c in zip(starts, chunks, strict=True)]
        slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                 for i, ps in enumerate(positions) for p in ps]
        query_lens = [len(c) for c in chunks]
        batch = ForwardBatch(
            input_ids=torch.tensor([t for c in chunks for t in c]),
            positions=torch.tensor([p for ps in positions for p in ps]),
            slot_mapping=torch.tensor(slots),
            query_lens=query_lens,
            seq_lens=[s + q for s, q in zip(starts, query_lens, strict=True)],
            block_tables=tables,
            logits_indices=torch.tensor(query_lens).cumsum(0) - 1,
        )
        return loaded.model(batch, caches).argmax(-1).tolist()

    outputs: list[list[int]] = [[t] for t in forward(prompts, [0] * n)]
    for _ in range(steps - 1):
        starts = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs, strict=True)]
        for out, token in zip(outputs, forward([[o[-1]] for o in outputs], starts), strict=True):
            out.append(token)
    return outputs


def until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """The tokens up to and including the first end-of-sequence token, where generate stops."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def test_greedy_batch_equals_transformers_generate(ours, reference) -> None:
    loaded, _ = ours
    reference, _ = reference
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.apply_chat_template(CHAT)] + [tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths in one batch
    got = greedy_batch(loaded, prompts, NEW_TOKENS)
    eos_ids = reference.generation_config.eos_token_id
    eos = tuple(eos_ids) if isinstance(eos_ids, list) else (eos_ids,)
    for prompt, ours_tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected = out[0, len(prompt):].tolist()
        assert until_eos(ours_tokens, eos) == expected, (
            f"prompt {tokenizer.decode(prompt)!r}:\n ours {tokenizer.decode(ours_tokens)!r}\n"
            f" hf   {tokenizer.decode(expected)!r}"
        )
    # The chat answer is a real answer, not noise: the weights were read correctly.
    assert "red" in tokenizer.decode(got[0]).lower()


def test_default_model_loads_fast(ours, reference) -> None:
    loaded, seconds = ours
    _, reference_seconds = reference
    assert loaded.config.architecture == "LlamaForCausalLM" and loaded.config.num_hidden_layers == 30
    assert loaded.config.tie_word_embeddings and loaded.config.vocab_size == 49152
    # Idle, about 1.5 s (metadata 0.1 s, tokenizer 0.4 s, dequantization 1 s) against transformers' 8 s,
    # which parses the metadata with gguf.GGUFReader twice. Compared within the same run, so that a busy
    # machine slows both alike.
    assert seconds < 0.5 * reference_seconds, f"{seconds:.1f} s, transformers {reference_seconds:.1f} s"
