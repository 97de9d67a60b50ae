"""Speculative decoding with a draft model (`speculative_model=`): a smaller tiny model of the same tokenizer,
or the target drafting for itself.

In deterministic mode the target's outputs must be plain decoding's to the bit whatever the draft model
proposes (the draft only changes how many tokens a step keeps). The target drafting for itself checks the
draft model's own KV cache: it follows the target's blocks, prompt chunks, preemption and drafts kept whole
included, so every greedy draft is kept.
"""

from __future__ import annotations

import pytest

from gracelm import Engine, SamplingParams
from tests.process_checks import assert_nothing_left
from tests.test_deterministic import _block_bytes
from tests.test_speculative_decoding import _all_params, _generate, _repeating_prompts
from tests.tiny_models import tiny_model

BASE = {"dtype": "float32", "deterministic": True, "max_model_len": 256, "num_threads": 1,
        "speculative_max_batch": 64}


def _draft() -> str:
    """A smaller model than the target, of the same tokenizer."""
    return str(tiny_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1))


def _plain(model: str, prompts, params) -> list:
    with Engine(model, **{k: v for k, v in BASE.items() if k != "speculative_max_batch"}) as llm:
        return _generate(llm, prompts, params)


def test_a_draft_model_gives_plain_decoding_s_outputs_to_the_bit():
    """Greedy and seeded requests with what reads their output (test_speculative_decoding's): drafted by the
    target itself (sampled rows reject some drafts) and by a smaller random model (which it rejects)."""
    model = str(tiny_model("llama"))
    prompts, params = _repeating_prompts(24), _all_params(24)
    plain = _plain(model, prompts, params)
    for draft, options in ((model, {}), (model, {"max_num_batched_tokens": 24}), (_draft(), {})):
        with Engine(model, **BASE, **options, speculative_model=draft) as llm:
            assert _generate(llm, prompts, params) == plain, (draft, options)
            stats = llm.stats()
        spec = stats["spec_decode"]
        assert spec["method"] == "draft" and spec["num_draft_tokens"] > 0
        if draft == model:
            assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert_nothing_left()


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 24},
                                     {"kv_cache_memory": 2 * 24 * _block_bytes("float32")}],
                         ids=["roomy", "chunked", "preempting"])
def test_the_target_drafting_for_itself_keeps_every_greedy_draft(options):
    model = str(tiny_model("llama"))
    prompts = _repeating_prompts(8)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 8
    plain = _plain(model, prompts, params)
    with Engine(model, **BASE, **options, speculative_model=model) as llm:
        assert _generate(llm, prompts, params) == plain
        stats = llm.stats()
    spec = stats["spec_decode"]
    assert spec["num_drafts"] > 8 and spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    assert spec["accepted_per_position"][0] == spec["num_drafts"]
    if "kv_cache_memory" in options:
        assert stats["num_preemptions"] > 0
    assert_nothing_left()


def test_the_kv_cache_holds_both_models_blocks():
    model, draft = str(tiny_model("llama")), _draft()
    memory = 64 * _block_bytes("float32")
    with Engine(model, **BASE, kv_cache_memory=memory) as llm:
        alone = llm.stats()["kv_blocks_total"]
    with Engine(model, **BASE, kv_cache_memory=memory, speculative_model=draft) as llm:
        stats = llm.stats()
    # The draft model's block: 2 layers x (K, V) x 16 tokens x 1 KV head x 16 dims, float32.
    draft_block = 2 * 2 * 16 * 1 * 16 * 4
    assert alone == 64
    assert stats["kv_blocks_total"] == memory // (_block_bytes("float32") + draft_block)
    assert stats["memory"]["kv_cache"] == stats["kv_blocks_total"] * (_block_bytes("float32") + draft_block)
    assert_nothing_left()


def test_a_draft_model_of_another_vocabulary_is_refused_naming_both():
    model = str(tiny_model("llama"))
    other = str(tiny_model("llama", vocab_size=640))
    with pytest.raises(Exception, match=r"vocabulary of 640 tokens.* 512"):
        Engine(model, speculative_model=other)
    assert_nothing_left()


@pytest.mark.parametrize("options, named", [
    ({"speculative": "ngram", "speculative_model": "x"}, "speculative_model"),
    ({"speculative": "draft"}, "speculative_model"),
    ({"speculative_model": "x", "tensor_parallel_size": 2}, "tensor_parallel_size"),
])
def test_inconsistent_speculation_options_are_refused(options, named):
    with pytest.raises(ValueError, match=named):
        Engine(str(tiny_model("llama")), **options)


def test_a_draft_model_drafts_through_its_compiled_decode_graphs(graph_cache):
    """On the first compiled path this machine runs (the path matrix's 4-bit model, its graphs built by the
    suite): the draft model's passes after its first are decode steps, which its own graphs serve; the
    target drafting for itself keeps nearly every greedy draft, and answers as without speculation."""
    from tests.kernel_paths import PATHS, matrix_gguf

    path = next((p for p in PATHS if p.compiled and p.why_not_here() is None), None)
    if path is None:
        pytest.skip("no compiled path runs here")
    gguf, options = str(matrix_gguf()), {"max_model_len": 256, "num_threads": 1, **path.engine_options()}
    prompts = [[7 + i, 30, 31, 32, 33, 34, 35] * 3 for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with Engine(gguf, **options) as llm:
        plain = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    with Engine(gguf, **options, speculative_model=gguf, speculative_max_batch=64) as llm:
        spec = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    assert stats["kernel_paths"]["draft_decode_graph"] == "compiled"
    assert stats["kernel_paths"]["decode_graph"] == "compiled"
    drafted = stats["spec_decode"]
    assert drafted["num_accepted_tokens"] >= 0.9 * drafted["num_draft_tokens"] > 0
    assert spec == plain
    assert_nothing_left()
