"""Containment: a fault of one request — its sampling in the engine core, its output processing in the
frontend — ends that request with an error, and the engine serves everyone else on. The sampling fault is
injected by the test hook `test_raise_in_sampling_for_seed`: rows of requests with that seed raise."""

from __future__ import annotations

import json
import time

import httpx
import openai
import psutil
import pytest

from gracelm import Engine, SamplingParams
from gracelm.engine import messages as msg
from gracelm.engine.output_processor import OutputProcessor
from gracelm.model.tokenizer import Tokenizer
from tests.process_checks import leftover_children, own_runtime_dirs
from tests.server_process import ServerProcess, Stream, metric_value
from tests.tiny_models import tiny_model

FAULTY_SEED = 4242
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def server(model):
    hooks = {"test_raise_in_sampling_for_seed": FAULTY_SEED, "test_step_sleep_s": 0.01}
    with ServerProcess(model, "--kv-cache-memory", "4MiB", "--stats-interval", "0", "--max-model-len", "512",
                       "--num-threads", "1", "--served-model-name", "tiny",
                       env={"GRACELM_TEST_HOOKS": json.dumps(hooks)}) as server:
        yield server


def _metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def _wait_idle(server, timeout: float = 30) -> str:
    """The metrics once nothing runs and the KV cache is empty again."""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(server)
        idle = (metric_value(text, "gracelm_kv_cache_usage_perc") == 0
                and metric_value(text, "gracelm_num_requests_running") == 0)
        if idle or time.monotonic() > deadline:
            assert idle, text
            return text
        time.sleep(0.1)


