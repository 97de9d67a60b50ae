"""The sampler against straightforward per-row references: penalties, filters, draws and logprobs. It runs on
`GRACELM_TEST_DEVICE` (`tests/devices.py`); the references on the CPU."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from gracelm.model.sampler import SamplerOutput, SamplingMetadata, greedy, make_generator, sample
from gracelm.sampling_params import SamplingParams
from tests.devices import TEST_DEVICE


def _meta(params: list[SamplingParams], vocab_size: int, generators=None, prompts=None, outputs=None,
          default_generator=None) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata.build(params, generators or [None] * rows, prompts or [[] for _ in range(rows)],
                                  outputs or [[] for _ in range(rows)], vocab_size,
                                  default_generator=default_generator)


def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    return sample(logits.to(TEST_DEVICE), meta)


def _distribution(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] what each random row may draw, unnormalised, gathered from its group's candidates."""
    logits, meta = logits.to(TEST_DEVICE), meta.to(TEST_DEVICE)
    dense = torch.zeros_like(logits)
    for group in meta.groups:
        rows = torch.arange(meta.num_rows, device=TEST_DEVICE) if group.rows is None else group.rows
        for c in group.candidates(logits[rows].clone()):
            target = rows if c.rows is None else rows[c.rows]
            dense[target] = c.probs if c.token_ids is None else dense[target].scatter(1, c.token_ids, c.probs)
    return dense.cpu()


def _reference_kept(logits: list[float], p: SamplingParams) -> set[int]:
    """Tokens a row may sample: softmax(logits / T), then top-k, top-p on what top-k left, then min-p."""
    top = max(logits)
    weights = [math.exp((x - top) / p.temperature) for x in logits]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if p.top_k > 0:
        order = order[:p.top_k]
    kept_mass = sum(probs[i] for i in order)
    nucleus, before = [], 0.0
    for i in order:
        if before >= p.top_p * kept_mass:
            break
        nucleus.append(i)
        before += probs[i]
    floor = p.min_p * max(probs)
    return {i for i in nucleus if probs[i] >= floor}


def _reference_penalised(logits: list[float], p: SamplingParams, prompt: list[int],
                         output: list[int]) -> list[float]:
    out = list(logits)
    for token in set(prompt) | set(output):
        x = out[token]
        out[token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for token, count in Counter(output).items():
        out[token] -= p.presence_penalty + p.frequency_penalty * count
    return out


def test_greedy_is_argmax_of_the_logits():
    logits = torch.randn(5, 1000, generator=make_generator(0))
    meta = _meta([SamplingParams(temperature=0.0)] * 5, 1000)
    out = _sample(logits.clone(), meta)
    assert meta.all_greedy and meta.penalties is None and not meta.groups
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_logprobs is None


def _seeded_run(target_row: int, mates: list[SamplingParams], steps: int = 8) -> list[int]:
    """The tokens of one seeded request (seed 7) over `steps` steps, placed among `mates`."""
    vocab = 500
    target = SamplingParams(temperature=1.0, seed=7)
    generator = make_generator(7)
    mate_generators = [make_generator(100 + i) if m.seed is not None else None for i, m in enumerate(mates)]
    noise = make_generator(1234)  # the mates' logits differ from run to run
    tokens = []
    for step in range(steps):
        own = torch.randn(vocab, generator=make_generator(step)) * 0.5  # the same in every run
        params = mates[:target_row] + [target] + mates[target_row:]
        generators = mate_generators[:target_row] + [generator] + mate_generators[target_row:]
        logits = torch.randn(len(params), vocab, generator=noise) * (3 + len(mates))
        logits[target_row] = own
        meta = _meta(params, vocab, generators, prompts=[[1, 2, 3]] * len(params),
                     outputs=[[4, 4, step]] * len(params), default_generator=make_generator(len(mates)))
        tokens.append(int(_sample(logits, meta).token_ids[target_row]))
    return tokens


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates():
    alone = _seeded_run(0, [])
    assert _seeded_run(0, []) == alone
    crowded = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
               SamplingParams(temperature=0.9, seed=3, top_p=0.8),
               SamplingParams(temperature=1.2, top_k=5, presence_penalty=1.0, logprobs=2),
               SamplingParams(temperature=0.5, min_p=0.1)]
    assert _seeded_run(2, crowded) == alone
    assert _seeded_run(4, crowded) == alone
    assert _seeded_run(1, crowded[2:]) == alone
    assert len(set(alone)) > 1  # a flat distribution over 500 tokens: the draws do change from step to step


