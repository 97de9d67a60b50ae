"""Scheduler alone, without torch, driven by a fake model whose next token is a pure function of the context.

The fake model keeps its own "KV cache" (the token at each slot of each block) and reads a request's
context back through the block table it was given, so a wrong block table, a wrongly shared prefix block
or a bad resumption after preemption changes the output, which the tests compare with solo runs.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable

import pytest

from gracelm.engine.frontend import check_prompt
from gracelm.engine.request import Request, RequestStatus
from gracelm.engine.scheduler import RequestUpdate, Scheduler, SchedulerConfig, SchedulerOutput
from gracelm.model_step import SampledToken
from gracelm.sampling_params import SamplingParams

VOCAB = 64
EOS = 0


def next_token(context: list[int]) -> int:
    """Depends on every token of the context and on their order."""
    state = 17
    for token in context:
        state = (state * 1_000_003 + token + 1) % 2_147_483_647
    return state % VOCAB


class FakeModel:
    def __init__(self, config: SchedulerConfig, next_token: Callable[[list[int]], int] = next_token) -> None:
        self.block_size = config.block_size
        self.next_token = next_token
        self.slots: list[list[int | None]] = [[None] * config.block_size for _ in range(config.num_blocks)]

    def step(self, output: SchedulerOutput) -> list[list[SampledToken]]:
        """Each sampling request's run, as `parallel/spec_verify.py` makes it: drafts kept while each is the
        token the context before it gives, then the token where none is kept; the context is read from the
        "KV" slots, so a wrong slot changes the tokens."""
        bs = self.block_size
        for item in output.scheduled:  # write every new token's "KV" first, as a forward pass does
            tokens = item.request.all_token_ids + item.draft_token_ids
            for pos in range(item.start_position, item.start_position + item.num_new_tokens):
                self.slots[item.block_ids[pos // bs]][pos % bs] = tokens[pos]
        sampled = []
        for item in output.scheduled:
            if item.samples:
                drafts = item.draft_token_ids
                end = item.start_position + item.num_new_tokens - len(drafts)
                run = []
                for position in range(len(drafts) + 1):
                    context = [self.slots[item.block_ids[pos // bs]][pos % bs]
                               for pos in range(end + position)]
                    run.append(SampledToken(self.next_token(context)))
                    if position == len(drafts) or run[-1].token_id != drafts[position]:
                        break
                sampled.append(run)
        return sampled


def config(**overrides) -> SchedulerConfig:
    values = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_blocks=64, block_size=4)
    return SchedulerConfig(**{**values, **overrides})


def make_request(request_id: str, prompt: list[int], priority: int = 0, **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(**params), eos_token_ids=(EOS,),
                   priority=priority)


def check_step(cfg: SchedulerConfig, output: SchedulerOutput) -> None:
    items = output.scheduled
    assert output.total_num_scheduled_tokens == sum(item.num_new_tokens for item in items)
    assert 0 < output.total_num_scheduled_tokens <= cfg.max_num_batched_tokens  # progress, within budget
    assert len(items) <= cfg.max_num_seqs
    assert len({id(item.request) for item in items}) == len(items)
    assert all(item.num_new_tokens >= 1 for item in items)


def check_order(scheduler: Scheduler) -> None:
    """The scheduler's invariant: both queues in (priority, arrival) order, and within one priority every
    running request arrived before every waiting one."""
    for queue in (scheduler.running, scheduler.waiting):
        keys = [(r.priority, r.arrival_order) for r in queue]
        assert keys == sorted(keys)
    for request in scheduler.running:
        assert all(request.arrival_order < other.arrival_order for other in scheduler.waiting
                   if other.priority == request.priority)


def run(scheduler: Scheduler, arrivals: dict[int, list[Request]], model: FakeModel | None = None,
        max_steps: int = 5000, after_step: Callable[[list[RequestUpdate]], None] = lambda updates: None
        ) -> dict[str, int]:
    """Drives the scheduler to the end; returns how often each request was preempted. `after_step` sees
    each step's updates.

    Pass the model that ran the scheduler's earlier steps: its slots are the cache they filled.
    """
    model, step, preemptions = model or FakeModel(scheduler.config), 0, {}
    while scheduler.has_unfinished_requests() or any(s >= step for s in arrivals):
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        if scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            check_step(scheduler.config, output)
            for request_id in output.preempted_request_ids:
                preemptions[request_id] = preemptions.get(request_id, 0) + 1
            after_step(scheduler.update_from_output(output, model.step(output)))
            check_order(scheduler)
        step += 1
        assert step < max_steps, "the scheduler stopped making progress"
    assert scheduler.num_running == scheduler.num_waiting == 0
    kv = scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_total_blocks  # no leak
    return preemptions


def finish(request: Request) -> tuple[list[int], str | None, int | None]:
    return request.output_token_ids, request.finish_reason, request.stop_reason


def workload(seed: int, count: int, max_model_len: int, shared_prefix: int) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(shared_prefix)]
    requests = []
    for i in range(count):
        own = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, max_model_len // 2))]
        prompt = (prefix + own)[:max_model_len] if rng.random() < 0.6 else own
        params = dict(max_tokens=rng.choice([None, 1, 5, 20, 40]), ignore_eos=rng.random() < 0.5,
                      stop_token_ids=rng.sample(range(1, VOCAB), rng.choice([0, 1])))
        requests.append(make_request(f"req-{i}", prompt, **params))
    return requests


def copy_request(request: Request) -> Request:
    return Request(request.request_id, list(request.prompt_token_ids), request.sampling_params,
                   eos_token_ids=request.eos_token_ids, priority=request.priority)


def test_core_modules_do_not_import_torch():
    code = ("import sys; import gracelm.engine.scheduler, gracelm.engine.request, "
            "gracelm.engine.kv_cache_manager; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("overrides, expect_preemption", [
    (dict(max_num_batched_tokens=256, num_blocks=256), False),  # roomy: plain continuous batching
    (dict(max_num_batched_tokens=7), False),  # tiny budget: everything goes in chunks
    (dict(num_blocks=24), True),  # tiny cache (one max_model_len request and a half): preemption
    (dict(num_blocks=17, max_num_batched_tokens=9, long_prefill_token_threshold=5), True),
    (dict(num_blocks=24, enable_prefix_caching=False), True),
])
def test_batched_outputs_equal_solo_outputs(overrides, expect_preemption):
    cfg = config(max_model_len=64, **overrides)
    requests = workload(seed=7, count=30, max_model_len=cfg.max_model_len, shared_prefix=21)
    solo = {}
    for request in requests:
        alone = copy_request(request)
        run(Scheduler(cfg), {0: [alone]})
        solo[request.request_id] = finish(alone)
    scheduler = Scheduler(cfg)
    arrivals = {step: requests[step * 3:step * 3 + 3] for step in range(10)}  # 3 new requests a step
    preemptions = run(scheduler, arrivals)
    assert {r.request_id: finish(r) for r in requests} == solo
    assert bool(preemptions) == expect_preemption
    reasons = {r.finish_reason for r in requests}
    assert reasons == {"stop", "length"}  # the workload exercises both ways to end
    if cfg.enable_prefix_caching:
        assert scheduler.stats()["prefix_cache_hits"] > 0
    else:
        assert scheduler.stats()["prefix_cache_queries"] == 0


def test_prefix_hits_are_counted_in_tokens():
    cfg = config(block_size=4)
    scheduler, model = Scheduler(cfg), FakeModel(cfg)
    prefix = list(range(1, 13))  # 3 full blocks
    first = make_request("a", prefix + [20], max_tokens=2, ignore_eos=True)
    run(scheduler, {0: [first]}, model)
    second = make_request("b", prefix + [30, 31], max_tokens=2, ignore_eos=True)
    run(scheduler, {0: [second]}, model)
    assert second.output_token_ids == expected_tokens(second.prompt_token_ids, 2)
    stats = scheduler.stats()
    assert stats["prefix_cache_queries"] == 13 + 14 and stats["prefix_cache_hits"] == 12


def test_a_step_says_each_sequence_s_prompt_length():
    """A prefix-cache hit that leaves one prompt token to compute gives a chunk of one row, shaped like a
    decode step's: the batch's `prompt_lens` tell the model that row is the prompt's, of 9 tokens (a prompt
    takes the weights its whole length gives it: `model/low_bit_gate.py`)."""
    cfg = config(block_size=4)
    scheduler, model = Scheduler(cfg), FakeModel(cfg)
    prompt = list(range(1, 10))  # 2 full blocks and 1 token
    run(scheduler, {0: [make_request("a", prompt, max_tokens=1, ignore_eos=True)]}, model)
    scheduler.add_request(make_request("b", prompt, max_tokens=2, ignore_eos=True))
    batches = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        batches.append(output.model_step(cfg.block_size).batch)
        scheduler.update_from_output(output, model.step(output))
    assert [(b.query_lens, b.seq_lens, b.prompt_lens) for b in batches] == [([1], [9], [9]), ([1], [10], [9])]


def test_chunked_prefill_splits_a_long_prompt():
    scheduler = Scheduler(config(max_num_batched_tokens=16, max_model_len=64))
    request = make_request("long", list(range(1, 41)), max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)
    model, steps = FakeModel(scheduler.config), []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        item = output.scheduled[0]
        steps.append((item.start_position, item.num_new_tokens, item.samples))
        scheduler.update_from_output(output, model.step(output))
    assert steps == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True)]
    assert len(request.output_token_ids) == 2


def test_long_prefill_threshold_caps_each_chunk():
    scheduler = Scheduler(config(max_num_batched_tokens=32, long_prefill_token_threshold=10))
    scheduler.add_request(make_request("a", list(range(1, 31))))
    scheduler.add_request(make_request("b", list(range(1, 6))))
    output = scheduler.schedule()
    assert [(i.request.request_id, i.num_new_tokens) for i in output.scheduled] == [("a", 10), ("b", 5)]


def test_running_requests_come_before_new_prefills():
    scheduler = Scheduler(config(max_num_batched_tokens=8))
    model = FakeModel(scheduler.config)
    decoding = make_request("decoding", [1, 2, 3], max_tokens=10, ignore_eos=True)
    scheduler.add_request(decoding)
    scheduler.update_from_output(output := scheduler.schedule(), model.step(output))
    scheduler.add_request(make_request("new", list(range(1, 21))))
    output = scheduler.schedule()
    scheduled = [(i.request.request_id, i.num_new_tokens) for i in output.scheduled]
    assert scheduled == [("decoding", 1), ("new", 7)]


def test_max_num_seqs_limits_the_batch():
    scheduler = Scheduler(config(max_num_seqs=2))
    for name in "abc":
        scheduler.add_request(make_request(name, [1, 2, 3], max_tokens=3, ignore_eos=True))
    output = scheduler.schedule()
    assert [i.request.request_id for i in output.scheduled] == ["a", "b"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1


def test_first_come_first_served_nobody_overtakes_the_head():
    scheduler = Scheduler(config(num_blocks=16, max_model_len=64, max_num_batched_tokens=64))
    model = FakeModel(scheduler.config)
    big = make_request("big", list(range(1, 41)), max_tokens=20, ignore_eos=True)  # 10 blocks
    scheduler.add_request(big)
    scheduler.update_from_output(output := scheduler.schedule(), model.step(output))
    scheduler.add_request(make_request("head", [9] * 29))  # 8 blocks: does not fit beside big's 11
    scheduler.add_request(make_request("small", [5]))  # would fit, but arrived later
    output = scheduler.schedule()
    assert [i.request.request_id for i in output.scheduled] == ["big"]
    assert [r.request_id for r in scheduler.waiting] == ["head", "small"]


def test_preemption_takes_the_latest_arrival_and_it_resumes_first():
    cfg = config(num_blocks=6, max_model_len=24, block_size=4, max_num_batched_tokens=64)
    scheduler, model = Scheduler(cfg), FakeModel(cfg)
    old = make_request("old", list(range(1, 9)), max_tokens=16, ignore_eos=True)  # 2 blocks, grows to 6
    new = make_request("new", list(range(11, 19)), max_tokens=16, ignore_eos=True)
    late = make_request("late", [3, 4])
    scheduler.add_request(old)
    scheduler.add_request(new)
    preempted_at = None
    for step in range(40):
        output = scheduler.schedule()
        if output.preempted_request_ids:
            preempted_at = step
            break
        scheduler.update_from_output(output, model.step(output))
        if step == 0:
            scheduler.add_request(late)
    assert preempted_at is not None and output.preempted_request_ids == ["new"]
    assert new.status == RequestStatus.PREEMPTED and new.block_ids == [] and new.num_computed_tokens == 0
    kept = list(new.output_token_ids)
    assert kept and [r.request_id for r in scheduler.waiting] == ["new", "late"]
    assert [i.request.request_id for i in output.scheduled] == ["old"]  # no admission in that step
    scheduler.update_from_output(output, model.step(output))
    run(scheduler, {}, model)
    assert new.output_token_ids[:len(kept)] == kept and len(new.output_token_ids) == 16


def test_a_request_preempted_in_a_step_is_not_readmitted_in_that_step():
    # Without prefix caching the victim's blocks all return as free space, and the small budget would let
    # it back in at once with a short chunk, only to be preempted again next step.
    cfg = config(num_blocks=6, max_model_len=24, block_size=4, max_num_batched_tokens=5,
                 enable_prefix_caching=False)
    scheduler, model = Scheduler(cfg), FakeModel(cfg)
    scheduler.add_request(make_request("old", list(range(1, 5)), max_tokens=20, ignore_eos=True))
    scheduler.add_request(make_request("new", list(range(11, 14)), max_tokens=20, ignore_eos=True))
    for _ in range(40):
        output = scheduler.schedule()
        if output.preempted_request_ids:
            break
        scheduler.update_from_output(output, model.step(output))
    assert output.preempted_request_ids == ["new"]
    assert [i.request.request_id for i in output.scheduled] == ["old"]
    assert scheduler.kv_cache.num_free_blocks > 0 and output.total_num_scheduled_tokens < 5  # it would fit
    scheduler.update_from_output(output, model.step(output))
    assert [i.request.request_id for i in scheduler.schedule().scheduled] == ["old", "new"]


def test_abort_frees_blocks_mid_prefill_mid_decode_and_waiting():
    cfg = config(max_num_batched_tokens=8, max_num_seqs=2)
    scheduler, model = Scheduler(cfg), FakeModel(cfg)
    prefilling = make_request("prefilling", list(range(1, 31)))
    decoding = make_request("decoding", [1, 2, 3], max_tokens=20, ignore_eos=True)
    waiting = make_request("waiting", [4, 5, 6])
    for request in (decoding, prefilling, waiting):
        scheduler.add_request(request)
    for _ in range(2):
        scheduler.update_from_output(output := scheduler.schedule(), model.step(output))
    assert decoding.output_token_ids and 0 < prefilling.num_computed_tokens < prefilling.num_tokens
    assert scheduler.abort_requests(["prefilling", "unknown", "waiting"]) == ["prefilling", "waiting"]
    output = scheduler.schedule()
    assert scheduler.abort_requests(["decoding"]) == ["decoding"]  # while its step is running
    assert scheduler.update_from_output(output, model.step(output)) == []
    for request in (prefilling, decoding, waiting):
        assert request.status == RequestStatus.FINISHED_ABORTED and request.finish_reason == "abort"
        assert request.block_ids == []
    assert not scheduler.has_unfinished_requests()
    stats = scheduler.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["kv_usage"] == 0.0
    assert stats["num_running"] == stats["num_waiting"] == 0


def solo_updates(request: Request, **overrides):
    scheduler = Scheduler(config(**overrides))
    model, updates = FakeModel(scheduler.config), []
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        updates += scheduler.update_from_output(output, model.step(output))
    return updates


def expected_tokens(prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def test_stops_and_finish_reasons():
    prompt = [7, 8, 9]
    free_run = expected_tokens(prompt, 30)
    updates = solo_updates(make_request("n", prompt, max_tokens=5, ignore_eos=True))
    assert [u.token_id for u in updates] == free_run[:5]
    assert [u.finished for u in updates] == [False] * 4 + [True]
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("length", None)

    stop_at = free_run[3]
    first = free_run.index(stop_at)
    stopping = make_request("s", prompt, max_tokens=20, stop_token_ids=[stop_at], ignore_eos=True)
    updates = solo_updates(stopping)
    assert [u.token_id for u in updates] == free_run[:first + 1]
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("stop", stop_at)

    eos_request = Request("e", prompt, SamplingParams(max_tokens=20), eos_token_ids=(stop_at,))
    updates = solo_updates(eos_request)
    assert len(updates) == first + 1
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("stop", None)

    ignoring = Request("i", prompt, SamplingParams(max_tokens=20, ignore_eos=True), eos_token_ids=(stop_at,))
    assert len(solo_updates(ignoring)) == 20


def test_unlimited_max_tokens_runs_to_max_model_len():
    request = make_request("u", list(range(1, 11)), max_tokens=None, ignore_eos=True)
    updates = solo_updates(request, max_model_len=32)
    assert request.num_tokens == 32 and len(updates) == 22 and updates[-1].finish_reason == "length"
    at_limit = make_request("full", list(range(1, 33)), max_tokens=None, ignore_eos=True)
    assert len(solo_updates(at_limit, max_model_len=32)) == 1


def test_too_long_or_empty_prompt_is_refused_at_admission():
    # The frontend checks a prompt once, before it reaches the scheduler (`check_prompt`).
    scheduler = Scheduler(config(max_model_len=32))
    with pytest.raises(ValueError, match=r"maximum context length is 32 tokens\. However, you requested 34 "
                                         r"tokens \(33 in the messages, 1 in the completion\)"):
        check_prompt(list(range(33)), max_model_len=32, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="empty"):
        check_prompt([], max_model_len=32, vocab_size=VOCAB)
    assert scheduler.num_waiting == 0 and not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("ok", [1]))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("ok", [2]))
    assert scheduler.num_waiting == 1


def test_cache_that_cannot_hold_one_full_request_is_refused():
    message = r"6 blocks of 16 tokens = 96 tokens.*max_model_len 100 tokens \(7 blocks\)"
    with pytest.raises(ValueError, match=message):
        Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100, num_blocks=6,
                                  block_size=16))
    Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, num_blocks=6,
                              block_size=16))


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="max_num_seqs"):
        config(max_num_seqs=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        config(long_prefill_token_threshold=0)


# -- priorities: a lower value runs first; equal priorities first come, first served ---------------------

def step(scheduler: Scheduler, model: FakeModel) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update_from_output(output, model.step(output))
    check_order(scheduler)
    return output


def scheduled(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.request.request_id, item.num_new_tokens) for item in output.scheduled]


def check_outputs(*requests: Request) -> None:
    for request in requests:
        count = len(request.output_token_ids)
        assert count == request.sampling_params.max_tokens
        assert request.output_token_ids == expected_tokens(request.prompt_token_ids, count)


@pytest.mark.parametrize("overrides", [
    dict(max_num_batched_tokens=256, num_blocks=256),
    dict(max_num_batched_tokens=7),
    dict(num_blocks=24),
    dict(num_blocks=17, max_num_batched_tokens=9, long_prefill_token_threshold=5),
    dict(num_blocks=24, max_num_seqs=3, enable_prefix_caching=False),
])
def test_mixed_priorities_give_solo_outputs(overrides):
    cfg = config(max_model_len=64, **overrides)
    requests = workload(seed=11, count=30, max_model_len=cfg.max_model_len, shared_prefix=21)
    rng = random.Random(3)
    for request in requests:
        request.priority = rng.choice([-1, 0, 0, 1, 5])
    solo = {}
    for request in requests:
        alone = copy_request(request)
        run(Scheduler(cfg), {0: [alone]})
        solo[request.request_id] = finish(alone)
    arrivals = {step: requests[step * 3:step * 3 + 3] for step in range(10)}
    run(Scheduler(cfg), arrivals)  # checks the order's invariant after every step
    assert {r.request_id: finish(r) for r in requests} == solo


def test_admission_takes_the_best_priority_then_the_first_arrived():
    scheduler = Scheduler(config(max_num_seqs=1))
    for name, priority in (("late-low", 3), ("first-normal", 0), ("urgent", -2), ("second-normal", 0)):
        scheduler.add_request(make_request(name, [1, 2], priority=priority))
    order = ["urgent", "first-normal", "second-normal", "late-low"]
    assert [r.request_id for r in scheduler.waiting] == order
    assert scheduled(scheduler.schedule()) == [("urgent", 2)]


def seated(priority: int) -> tuple[Scheduler, FakeModel, list[Request], Request]:
    """Two running requests of priority 5 on the only two seats, and a request of `priority` that arrives."""
    cfg = config(max_num_seqs=2)
    scheduler, model = Scheduler(cfg), FakeModel(cfg)
    running = [make_request(name, prompt, priority=5, max_tokens=10, ignore_eos=True)
               for name, prompt in (("first", [1, 2, 3]), ("second", [4, 5, 6]))]
    for request in running:
        scheduler.add_request(request)
    step(scheduler, model)
    arriving = make_request("arriving", [7, 8], priority=priority, max_tokens=3, ignore_eos=True)
    scheduler.add_request(arriving)
    return scheduler, model, running, arriving


def test_a_waiting_request_of_higher_priority_preempts_the_latest_lower_one_for_a_seat():
    scheduler, model, (first, second), urgent = seated(priority=0)
    output = step(scheduler, model)
    assert output.preempted_request_ids == ["second"] and scheduled(output) == [("arriving", 2), ("first", 1)]
    assert second.status == RequestStatus.PREEMPTED and second.block_ids == []
    assert second.num_computed_tokens == 0
    assert [r.request_id for r in scheduler.waiting] == ["second"]
    stats = scheduler.stats()
    assert stats["num_running_background"] == stats["num_waiting_background"] == 1
    while not urgent.is_finished:
        step(scheduler, model)
    assert second.status == RequestStatus.PREEMPTED and len(second.output_token_ids) == 1  # still waits
    run(scheduler, {}, model)
    check_outputs(first, second, urgent)  # the preempted one recomputed its context correctly


@pytest.mark.parametrize("priority", [5, 9])
def test_a_waiting_request_never_preempts_one_of_equal_or_higher_priority(priority):
    scheduler, model, running, arriving = seated(priority)
    for _ in range(9):  # the running ones finish first: 10 tokens each
        output = step(scheduler, model)
        assert not output.preempted_request_ids and arriving.status == RequestStatus.WAITING
    assert all(r.is_finished for r in running)
    run(scheduler, {}, model)
    check_outputs(*running, arriving)


def test_a_waiting_request_of_higher_priority_preempts_lower_ones_for_blocks():
    cfg = config(num_blocks=10, max_model_len=28, block_size=4, max_num_batched_tokens=64)
    scheduler, model = Scheduler(cfg), FakeModel(cfg)
    lowest = make_request("lowest", list(range(1, 16)), priority=9, max_tokens=5, ignore_eos=True)
    low = make_request("low", list(range(20, 35)), priority=5, max_tokens=5, ignore_eos=True)
    for request in (lowest, low):  # 4 blocks each: 2 of 10 left
        scheduler.add_request(request)
    step(scheduler, model)
    assert scheduler.kv_cache.num_free_blocks == 2
    small = make_request("small", [40, 41, 42, 43, 44], max_tokens=2, ignore_eos=True)  # 2 blocks: fits
    scheduler.add_request(small)
    assert not step(scheduler, model).preempted_request_ids
    big = make_request("big", list(range(36, 63)), priority=-1, max_tokens=1, ignore_eos=True)  # 7 blocks
    scheduler.add_request(big)
    output = step(scheduler, model)
    # The lowest priority first, though it arrived first; then the next, until the 7 blocks fit.
    assert output.preempted_request_ids == ["lowest", "low"]
    assert scheduled(output) == [("big", 27), ("small", 1)]
    assert [r.request_id for r in scheduler.waiting] == ["low", "lowest"]
    run(scheduler, {}, model)
    check_outputs(lowest, low, small, big)


def test_the_budget_goes_to_higher_priority_first():
    cfg = config(max_num_batched_tokens=8)
    scheduler, model = Scheduler(cfg), FakeModel(cfg)
    chat = make_request("chat", [1, 2, 3], max_tokens=10, ignore_eos=True)
    batch = make_request("batch", list(range(1, 41)), priority=1, max_tokens=2, ignore_eos=True)
    scheduler.add_request(batch)
    scheduler.add_request(chat)
    assert scheduled(step(scheduler, model)) == [("chat", 3), ("batch", 5)]
    assert scheduled(step(scheduler, model)) == [("chat", 1), ("batch", 7)]
    newcomer = make_request("newcomer", list(range(5, 12)), max_tokens=2, ignore_eos=True)
    scheduler.add_request(newcomer)
    # The running batch prefill yields the budget to the newcomer's prefill, at once.
    assert scheduled(step(scheduler, model)) == [("chat", 1), ("newcomer", 7)]
    assert scheduled(step(scheduler, model)) == [("chat", 1), ("newcomer", 1), ("batch", 6)]
    run(scheduler, {}, model)
    check_outputs(chat, batch, newcomer)


def test_an_aborted_preempted_request_is_freed():
    scheduler, model, (first, second), _ = seated(priority=0)
    assert step(scheduler, model).preempted_request_ids == ["second"]
    assert scheduler.abort_requests(["second"]) == ["second"]
    assert second.status == RequestStatus.FINISHED_ABORTED and second.block_ids == []
    assert scheduler.num_waiting == 0
    run(scheduler, {}, model)  # checks that no block leaked


def test_a_starved_request_of_low_priority_completes_once_the_stream_ends():
    cfg = config(max_num_seqs=2, max_num_batched_tokens=16)
    scheduler = Scheduler(cfg)
    starved = make_request("starved", [1, 2, 3], priority=1, max_tokens=8, ignore_eos=True)
    stream = [make_request(f"chat-{i}", [4, 5, i % 60 + 1], max_tokens=3, ignore_eos=True) for i in range(40)]
    arrivals = {0: [starved], **{step + 1: [request] for step, request in enumerate(stream)}}
    preemptions = run(scheduler, arrivals)
    assert preemptions.get("starved", 0) >= 1 and set(preemptions) == {"starved"}
    check_outputs(starved, *stream)
