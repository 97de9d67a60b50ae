"""Priority scheduling end to end, through the official `openai` client and vLLM's `priority` request field.

A real server with two seats (`--max-num-seqs 2`), both held by long streams of low priority (`priority: 5`):
an interactive request (priority 0) preempts one of them, and its first token comes before either ends; the
low-priority streams then finish with the tokens they have alone. Every engine step is slowed (the test-only
hook `test_step_sleep_s`), so that a long stream cannot end while the interactive request is on its way,
however loaded the machine: the test checks the order of events, never a duration.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from gracelm.engine.frontend import MAX_PRIORITY, MIN_PRIORITY
from tests.server_process import ServerProcess, metric_value
from tests.tiny_models import tiny_model

MODEL = "tiny"
LABEL = {"model_name": MODEL}
PROMPT = "the cat and the dog"
LOW_TOKENS = 120  # a step takes at least 20 ms: a low-priority stream lasts at least 2.4 s
HOOKS = {"test_step_sleep_s": 0.02}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(tiny_model("llama"), "--served-model-name", MODEL, "--max-num-seqs", "2",
                       "--kv-cache-memory", "16MiB", env={"GRACELM_TEST_HOOKS": json.dumps(HOOKS)}) as s:
        yield s


async def _low(client: openai.AsyncOpenAI, name: str, events: list[tuple[str, str]],
               started: asyncio.Event) -> tuple[str, str | None]:
    """A long greedy completion at priority 5; records its first token and its end."""
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LOW_TOKENS, temperature=0,
                                             stream=True, extra_body={"priority": 5, "ignore_eos": True})
    text, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:  # each chunk carries a token (or more)
            if not started.is_set():
                events.append((name, "first token"))
                started.set()
            text.append(choice.text)
            finish = choice.finish_reason or finish
    events.append((name, "end"))
    return "".join(text), finish


async def _interactive(client: openai.AsyncOpenAI, events: list[tuple[str, str]]) -> str | None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0,
        logprobs=True, stream=True, extra_body={"priority": 0, "ignore_eos": True})
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and ("interactive", "first token") not in events:
                events.append(("interactive", "first token"))  # the role chunk carries no token
            finish = choice.finish_reason or finish
    events.append(("interactive", "end"))
    return finish


def _metric(server: ServerProcess, name: str) -> float:
    return metric_value(httpx.get(f"{server.url}/metrics", timeout=30).text, name, **LABEL)


async def _scenario(server: ServerProcess) -> tuple[list[tuple[str, str]], list[tuple[str, str | None]],
                                                     str | None, float]:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    events: list[tuple[str, str]] = []
    started = [asyncio.Event(), asyncio.Event()]
    lows = [asyncio.create_task(_low(client, f"low-{i}", events, started[i])) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=120)
    background = await asyncio.to_thread(_metric, server, "gracelm_num_requests_running_background")
    interactive = await _interactive(client, events)
    return events, await asyncio.gather(*lows), interactive, background


def test_an_interactive_request_overtakes_background_ones(server):
    preempted_before = _metric(server, "gracelm_num_preemptions_total")
    events, lows, interactive, background = asyncio.run(_scenario(server))
    assert background == 2  # both seats held by background requests when the interactive one came
    order = events.index
    for name in ("low-0", "low-1"):
        assert order(("interactive", "first token")) < order((name, "end")), events
    assert order(("interactive", "end")) < min(order(("low-0", "end")), order(("low-1", "end"))), events
    assert interactive == "length"
    assert _metric(server, "gracelm_num_preemptions_total") > preempted_before  # a seat was taken back
    # Both finish, the preempted one recomputed: the same tokens as a stream that runs alone.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LOW_TOKENS, temperature=0,
                                      extra_body={"priority": 5, "ignore_eos": True})
    assert lows == [(alone.choices[0].text, "length")] * 2
    assert _metric(server, "gracelm_num_requests_running_background") == 0
    assert _metric(server, "gracelm_num_requests_waiting_background") == 0


@pytest.mark.parametrize("value", [MIN_PRIORITY - 1, MAX_PRIORITY + 1, "high", 1.5, None])
def test_a_priority_out_of_range_or_not_an_integer_is_a_400_naming_it(server, value):
    for route, body in (("completions", {"prompt": PROMPT}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body |= {"max_tokens": 2, "priority": value}
        r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "priority", r.text


def test_the_bounds_and_a_negative_priority_are_served(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    for value in (MIN_PRIORITY, -3, MAX_PRIORITY):
        answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                           extra_body={"priority": value, "ignore_eos": True})
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 2
