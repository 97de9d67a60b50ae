"""Speculative decoding through the engine (`speculative="ngram"`) on a tiny random model.

In deterministic mode a verification's rows are computed as the same tokens decoded one by one are, so
speculation must give plain decoding's tokens and logprobs to the bit: greedy and seeded, with penalties,
stop strings, structured outputs, n > 1, chunked prefill and preemption. The prompts repeat themselves, so
that drafts are found, and some kept.
"""

from __future__ import annotations

import random

import pytest

from gracelm import Engine, SamplingParams
from gracelm.structured_output import StructuredOutputs
from tests.process_checks import assert_nothing_left
from tests.test_deterministic import _block_bytes, _params
from tests.tiny_models import tiny_model

SPECULATION = dict(speculative="ngram", prompt_lookup_min=1, speculative_max_batch=64)


def _repeating_prompts(count: int) -> list[list[int]]:
    """Each a random phrase said three times and begun a fourth."""
    rng = random.Random(5)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, 500) for _ in range(6 + i % 11)]
        prompts.append(phrase * 3 + phrase[:3])
    return prompts


def _with(params: SamplingParams, **changes) -> SamplingParams:
    return SamplingParams(**{**{name: getattr(params, name) for name in params.__struct_fields__}, **changes})


def _all_params(count: int) -> list[SamplingParams]:
    """Greedy and seeded kinds in turn (test_deterministic's), some with what reads the output so far."""
    params = [_with(p, max_tokens=24) for p in _params(count)]
    extras = [dict(presence_penalty=0.5, frequency_penalty=0.3), dict(repetition_penalty=1.3),
              dict(min_tokens=6, ignore_eos=False), dict(n=2), dict(logit_bias={7: 3.0}),
              dict(structured_outputs=StructuredOutputs(regex="[a-z ]{4,30}"), ignore_eos=False)]
    for i, extra in enumerate(extras):
        params[i * 3 + 1] = _with(params[i * 3 + 1], **extra)
    return params


def _results(outputs) -> list:
    """Each completion's tokens, text, finish reason and exact logprobs."""
    return [[(list(c.token_ids), c.text, c.finish_reason,
              [{token: entry.logprob for token, entry in at.items()} for at in c.logprobs or []])
             for c in out.outputs] for out in outputs]


def _generate(llm: Engine, prompts, params) -> list:
    return _results(llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_gives_plain_decoding_s_outputs_to_the_bit(dtype: str):
    model = str(tiny_model("llama"))
    prompts, params = _repeating_prompts(24), _all_params(24)
    base = {"dtype": dtype, "deterministic": True, "max_model_len": 256, "num_threads": 1}
    with Engine(model, **base) as llm:
        plain = _generate(llm, prompts, params)
        # Stop strings taken from plain outputs' middles: they end some runs inside a kept draft.
        stops = [_with(p, stop=[out[0][1][len(out[0][1]) // 2:][:3]]) if out[0][1][3:] else p
                 for p, out in zip(params, plain, strict=True)]
        plain_stopped = _generate(llm, prompts, stops)
    for options in ({}, {"max_num_batched_tokens": 24}, {"kv_cache_memory": 40 * _block_bytes(dtype)}):
        with Engine(model, **base, **options, **SPECULATION) as llm:
            assert _generate(llm, prompts, params) == plain, options
            assert _generate(llm, prompts, stops) == plain_stopped, options
            stats = llm.stats()
            if "kv_cache_memory" in options:
                assert stats["num_preemptions"] > 0
        spec = stats["spec_decode"]
        assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], (options, spec)
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert_nothing_left()


def test_speculation_is_refused_for_an_embedding_model():
    from tests.tiny_models import tiny_embedding_model

    with pytest.raises(Exception, match="speculative ngram"):
        Engine(str(tiny_embedding_model()), **SPECULATION)
    assert_nothing_left()


def test_prompt_lookup_bounds_are_checked():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        Engine(str(tiny_model("llama")), speculative="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
