"""Embedding requests in the scheduler alone, without torch: a fake model whose hidden state at a row is
(token, position, 1), so that each pooled vector tells which rows it summed. Prompts chunked by a small
budget, preempted for want of blocks and resumed, taken from the prefix cache, and batched with generation
requests must each give the vector of their prompt alone.
"""

from __future__ import annotations

import random

import pytest

from gracelm.engine.request import Request, RequestStatus
from gracelm.engine.scheduler import RequestUpdate, Scheduler, SchedulerConfig
from gracelm.model_step import PooledSum, SampledToken
from gracelm.sampling_params import SamplingParams


def expected(prompt: list[int], pooling: str) -> list[float]:
    rows = {"last": [len(prompt) - 1], "cls": [0], "mean": range(len(prompt))}[pooling]
    return [sum(prompt[p] for p in rows) / len(rows), sum(rows) / len(rows), 1.0]


def fake_step(scheduler: Scheduler) -> tuple[list[RequestUpdate], int]:
    """One step: every sampling row gets token 1, every pooled row its (token, position, 1); the updates,
    and how many requests the step preempted."""
    output = scheduler.schedule()
    step = output.model_step(scheduler.config.block_size)
    batch = step.batch
    num_scored = len(step.request_ids) + sum(len(rows.target_ids) for rows in step.prompt_rows)
    pooled_rows = iter(batch.logits_indices[num_scored:])
    pooled = {}
    for rows in step.pool_rows:
        indices = [next(pooled_rows) for _ in range(rows.num_rows)]
        vector = [float(sum(batch.input_ids[i] for i in indices)),
                  float(sum(batch.positions[i] for i in indices)), float(len(indices))]
        pooled[rows.request_id] = PooledSum(vector, rows.num_rows)
    sampled = [[SampledToken(1)] for _ in step.request_ids]
    return scheduler.update_from_output(output, sampled, None, pooled), len(output.preempted_request_ids)


def drive(scheduler: Scheduler, requests: list[Request]) -> dict[str, list[float] | None]:
    """Each request's embedding (None for a generation request) once all have finished; the preemptions
    counted under "preempted"."""
    for request in requests:
        scheduler.add_request(request)
    results: dict = {"preempted": 0}
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            return results
        updates, preempted = fake_step(scheduler)
        results["preempted"] += preempted
        for update in updates:
            if update.finished:
                results[update.request_id] = update.embedding
    raise AssertionError("the requests never finished")


def embedding_request(request_id: str, prompt: list[int], pooling: str) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=1), pooling=pooling)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("num_blocks", [64, 10])  # 10 blocks of 4: preemptions
def test_chunked_and_preempted_prompts_pool_as_alone(pooling, num_blocks):
    rng = random.Random(num_blocks)
    prompts = [[rng.randrange(1, 60) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    # Chunks of 4 tokens: the four running prompts grow together, and with 10 blocks they outgrow them.
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=40,
                                          num_blocks=num_blocks, block_size=4,
                                          long_prefill_token_threshold=4))
    results = drive(scheduler, [embedding_request(f"e{i}", p, pooling) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert results[f"e{i}"] == pytest.approx(expected(prompt, pooling))
    assert (results["preempted"] > 0) == (num_blocks < 64)
    assert scheduler.kv_cache.num_free_blocks == num_blocks


def test_last_token_pooling_takes_the_prefix_cache_and_mean_does_not():
    prompt = list(range(1, 30))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40,
                                          num_blocks=64, block_size=4))
    drive(scheduler, [embedding_request("first", prompt, "last")])
    queries = scheduler.kv_cache.prefix_cache_hits
    assert drive(scheduler, [embedding_request("again", prompt, "last")])["again"] == expected(prompt, "last")
    assert scheduler.kv_cache.prefix_cache_hits > queries
    hits = scheduler.kv_cache.prefix_cache_hits
    assert drive(scheduler, [embedding_request("mean", prompt, "mean")])["mean"] == pytest.approx(
        expected(prompt, "mean"))
    assert scheduler.kv_cache.prefix_cache_hits == hits


def test_embeddings_and_generation_share_the_steps():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=40,
                                          num_blocks=64, block_size=4))
    text = Request("text", [5] * 20, SamplingParams(max_tokens=3))
    vector = embedding_request("vector", [7] * 20, "mean")
    results = drive(scheduler, [text, vector])
    assert results["vector"] == pytest.approx(expected([7] * 20, "mean"))
    assert results["text"] is None and text.output_token_ids == [1, 1, 1]
    assert vector.status is RequestStatus.FINISHED_STOPPED and not vector.output_token_ids