def test_different_seeds_draw_differently():
    logits = torch.zeros(2, 1000)
    meta = _meta([SamplingParams(seed=1), SamplingParams(seed=2)], 1000,
                 [make_generator(1), make_generator(2)])
    first, second = _sample(logits, meta).token_ids.tolist()
    assert first != second


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=7),
    SamplingParams(temperature=0.7, top_k=100),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.3, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.6),
    SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=-1, top_p=1.0),
    SamplingParams(temperature=1.0, top_k=5000, min_p=0.3),
])
def test_filters_keep_the_tokens_of_the_reference(params):
    vocab = 2000
    gen = make_generator(42)
    # Peaked rows resolve top-p from the first prefix; the flat ones need the wider prefixes.
    logits = torch.cat([torch.randn(4, vocab, generator=gen) * 4, torch.randn(4, vocab, generator=gen) * 0.3])
    other = SamplingParams(temperature=0.9)
    rows = [params, other] * 4
    meta = _meta(rows, vocab)
    probs = _distribution(logits, meta)
    for row in range(len(rows)):
        kept = set(torch.nonzero(probs[row]).squeeze(1).tolist())
        assert kept == _reference_kept(logits[row].tolist(), rows[row]), f"row {row}"


def test_kept_tokens_keep_their_relative_probabilities():
    vocab = 200
    logits = torch.randn(1, vocab, generator=make_generator(3)) * 2
    meta = _meta([SamplingParams(temperature=0.5, top_k=20, min_p=0.01)], vocab)
    probs = _distribution(logits, meta)[0]
    expected = torch.softmax(logits[0] / 0.5, dim=-1)
    kept = probs > 0
    assert torch.allclose(probs[kept] / probs[kept].sum(), expected[kept] / expected[kept].sum(), atol=1e-6)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.0, repetition_penalty=0.7),
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=-0.8),
    SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.7),
])
def test_penalties_match_the_reference(params):
    vocab = 60
    logits = torch.randn(3, vocab, generator=make_generator(5)) * 3
    prompts = [[1, 2, 2, 3, 50], [7, 8], [1, 2, 3]]
    outputs = [[3, 4, 4, 4, 9, 59], [8, 8, 10], [4, 5]]
    rows = [params, params, SamplingParams(temperature=0.0)]
    meta = _meta(rows, vocab, prompts=prompts, outputs=outputs)
    penalised = logits.clone()
    meta.penalties.apply(penalised)
    for row in range(3):
        expected = _reference_penalised(logits[row].tolist(), rows[row], prompts[row], outputs[row])
        assert torch.allclose(penalised[row], torch.tensor(expected), atol=1e-5), f"row {row}"
    assert torch.equal(penalised[2], logits[2])
    assert torch.equal(_sample(logits.clone(), meta).token_ids, penalised.argmax(dim=-1))


def test_no_penalty_builds_no_penalty_state():
    assert _meta([SamplingParams(top_k=3)], 10, prompts=[[1, 2]], outputs=[[3]]).penalties is None


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=6, top_p=0.9),  # from a prefix
                                    SamplingParams(temperature=1.3, min_p=0.1)])  # from the whole vocabulary
def test_sampled_frequencies_follow_the_filtered_distribution(params):
    vocab = 8
    logits = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.0, -0.5, 3.0, 0.2])
    kept = _reference_kept(logits.tolist(), params)
    mask = torch.tensor([i in kept for i in range(vocab)])
    weights = torch.softmax(logits / params.temperature, dim=-1) * mask
    expected = weights / weights.sum()
    unseeded, seeded = 6000, 2000
    generators = [None] * unseeded + [make_generator(seed) for seed in range(seeded)]
    meta = _meta([params] * len(generators), vocab, generators, default_generator=make_generator(9))
    tokens = _sample(logits.repeat(len(generators), 1), meta).token_ids
    for drawn in (tokens[:unseeded], tokens[unseeded:]):
        frequencies = torch.bincount(drawn, minlength=vocab).float() / drawn.numel()
        assert frequencies[expected == 0].sum() == 0
        # Binomial standard deviations are at most 0.0065 (6000 draws) and 0.011 (2000): this is 4-5 of them.
        assert (frequencies - expected).abs().max() < 0.045, (frequencies, expected)