def _sse(server, route: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{server.url}/v1/{route}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_faulty_request_fails_alone_while_a_stream_completes(server):
    before = metric_value(_metrics(server), "gracelm_request_faults_total", stage="sampling")
    normal = Stream(server.url, max_tokens=120)
    normal.wait_started()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as chat_error:
        client.chat.completions.create(model="tiny", messages=USER, seed=FAULTY_SEED, max_tokens=8)
    assert chat_error.value.status_code == 500
    assert chat_error.value.body["code"] == "request_failed"
    assert "chatcmpl-" in chat_error.value.body["message"]  # the request's id, to find it in the log
    with pytest.raises(openai.InternalServerError) as completion_error:
        client.completions.create(model="tiny", prompt="the cat", seed=FAULTY_SEED, max_tokens=8)
    assert "cmpl-" in completion_error.value.body["message"]
    chunks = []
    with pytest.raises(openai.APIError) as stream_error:
        for chunk in client.chat.completions.create(model="tiny", messages=USER, seed=FAULTY_SEED,
                                                    max_tokens=8, stream=True):
            chunks.append(chunk)
    assert "request_failed" in str(stream_error.value.body)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["error"]

    normal.join()
    assert normal.error is None and not normal.errors
    assert normal.finish_reasons == ["length"] and normal.completion_tokens == 120
    assert normal.events[-1] == "[DONE]"
    text = _wait_idle(server)
    assert metric_value(text, "gracelm_request_faults_total", stage="sampling") == before + 3
    assert metric_value(text, "gracelm_request_success_total", finished_reason="error") >= 3
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("route,body", [("completions", {"prompt": "the cat"}),
                                        ("chat/completions", {"messages": USER})])
def test_a_fault_in_one_choice_ends_its_request_with_an_error_event_then_done(server, route, body):
    # Choice i is seeded seed + i: only choice 0 of three meets the fault, and the request ends whole.
    events = _sse(server, route, {**body, "n": 3, "seed": FAULTY_SEED, "max_tokens": 50, "ignore_eos": True})
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[-1]["error"]["code"] == "request_failed"
    reasons = {c["index"]: c["finish_reason"] for p in payloads for c in p.get("choices", [])
               if c.get("finish_reason")}
    assert reasons == {0: "error", 1: "error", 2: "error"}
    _wait_idle(server)
    served = httpx.post(f"{server.url}/v1/{route}", json={**body, "n": 3, "seed": FAULTY_SEED + 1,
                                                          "max_tokens": 5}, timeout=60)
    assert served.status_code == 200, served.text
    assert [c["finish_reason"] for c in served.json()["choices"]] == ["length"] * 3


@pytest.mark.parametrize("options", [{}, {"speculative": "ngram", "prompt_lookup_min": 1}],
                         ids=["plain", "speculating"])
def test_the_offline_engine_ends_the_faulty_request_alone(model, monkeypatch, options):
    monkeypatch.setenv("GRACELM_TEST_HOOKS", json.dumps({"test_raise_in_sampling_for_seed": FAULTY_SEED}))
    innocent = [SamplingParams(max_tokens=10, seed=7, ignore_eos=True),
                SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    others = {p.pid for p in psutil.Process().children(recursive=True)}  # this module's server
    # Prompts that repeat themselves: speculating, the innocent rows draft beside the faulty one.
    dog, bird = "a dog and a dog and a dog and a", "a bird, a bird, a bird, a"
    with Engine(model, kv_cache_memory="4MiB", max_model_len=256, num_threads=1, **options) as llm:
        faulty = SamplingParams(max_tokens=10, seed=FAULTY_SEED)
        together = llm.generate([dog, "the cat", bird], [innocent[0], faulty, innocent[1]], use_tqdm=False)
        assert together[1].finished and together[1].outputs[0].finish_reason == "error"
        assert together[1].outputs[0].token_ids == []
        alone = llm.generate([dog, bird], innocent, use_tqdm=False)
        # The step that met the fault sampled the other rows again, from their own logits and generator
        # states: they got the very tokens they get without it.
        assert [o.outputs[0].token_ids for o in (together[0], together[2])] == \
            [o.outputs[0].token_ids for o in alone]
        assert all(o.outputs[0].finish_reason == "length" for o in alone)
        assert llm.request_faults == {"sampling": 1}
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert (stats["spec_decode"]["num_draft_tokens"] > 0) == bool(options)
    assert [p for p in leftover_children() if p.pid not in others] == []
    assert own_runtime_dirs() == []


class _Poisoned(Tokenizer):
    """The tiny model's real tokenizer, whose decoding raises on one token id: a detokenization fault."""

    poison = 77

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.poison in ids:
            raise UnicodeError("decoding fault injected by the test")
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_detokenization_fault_ends_its_request_only(model):
    tokenizer = _Poisoned.from_dir(model)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=5)
    adds = processor.add_request("bad", None, [5, 6], params) + processor.add_request("good", None, [5, 6],
                                                                                      SamplingParams())
    assert [a.request_id for a in adds] == ["bad/0", "bad/1", "good/0"]
    processed = processor.process([msg.TokenOutput("bad/0", 10), msg.TokenOutput("bad/1", _Poisoned.poison),
                                   msg.TokenOutput("good/0", 11)])
    by_id = {d.request_id: d for d in processed.deltas}
    assert [o.finish_reason for o in by_id["bad"].outputs] == ["error", "error"] and by_id["bad"].finished
    assert by_id["good"].outputs[0].finish_reason is None and not by_id["good"].finished
    assert sorted(processed.core_ids_to_abort) == ["bad/0", "bad/1"]  # nothing of it left in the core
    assert processor.faults == {"detokenize": 1}
    later = processor.process([msg.TokenOutput("bad/0", 12), msg.TokenOutput("good/0", 2, "stop")])
    assert [d.request_id for d in later.deltas] == ["good"] and later.deltas[0].finished
    assert not processor.has_unfinished()


def test_a_fault_the_core_reports_ends_every_choice_of_its_request(model):
    processor = OutputProcessor(Tokenizer.from_dir(model))
    processor.add_request("r", None, [5, 6], SamplingParams(n=2, max_tokens=5))
    processed = processor.process([msg.TokenOutput("r/1", None, "error", fault="sampling")])
    assert [o.finish_reason for o in processed.deltas[0].outputs] == ["error", "error"]
    assert processed.core_ids_to_abort == ["r/0", "r/1"]  # r/1 is over in the core already: a no-op there
    assert processor.faults == {"sampling": 1} and not processor.has_unfinished()
