"""Admission control (`gracelm/serving/admission_control.py`) of real `gracelm serve` processes: beyond
`--max-num-queued-reqs` sequences in flight, or after `--max-queue-wait` without a first token, a request is
answered 429 with `Retry-After` and OpenAI's rate-limit body on a kept connection, and counted by reason in
/metrics, while `/health` and `/ready` stay 200, every admitted request completes and the KV cache empties
afterwards; batch lines are outside it. Then the bound's arithmetic and `ServerState`'s, alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from types import SimpleNamespace

import httpx
import openai
import pytest

from gracelm.lifecycle.server_state import Lifecycle, QueueFull, ServerState
from gracelm.serving.admission_control import default_max_in_flight, max_in_flight
from tests.batch_helpers import chat_lines, jsonl, outputs, submit, wait_for
from tests.process_checks import wait_until
from tests.server_process import ServerProcess, Stream, metric_value
from tests.tiny_models import tiny_model

MODEL = "tiny"
LABEL = {"model_name": MODEL}
# Every step takes at least 10 ms, so a long stream holds its seat for at least LONG / 100 s, however fast
# the machine: long enough for what a test does meanwhile.
HOOKS = {"GRACELM_TEST_HOOKS": json.dumps({"test_step_sleep_s": 0.01})}
LONG = 400
QUEUE_WAIT_S = 1.0
COMMON = ("--served-model-name", MODEL, "--kv-cache-memory", "16MiB", "--stats-interval", "0",
          "--disable-log-requests")
SHORT = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def bounded() -> Iterator[ServerProcess]:
    """Two seats and at most four sequences in flight: two running, two waiting."""
    with ServerProcess(tiny_model("llama"), *COMMON, "--max-num-seqs", "2", "--max-num-queued-reqs", "4",
                       env=HOOKS) as server:
        yield server


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One seat, the default bound, and a short queue wait; a state directory for batches."""
    state_dir = tmp_path_factory.mktemp("admission") / "state"
    with ServerProcess(tiny_model("llama"), *COMMON, "--max-num-seqs", "1", "--max-queue-wait",
                       str(QUEUE_WAIT_S), "--state-dir", str(state_dir), env=HOOKS) as server:
        yield server


def _metric(server: ServerProcess, name: str, **labels: str) -> float:
    return metric_value(httpx.get(f"{server.url}/metrics", timeout=30).text, name, **LABEL, **labels)


def _rejections(server: ServerProcess) -> dict[str, float]:
    return {reason: _metric(server, "gracelm_request_rejections_total", reason=reason)
            for reason in ("queue_full", "queue_wait")}


def _assert_rate_limited(response: httpx.Response) -> dict:
    """A 429 as OpenAI answers a rate limit, telling when to retry, on a connection the server keeps."""
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    assert response.headers.get("connection", "").lower() != "close"
    error = response.json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded" and error["message"], error
    return error


def _assert_idle(server: ServerProcess) -> None:
    """Nothing in the engine any more, and every KV block free (the admitted ones ended, the aborted ones
    released theirs)."""
    wait_until(lambda: _metric(server, "gracelm_num_requests_running") == 0
               and _metric(server, "gracelm_num_requests_waiting") == 0, 60, "the engine never emptied")
    wait_until(lambda: _metric(server, "gracelm_kv_cache_usage_perc") == 0, 60, "KV blocks still in use")