def test_logprobs_are_those_of_the_raw_logits():
    vocab = 100
    logits = torch.randn(4, vocab, generator=make_generator(11)) * 2
    rows = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.8, frequency_penalty=1.0),
            SamplingParams(temperature=0.7, seed=1, logprobs=5, top_k=10),
            SamplingParams(temperature=1.0, logprobs=0, presence_penalty=2.0),
            SamplingParams(temperature=0.0)]
    meta = _meta(rows, vocab, [None, make_generator(1), None, None], outputs=[[1, 2], [3], [4, 4], []])
    out = _sample(logits.clone(), meta)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1), atol=1e-6)
    assert out.top_logprob_ids.shape == out.top_logprobs.shape == (4, 5)
    expected = raw.sort(dim=-1, descending=True)
    for row, count in enumerate([3, 5]):  # each row's own top-n; the other columns are filler
        assert torch.equal(out.top_logprob_ids[row, :count], expected.indices[row, :count])
        assert torch.allclose(out.top_logprobs[row, :count], expected.values[row, :count], atol=1e-6)


def test_a_row_gets_the_same_token_and_top_logprobs_beside_any_rows():
    """Batch invariance of the sampler: a seeded top-k row and a greedy row asking top logprobs, over logits
    full of ties (bfloat16-rounded, as a bfloat16 model gives them), alone and beside rows with a wider top-k,
    top-p only, and more top logprobs. A row's prefix width and top-n are its own: a wider `topk` may order
    tied logits otherwise, and a longer sum rounds otherwise."""
    vocab = 2000
    logits = (torch.randn(4, vocab, generator=make_generator(5)) * 3).bfloat16().float()
    mine = [SamplingParams(temperature=1.0, top_k=40, seed=0, logprobs=2),
            SamplingParams(temperature=0.0, logprobs=3)]
    mates = [SamplingParams(temperature=1.0, top_k=700, seed=9, logprobs=8),
             SamplingParams(temperature=0.9, top_p=0.95, seed=8, logprobs=6)]
    for seed in range(40):
        mine[0] = SamplingParams(temperature=1.0, top_k=40, seed=seed, logprobs=2)
        alone = [sample(logits[row:row + 1].clone(), _meta([params], vocab, [make_generator(seed)]))
                 for row, params in enumerate(mine)]
        batched = sample(logits.clone(), _meta(mine + mates, vocab, [make_generator(seed), None,
                                                                     make_generator(9), make_generator(8)]))
        for row, (params, out) in enumerate(zip(mine, alone, strict=True)):
            count = params.logprobs
            assert batched.token_ids[row] == out.token_ids[0], seed
            assert torch.equal(batched.top_logprob_ids[row, :count], out.top_logprob_ids[0, :count]), seed
            assert torch.equal(batched.top_logprobs[row, :count], out.top_logprobs[0, :count]), seed


def test_logprobs_zero_returns_the_sampled_logprob_only():
    out = _sample(torch.randn(2, 30), _meta([SamplingParams(logprobs=0), SamplingParams()], 30))
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.top_logprob_ids is None and out.top_logprobs is None


def test_mixed_batch_in_one_call():
    vocab = 400
    logits = torch.randn(5, vocab, generator=make_generator(21)) * 3
    prompts = [[5, 6, 7]] * 5
    outputs = [[int(logits[0].argmax())] * 3, [], [9], [], [1, 1]]
    rows = [SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0),
            SamplingParams(temperature=0.8, seed=99, logprobs=2),
            SamplingParams(temperature=1.0, top_k=3, repetition_penalty=1.4),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.1, top_p=0.3, min_p=0.1)]
    out = _sample(logits.clone(), _meta(rows, vocab, [None, make_generator(99), None, None, None],
                                       prompts, outputs, make_generator(0)))
    penalised = _reference_penalised(logits[0].tolist(), rows[0], prompts[0], outputs[0])
    assert out.token_ids[0] == max(range(vocab), key=lambda i: penalised[i])
    assert out.token_ids[0] != logits[0].argmax()  # the penalty did move the greedy choice
    alone = _sample(logits[1:2].clone(), _meta([rows[1]], vocab, [make_generator(99)]))
    assert out.token_ids[1] == alone.token_ids[0]
    third = _reference_penalised(logits[2].tolist(), rows[2], prompts[2], outputs[2])
    assert int(out.token_ids[2]) in _reference_kept(third, rows[2])
    assert out.token_ids[3] == logits[3].argmax()
    assert int(out.token_ids[4]) in _reference_kept(logits[4].tolist(), rows[4])
    assert out.token_ids.dtype == torch.int64 and out.top_logprob_ids.shape == (5, 2)


