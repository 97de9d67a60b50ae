"""The paged model computes transformers' logits (float32, within 1e-4) for every way the engine calls it:
mixed-length batches, prompts split over several calls, and decode steps over scattered cache blocks —
both as loaded and frozen (`freeze()`: fused, repacked linears), the way the engine runs it. Freezing
changes no logit: within 1e-5 in float32, bit for bit in bfloat16 on the CPU (oneDNN runs the same kernel
either way). The model runs on `GRACELM_TEST_DEVICE` (`tests/devices.py`), transformers on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gracelm.model.attention import allocate_kv_cache
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.llama import FrozenLinear, LlamaForCausalLM
from gracelm.model.loader import load_model
from tests.devices import TEST_DEVICE
from tests.tiny_models import VOCAB_SIZE, tiny_model

ATOL = 1e-4
BLOCK_SIZE = 4  # small, so that sequences span many blocks

# Phi-4-mini's kind: rope over half of each head, LongRoPE (within its original context: its short factors).
PHI4_MINI_KIND = {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 128, "rope_scaling": {
    "type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [8.0] * 4}}
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-rope-llama3": ("llama", {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-rope-linear": ("llama", {"rope_theta": 10000.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True, "head_dim": 32}),
    # Phi-3's fused q/k/v and gate/up; Phi-4-mini's partial rotary and LongRoPE (its short factors).
    "phi3": ("phi3", {}),
    "phi3-partial-longrope": ("phi3", PHI4_MINI_KIND),
}


class PagedRunner:
    """Drives the model as an engine does: each sequence owns blocks taken from a shuffled free list."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 96, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.kv_caches = allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, dtype, TEST_DEVICE)
        generator = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One forward over (sequence id, new tokens) chunks; logits of every new token, per chunk."""
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq, new in chunks:
            tokens, blocks = self.tokens.setdefault(seq, []), self.blocks.setdefault(seq, [])
            for token in new:
                position = len(tokens)
                if position % BLOCK_SIZE == 0:
                    blocks.append(self.free_blocks.pop())
                tokens.append(token)
                input_ids.append(token)
                positions.append(position)
                slots.append(blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            query_lens.append(len(new))
            seq_lens.append(len(tokens))
        width = max(len(self.blocks[seq]) for seq, _ in chunks)
        tables = [self.blocks[seq] + [0] * (width - len(self.blocks[seq])) for seq, _ in chunks]
        self.last_batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, device=TEST_DEVICE),
            positions=torch.tensor(positions, device=TEST_DEVICE),
            slot_mapping=torch.tensor(slots, device=TEST_DEVICE),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=torch.tensor(tables, device=TEST_DEVICE),
            logits_indices=torch.arange(len(input_ids), device=TEST_DEVICE),
        )
        return list(self.model(self.last_batch, self.kv_caches).cpu().split(query_lens))

    def rerun_for_last_tokens(self) -> list[torch.Tensor]:
        """The last batch again (rewriting the same K/V), asking only for each sequence's last row."""
        batch = self.last_batch
        batch.logits_indices = torch.tensor(batch.query_lens, device=TEST_DEVICE).cumsum(0) - 1
        return list(self.model(batch, self.kv_caches).cpu().split(1))


