"""Engine and AsyncEngine over a real engine-core process and a tiny random model.

The reference for every batching test is the same prompts run one at a time, greedy, without prefix
caching: batching, chunked prefill, preemption and prefix caching must not change a single token.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from gracelm import AsyncEngine, Engine, SamplingParams
from tests.process_checks import assert_nothing_left
from tests.tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BASE = {"max_model_len": 256, "num_threads": 1}
# One block of the tiny model's cache: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def _prompts(count: int, prefix: list[int] | None = None, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        length = 3 + (i * 37) % 150  # 3 .. 152 tokens, in no order
        prompts.append([*(prefix or []), *(rng.randrange(3, 500) for _ in range(length))])
    return prompts


def _token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def _assert_no_kv_leak(llm: Engine) -> dict:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    return stats


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def reference(model):
    """Each prompt alone, for the plain prompts and for prompts sharing a 64-token prefix."""
    shared = [random.Random(99).randrange(3, 500) for _ in range(64)]
    prompts = {"plain": _prompts(20), "shared": _prompts(20, prefix=shared, seed=1)[:10]}
    with Engine(model, enable_prefix_caching=False, **BASE) as llm:
        ref = {name: [_token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in batch]
               for name, batch in prompts.items()}
        _assert_no_kv_leak(llm)
    assert_nothing_left()
    return prompts, ref


@pytest.mark.parametrize("options", [
    pytest.param({}, id="batched"),
    pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
    pytest.param({"kv_cache_memory": 20 * TINY_BLOCK_BYTES}, id="preemption"),
])
def test_batched_greedy_equals_one_at_a_time(model, reference, options):
    prompts, ref = reference
    with Engine(model, **{**BASE, **options}) as llm:
        assert _token_ids(llm.generate(prompts["plain"], GREEDY, use_tqdm=False)) == ref["plain"]
        stats = _assert_no_kv_leak(llm)
        if "kv_cache_memory" in options:
            assert stats["kv_blocks_total"] == 20
            assert stats["num_preemptions"] > 0, "the tiny cache should have forced preemption"
    assert_nothing_left()


def test_priorities_with_preemption_change_no_token(model, reference):
    # Each prompt more urgent than the one before, and a cache of one full-length request (16 blocks): the
    # later ones overtake and preempt the earlier ones, however the requests reach the core.
    prompts, ref = reference
    priorities = [-i for i in range(len(prompts["plain"]))]
    with Engine(model, **BASE, kv_cache_memory=16 * TINY_BLOCK_BYTES) as llm:
        outputs = llm.generate(prompts["plain"], GREEDY, use_tqdm=False, priority=priorities)
        assert _token_ids(outputs) == ref["plain"]
        assert _assert_no_kv_leak(llm)["num_preemptions"] > 0
        with pytest.raises(ValueError, match=r"priority must be an integer in \[-2147483648, 2147483647\]"):
            llm.generate(prompts["plain"][:2], GREEDY, use_tqdm=False, priority=[0, 2**31])
        with pytest.raises(ValueError, match="got 1 int values for 2 prompts"):
            llm.generate(prompts["plain"][:2], GREEDY, use_tqdm=False, priority=[0])
        _assert_no_kv_leak(llm)  # nothing was queued
    assert_nothing_left()


def test_shared_prefix_hits_the_prefix_cache_and_changes_nothing(model, reference):
    prompts, ref = reference
    with Engine(model, **BASE) as llm:
        first = llm.generate(prompts["shared"][:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts["shared"][1:], GREEDY, use_tqdm=False)
        assert _token_ids(first + rest) == ref["shared"]
        stats = _assert_no_kv_leak(llm)
    # The 9 later prompts find at least the 4 full blocks (64 tokens) of the shared prefix cached.
    assert stats["prefix_cache_hits"] >= 9 * 64
    assert stats["prefix_cache_queries"] >= stats["prefix_cache_hits"]
    assert_nothing_left()


def test_text_prompts_chat_n_seeds_and_stop_strings(model):
    with Engine(model, **BASE) as llm:
        [out] = llm.generate("the cat runs", GREEDY, use_tqdm=False)
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length" and len(completion.token_ids) == 12
        assert out.prompt == "the cat runs" and out.prompt_token_ids == llm.tokenizer.encode("the cat runs")
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
        assert out.metrics.arrival_time <= out.metrics.first_token_time <= out.metrics.finish_time

        # A stop string taken from the middle of the greedy text: the text ends right before it.
        text = completion.text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        stopping = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
        [stopped] = llm.generate("the cat runs", stopping, use_tqdm=False)
        assert stopped.outputs[0].text == text[:text.index(stop)]
        assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop

        # n=2 with a seed is the same as two requests seeded seed and seed + 1.
        sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
        [fanned] = llm.generate("a dog", SamplingParams(**{**_fields(sampled), "n": 2}), use_tqdm=False)
        reseeded = SamplingParams(**{**_fields(sampled), "seed": 8})
        singles = llm.generate(["a dog", "a dog"], [sampled, reseeded], use_tqdm=False)
        assert [c.token_ids for c in fanned.outputs] == _token_ids(singles)
        assert [c.index for c in fanned.outputs] == [0, 1]

        [chat] = llm.chat([{"role": "user", "content": "hello"}], GREEDY, use_tqdm=False)
        conversation = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
        assert chat.prompt_token_ids == conversation

        [with_logprobs] = llm.generate("a dog", SamplingParams(temperature=0.0, max_tokens=3, logprobs=2),
                                       use_tqdm=False)
        completion = with_logprobs.outputs[0]
        assert len(completion.logprobs) == 3
        for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            ranked = {lp.rank: tid for tid, lp in entry.items()}
            assert ranked[1] == token_id  # greedy takes the most likely token
        _assert_no_kv_leak(llm)
    assert_nothing_left()


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


def test_invalid_prompts_raise_before_anything_is_queued(model):
    with Engine(model, **BASE) as llm:
        with pytest.raises(ValueError, match="empty"):
            llm.generate("", GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
            llm.generate([5] * 256, GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
            llm.generate([[5, 6], [5] * 300], GREEDY, use_tqdm=False)  # the valid one is not queued either
        with pytest.raises(ValueError, match="token ids"):
            llm.generate([5, 10**6], GREEDY, use_tqdm=False)
        _assert_no_kv_leak(llm)
        assert llm.config.max_model_len == 256 and llm.model_config.vocab_size == 512
    assert_nothing_left()


def test_shutdown_is_idempotent_and_later_calls_fail(model):
    llm = Engine(model, **BASE)
    llm.shutdown()
    llm.shutdown()
    with pytest.raises(Exception, match="shut down"):
        llm.generate("a dog", GREEDY, use_tqdm=False)
    assert_nothing_left()


async def _stream(engine: AsyncEngine, prompt, params, request_id: str, stop_after: int | None = None):
    outputs = []
    async for out in engine.generate(prompt, params, request_id):
        outputs.append(out)
        if stop_after is not None and len(outputs) >= stop_after:
            break
    return outputs


async def _wait_until(predicate, engine: AsyncEngine, timeout: float = 20.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        stats = await engine.stats()
        if predicate(stats):
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not reached; last stats {stats}")


def test_async_streams_and_aborts_mid_prefill_and_mid_decode_leak_nothing(model):
    long_run = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    # A token budget of 2 makes the 250-token prompt's prefill last over a hundred steps.
    engine = AsyncEngine(model, max_num_batched_tokens=2, max_model_len=512, num_threads=1)

    async def scenario():
        # Streaming: cumulative outputs, the last one finished, the text growing.
        # A consumer that lags gets the latest cumulative output, skipping none of the tokens: counts grow
        # strictly, each output extends the one before, and the last has all 12.
        outputs = await _stream(engine, "the cat runs", GREEDY, "stream")
        counts = [len(o.outputs[0].token_ids) for o in outputs]
        assert counts == sorted(set(counts)) and counts[-1] == 12
        final_ids = outputs[-1].outputs[0].token_ids
        assert all(final_ids[:len(o.outputs[0].token_ids)] == o.outputs[0].token_ids for o in outputs)
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])

        # Mid-prefill: cancel while the request runs and before it produced anything.
        received = []

        async def consume():
            async for out in engine.generate([7] * 250, long_run, "prefill"):
                received.append(out)

        task = asyncio.create_task(consume())
        await _wait_until(lambda s: s["num_running"] == 1, engine)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert received == [], "the request was no longer in prefill"
        await _wait_until(lambda s: s["num_running"] == 0, engine)

        # Mid-decode: stop reading (closing the generator) after 3 tokens, and an explicit abort.
        partial = await _stream(engine, "a dog", long_run, "decode", stop_after=3)
        assert len(partial) == 3 and not partial[-1].finished
        aborted_task = asyncio.create_task(_stream(engine, "a bird", long_run, "explicit"))
        await _wait_until(lambda s: s["num_running"] == 1, engine)
        await engine.abort("explicit")
        last = (await aborted_task)[-1]
        assert last.finished and last.outputs[0].finish_reason == "abort"

        with pytest.raises(ValueError, match="empty"):
            await _stream(engine, [], GREEDY, "bad")
        return await _wait_until(lambda s: s["num_running"] == 0, engine)

    try:
        stats = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_waiting"] == 0
    assert not engine.is_running
    assert_nothing_left()


def test_the_worker_runs_the_frozen_fast_path():
    """The engine computes with fused, frozen linears (what the parity tests check against transformers)."""
    from gracelm.config import EngineConfig
    from gracelm.model.llama import FrozenLinear
    from gracelm.parallel.worker import Worker

    model = Worker(EngineConfig(model=str(tiny_model("llama")), **BASE)).load_model().model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, FrozenLinear)
    assert isinstance(layer.mlp.gate_up_proj, FrozenLinear)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
