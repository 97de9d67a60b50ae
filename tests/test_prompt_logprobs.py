"""Prompt logprobs: vLLM's `prompt_logprobs` and completions `echo` with `logprobs` (OpenAI's prompt scoring,
`max_tokens: 0` included) equal a reference computed with transformers (log_softmax of a full forward pass)
within 1e-4 in float32, through chunked prefill and batched prompts, against a real server of a tiny random
model, and with tensor parallelism (rank 0 scores the gathered rows); the prefix cache still serves requests
that do not ask; `return_tokens_as_token_ids`; and, in the scheduler, a preemption in the middle of a
prefill never computes or sends a prompt position twice."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import torch

from gracelm import Engine
from gracelm.engine.request import Request
from gracelm.engine.scheduler import Scheduler, SchedulerConfig
from gracelm.model_step import PromptLogprobs, SampledToken
from gracelm.sampling_params import SamplingParams
from tests.process_checks import leftover_children
from tests.server_process import ServerProcess
from tests.tiny_models import tiny_model

MODEL = "tiny-prompt-logprobs"
PROMPTS = ["the quick red cat runs over the old stone and the small dog reads a green light",
           "a model writes tokens while the server answers a question about the river at night"]
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    # A step budget of 8 tokens: every prompt here is prefilled in several chunks.
    with ServerProcess(model_dir, "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-memory",
                       "16MiB", "--max-num-batched-tokens", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Per prompt token ids: transformers' log_softmax over the vocabulary at every position."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def _tokenize(server, prompt: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def _check_against(reference, ids: list[int], scored: list, num_top: int) -> None:
    """`scored`: vLLM's prompt_logprobs of `ids` as JSON (token ids as string keys)."""
    expected = reference(ids)
    assert len(scored) == len(ids) and scored[0] is None
    for position, (token_id, entry) in enumerate(zip(ids[1:], scored[1:], strict=True)):
        row = expected[position]
        want = row[token_id].item()
        got = entry[str(token_id)]
        assert abs(got["logprob"] - want) < TOL, (position, got, want)
        assert got["rank"] == int((row > row[token_id]).sum()) + 1
        values, top_ids = row.topk(num_top)
        for rank, (top_id, value) in enumerate(zip(top_ids.tolist(), values.tolist(), strict=True), start=1):
            assert abs(entry[str(top_id)]["logprob"] - value) < TOL and entry[str(top_id)]["rank"] == rank
        assert set(entry) <= {str(t) for t in top_ids.tolist()} | {str(token_id)}
        assert all(e["decoded_token"] is not None for e in entry.values())


def test_prompt_logprobs_of_a_batch_match_transformers(server, reference):
    # Two prompts in one request, run together, each prefilled in chunks of the 8-token budget.
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for prompt, choice in zip(PROMPTS, choices, strict=True):
        ids = _tokenize(server, prompt)
        assert len(ids) > 8
        _check_against(reference, ids, choice["prompt_logprobs"], 3)
    # Asking for none leaves the field null.
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=120)
    assert all(c["prompt_logprobs"] is None for c in plain.json()["choices"])