Models = tuple[LlamaForCausalLM, torch.nn.Module]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[Path, torch.nn.Module]:
    """A tiny model's directory and transformers' model of it."""
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[request.param]
    directory: Path = tiny_model(arch, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    return directory, reference.eval()


@pytest.fixture(scope="module", params=["as-loaded", "frozen"])
def models(request: pytest.FixtureRequest, variant: tuple[Path, torch.nn.Module]) -> Models:
    directory, reference = variant
    ours = load_model(directory, dtype="float32", device=TEST_DEVICE).model
    if request.param == "frozen":
        ours.freeze()
    return ours, reference


def reference_logits(reference: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_matches(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.shape == expected.shape
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_rope_scaling_reaches_the_model(models: Models) -> None:
    ours, reference = models
    hf_rope = reference.config.rope_parameters or {}
    assert (ours.config.rope_scaling or {}).get("rope_type", "default") == hf_rope.get("rope_type", "default")
    assert ours.config.rope_theta == hf_rope.get("rope_theta", ours.config.rope_theta)


def test_one_batch_of_sequences_of_different_lengths(models: Models) -> None:
    ours, reference = models
    # Prompts of up to 16 tokens are attended in a batch padded to 16 rows; the 17 and the 70 alone
    # (`attention.PrefillBatch`).
    prompts = [random_tokens(n, seed=n) for n in (7, 1, 12, 3, 16, 17, 70)]
    runner = PagedRunner(ours)
    chunks = list(enumerate(prompts))
    for prompt, logits in zip(prompts, runner.step(chunks), strict=True):
        assert_matches(logits, reference_logits(reference, prompt))
    # Writing the same K/V again is idempotent, so the same batch can ask for its last rows only.
    for prompt, logits in zip(prompts, runner.rerun_for_last_tokens(), strict=True):
        assert_matches(logits, reference_logits(reference, prompt)[-1:])


def test_a_prompt_gets_the_same_logits_beside_others_as_alone() -> None:
    """Short prompts are attended in one batch, each padded to 16 rows (`attention.PrefillBatch`), and a
    prompt alone the same way: its logits are bit for bit those it gets alone, whatever prompts share its
    step (as the engine needs: a request must not change another's answer). In bfloat16, as served:
    float32's MKL matmuls round a row otherwise as the rows beside it change (the batch-invariant mode's
    concern)."""
    dtype = torch.bfloat16
    model = load_model(tiny_model("llama"), dtype=str(dtype).removeprefix("torch."), device=TEST_DEVICE).model
    model.freeze()
    prompt = random_tokens(10, seed=5)
    alone = PagedRunner(model, dtype=dtype).step([(0, prompt)])[0]
    others = [random_tokens(n, seed=30 + n) for n in (3, 12, 16, 30, 70)]
    together = PagedRunner(model, seed=4, dtype=dtype).step([(1, others[0]), (0, prompt)]
                                                            + [(2 + i, p) for i, p in enumerate(others[1:])])
    assert torch.equal(together[1], alone)


def test_prompt_split_over_several_calls(models: Models) -> None:
    ours, reference = models
    prompt, other = random_tokens(23, seed=1), random_tokens(6, seed=2)
    runner = PagedRunner(ours, seed=1)
    got = [runner.step([(0, prompt[:7]), (1, other)])[0]]
    got += runner.step([(0, prompt[7:8])])  # a one-token chunk goes down the decode path
    got += runner.step([(1, [5]), (0, prompt[8:17])])[1:]  # a chunk after context, beside a decode
    got += runner.step([(0, prompt[17:])])
    assert_matches(torch.cat(got), reference_logits(reference, prompt))
    assert_matches(torch.cat(runner.step([(1, [9])])), reference_logits(reference, [*other, 5, 9])[-1:])


def test_decode_steps_over_scattered_blocks(models: Models) -> None:
    ours, reference = models
    runner = PagedRunner(ours, seed=2)
    prompts = {seq: random_tokens(n, seed=10 + seq) for seq, n in enumerate((5, 9, 2))}
    got: dict[int, list[torch.Tensor]] = {seq: [] for seq in prompts}
    for seq, logits in zip(prompts, runner.step(list(prompts.items())), strict=True):
        got[seq].append(logits)
    continuation = random_tokens(8 * len(prompts), seed=3)
    for step in range(8):
        chunks = [(seq, [continuation[step * len(prompts) + seq]]) for seq in prompts]
        for seq, logits in zip(prompts, runner.step(chunks), strict=True):
            got[seq].append(logits)
    blocks_in_use = sorted(block for blocks in runner.blocks.values() for block in blocks)
    assert blocks_in_use != list(range(blocks_in_use[0], blocks_in_use[0] + len(blocks_in_use)))
    for seq, logits in got.items():
        assert_matches(torch.cat(logits), reference_logits(reference, runner.tokens[seq]))


FREEZE_ARCHS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}),
                "qwen3-tied": ("qwen3", {"tie_word_embeddings": True, "head_dim": 32}), "phi3": ("phi3", {})}


