"""The sampler's mask/bias stage and the per-request constraint state, without a server; then the offline
engine (a real engine-core process, a tiny random model) with constrained requests under batching,
chunked prefill and preemption, and a constraint that fails ending its request only."""

from __future__ import annotations

import re

import pytest
import torch

from gracelm import Engine, SamplingParams
from gracelm.model.sampler import SamplingMetadata, TokenConstraints, make_generator, sample
from gracelm.model.token_constraints import ConstraintStates
from gracelm.model.tokenizer import Tokenizer
from gracelm.structured_output import StructuredOutputs
from gracelm.thinking_span import ThinkingSpan
from tests.process_checks import assert_nothing_left
from tests.tiny_models import VOCAB_SIZE, tiny_model

PATTERN = r"(cat|dog) [0-9]{2,6}"
REGEX = StructuredOutputs(regex=PATTERN)
# One block of the tiny model's cache: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4
BASE = {"max_model_len": 256, "num_threads": 1}


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.from_dir(model)


def _sample(logits: torch.Tensor, params: list[SamplingParams], constraints: TokenConstraints | None):
    generators = [make_generator(100 + i) for i in range(len(params))]
    meta = SamplingMetadata.build(params, generators, [[1]] * len(params), [[]] * len(params),
                                  logits.shape[1], constraints=constraints)
    return sample(logits.clone(), meta).token_ids


def test_mask_and_bias_touch_only_their_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0, seed=1)] * 3
    allowed = torch.zeros(1, 50, dtype=torch.bool)
    allowed[0, [7, 11]] = True
    constraints = TokenConstraints(mask_rows=torch.tensor([1]), disallowed=~allowed,
                                   bias_keys=torch.tensor([2 * 50 + 5]), bias_values=torch.tensor([100.0]))
    free = _sample(logits, params, None)
    for _ in range(20):
        tokens = _sample(logits, params, constraints)
        assert int(tokens[1]) in (7, 11)
        assert int(tokens[2]) == 5  # +100 on token 5 outweighs the rest
        assert int(tokens[0]) == int(free[0])  # the unconstrained row draws what it would have drawn
    greedy = [SamplingParams(temperature=0.0)] * 3
    ban = TokenConstraints(None, None, torch.tensor([int(logits[0].argmax())]), torch.tensor([-torch.inf]))
    assert int(_sample(logits, greedy, ban)[0]) != int(logits[0].argmax())


def test_grammar_mask_follows_the_output(tokenizer):
    states = ConstraintStates(tokenizer, VOCAB_SIZE)
    params = SamplingParams(structured_outputs=REGEX)
    text = "dog 1234"
    ids = tokenizer.encode(text, add_special_tokens=False)
    output: list[int] = []
    for token in ids:
        constraints = states.build(["r"], [params], [output])
        allowed = ~constraints.disallowed[0]
        assert bool(allowed[token]), (output, token)
        # The end of sequence only where the text so far is a whole match.
        complete = re.fullmatch(PATTERN, tokenizer.decode(output)) is not None
        assert bool(allowed[tokenizer.eos_token_id]) == complete, tokenizer.decode(output)
        prefixes = {tokenizer.decode(output + [t]) for t in torch.nonzero(allowed).flatten().tolist()}
        assert all(re.fullmatch(r"(c(a(t( [0-9]{0,6})?)?)?|d(o(g( [0-9]{0,6})?)?)?)", p) for p in prefixes)
        states.advance("r", token)
        output.append(token)
    # Complete: end of sequence allowed now.
    assert not bool(states.build(["r"], [params], [output]).disallowed[0][tokenizer.eos_token_id])
    # A matcher out of step with the output (a preempted request recomputed; a token never recorded) is
    # rebuilt from the output tokens: the same mask as one that followed them.
    states.advance("r", ids[-1])
    again = states.build(["r"], [params], [output]).disallowed[0]
    fresh = ConstraintStates(tokenizer, VOCAB_SIZE).build(["s"], [params], [output]).disallowed[0]
    assert torch.equal(again, fresh)
    states.release(["r"])
    assert len(states) == 0


OPENER, END, WORD = 3, 4, 5  # any ids serve as the think tags here


def _thinking_mask(states: ConstraintStates, span: ThinkingSpan, output: list[int]) -> torch.Tensor | None:
    """The row's disallowed tokens after `output`, its last token advanced first, as the worker does."""
    for token in output[-1:]:
        states.advance("r", token)
    params = SamplingParams(structured_outputs=REGEX, thinking=span)
    return states.build(["r"], [params], [output]).disallowed


def _grammar_mask(tokenizer: Tokenizer, output: list[int]) -> torch.Tensor:
    params = SamplingParams(structured_outputs=REGEX)
    return ConstraintStates(tokenizer, VOCAB_SIZE).build(["s"], [params], [output]).disallowed[0]


