"""The start-up warm-up (`gracelm/parallel/warmup.py`, `gracelm/serving/serving_warmup.py`): the engine's
first steps and the HTTP process's first uses run before the server is ready, and leave no trace: no request,
no prefix-cache entry, no KV block in use, no count in /metrics, no draw of the default generator."""

from __future__ import annotations

import asyncio
import logging
import re
from itertools import accumulate

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import gracelm.parallel.executor as executor_module
from gracelm.config import EngineConfig
from gracelm.engine import messages as msg
from gracelm.engine.core import EngineCore
from gracelm.model.low_bit_gate import SHORT_PROMPT
from gracelm.model.sampler import make_generator
from gracelm.model.tokenizer import Tokenizer
from gracelm.parallel.warmup import DECODE_STEPS, LONG_PROMPT_LEN, SHORT_PROMPT_LEN, warmup_steps
from gracelm.sampling_params import SamplingParams
from gracelm.serving.serving_warmup import warm_up_serving
from tests.kernel_paths import BY_NAME, KernelPath, matrix_gguf
from tests.server_process import ServerProcess
from tests.tiny_models import tiny_model

CORE = {"kv_cache_memory": "1MiB", "num_threads": 1, "max_model_len": 256}


def test_the_steps_prefill_a_long_and_a_short_prompt_then_decode_both_then_one() -> None:
    block_size, vocab = 16, 100
    steps = warmup_steps(block_size, num_blocks=64, vocab_size=vocab)
    prefill, *decodes = steps
    assert prefill.batch.query_lens[0] >= SHORT_PROMPT > prefill.batch.query_lens[1]
    assert prefill.batch.prompt_lens == prefill.batch.query_lens
    assert [len(step.batch.query_lens) for step in decodes] == [2] * DECODE_STEPS + [1] * DECODE_STEPS
    assert all(step.batch.query_lens == [1] * len(step.batch.query_lens) for step in decodes)
    written: set[int] = set()  # each slot written once, by one sequence
    for step in steps:
        batch = step.batch
        assert all(0 <= token < vocab for token in batch.input_ids)
        assert batch.logits_indices == [end - 1 for end in accumulate(batch.query_lens)]
        slots = set(batch.slot_mapping)
        assert len(slots) == len(batch.slot_mapping) and not written & slots
        assert max(slots) // block_size < 64
        written |= slots
        assert len(step.request_ids) == len(step.params) == len(batch.query_lens)
    assert any(params.temperature == 0 for params in prefill.params)
    assert any(params.temperature > 0 and params.seed is None for params in prefill.params)


def test_where_long_prompts_take_no_kernels_of_their_own_both_prompts_are_short() -> None:
    long = warmup_steps(16, num_blocks=64, vocab_size=100)
    short = warmup_steps(16, num_blocks=64, vocab_size=100, long_prompt=False)
    assert long[0].batch.query_lens == [LONG_PROMPT_LEN, SHORT_PROMPT_LEN]
    assert short[0].batch.query_lens == [SHORT_PROMPT_LEN] * 2 and SHORT_PROMPT_LEN < SHORT_PROMPT
    assert [len(step.batch.query_lens) for step in short] == [len(step.batch.query_lens) for step in long]
    assert [step.params for step in short] == [step.params for step in long]


def test_a_small_cache_warms_up_with_what_fits() -> None:
    assert len(warmup_steps(16, num_blocks=2, vocab_size=100)[0].request_ids) == 1
    assert warmup_steps(16, num_blocks=1, vocab_size=100) == []


def _core(**options) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_model("llama")), **CORE, **options))


def _sample(core: EngineCore, prompt: list[int], params: SamplingParams) -> list[int]:
    core.add_request(msg.AddRequest("r", prompt, params, [], 0.0, 0))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        tokens += [out.token_id for out in core.step() if out.token_id is not None]
    return tokens