def mixed_batch_with_decodes(model: LlamaForCausalLM, dtype: torch.dtype) -> torch.Tensor:
    """Every logit of a prefill batch of mixed lengths, a chunk beside decodes, then decode steps."""
    runner = PagedRunner(model, seed=3, dtype=dtype)
    prompts = {seq: random_tokens(n, seed=20 + seq) for seq, n in enumerate((9, 1, 14, 4))}
    logits = runner.step([(seq, prompt[:6]) for seq, prompt in prompts.items()])
    logits += runner.step([(seq, prompt[6:] or [7]) for seq, prompt in prompts.items()])
    continuation = random_tokens(6 * len(prompts), seed=4)
    for step in range(6):
        logits += runner.step([(seq, [continuation[step * len(prompts) + seq]]) for seq in prompts])
    return torch.cat(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FREEZE_ARCHS))
def test_freezing_changes_no_logit(name: str, dtype: torch.dtype) -> None:
    arch, overrides = FREEZE_ARCHS[name]
    directory = tiny_model(arch, **overrides)
    model = load_model(directory, dtype=str(dtype).removeprefix("torch."), device=TEST_DEVICE).model
    expected = mixed_batch_with_decodes(model, dtype)
    model.freeze()
    assert not [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    config = model.config
    kv_width = config.num_key_value_heads * config.head_dim
    assert attn.qkv_proj.output_sizes == (config.num_attention_heads * config.head_dim, kv_width, kv_width)
    assert mlp.gate_up_proj.output_sizes == (config.intermediate_size,) * 2
    assert isinstance(model.logits_proj, FrozenLinear)
    on_cpu = TEST_DEVICE.type == "cpu"
    # oneDNN packs bfloat16 only where the CPU computes it natively; elsewhere F.linear emulates it.
    native_bf16 = (on_cpu and torch.backends.mkldnn.is_available()
                   and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert (model.logits_proj.packed is not None) == (dtype == torch.bfloat16 and native_bf16)
    frozen = mixed_batch_with_decodes(model, dtype)
    assert frozen.dtype == torch.float32 and frozen.shape == expected.shape
    if dtype == torch.bfloat16 and on_cpu:
        assert torch.equal(frozen, expected)
    elif dtype == torch.bfloat16:
        # A GPU's BLAS may pick another kernel for a stacked (wider) matmul: the same function, rounded
        # differently in bfloat16 (its 8 bits of mantissa: a relative error of 2^-8 per rounding).
        torch.testing.assert_close(frozen, expected, atol=0.05, rtol=0.02)
    else:
        torch.testing.assert_close(frozen, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides", [{}, PHI4_MINI_KIND], ids=["phi3", "phi3-partial-longrope"])
def test_greedy_tokens_equal_transformers_generate(overrides: dict) -> None:
    """Phi-3's greedy tokens, decoded step by step over the paged cache, are transformers' in float32."""
    from transformers import AutoModelForCausalLM

    directory = tiny_model("phi3", **overrides)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = load_model(directory, dtype="float32", device=TEST_DEVICE).model
    model.freeze()
    assert_greedy_equals_generate(model, reference, random_tokens(9, seed=7), 24)


def assert_greedy_equals_generate(model: torch.nn.Module, reference: torch.nn.Module, prompt: list[int],
                                  new_tokens: int) -> None:
    """`model`'s greedy tokens after `prompt`, decoded step by step over the paged cache, are transformers'
    `generate` of `reference` (up to an end-of-sequence token, where generate stops)."""
    runner = PagedRunner(model)
    logits = runner.step([(0, prompt)])[0]
    ours = []
    for _ in range(new_tokens):
        ours.append(int(logits[-1].argmax()))
        logits = runner.step([(0, ours[-1:])])[0]
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected = out[0, len(prompt):].tolist()
    assert len(expected) > 4 and ours[: len(expected)] == expected
