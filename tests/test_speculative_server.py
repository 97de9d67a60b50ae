"""Speculative decoding (`gracelm serve --speculative ngram`) end to end, through real server processes.

With `--deterministic` a verification's rows are computed as the same tokens decoded one by one are, so a
speculating server must answer what a server without speculation answers, to the character and the logprob:
greedy and seeded, streamed and not, `n=2`, with a stop string, through the official `openai` client. Its
drafts show on `/metrics` (gracelm's names and vLLM's) and on `/status.json`. A SIGTERM drains speculating
streams to their full length and leaves nothing behind; an embedding server refuses the option at start.
"""

from __future__ import annotations

import json
import signal
from collections import defaultdict

import httpx
import openai
import pytest

from gracelm.lifecycle.exit_codes import ExitCode
from tests.process_checks import wait_until
from tests.server_process import ServerProcess, Stream, metric_value
from tests.tiny_models import tiny_embedding_model, tiny_model

NAME = "tiny"
SPECULATION = ("--speculative", "ngram", "--prompt-lookup-min", "1")
ENV = {"GRACELM_API_KEY": None}  # no key: the API and /status.json are open
# Prompts that repeat themselves, so that prompt lookup finds drafts.
PROMPTS = ["the quick red cat runs into the river and the dog reads. " * 3 + "the quick red",
           "a small bird finds the old stone under the light. " * 3 + "a small bird finds"]


def _metrics(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def _status(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/status.json", timeout=30).json()


# -- the drain -----------------------------------------------------------------------------------------


STREAMS, LONG = 4, 200  # at most --speculative-max-batch (8) requests: every stream may draft


class GreedyStream(Stream):
    """`Stream` (ignore_eos, usage in the last event) of a greedy completion: on the tiny random model a
    greedy answer soon repeats itself, so its drafts are accepted (sampled at temperature 1, hardly ever)."""

    def _run(self, url: str, body: dict, headers: dict[str, str | bytes]) -> None:
        super()._run(url, {**body, "temperature": 0.0}, headers)


def test_sigterm_lets_speculating_streams_finish_and_leaves_nothing():
    hooks = {"test_step_sleep_s": 0.02}  # slow steps: the signal comes while the streams run
    server = ServerProcess(tiny_model("llama"), *SPECULATION, "--kv-cache-memory", "4MiB", "--stats-interval",
                           "0", "--max-model-len", "512", "--num-threads", "1", "--shutdown-timeout", "60",
                           env={**ENV, "GRACELM_TEST_HOOKS": json.dumps(hooks)})
    try:
        streams = [GreedyStream(server.url, LONG, prompt=PROMPTS[i % len(PROMPTS)]) for i in range(STREAMS)]
        for stream in streams:
            stream.wait_started()
        spec = _status(server)["engine"]["spec_decode"]
        assert spec is not None and spec["method"] == "ngram", spec
        wait_until(lambda: _status(server)["engine"]["spec_decode"]["num_accepted_tokens"] > 0, 30,
                   "an accepted draft")
        server.capture()
        assert all(stream.ended_at is None for stream in streams), "the streams ended before the signal"
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: f"draining: {STREAMS} requests in flight" in server.log(), 30,
                   lambda: f"a drain of {STREAMS} requests:\n{server.log()[-3000:]}")
        for stream in streams:
            stream.join()
            assert stream.error is None and stream.events[-1] == "[DONE]" and not stream.errors
            assert stream.finish_reasons == ["length"] and stream.completion_tokens == LONG
        assert server.wait_exit(60) == ExitCode.CLEAN_STOP, server.log()[-5000:]
        server.assert_nothing_left()
        assert "resource_tracker: There appear to be" not in server.log(), server.log()[-5000:]
    finally:
        if server.process.poll() is None:
            server.kill()
        server.close_log()


# -- a start that is refused ---------------------------------------------------------------------------


def test_an_embedding_server_refuses_speculation_at_start():
    server = ServerProcess(tiny_embedding_model(), "--task", "embed", "--speculative", "ngram",
                           env=ENV, wait_ready=False)
    try:
        assert server.wait_exit(60) == ExitCode.STARTUP_FAILURE, server.log()[-5000:]
        log = server.log()
        assert "speculative ngram (--speculative) applies to text generation" in log, log[-5000:]
        assert "--task embed" in log
        server.assert_nothing_left()
    finally:
        if server.process.poll() is None:
            server.kill()
        server.close_log()


# -- speculation against plain decoding ----------------------------------------------------------------
# Last in the file: the comparison's two servers (module-scoped) run until the module's end, and the tests
# above need not run beside them.

# The same start for both servers, but for speculation.
COMMON = ("--deterministic", "--served-model-name", NAME, "--max-model-len", "512", "--num-threads", "1",
          "--stats-interval", "0", "--metrics-names", "vllm")
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 7}}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def servers():
    """The speculating server and the plain one, started at once on ports of their own."""
    started: list[ServerProcess] = []
    try:
        for extra in (SPECULATION, ()):
            started.append(ServerProcess(tiny_model("llama"), *COMMON, *extra, env=ENV, wait_ready=False))
        for server in started:
            server.wait_ready(180)
    except BaseException:
        for server in started:
            server.kill()
            server.close_log()
        raise
    yield started[0], started[1]
    # Each stopped with SIGTERM: exit code 0, nothing of it left (the other one may still run). The second
    # is stopped, or killed, whatever the first one's stop found.
    failures = []
    for server in started:
        try:
            server.stop()
        except BaseException as e:  # noqa: BLE001 - raised below, once both are down
            failures.append(e)
        finally:
            if server.process.poll() is None:
                server.kill()
            server.close_log()
    if failures:
        raise failures[0]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _answer(client: openai.OpenAI, prompt: str, sampling: dict, stop: list[str] | None) -> dict:
    """A non-streamed completion of n=2: each choice's text, finish reason and token logprobs, and usage."""
    answer = client.completions.create(model=NAME, prompt=prompt, n=2, max_tokens=MAX_TOKENS, logprobs=1,
                                       stop=stop, **sampling)
    choices = sorted(answer.choices, key=lambda c: c.index)
    return {"choices": [(c.text, c.finish_reason, c.logprobs.token_logprobs) for c in choices],
            "usage": (answer.usage.prompt_tokens, answer.usage.completion_tokens)}