@pytest.mark.parametrize("span", [ThinkingSpan(end=END, opener=OPENER), ThinkingSpan(end=END)])
def test_a_grammar_waits_for_the_end_of_the_thinking(tokenizer, span):
    """A reasoning model's thinking is not masked; the grammar reads the tokens after its end. Where the
    thinking is optional, the first token may be its opener or what the grammar allows."""
    states = ConstraintStates(tokenizer, VOCAB_SIZE)
    first = _thinking_mask(states, span, [])
    if span.opener is None:
        assert first is None  # the output starts inside the thinking
    else:
        expected = _grammar_mask(tokenizer, []).clone()
        expected[OPENER] = False
        assert torch.equal(first[0], expected)
    thinking = [OPENER, WORD, WORD] if span.opener is not None else [WORD, WORD]
    assert _thinking_mask(states, span, thinking) is None
    output, answer = [*thinking, END], []
    for token in tokenizer.encode("dog 12", add_special_tokens=False):
        assert torch.equal(_thinking_mask(states, span, output)[0], _grammar_mask(tokenizer, answer))
        output.append(token)
        answer.append(token)
    assert not bool(_thinking_mask(states, span, output)[0][tokenizer.eos_token_id])  # "dog 12" matches
    # Out of step with the output (a token never recorded): rebuilt from the answer's tokens.
    assert torch.equal(_thinking_mask(states, span, [*thinking, END])[0], _grammar_mask(tokenizer, []))


def test_an_output_that_does_not_open_its_optional_thinking_is_all_answer(tokenizer):
    states = ConstraintStates(tokenizer, VOCAB_SIZE)
    span = ThinkingSpan(end=END, opener=OPENER)
    first = tokenizer.encode("dog", add_special_tokens=False)[:1]
    _thinking_mask(states, span, [])
    assert torch.equal(_thinking_mask(states, span, first)[0], _grammar_mask(tokenizer, first))


def test_unconstrained_rows_cost_nothing_and_refusals_name_the_request(tokenizer):
    states = ConstraintStates(tokenizer, VOCAB_SIZE)
    assert states.build(["a", "b"], [SamplingParams(), SamplingParams(temperature=0)], [[], []]) is None
    constrained = states.build(["a", "b"], [SamplingParams(), SamplingParams(structured_outputs=REGEX)],
                               [[], []])
    assert constrained.mask_rows.tolist() == [1] and constrained.bias_keys is None
    with pytest.raises(ValueError, match="request b: its grammar refused token"):
        states.advance("b", tokenizer.encode("zzz", add_special_tokens=False)[0])
    with pytest.raises(ValueError, match="request c: its grammar does not compile"):
        broken = StructuredOutputs(grammar="start: nope")
        states.build(["c"], [SamplingParams(structured_outputs=broken)], [[]])
    with pytest.raises(ValueError, match="request d: allowed_token_ids names token 9999"):
        states.build(["d"], [SamplingParams(allowed_token_ids=[9999])], [[]])
    cat = tokenizer.encode("cat", add_special_tokens=False)
    conflict = SamplingParams(structured_outputs=StructuredOutputs(choice=["dog"]), allowed_token_ids=cat)
    with pytest.raises(ValueError, match="request e: no token is allowed"):
        states.build(["e"], [conflict], [[]])


def test_bad_words_ban_the_last_token_after_the_others(tokenizer):
    states = ConstraintStates(tokenizer, VOCAB_SIZE)
    params = SamplingParams(bad_words=["red cat"], logit_bias={9: -5.0})
    words = [tokenizer.encode(w, add_special_tokens=False) for w in ("red cat", " red cat")]
    assert all(len(w) > 1 for w in words), words
    banned = set(states.build(["r"], [params], [[]]).bias_keys.tolist())
    assert banned == {9}  # only the bias: no word's beginning was produced
    for word in words:
        keys = states.build(["r"], [params], [[5, *word[:-1]]]).bias_keys.tolist()
        assert word[-1] in keys and 9 in keys


@pytest.mark.parametrize("options", [
    pytest.param({}, id="batched"),
    pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
    pytest.param({"kv_cache_memory": 20 * TINY_BLOCK_BYTES}, id="preemption"),
])
def test_constrained_greedy_under_batching_equals_one_at_a_time(model, options):
    """Constrained requests give the tokens they give alone, however they are scheduled: the grammar
    state follows each request through chunked prefill and preemption."""
    prompts = [[3 + (i * 7 + j) % 400 for j in range(20 + (i * 37) % 120)] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=REGEX),
              SamplingParams(temperature=0.0, max_tokens=24, bad_words=["the"], logit_bias={40: 3.0})]
    with Engine(model, enable_prefix_caching=False, **BASE) as llm:
        alone = [llm.generate([p], params[i % 2], use_tqdm=False)[0].outputs[0]
                 for i, p in enumerate(prompts)]
    with Engine(model, **{**BASE, **options}) as llm:
        together = [o.outputs[0] for o in llm.generate(prompts, [params[i % 2] for i in range(len(prompts))],
                                                       use_tqdm=False)]
        stats = llm.stats()
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for i, out in enumerate(together):
        if i % 2 == 0:
            assert out.finish_reason == "stop" and re.fullmatch(PATTERN, out.text), out
    if "kv_cache_memory" in options:
        assert stats["num_preemptions"] > 0, "the tiny cache should have forced preemption"
    assert_nothing_left()


def test_a_failing_constraint_ends_its_request_only(model):
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(grammar="start: nope"))
    good = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=REGEX)
    with Engine(model, **BASE) as llm:
        failed, served = llm.generate([[5, 6, 7], [8, 9, 10]], [bad, good], use_tqdm=False)
        assert failed.outputs[0].finish_reason == "error"
        assert served.outputs[0].finish_reason == "stop" and re.fullmatch(PATTERN, served.outputs[0].text)
        again = llm.generate([[8, 9, 10]], good, use_tqdm=False)[0].outputs[0]
        assert again.token_ids == served.outputs[0].token_ids
    assert_nothing_left()
