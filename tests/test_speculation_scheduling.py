"""Speculative decoding in the scheduler, without torch: n-gram drafts verified by the fake model of
test_scheduler.py, which reads each context back from its "KV" slots (so a rejected draft left where a
later token is read, or a wrongly kept block, changes the tokens).

The fake model here mostly copies (the token that followed the last earlier occurrence of its context's
last token), as an answer that quotes its input does, so drafts are both kept and rejected.
"""

from __future__ import annotations

import pytest

from gracelm.arith import cdiv
from gracelm.engine.kv_cache_manager import hash_block
from gracelm.engine.request import Request
from gracelm.engine.scheduler import RequestUpdate, Scheduler, SchedulerConfig
from gracelm.engine.speculation import Speculation, SpeculationConfig
from tests.test_scheduler import (
    FakeModel,
    config,
    copy_request,
    finish,
    make_request,
    next_token,
    run,
    workload,
)


def copying_token(context: list[int]) -> int:
    """Four times in five the token that followed the last earlier occurrence of the context's last token
    (when there is one), else `next_token`'s."""
    token = next_token(context)
    if token % 5:
        last = context[-1]
        for index in range(len(context) - 2, -1, -1):
            if context[index] == last:
                return context[index + 1]
    return token


def speculating(cfg: SchedulerConfig, max_batch: int = 64, k: int = 4) -> SchedulerConfig:
    cfg.speculation = SpeculationConfig("ngram", k, 1, 3, max_batch)
    return cfg


def drive(scheduler: Scheduler, arrivals: dict[int, list[Request]], model: FakeModel) -> list[list]:
    """Runs to the end (test_scheduler's `run`: the budget, the order, no block left); returns each step's
    updates. Checks after each step that a request that took tokens has all but the newest computed, and
    that none holds a block past its next token's (rejected drafts' blocks are freed)."""
    steps: list[list[RequestUpdate]] = []

    def check(updates: list[RequestUpdate]) -> None:
        steps.append(updates)
        sampled = {update.request_id for update in updates}
        for request in scheduler.running:
            assert len(request.block_ids) <= cdiv(request.num_computed_tokens + 1, model.block_size)
            if request.request_id in sampled:  # the kept drafts' KV counts: only the new token is not
                assert request.num_computed_tokens == request.num_tokens - 1

    run(scheduler, arrivals, model, after_step=check)
    return steps


def outputs(cfg: SchedulerConfig, requests: list[Request]) -> tuple[list[Request], Scheduler, FakeModel]:
    """Copies of the requests run to the end, 3 arriving a step."""
    scheduler, model = Scheduler(cfg), FakeModel(cfg, copying_token)
    requests = [copy_request(r) for r in requests]
    arrivals = {step: requests[step * 3:(step + 1) * 3] for step in range(cdiv(len(requests), 3))}
    drive(scheduler, arrivals, model)
    return requests, scheduler, model


def check_prefix_cache(scheduler: Scheduler, model: FakeModel, requests: list[Request]) -> None:
    """Every cached block holds the tokens its hash names, each the block of a sequence some request
    produced: a rejected draft never reaches the prefix cache."""
    size = scheduler.config.block_size
    known = {}
    for request in requests:
        tokens, parent = request.all_token_ids, None
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash_block(parent, tokens[start:start + size])
            known[parent] = tokens[start:start + size]
    kv = scheduler.kv_cache
    cached = kv.cached_blocks_by_recency()
    assert cached
    for block_hash, block in cached:
        assert model.slots[block] == known[block_hash]


@pytest.mark.parametrize("overrides", [
    dict(max_num_batched_tokens=256, num_blocks=256),  # roomy
    dict(max_num_batched_tokens=7),  # tiny budget: prompts in chunks, drafts cut to the budget
    dict(num_blocks=24),  # tiny cache: preemption
    dict(num_blocks=17, max_num_batched_tokens=9, long_prefill_token_threshold=5),
    dict(num_blocks=24, enable_prefix_caching=False),
])
def test_speculation_gives_the_outputs_of_plain_decoding(overrides):
    requests = workload(seed=11, count=30, max_model_len=64, shared_prefix=21)
    plain, _, _ = outputs(config(**overrides), requests)
    spec, scheduler, model = outputs(speculating(config(**overrides)), requests)
    assert [finish(r) for r in spec] == [finish(r) for r in plain]
    stats = scheduler.stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # kept and rejected drafts both
    per_position = stats["accepted_per_position"]
    assert per_position == sorted(per_position, reverse=True) and per_position[-1] > 0
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_total_blocks
    assert scheduler.speculation is not None and scheduler.speculation.num_tracked() == 0
    if scheduler.config.enable_prefix_caching:
        check_prefix_cache(scheduler, model, spec)