def test_the_engine_after_its_warm_up_is_as_a_fresh_one(caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in use or counted, an empty prefix cache, no generator of its own left, and the default
    generator's draws those of an engine that never warmed up."""
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="gracelm.parallel.warmup"):
        core = _core(seed=3)
    try:
        assert re.search(r"warm-up: \d+ steps \(prompts of \d+, \d+ tokens\) in \d+ ms", caplog.text)
        stats = core.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["kv_usage"] == 0
        assert stats["num_running"] == stats["num_waiting"] == stats["num_preemptions"] == 0
        assert stats["compiled_steps"] == 0
        assert core.scheduler.kv_cache.cached_blocks_by_recency() == []
        assert core.scheduler.kv_cache.prefix_cache_queries == core.scheduler.kv_cache.prefix_cache_hits == 0
        driver = core.executor._driver
        assert driver._generators == {}
        assert torch.equal(driver._default_generator.get_state(), make_generator(3).get_state())
        warmed = _sample(core, list(range(3, 40)), unseeded)
    finally:
        core.executor.shutdown()
    monkeypatch.setattr(executor_module, "run_warmup", lambda driver, steps: None)
    cold = _core(seed=3)
    try:
        assert _sample(cold, list(range(3, 40)), unseeded) == warmed
    finally:
        cold.executor.shutdown()


def test_a_served_engine_is_ready_with_nothing_counted_and_the_phase_timed() -> None:
    with ServerProcess(tiny_model("llama"), "--kv-cache-memory", "1MiB", "--num-threads", "1",
                       "--stats-interval", "0") as server:
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        log = server.log()
    counts = [(sample.name, sample.labels, sample.value) for family in text_string_to_metric_families(metrics)
              if family.type in ("counter", "histogram") for sample in family.samples
              if sample.name.endswith(("_total", "_count"))]
    assert counts and not [count for count in counts if count[2]], counts
    for gauge in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        assert re.search(rf"^gracelm_{gauge}\{{[^}}]*\}} 0\.0$", metrics, re.M), gauge
    free = re.search(r"^gracelm_kv_cache_blocks_free\{[^}]*\} (\S+)$", metrics, re.M)
    total = re.search(r"^gracelm_kv_cache_blocks_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert free and total and free.group(1) == total.group(1)
    assert float(re.findall(r'gracelm_startup_phase_seconds\{[^}]*phase="warmup"\} (\S+)', metrics)[0]) > 0
    steps = rf"{1 + 2 * DECODE_STEPS} steps \(prompts of {LONG_PROMPT_LEN}, {SHORT_PROMPT_LEN} tokens\)"
    assert re.search(rf"warm-up: {steps} in \d+ ms", log), log[-3000:]  # dense weights: the long prompt


# The paths whose warm-up has no long prompt: a 4-bit file's forms alone, without the tile unit.
_SHORT_WARM_UP = {"blocks-vnni"}
_WARM_UP_PATHS = ("blocks-vnni", "blocks-amx", "blocks-dense-copy", "int4-bfloat16", "dense")


@pytest.mark.parametrize("path", [BY_NAME[name] for name in _WARM_UP_PATHS], ids=lambda path: path.name)
def test_a_4bit_files_server_warms_up_with_a_long_prompt_only_where_long_prompts_differ(path: KernelPath
                                                                                       ) -> None:
    """The executor asks the loaded model (`llama.long_prompts_differ`): where the blocks kernel serves every
    row without the tile unit, two short prompts; beside a dense copy, in dense weights, through torch's int4
    form (which keeps a dense copy) or through the tile unit, the long one too. Each path forced by its masked
    CPU features and options, as the path matrix forces them (tests/kernel_paths.py)."""
    if path.why_not_here() is not None:
        pytest.skip(f"path {path.name}: {path.why_not_here()}")
    args = path.server_args()
    eager = [] if "--enforce-eager" in args else ["--enforce-eager"]  # no graph compiler beside the test
    options = ("--kv-cache-memory", "1MiB", "--num-threads", "1")
    with ServerProcess(matrix_gguf(), *args, *eager, *options) as server:
        log = server.log()
    first = SHORT_PROMPT_LEN if path.name in _SHORT_WARM_UP else LONG_PROMPT_LEN
    assert f"(prompts of {first}, {SHORT_PROMPT_LEN} tokens)" in log, log[-3000:]


@pytest.mark.parametrize("template", [None, "{{ raise_exception('no chat here') }}"])
def test_the_http_warm_up_never_fails_a_start(template: str | None) -> None:
    """A model without a chat template, or one that refuses the warm-up's conversation, still starts."""
    tokenizer = Tokenizer.from_dir(tiny_model("llama"))
    tokenizer.chat_template = template
    asyncio.run(warm_up_serving(tokenizer, 256))
