"""Verification of draft tokens (`gracelm/parallel/spec_verify.py`) with the engine's own sampler: a seeded
request emits the tokens plain decoding gives it, and sampled outputs keep the target's distribution (a
chi-square over many seeds on a small Markov chain, drafts that are often wrong)."""

from __future__ import annotations

import itertools

import torch

from gracelm.model.sampler import SamplingMetadata, make_generator, sample
from gracelm.model_step import ModelStep, SampledToken, StepBatch
from gracelm.parallel.spec_verify import verify
from gracelm.sampling_params import SamplingParams

VOCAB = 5
# Row t: the logits of the token after t (a Markov chain: the "model").
CHAIN = torch.tensor([[0.0, 1.0, 0.5, -0.5, 0.2],
                      [0.8, 0.0, -0.3, 0.6, 0.1],
                      [-0.2, 0.4, 0.0, 0.9, 0.3],
                      [0.5, -0.4, 0.7, 0.0, 0.2],
                      [0.1, 0.3, -0.6, 0.4, 0.0]])
# The chi-square's critical value at p = 0.001 for 24 degrees of freedom (25 cells): a correct sampler
# exceeds it one run in a thousand, and the seeds below are fixed, so the test gives the same answer each run.
CHI2_24_P001 = 51.18


class Sampler:
    """Samples rows as the worker does: each request with its own seeded generator, kept across steps."""

    def __init__(self) -> None:
        self.generators: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, step: ModelStep) -> list[SampledToken]:
        generators = [self.generators.setdefault(rid, make_generator(p.seed or 0))
                      for rid, p in zip(step.request_ids, step.params, strict=True)]
        meta = SamplingMetadata.build(step.params, generators, step.prompt_token_ids, step.output_token_ids,
                                      VOCAB)
        out = sample(logits.clone(), meta)
        return [SampledToken(int(t)) for t in out.token_ids]


def step_for(seeds: list[int], outputs: list[list[int]], drafts: list[list[int]]) -> ModelStep:
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=100) for seed in seeds]
    batch = StepBatch([], [], [], [], [], [], [], [])
    return ModelStep(batch, [f"r{seed}" for seed in seeds], params, [[0] for _ in seeds], outputs,
                     [[] for _ in seeds], draft_token_ids=drafts)


def logits_for(outputs: list[list[int]], drafts: list[list[int]]) -> torch.Tensor:
    """Each request's row after its last token, then after each draft token (as if all were kept)."""
    rows = []
    for output, draft in zip(outputs, drafts, strict=True):
        context = [0, *output]
        rows.append(CHAIN[context[-1]])
        rows.extend(CHAIN[token] for token in draft)
    return torch.stack(rows)


def generate(seeds: list[int], count: int, draft_of) -> list[list[int]]:
    """`count` tokens of each request, drafting `draft_of(output)` at every step."""
    sampler, outputs = Sampler(), [[] for _ in seeds]
    while any(len(output) < count for output in outputs):
        drafts = [draft_of(output) for output in outputs]
        runs = verify(logits_for(outputs, drafts), step_for(seeds, outputs, drafts), sampler)
        for output, run in zip(outputs, runs, strict=True):
            output.extend(token.token_id for token in run)
    return [output[:count] for output in outputs]


def wrong_half_the_time(output: list[int]) -> list[int]:
    """Two draft tokens: the chain's likeliest next ones, but with the second off by one on odd lengths."""
    last = output[-1] if output else 0
    first = int(CHAIN[last].argmax())
    second = int(CHAIN[first].argmax())
    return [first, (second + len(output) % 2) % VOCAB]


def test_a_seeded_request_emits_what_plain_decoding_samples():
    seeds = list(range(40))
    plain = generate(seeds, 12, lambda output: [])
    assert generate(seeds, 12, wrong_half_the_time) == plain
    assert generate(seeds, 12, lambda output: [1, 2, 3]) == plain


def test_verified_samples_keep_the_target_distribution():
    seeds = list(range(4000))
    pairs = [tuple(output) for output in generate(seeds, 2, wrong_half_the_time)]
    probs = CHAIN.softmax(-1)
    chi2 = 0.0
    for first, second in itertools.product(range(VOCAB), repeat=2):
        expected = len(seeds) * float(probs[0, first] * probs[first, second])
        chi2 += (pairs.count((first, second)) - expected) ** 2 / expected
    assert chi2 < CHI2_24_P001


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    params = [SamplingParams(temperature=0.0, max_tokens=100)]
    batch = StepBatch([], [], [], [], [], [], [], [])
    likeliest = [int(CHAIN[0].argmax())]
    likeliest.append(int(CHAIN[likeliest[-1]].argmax()))
    for drafts, kept in (([likeliest[0], likeliest[1]], 2), ([likeliest[0], 4], 1), ([4, 4], 0)):
        step = ModelStep(batch, ["g"], params, [[0]], [[]], [[]], draft_token_ids=[drafts])
        run = verify(logits_for([[]], [drafts]), step, Sampler())
        assert [t.token_id for t in run[0][:kept]] == drafts[:kept] and len(run[0]) == kept + 1
