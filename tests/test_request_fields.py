"""Every request field is honoured or refused: a walk over the fields of the chat and completions request
models (each is shown to have its effect by a test named here, or is refused with a 400 naming it), unknown
fields refused as OpenAI refuses them, and the effect of each field this server added, through the official
`openai` client against a real server of a tiny random model."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from gracelm.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from gracelm.serving.request_fields import UNSUPPORTED
from tests.server_process import ServerProcess
from tests.tiny_models import tiny_model

MODEL = "tiny-fields"
PROMPT = "the quick red cat runs over the old stone"
MESSAGES = [{"role": "user", "content": "tell me about the river"}]
LONG = {"ignore_eos": True}
DOCS = Path(__file__).parent.parent / "docs" / "api_fields.md"

# Field -> the test that shows its effect ("module::function"; this module when no module is named).
HONOURED = {
    "messages": "tests.test_api_server::test_chat_completion_counts_usage",
    "prompt": "tests.test_api_server::test_completion_accepts_token_ids",
    "model": "tests.test_api_errors::test_unknown_model",
    "n": "tests.test_api_server::test_n_choices_plain_and_streamed",
    "stop": "tests.test_api_server::test_stop_string_truncates",
    "seed": "tests.test_api_server::test_seed_reproducibility",
    "stream": "tests.test_api_server::test_chat_stream_matches_plain_answer",
    "stream_options": "test_continuous_usage_stats_and_usage_chunk",
    "logprobs": "tests.test_api_server::test_chat_logprobs",
    "top_logprobs": "tests.test_api_server::test_chat_logprobs",
    "max_tokens": "tests.test_api_server::test_chat_completion_counts_usage",
    "max_completion_tokens": "test_max_completion_tokens_bounds_the_answer",
    "temperature": "test_sampling_filters_and_penalties_have_their_effect",
    "top_p": "test_sampling_filters_and_penalties_have_their_effect",
    "top_k": "test_sampling_filters_and_penalties_have_their_effect",
    "min_p": "test_sampling_filters_and_penalties_have_their_effect",
    "presence_penalty": "test_sampling_filters_and_penalties_have_their_effect",
    "frequency_penalty": "test_sampling_filters_and_penalties_have_their_effect",
    "repetition_penalty": "test_sampling_filters_and_penalties_have_their_effect",
    "ignore_eos": "test_min_tokens_holds_off_stop_tokens",
    "stop_token_ids": "test_min_tokens_holds_off_stop_tokens",
    "min_tokens": "test_min_tokens_holds_off_stop_tokens",
    "include_stop_str_in_output": "test_include_stop_str_in_output_and_stop_reason",
    "skip_special_tokens": "test_special_tokens_skipped_or_spaced",
    "spaces_between_special_tokens": "test_special_tokens_skipped_or_spaced",
    "truncate_prompt_tokens": "test_truncate_prompt_tokens_keeps_the_end",
    "add_special_tokens": "test_add_special_tokens",
    "echo": "test_echo_on_both_endpoints",
    "prompt_logprobs": "tests.test_prompt_logprobs::test_prompt_logprobs_of_a_batch_match_transformers",
    "return_tokens_as_token_ids": "tests.test_prompt_logprobs::test_return_tokens_as_token_ids",
    "add_generation_prompt": "test_chat_template_options",
    "continue_final_message": "test_chat_template_options",
    "chat_template": "test_chat_template_options",
    "chat_template_kwargs": "test_chat_template_options",
    "documents": "test_chat_template_options",
    "reasoning_effort": "test_chat_template_options",
    "request_id": "tests.test_tokenize::test_request_id_header_and_body_field",
    "priority": "tests.test_priority::test_an_interactive_request_overtakes_background_ones",
    "best_of": "test_best_of_equal_to_n_is_served_and_more_refused",
    "user": "test_no_op_values_are_accepted",
    "safety_identifier": "test_no_op_values_are_accepted",
    "prompt_cache_key": "test_no_op_values_are_accepted",
    "metadata": "test_no_op_values_are_accepted",
    "parallel_tool_calls": "test_no_op_values_are_accepted",
    "no_stop_trim": "test_include_stop_str_in_output_and_stop_reason",
    "rid": "test_the_routers_bodies_are_served_as_they_come",
    "separate_reasoning": "tests.test_reasoning::test_the_request_switches",
    "stream_reasoning": "tests.test_reasoning::test_the_request_switches",
    "include_reasoning": "tests.test_reasoning::test_the_request_switches",
}
# Fields whose implementation belongs to the structured-outputs and tool-calling work: refused (in
# UNSUPPORTED) until then, and shown honoured by those tests after.
THEIR_TESTS = [Path(__file__).parent / name for name in ("test_structured_outputs.py", "test_tool_calls.py")]
THEIRS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "logit_bias",
          "allowed_token_ids", "bad_words", "tools", "tool_choice", "parallel_tool_calls", "json_schema",
          "regex", "ebnf"}
# A value of each refused field that asks for what the server does not do.
REFUSED_VALUES = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "store": True, "service_tier": "flex",
    "verbosity": "low", "web_search_options": {"search_context_size": "low"},
    "moderation": {"model": "m"}, "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "x"},
    "functions": [{"name": "f"}], "function_call": "auto", "suffix": "end", "use_beam_search": True,
    "length_penalty": 0.5, "mm_processor_kwargs": {"a": 1}, "logits_processors": ["x"],
    "return_token_ids": True, "cache_salt": "salt", "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "prompt_embeds": "AAAA", "response_format": {"type": "json_object"},
    "structured_outputs": {"json": {}}, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a"], "guided_grammar": "root ::= \"a\"", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "logit_bias": {"1": 100}, "allowed_token_ids": [1],
    "bad_words": ["cat"], "media_io_kwargs": {"video": {}}, "stop_regex": "a+", "return_hidden_states": True,
    "return_routed_experts": True, "return_cached_tokens_details": True, "return_prompt_token_ids": True,
    "return_meta_info": True, "lora_path": "adapter", "session_id": "s", "session_params": {"id": "s"},
    "custom_logit_processor": "x", "custom_params": {"a": 1}, "images_config": {"a": 1},
    "max_dynamic_patch": 4, "min_dynamic_patch": 1, "use_audio_in_video": True, "input_ids": [1, 2],
    "task": "title", "extra_key": "k", "ngram_corpus_id": "c", "custom_labels": {"team": "a"},
    "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7, "disagg_prefill_dp_rank": 1,
    "routed_dp_rank": 1, "data_parallel_rank": 1,
}
# The bodies the field's routers forward, as they rebuild them (observed: vllm-router 0.1.17, sglang-router
# 0.3.2), beyond what the client sent.
ROUTER_CHAT_FIELDS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                      "continue_final_message": False, "skip_special_tokens": True,
                      "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
                      "include_reasoning": True}
ROUTER_COMPLETION_FIELDS = {"echo": False, "no_stop_trim": False, "ignore_eos": False,
                            "skip_special_tokens": True, "return_hidden_states": False}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(tiny_model("llama"), "--served-model-name", MODEL, "--kv-cache-memory", "16MiB",
                       "--trust-request-chat-template") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _fields(model) -> set[str]:
    return set(model.model_fields)


def _test_exists(reference: str) -> bool:
    module_name, _, name = reference.rpartition("::")
    module = importlib.import_module(module_name) if module_name else sys.modules[__name__]
    return callable(getattr(module, name, None))


def test_every_field_is_honoured_or_refused():
    fields = _fields(ChatCompletionRequest) | _fields(CompletionRequest)
    theirs = "".join(p.read_text() for p in THEIR_TESTS if p.exists())
    shown_by_them = {f for f in THEIRS - UNSUPPORTED.keys() if re.search(rf"\b{f}\b", theirs)}
    unaccounted = fields - HONOURED.keys() - UNSUPPORTED.keys() - shown_by_them
    assert not unaccounted, f"fields neither shown honoured nor refused: {sorted(unaccounted)}"
    assert not HONOURED.keys() & UNSUPPORTED.keys() - {"parallel_tool_calls"}
    missing = [ref for ref in HONOURED.values() if not _test_exists(ref)]
    assert not missing, f"tests named for honoured fields that do not exist: {missing}"
    assert THEIRS <= fields
    table = DOCS.read_text()
    undocumented = [f for f in fields if not re.search(rf"^\| `{f}` \|", table, re.MULTILINE)]
    assert not undocumented, f"fields missing from docs/api_fields.md: {undocumented}"


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_each_refused_field_is_a_400_naming_it(server, field):
    route = "completions" if field in _fields(CompletionRequest) else "chat/completions"
    body = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    body |= {"max_tokens": 2, field: REFUSED_VALUES[field]}
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"] and "not supported" in error["message"]


def test_unknown_fields_are_refused_as_openai_does(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       extra_body={"temprature": 0.5})
    assert e.value.body["message"] == "Unrecognized request argument supplied: temprature"
    assert e.value.body["param"] == "temprature"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "foo": 1, "bar": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "Unrecognized request arguments supplied: foo, bar"
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, timeout=60)
    assert r.status_code == 400 and "messages.0.colour" in r.json()["error"]["message"]


def test_no_op_values_are_accepted(client):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    same = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, modalities=["text"], store=False,
        service_tier="auto", metadata={"k": "v"}, user="u1", safety_identifier="s1", prompt_cache_key="p1",
        parallel_tool_calls=True, response_format={"type": "text"}, tool_choice="none")
    assert same.choices[0].message.content == plain.choices[0].message.content
    assert same.service_tier == "default" and plain.service_tier is None


def _greedy(client, prompt, max_tokens=12, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={**LONG, **extra})


def test_max_completion_tokens_bounds_the_answer(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3, temperature=0,
                                       extra_body=LONG)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_sampling_filters_and_penalties_have_their_effect(client):
    greedy = _greedy(client, PROMPT, 24).choices[0].text
    hot = dict(temperature=2.0, seed=7)
    for narrowing in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                      extra_body={**LONG, **narrowing}, **hot)
        assert r.choices[0].text == greedy, narrowing
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, extra_body=LONG, **hot)
    assert free.choices[0].text != greedy  # temperature 2 without a filter wanders off the greedy path
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body=LONG, **penalty)
        assert r.choices[0].text != greedy, penalty
    assert _greedy(client, PROMPT, 24, repetition_penalty=2.0).choices[0].text != greedy


def _token_ids(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
    return r.json()["tokens"]


def test_min_tokens_holds_off_stop_tokens(client, server):
    # The greedy answer's first token, as a stop token: it ends the answer at once...
    ids = _token_ids(server, PROMPT)
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=0)
    token = _token_ids(server, first.choices[0].logprobs.tokens[0])
    assert len(token) == 1
    stopped = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": token, **LONG})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].stop_reason == token[0]
    # ...unless min_tokens holds it off: then the answer has at least that many tokens, none of them it.
    held = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=0,
                                     extra_body={"stop_token_ids": token, "min_tokens": 4, **LONG})
    assert held.usage.completion_tokens >= 4
    assert first.choices[0].logprobs.tokens[0] not in held.choices[0].logprobs.tokens[:4]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body={"min_tokens": 3})
    assert e.value.body["param"] == "min_tokens"


def test_include_stop_str_in_output_and_stop_reason(client):
    text = _greedy(client, PROMPT, 16).choices[0].text
    stop = text[4:7]
    cut = text.index(stop)
    for stream in (False, True):
        for include, field in ((False, "include_stop_str_in_output"), (True, "include_stop_str_in_output"),
                               (True, "no_stop_trim")):  # SGLang's name for it
            body = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                        extra_body={**LONG, field: include})
            if stream:
                chunks = list(client.completions.create(stream=True, **body))
                got = "".join(c.choices[0].text for c in chunks if c.choices)
                reason = [c.choices[0].stop_reason for c in chunks if c.choices][-1]
            else:
                choice = client.completions.create(**body).choices[0]
                got, reason = choice.text, choice.stop_reason
            assert got == text[:cut + (len(stop) if include else 0)], (stream, include)
            assert reason == stop


def test_the_routers_bodies_are_served_as_they_come(client, server):
    """What vllm-router and sglang-router add is accepted and changes nothing; SGLang's `rid` names the
    request; the one data-parallel rank may be asked for; without a reasoning parser, the reasoning switches
    have nothing to switch (with one: `tests/test_reasoning.py`)."""
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    for reasoning in (True, False):
        routed = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
            extra_body={**ROUTER_CHAT_FIELDS, "separate_reasoning": reasoning, "stream_reasoning": reasoning,
                        "include_reasoning": reasoning, "routed_dp_rank": 0, "data_parallel_rank": 0})
        assert routed.choices[0].message.content == plain.choices[0].message.content
        assert getattr(routed.choices[0].message, "reasoning_content", None) is None
    text = _greedy(client, PROMPT, 6).choices[0].text
    routed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                       extra_body={**LONG, **ROUTER_COMPLETION_FIELDS, "rid": "from-sglang"})
    assert routed.choices[0].text == text and routed.id == "cmpl-from-sglang"
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 2, "rid": "a", "request_id": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text


def _with_a_special_token(client) -> tuple[int, str]:
    """A seed whose hot sample (ignoring EOS) has a special token among its tokens, and those tokens."""
    for seed in range(0, 400, 8):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=2.0, seed=seed,
                                      n=8, logprobs=0, extra_body={**LONG, "skip_special_tokens": False,
                                                                  "spaces_between_special_tokens": False})
        for choice in r.choices:
            if any(t.startswith("<|") and t.endswith("|>") for t in choice.logprobs.tokens):
                return seed + choice.index, choice.text
    pytest.fail("no sample with a special token")


def test_special_tokens_skipped_or_spaced(client):
    seed, kept = _with_a_special_token(client)

    def text(**extra):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=2.0,
                                         seed=seed, extra_body={**LONG, **extra}).choices[0].text

    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == kept
    assert re.search(r"<\|\w+\|>", kept)
    skipped = text()
    assert not re.search(r"<\|\w+\|>", skipped)
    assert re.sub(r"<\|\w+\|>", "", kept) == skipped
    spaced = text(skip_special_tokens=False)
    assert spaced != kept and spaced.replace(" ", "") == kept.replace(" ", "")


def test_truncate_prompt_tokens_keeps_the_end(client, server):
    ids = _token_ids(server, PROMPT)
    r = _greedy(client, ids, 8, truncate_prompt_tokens=3)
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].text == _greedy(client, ids[-3:], 8).choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_add_special_tokens(server):
    plain = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, timeout=60).json()
    bare = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False},
                      timeout=60).json()
    assert plain["tokens"][-bare["count"]:] == bare["tokens"]
    messages = {"messages": MESSAGES}
    chat = httpx.post(f"{server.url}/tokenize", json=messages, timeout=60).json()
    with_bos = httpx.post(f"{server.url}/tokenize", json={**messages, "add_special_tokens": True},
                          timeout=60).json()
    assert with_bos["tokens"][-chat["count"]:] == chat["tokens"]


def test_echo_on_both_endpoints(client):
    r = _greedy(client, PROMPT, 6, echo=True)
    plain = _greedy(client, PROMPT, 6).choices[0].text
    assert r.choices[0].text == PROMPT + plain
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                         echo=True, extra_body=LONG)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT + plain
    # With logprobs, the prompt's tokens lead them, the first unscored (tests/test_prompt_logprobs.py checks
    # their values against transformers).
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1,
                                       extra_body=LONG).choices[0].logprobs
    assert scored.token_logprobs[0] is None and len(scored.tokens) == r.usage.prompt_tokens + 2
    messages = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    body = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True, **LONG}
    echoed = client.chat.completions.create(**body, extra_body=extra).choices[0].message.content
    plain = client.chat.completions.create(**body, extra_body={**extra, "echo": False})
    plain = plain.choices[0].message.content
    assert echoed == "Once upon" + plain
    chunks = client.chat.completions.create(**body, stream=True, extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    # With a generation prompt, the final message is the user's, not the answer's beginning: nothing echoed.
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    echoed = client.chat.completions.create(**body, extra_body={"echo": True, **LONG}).choices[0].message
    plain = client.chat.completions.create(**body, extra_body=LONG).choices[0].message
    assert echoed.content == plain.content


def _tokenize(server, **body) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_template_options(client, server):
    with_prompt = _tokenize(server, messages=MESSAGES)
    without = _tokenize(server, messages=MESSAGES, add_generation_prompt=False)
    assert with_prompt[:len(without)] == without
    assert with_prompt[len(without):] == _token_ids(server, "<|im_start|>assistant\n")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(without)
    # The final message continued: its turn is left open.
    messages = [*MESSAGES, {"role": "assistant", "content": "It flows"}]
    continued = _tokenize(server, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert continued == _tokenize(server, messages=MESSAGES, add_generation_prompt=True) + \
        _token_ids(server, "It flows")
    with pytest.raises(openai.BadRequestError):  # both at once
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    # A request's own template, and the variables it reads.
    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ documents | length }}"
    extra = {"chat_template": template, "chat_template_kwargs": {"greeting": "hello there "},
             "documents": [{"title": "a", "text": "b"}]}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=extra)
    assert r.usage.prompt_tokens == len(_token_ids(server, "hello there [tell me about the river]1"))
    for unread in ({"chat_template_kwargs": {"colour": "red"}}, {"documents": [{"text": "x"}]},
                   {"reasoning_effort": "low"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=unread)
        assert "does not read" in e.value.body["message"]
    effort = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ reasoning_effort }}"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, reasoning_effort="low",
                                       extra_body={"chat_template": effort})
    assert r.usage.prompt_tokens == len(_token_ids(server, "tell me about the riverlow"))


@pytest.mark.parametrize(("template", "why"), [
    ("{% for a in range(800) %}{% for b in range(800) %}{% for c in range(800) %}{% endfor %}{% endfor %}"
     "{% endfor %}", "took more than 1 s to render"),  # 104 bytes once held the event loop for 20 s
    ('{{ "ab " * 6000000 }}', "repeats 3 items 6000000 times"),  # once 2 GB
    ("{% for i in range(10**8) %}{% endfor %}", "a range of 100000000 numbers"),  # once a 500
    ("{% set x = 7 ** 100000 %}", "raises to the power 100000"),
    ('{% for i in range(9000) %}{{ "x" * 200 }}{% endfor %}', "rendered 1800000 characters"),
])
def test_a_requests_template_beyond_its_budget_is_a_400_and_the_server_answers_meanwhile(server, client,
                                                                                          template, why):
    answered: list[float] = []

    def probe() -> None:
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        answered.append(time.monotonic() - started)

    prober = threading.Thread(target=lambda: [probe() or time.sleep(0.1) for _ in range(5)])
    prober.start()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       extra_body={"chat_template": template})
    prober.join(30)
    assert e.value.body["param"] == "chat_template" and e.value.body["code"] == "template_budget_exceeded"
    assert why in e.value.body["message"]
    assert max(answered) < 1.0  # the render is off the event loop
    assert psutil.Process(server.pid).memory_info().rss < 1 << 30


def test_best_of_equal_to_n_is_served_and_more_refused(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, best_of=2)
    assert len(r.choices) == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=1, best_of=3)
    assert e.value.body["param"] == "best_of"


def test_continuous_usage_stats_and_usage_chunk(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True, extra_body=LONG,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    # A lagging reader may get two tokens in one delta: the counts grow with every chunk and end at 4.
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts[0] >= 1 and counts[-1] == 4 and counts == sorted(set(counts)), counts
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices
    quiet = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True,
                                           extra_body=LONG))
    assert all(c.usage is None for c in quiet)


@pytest.mark.parametrize("stream", [False, True])
def test_batched_prompts_in_one_request(client, server, stream):
    prompts = [PROMPT, "a small blue bird", "the old river"]
    singles = [_greedy(client, p, 6).choices[0].text for p in prompts]
    for batch in (prompts, [_token_ids(server, p) for p in prompts]):
        body = dict(model=MODEL, prompt=batch, max_tokens=6, temperature=0, n=2, extra_body=LONG)
        if stream:
            texts: dict[int, str] = {}
            for chunk in client.completions.create(stream=True, **body):
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
        else:
            r = client.completions.create(**body)
            texts = {c.index: c.text for c in r.choices}
            assert r.usage.completion_tokens == 6 * 2 * len(prompts)
        assert sorted(texts) == list(range(2 * len(prompts)))
        for index, text in texts.items():
            assert text == singles[index // 2], index


def test_version_flag():
    out = subprocess.run([str(Path(sys.executable).parent / "gracelm"), "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and re.fullmatch(r"gracelm \S+\n", out.stdout)