def solo_steps(request: Request, cfg: SchedulerConfig) -> list[list]:
    scheduler = Scheduler(cfg)
    return [updates for updates in drive(scheduler, {0: [request]}, FakeModel(cfg, copying_token))
            if updates]


def test_a_stop_inside_a_kept_run_ends_the_request_there():
    prompt = [5, 6, 7, 8, 9, 10, 11] * 3
    free = [u.token_id for step in solo_steps(make_request("f", prompt, max_tokens=40, ignore_eos=True),
                                              config()) for u in step]
    ended_inside = 0
    for index in range(1, 30):
        stop = free[index]
        if stop in free[:index]:
            continue
        params = dict(max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
        plain = solo_steps(make_request("p", prompt, **params), config())
        spec = solo_steps(make_request("s", prompt, **params), speculating(config()))
        tokens = [u.token_id for step in spec for u in step]
        assert tokens == [u.token_id for step in plain for u in step] == free[:index + 1]
        assert (spec[-1][-1].finish_reason, spec[-1][-1].stop_reason) == ("stop", stop)
        assert [u.finished for step in spec for u in step] == [False] * index + [True]
        ended_inside += len(spec[-1]) > 1
    assert ended_inside  # some stops came in a step that kept drafts


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_max_tokens_caps_the_drafts(max_tokens):
    prompt = [3, 4, 5, 6] * 6
    params = dict(max_tokens=max_tokens, ignore_eos=True)
    plain = solo_steps(make_request("p", prompt, **params), config())
    spec = solo_steps(make_request("s", prompt, **params), speculating(config()))
    assert [u.token_id for s in spec for u in s] == [u.token_id for s in plain for u in s]
    assert sum(len(s) for s in spec) == max_tokens
    assert spec[-1][-1].finish_reason == "length"


def test_max_model_len_caps_the_drafts():
    cfg = config(max_model_len=30)
    prompt = [3, 4, 5, 6] * 6
    spec = solo_steps(make_request("s", prompt, max_tokens=None, ignore_eos=True), speculating(cfg))
    assert sum(len(s) for s in spec) == 30 - len(prompt)
    assert spec[-1][-1].finish_reason == "length"


def test_no_request_drafts_while_more_run_than_max_batch():
    cfg = speculating(config(num_blocks=256, max_num_batched_tokens=256), max_batch=2)
    scheduler, model = Scheduler(cfg), FakeModel(cfg, copying_token)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [5, 6, 7, 8] * 4 + [i + 1], max_tokens=12 + 6 * i,
                                           ignore_eos=True))
    drafted_with = set()
    while scheduler.has_unfinished_requests():
        running = len(scheduler.running)
        output = scheduler.schedule()
        if any(item.draft_token_ids for item in output.scheduled):
            drafted_with.add(running)
        scheduler.update_from_output(output, model.step(output))
    assert drafted_with and max(drafted_with) <= 2


def test_a_request_whose_drafts_fail_drafts_less_and_less():
    # The plain fake model never copies: every n-gram draft is rejected, yet one is found at every step.
    cfg = speculating(config(max_model_len=64, num_blocks=64))
    scheduler, model = Scheduler(cfg), FakeModel(cfg)
    scheduler.add_request(make_request("r", [9] * 8, max_tokens=48, ignore_eos=True))
    steps = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, model.step(output))
        steps += 1
    stats = scheduler.stats()["spec_decode"]
    assert steps >= 48 and 0 < stats["num_drafts"] <= 8


def test_a_sequence_drafts_as_long_and_as_often_as_its_verifications_suggest():
    # Method "draft": placeholders of the length drafted, whatever the tokens.
    speculation = Speculation(SpeculationConfig("draft", 8, 1, 3, 64))
    request = make_request("r", [1, 2, 3], max_tokens=100)
    assert len(speculation.draft(request, 100, 1)) == 4  # half of the most, at first
    speculation.record("r", 4, 4)  # kept whole: twice as long
    assert len(speculation.draft(request, 100, 1)) == 8
    speculation.record("r", 8, 8)  # never more than the most
    assert len(speculation.draft(request, 100, 8)) == 8
    speculation.record("r", 8, 2)  # kept in part: one more than it kept; its share kept (1 + 1/4) / 2
    assert speculation.draft(request, 100, 8) == []  # beside 7 others, a share of 0.67 is needed
    assert len(speculation.draft(request, 100, 4)) == 3  # beside 3, 0.5
    speculation.record("r", 3, 0)  # wholly rejected: sits out a step
    assert speculation.draft(request, 100, 1) == []
    assert len(speculation.draft(request, 2, 1)) == 2  # never more than the room
    speculation.forget("r")
    assert speculation.num_tracked() == 0