def test_echo_with_logprobs_scores_the_prompt(client, server, reference):
    prompt = PROMPTS[0]
    ids = _tokenize(server, prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                  logprobs=2, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 3
    assert len(lp.text_offset) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = reference(ids)
    for position, token_id in enumerate(ids[1:]):
        assert abs(lp.token_logprobs[position + 1] - expected[position][token_id].item()) < TOL
        assert len(lp.top_logprobs[position + 1]) == 2
        assert abs(max(lp.top_logprobs[position + 1].values()) - expected[position].max().item()) < TOL
    # text_offset runs over the echoed prompt, then the completion from the end of the prompt's text.
    assert lp.text_offset[0] == 0
    for i in range(1, len(ids)):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    assert "".join(lp.tokens[:len(ids)]) == prompt
    assert lp.text_offset[len(ids)] == len(prompt)
    # The completion's own logprobs are those of the same request without echo.
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.tokens[len(ids):] == plain.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.token_logprobs, abs=TOL)
    # Streamed: the first chunk carries the prompt and its logprobs, the others the completion's.
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                            echo=True, logprobs=2, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt_only(client, server, reference):
    prompt = PROMPTS[1]
    ids = _tokenize(server, prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    expected = reference(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [expected[i][t].item() for i, t in enumerate(ids[1:])], abs=TOL)
    streamed = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True) if c.choices]
    assert "".join(c.text for c in streamed) == prompt
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == choice.logprobs.tokens
    # Without echo, max_tokens 0 asks for nothing: refused.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_chat_prompt_logprobs(server, reference):
    messages = [{"role": "user", "content": "tell me about the river and the old stone"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages},
                     timeout=60).json()["tokens"]
    _check_against(reference, ids, r.json()["prompt_logprobs"], 2)
    # vLLM refuses prompt logprobs on a stream; so does this server, naming the field.
    for route, extra in (("chat/completions", {"messages": messages}), ("completions", {"prompt": "a b"})):
        r = httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, "max_tokens": 1, "stream": True,
                                                         "prompt_logprobs": 1, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def _prefix_cache_hits(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    return float(re.search(r"^gracelm_prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)[1])


def test_prefix_cache_serves_requests_that_do_not_ask(server, reference):
    prompt = " ".join(["over the old stone bridge the quick red cat runs and the small dog reads"] * 3)
    ids = _tokenize(server, prompt)
    assert len(ids) > 33  # two full blocks of 16 to reuse
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status()
    before = _prefix_cache_hits(server)
    # Cached blocks have no logits: a request for prompt logprobs computes the whole prompt, and gets all.
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": 1}, timeout=120)
    _check_against(reference, ids, r.json()["choices"][0]["prompt_logprobs"], 1)
    assert _prefix_cache_hits(server) == before
    httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status()
    assert _prefix_cache_hits(server) >= before + 32


def test_return_tokens_as_token_ids(client, server):
    prompt = PROMPTS[0]
    ids = _tokenize(server, prompt)
    named = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                      logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                              "ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    lp = named.choices[0].logprobs
    token_ids = [int(re.fullmatch(r"token_id:(\d+)", t)[1]) for t in lp.tokens]
    assert token_ids[:len(ids)] == ids
    assert named.choices[0].text == prompt + plain.choices[0].text
    assert all(re.fullmatch(r"token_id:\d+", key) for top in lp.top_logprobs[1:] for key in top)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert content and all(re.fullmatch(r"token_id:\d+", c.token) and bytes(c.bytes).decode() == c.token
                           and all(re.fullmatch(r"token_id:\d+", t.token) for t in c.top_logprobs)
                           for c in content)


def test_tensor_parallel_prompt_logprobs_match_transformers(model_dir, reference):
    prompts = [list(range(5, 40)), list(range(100, 120))]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    # The module's server runs beside it: only the engine's own processes must be gone after it.
    before = {p.pid for p in leftover_children(wait=0)}
    with Engine(str(model_dir), tensor_parallel_size=2, dtype="float32", kv_cache_memory="4MiB",
                num_threads=1, max_num_batched_tokens=8) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outputs, strict=True):
        scored = [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                   "decoded_token": lp.decoded_token} for t, lp in e.items()}
                  for e in out.outputs[0].prompt_logprobs]
        _check_against(reference, ids, scored, 2)
    assert [p for p in leftover_children() if p.pid not in before] == []


# -- the scheduler: prompt rows over chunks and a preemption ----------------------------------------------

def _fake_step(output, model_step) -> tuple[list[list[SampledToken]], dict[str, PromptLogprobs]]:
    """Each prompt row's "logprob" is minus its position, so that what arrives tells which rows ran."""
    positions = [model_step.batch.positions[i] for i in model_step.batch.logits_indices]
    prompt_positions = iter(positions[len(model_step.request_ids):])
    scored = {rows.request_id: PromptLogprobs([-float(next(prompt_positions)) for _ in rows.target_ids],
                                              [1] * len(rows.target_ids), [[] for _ in rows.target_ids],
                                              [[] for _ in rows.target_ids])
              for rows in model_step.prompt_rows}
    return [[SampledToken(7)] for _ in model_step.request_ids], scored


def test_a_preemption_in_prefill_never_scores_a_prompt_position_twice():
    # 6 blocks of 4 tokens, 4 tokens a step: the first request's decodes soon preempt the second, which is
    # in the middle of its 14-token prefill; it resumes, recomputes, and scores only what it had not.
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=24,
                                          num_blocks=6, block_size=4, enable_prefix_caching=True))
    first = Request("first", list(range(10, 17)), SamplingParams(max_tokens=17, ignore_eos=True))
    prompt = list(range(20, 34))
    second = Request("second", prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0))
    scheduler.add_request(first)
    scheduler.add_request(second)
    scored_positions: list[int] = []
    delivered = []
    preempted_in_prefill = False
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        preempted_in_prefill |= "second" in output.preempted_request_ids and not second.output_token_ids
        step = output.model_step(4)
        for rows in step.prompt_rows:
            start = len(step.request_ids) + sum(len(r.target_ids) for r in step.prompt_rows[:step.prompt_rows
                                                                                          .index(rows)])
            positions = [step.batch.positions[step.batch.logits_indices[start + i]]
                         for i in range(len(rows.target_ids))]
            assert rows.target_ids == [prompt[p + 1] for p in positions]
            scored_positions += positions
        sampled, scored = _fake_step(output, step)
        for update in scheduler.update_from_output(output, sampled, scored):
            if update.prompt_logprobs is not None:
                delivered.append((update.request_id, update.prompt_logprobs))
    assert preempted_in_prefill
    assert scored_positions == list(range(len(prompt) - 1))
    assert [(rid, p.logprobs) for rid, p in delivered] == [("second", [-float(p) for p in range(13)])]