def test_inconsistent_inputs_are_refused():
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build([SamplingParams()], [], [[]], [[]], 10)
    with pytest.raises(ValueError, match="shape"):
        _sample(torch.zeros(2, 11), _meta([SamplingParams(), SamplingParams()], 10))


EXTREME = [
    SamplingParams(temperature=1e-300),  # far below float32: would divide by zero
    SamplingParams(temperature=4e-6, top_k=3),  # below the greedy threshold, with a filter
    SamplingParams(temperature=1.7e-5, top_k=5, top_p=1e-300),  # just above it, top_p underflowing
    SamplingParams(temperature=2.0, repetition_penalty=1e-300),  # would divide the repeated logits by 0
    SamplingParams(temperature=1e-5, repetition_penalty=1e-38, top_p=0.5, min_p=1.0),
    SamplingParams(temperature=2.0, presence_penalty=2.0, frequency_penalty=-2.0, top_k=1),
]


@pytest.mark.parametrize("params", EXTREME, ids=range(len(EXTREME)))
def test_every_accepted_value_samples_a_valid_token(params):
    vocab = 50
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=generator) * 30
    seen = [[1, 2, 3, 2]] * 4
    meta = _meta([params] * 4, vocab, generators=[None, make_generator(1), None, make_generator(2)],
                 prompts=seen, outputs=seen)
    out = _sample(logits.clone(), meta)
    assert out.token_ids.shape == (4,) and bool(((out.token_ids >= 0) & (out.token_ids < vocab)).all())
    if params.temperature < 1e-5:  # greedy: the argmax of the penalised logits
        penalised = torch.tensor([_reference_penalised(row.tolist(), params, seen[0], seen[0])
                                  for row in logits])
        assert out.token_ids.tolist() == penalised.argmax(dim=-1).tolist()


def test_non_finite_logits_stay_in_their_row():
    vocab = 40
    logits = torch.randn(5, vocab) * 3
    logits[1] = torch.nan  # a row with nothing possible
    logits[2, 7] = torch.inf  # one certain token
    logits[3, :] = -torch.inf
    logits[3, 11] = torch.nan
    params = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_p=0.9), SamplingParams(temperature=1.0, top_k=4),
              SamplingParams(temperature=0.0, logprobs=3)]
    clean = logits[[0, 4]].clone()
    generators = [make_generator(5), None, None, None, None]
    out = _sample(logits.clone(), _meta(params, vocab, generators=generators))
    tokens = out.token_ids.tolist()
    assert all(0 <= t < vocab for t in tokens) and tokens[2] == 7
    # The healthy rows sample exactly as they would alone.
    alone = _sample(clean.clone(), _meta([params[0], params[4]], vocab, generators=[make_generator(5), None]))
    assert [tokens[0], tokens[4]] == alone.token_ids.tolist()
    assert out.logprobs is not None and bool(torch.isfinite(out.logprobs).all())
    assert out.top_logprobs is not None and bool(torch.isfinite(out.top_logprobs).all())


@pytest.mark.parametrize("vocab", [49152, 32000, 50257, 97])  # chunks of 1,024, 1,000, 1,733; none (prime)
@pytest.mark.parametrize("rows", [0, 1, 5, 32])
def test_greedy_is_argmax_with_ties_to_the_lowest_id(vocab: int, rows: int) -> None:
    generator = torch.Generator().manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, generator=generator)
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    if rows:
        logits[:, [3, vocab // 2, vocab - 1]] = 1e30  # a tie across chunks: the first one wins
        logits[0] = -torch.inf  # nothing possible: token 0, as argmax says
        assert greedy(logits).tolist() == [0] + [3] * (rows - 1) == logits.argmax(dim=-1).tolist()