def _streamed(client: openai.OpenAI, prompt: str, sampling: dict, stop: list[str] | None) -> dict:
    """The same request streamed: each choice's text pieces joined, its finish reason, and the usage."""
    texts: dict[int, list[str]] = defaultdict(list)
    reasons: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model=NAME, prompt=prompt, n=2, max_tokens=MAX_TOKENS, stop=stop,
                                           stream=True, stream_options={"include_usage": True}, **sampling):
        for choice in chunk.choices:
            texts[choice.index].append(choice.text)
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return {"choices": [("".join(texts[i]), reasons.get(i)) for i in sorted(texts)], "usage": usage}


def _stops(plain: openai.OpenAI) -> dict[tuple[int, str], list[str]]:
    """For each prompt and sampling, a stop string from the middle of the plain server's first answer, so
    that it ends that answer early (where the speculating server may take several tokens in one step)."""
    stops = {}
    for index, prompt in enumerate(PROMPTS):
        for kind, sampling in SAMPLINGS.items():
            text = _answer(plain, prompt, sampling, None)["choices"][0][0]
            assert len(text) > 12, f"too short an answer to stop inside: {text!r}"
            stops[(index, kind)] = [text[len(text) // 2:][:4]]
    return stops


@pytest.fixture(scope="module")
def answers(servers):
    """Each case (prompt, sampling, with a stop string or not) on each server, non-streamed and streamed:
    {"speculating" | "plain": {case: (answer, streamed answer)}}."""
    speculating, plain = servers
    stops = _stops(_client(plain))
    found = {}
    for name, server in (("speculating", speculating), ("plain", plain)):
        client = _client(server)
        found[name] = {}
        for index, prompt in enumerate(PROMPTS):
            for kind, sampling in SAMPLINGS.items():
                for stop in (None, stops[(index, kind)]):
                    found[name][(index, kind, stop is not None)] = (_answer(client, prompt, sampling, stop),
                                                                    _streamed(client, prompt, sampling, stop))
    return found


def test_speculation_answers_as_plain_decoding_streamed_or_not(answers):
    speculating, plain = answers["speculating"], answers["plain"]
    assert speculating.keys() == plain.keys()
    for case, (whole, streamed) in speculating.items():
        assert (whole, streamed) == plain[case], case
        # The stream's pieces joined are the non-streamed answer, finish reasons and usage included.
        assert streamed["choices"] == [(text, reason) for text, reason, _ in whole["choices"]], case
        assert streamed["usage"] == whole["usage"], case
    # Each stop string, taken from the first choice's answer without it, ends that choice's answer with it.
    stopped = {case: whole["choices"][0][1] for case, (whole, _) in speculating.items() if case[2]}
    assert set(stopped.values()) == {"stop"}, stopped
    by_kind = {kind: [whole["choices"] for (_, k, _), (whole, _) in speculating.items() if k == kind]
               for kind in SAMPLINGS}
    assert all(first[0] == second[0] for first, second in by_kind["greedy"])  # greedy: both choices alike
    assert any(first[0] != second[0] for first, second in by_kind["seeded"])  # sampled: they differ


def test_drafts_show_on_metrics_under_both_names_and_on_the_status_page(servers, answers):
    speculating, plain = servers
    text = _metrics(speculating)
    counts = {name: metric_value(text, f"gracelm_spec_decode_num_{name}_total", model_name=NAME)
              for name in ("drafts", "draft_tokens", "accepted_tokens")}
    assert counts["drafts"] > 0 and counts["draft_tokens"] >= counts["drafts"]
    assert 0 < counts["accepted_tokens"] <= counts["draft_tokens"]
    per_position = [metric_value(text, "gracelm_spec_decode_num_accepted_tokens_per_pos_total",
                                 model_name=NAME, position=str(p)) for p in range(4)]
    assert per_position[0] > 0 and sum(per_position) == counts["accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)  # a position is reached past the one before
    for name, value in counts.items():  # vLLM's names: the same counts
        assert metric_value(text, f"vllm:spec_decode_num_{name}_total", model_name=NAME, engine="0") == value
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0

    spec = _status(speculating)["engine"]["spec_decode"]
    assert spec["method"] == "ngram"
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == \
        (counts["drafts"], counts["draft_tokens"], counts["accepted_tokens"])

    # The server without speculation drafted nothing, and says so.
    text = _metrics(plain)
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        assert metric_value(text, f"gracelm_spec_decode_num_{name}_total", model_name=NAME) == 0
    assert _status(plain)["engine"]["spec_decode"] is None