class _Probes:
    """`/health` and `/ready`, asked over and over in a thread until the block ends: every answer's status."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.statuses: list[int] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=30) as client:
            while not self._stop.wait(0.02):
                self.statuses += [client.get("/health").status_code, client.get("/ready").status_code]

    def __enter__(self) -> _Probes:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(30)


def test_a_flood_beyond_the_bound_gets_429s_and_the_admitted_complete(bounded):
    before = _rejections(bounded)
    admitted_before = {api: _metric(bounded, "gracelm_api_requests_total", api=api)
                       for api in ("completions", "chat_completions")}
    client = openai.OpenAI(base_url=f"{bounded.url}/v1", api_key="none", max_retries=0, timeout=120)
    with _Probes(bounded.url) as probes, ThreadPoolExecutor(12) as pool:
        longs = [Stream(bounded.url, LONG) for _ in range(2)]
        for stream in longs:
            stream.wait_started()  # both seats taken: two sequences in flight, for seconds
        # Twelve at once: two more fit the bound of four (they wait for a seat), the other ten are refused.
        flood = [pool.submit(httpx.post, f"{bounded.url}/v1/completions", json=SHORT, timeout=120)
                 for _ in range(12)]
        refused = []
        for done in as_completed(flood):
            if done.result().status_code != 200:
                refused.append(done.result())
            if len(refused) == 10:
                break
        for response in refused:
            assert "--max-num-queued-reqs" in _assert_rate_limited(response)["message"]
        # The bound is still full (the long streams hold their seats): the official client sees the 429 as
        # a RateLimitError, with the header that says when to retry; a stream is refused before it starts.
        for streamed in (False, True):
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=streamed)
            assert info.value.response.headers["retry-after"] == "1"
            assert info.value.code == "rate_limit_exceeded"
        admitted = [f.result() for f in flood if f.result().status_code == 200]
        for stream in longs:
            stream.join()
    assert len(admitted) == 2
    for response in admitted:
        answer = response.json()
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 4
    assert all(s.finish_reasons == ["length"] and s.completion_tokens == LONG and not s.errors for s in longs)
    assert probes.statuses and set(probes.statuses) == {200}, probes.statuses
    after = _rejections(bounded)
    assert after == {"queue_full": before["queue_full"] + 12, "queue_wait": before["queue_wait"]}
    # Only the admitted count by API: the two long streams and the two of the flood that fit.
    admitted_after = {api: _metric(bounded, "gracelm_api_requests_total", api=api) for api in admitted_before}
    assert admitted_after == {"completions": admitted_before["completions"] + 4,
                              "chat_completions": admitted_before["chat_completions"]}
    _assert_idle(bounded)


def test_the_default_bound_comes_from_the_kv_cache(timed):
    # With one seat the core keeps blocks for one request of the full context: twice that is two.
    status = httpx.get(f"{timed.url}/status.json", timeout=30).json()
    assert status["requests"]["max_in_flight"] == 2


@contextlib.contextmanager
def _holding_the_seat(server: ServerProcess) -> Iterator[None]:
    """A long stream that has its first token: the one seat is taken until the block ends, which closes the
    connection and so aborts the stream's request."""
    body = {**SHORT, "max_tokens": LONG, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as running:
        lines = running.iter_lines()  # kept referenced: a collected iterator would close the connection
        assert any(line.startswith("data: ") for line in lines)
        yield


def test_a_request_waiting_past_the_queue_wait_is_aborted_and_gets_429(timed):
    before = _rejections(timed)
    with _Probes(timed.url) as probes, _holding_the_seat(timed):
        waited: dict[str, httpx.Response | float] = {}

        def plain() -> None:
            start = time.monotonic()
            waited["response"] = httpx.post(f"{timed.url}/v1/completions", json=SHORT, timeout=120)
            waited["seconds"] = time.monotonic() - start

        waiter = threading.Thread(target=plain)
        waiter.start()
        wait_until(lambda: _metric(timed, "gracelm_num_requests_waiting") == 1, 60, "the request not queued")
        # Two in flight, the default bound: a third is refused at once.
        _assert_rate_limited(httpx.post(f"{timed.url}/v1/completions", json=SHORT, timeout=120))
        waiter.join(60)
        error = _assert_rate_limited(waited["response"])
        assert "--max-queue-wait" in error["message"]
        assert waited["seconds"] >= QUEUE_WAIT_S
        # Aborted in the engine: no longer waiting there, while the long stream runs on.
        wait_until(lambda: _metric(timed, "gracelm_num_requests_waiting") == 0, 60, "still queued")
        assert _metric(timed, "gracelm_num_requests_running") == 1
        # A stream's 200 and first chunk went out at its start: the 429's body comes as an error event.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "stream": True}
        with httpx.stream("POST", f"{timed.url}/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        payloads = [json.loads(e) for e in events[:-1]]
        assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
        assert payloads[-1]["error"]["code"] == "rate_limit_exceeded", payloads
        assert not any(c.get("delta", {}).get("content") for p in payloads[:-1] for c in p["choices"])
    assert set(probes.statuses) == {200}, probes.statuses
    assert _rejections(timed) == {"queue_full": before["queue_full"] + 1,
                                  "queue_wait": before["queue_wait"] + 2}
    _assert_idle(timed)


def test_batch_lines_are_neither_counted_nor_timed(timed):
    api = openai.OpenAI(base_url=f"{timed.url}/v1", api_key="none", max_retries=0, timeout=60)
    before = _rejections(timed)
    with _holding_the_seat(timed):
        batch = submit(api, jsonl(chat_lines(2)))
        wait_until(lambda: _metric(timed, "gracelm_num_requests_waiting_background") == 1, 60,
                   "no batch line queued")
        line_queued = time.monotonic()
        # The line waits in the engine without a place in the bound: a client's request still gets the
        # second place, then waits its --max-queue-wait behind the long stream like any other, and is
        # refused for that.
        _assert_rate_limited(httpx.post(f"{timed.url}/v1/completions", json=SHORT, timeout=120))
        assert _rejections(timed) == {"queue_full": before["queue_full"],
                                      "queue_wait": before["queue_wait"] + 1}
        # The line has waited longer than the queue wait, and waits on.
        assert time.monotonic() - line_queued > QUEUE_WAIT_S
        assert _metric(timed, "gracelm_num_requests_waiting_background") == 1
    done = wait_for(api, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2, done
    assert all(line["response"]["status_code"] == 200 for line in outputs(api, done).values())
    _assert_idle(timed)


def test_the_default_bound_is_twice_the_full_contexts_the_kv_cache_holds_and_at_least_the_seats():
    blocks_per_request = 512 // 16
    assert default_max_in_flight(64 * blocks_per_request, 16, 512, 64) == 128  # room for every seat
    assert default_max_in_flight(20 * blocks_per_request, 16, 512, 64) == 64  # long requests are few
    assert default_max_in_flight(40 * blocks_per_request + 31, 16, 512, 64) == 80
    assert default_max_in_flight(blocks_per_request, 16, 500, 1) == 2  # a partial last block counts whole
    engine = SimpleNamespace(num_kv_blocks=4 * blocks_per_request,
                             config=SimpleNamespace(block_size=16, max_model_len=512, max_num_seqs=2))
    assert max_in_flight(None, engine) == 8  # type: ignore[arg-type]
    assert max_in_flight(3, engine) == 3  # type: ignore[arg-type]
    assert max_in_flight(0, engine) is None  # type: ignore[arg-type]


def test_the_bound_counts_sequences_and_leaves_background_work_out():
    async def scenario() -> None:
        state = ServerState(max_in_flight=4, max_queue_wait=30)
        state.set(Lifecycle.RUNNING)
        three = state.admit(slots=3)  # a request of n = 3
        one = state.admit()
        with pytest.raises(QueueFull):
            state.admit()
        line = state.admit(background=True)  # a batch line: admitted while the bound is full, not counted
        assert (state.num_in_flight, state.num_active) == (4, 3)
        assert line.queue_wait_left() is None and 29 < one.queue_wait_left() <= 30
        for admission in (three, one, line):
            admission.release()
            admission.release()  # a second release changes nothing
        assert (state.num_in_flight, state.num_active) == (0, 0)
        alone = state.admit(slots=9)  # larger than the bound: served alone rather than refused for ever
        with pytest.raises(QueueFull):
            state.admit()
        alone.release()
        unbounded = ServerState()
        unbounded.set(Lifecycle.RUNNING)
        assert unbounded.admit(slots=1000).queue_wait_left() is None

    asyncio.run(scenario())


def test_the_option_takes_zero_for_no_bound_and_refuses_negatives():
    from gracelm.serving.server_config import ServerConfig

    assert ServerConfig(max_num_queued_reqs=0).max_num_queued_reqs == 0
    with pytest.raises(ValueError, match="max_num_queued_reqs"):
        ServerConfig(max_num_queued_reqs=-1)
    with pytest.raises(ValueError, match="max_queue_wait"):
        ServerConfig(max_queue_wait=0)

