"""Reasoning output (`--reasoning-parser`): the parsers on text split anywhere, the thinking as the engine
core counts it, the parser's choice and refusal at start, and — against real servers of scripted models
(`tests/scripted_models.py`), through the official `openai` client — the thinking apart from the answer,
plain and streamed, with tools, with structured outputs that apply after it, and with it turned off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gracelm.serving.reasoning_parsers import (
    NO_REASONING,
    Phase,
    ReasoningParser,
    ReasoningPlan,
    resolve,
)
from gracelm.thinking_span import ThinkingSpan
from tests.scripted_models import DEEPSEEK_R1_TEMPLATE, QWEN3_TEMPLATE, make_scripted_model

OPENING_QWEN3 = ReasoningPlan(Phase.OPENING, Phase.ANSWER, ThinkingSpan(end=2, opener=1))
OPENING_DEEPSEEK = ReasoningPlan(Phase.OPENING, Phase.THINKING, ThinkingSpan(end=2))
THINKING = ReasoningPlan(Phase.THINKING, Phase.THINKING, ThinkingSpan(end=2))

# (plan, output text, (reasoning, content))
CASES = [
    (OPENING_QWEN3, "<think>a <b> c</think>\n\nanswer", ("a <b> c", "\n\nanswer")),
    (OPENING_QWEN3, "no thinking at all </think> here", (None, "no thinking at all </think> here")),
    (OPENING_QWEN3, " <think>late</think>", (None, " <think>late</think>")),
    (OPENING_QWEN3, "<think>cut off </thi", ("cut off </thi", "")),
    (OPENING_QWEN3, "<thin", (None, "<thin")),
    (OPENING_QWEN3, "<think></think>x", (None, "x")),
    (OPENING_DEEPSEEK, "<think>opened again</think>x", ("opened again", "x")),
    (OPENING_DEEPSEEK, "straight in</think> done", ("straight in", " done")),
    (OPENING_DEEPSEEK, "never closed <", ("never closed <", "")),
    (OPENING_DEEPSEEK, "<thi", ("<thi", "")),
    (THINKING, "<think> is text here</think>a</think>b", ("<think> is text here", "a</think>b")),
    (NO_REASONING, "<think>x</think>y", (None, "<think>x</think>y")),
]


def _fed(plan: ReasoningPlan, pieces: list[str]) -> tuple[str | None, str]:
    """The text read piece by piece, then an empty last piece (a stream's last delta may have no text)."""
    reader = plan.reader()
    reasoning = content = ""
    for index, piece in enumerate([*pieces, ""]):
        more_reasoning, more_content = reader.read(piece, last=index == len(pieces))
        reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning or None, content


@pytest.mark.parametrize(("plan", "text", "expected"), CASES)
def test_parser_reads_the_same_however_the_text_is_split(plan: ReasoningPlan, text: str,
                                                         expected: tuple) -> None:
    assert plan.split(text) == expected
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            pieces = [text[:cut], text[cut:second], text[second:]]
            assert _fed(plan, pieces) == expected, f"split at {cut} and {second}"
    assert _fed(plan, list(text)) == expected, "one character at a time"


def test_switches_keep_the_thinking_in_the_content_or_leave_it_out() -> None:
    import dataclasses

    together = dataclasses.replace(OPENING_QWEN3, separated=False)
    assert together.split("<think>a</think>b") == (None, "<think>a</think>b")
    assert together.reasoning_tokens([1, 7, 2, 8]) == 3  # counted all the same
    assert dataclasses.replace(OPENING_QWEN3, shown=False).split("<think>a</think>b") == ("a", "b")


@pytest.mark.parametrize(("span", "tokens", "answer_start", "reasoning"), [
    (ThinkingSpan(end=2, opener=1), [], None, 0),
    (ThinkingSpan(end=2, opener=1), [1, 5, 6], None, 3),
    (ThinkingSpan(end=2, opener=1), [1, 5, 2, 7], 3, 3),
    (ThinkingSpan(end=2, opener=1), [7, 2, 8], 0, 0),
    (ThinkingSpan(end=2), [], None, 0),
    (ThinkingSpan(end=2), [5, 2], 2, 2),
    (ThinkingSpan(end=2), [1, 5, 2, 9], 3, 3),
])
def test_thinking_span_by_token_ids(span: ThinkingSpan, tokens: list[int], answer_start: int | None,
                                    reasoning: int) -> None:
    assert span.answer_start(tokens) == answer_start
    assert span.reasoning_tokens(tokens) == reasoning
    assert span.may_open(tokens) == (span.opener is not None and not tokens)


# -- the scripted models ----------------------------------------------------------------------------------

THOUGHT = 'Let me look: <tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call> is not needed.'
CALL_ARGUMENTS = '{"city": "Oslo", "unit": "c"}'
CALL = f'<tool_call>{{"name": "get_weather", "arguments": {CALL_ARGUMENTS}}}</tool_call>'
# Qwen3's: the model writes `<think>` itself, then its thinking, then a call (hermes form) as its answer.
QWEN3_SCRIPT = ["<think>", THOUGHT, "</think>", CALL]
# DeepSeek-R1's: the prompt opens the thinking; the answer is a JSON object.
DEEPSEEK_SCRIPT = ["<think>", THOUGHT, "</think>", CALL_ARGUMENTS]
# No required keys: llguidance's mask leaves a token out that spans bytes the grammar forces (a required
# key's), and the script's answer is one such token.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}}}}}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("scripted")
    return {"qwen3": make_scripted_model(base / "qwen3", QWEN3_SCRIPT, QWEN3_TEMPLATE),
            "deepseek_r1": make_scripted_model(base / "deepseek", DEEPSEEK_SCRIPT, DEEPSEEK_R1_TEMPLATE)}


def _serving(model: Path, parser: str, *args: str) -> Iterator:
    """An openai client of a server of `model` with `--reasoning-parser parser`, while it runs."""
    import openai

    from tests.server_process import ServerProcess

    with ServerProcess(model, "--reasoning-parser", parser, "--max-model-len", "512", "--served-model-name",
                       "m", *args, env={"OMP_WAIT_POLICY": "PASSIVE"}) as process:
        yield openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def qwen3(models, tmp_path_factory):
    yield from _serving(models["qwen3"], "auto", "--state-dir", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(scope="module")
def deepseek(models):
    yield from _serving(models["deepseek_r1"], "deepseek_r1")


def test_the_parser_auto_picks_is_the_templates_and_a_model_without_think_tokens_is_refused(models) -> None:
    from gracelm.model.tokenizer import Tokenizer
    from tests.tiny_models import tiny_model

    qwen3, deepseek = (Tokenizer.from_dir(models[name]) for name in ("qwen3", "deepseek_r1"))
    chosen = resolve("auto", qwen3)
    assert chosen == ReasoningParser("qwen3", qwen3.token_to_id("<think>"), qwen3.token_to_id("</think>"))
    assert resolve("auto", deepseek).name == "deepseek_r1"
    assert resolve(None, qwen3) is None
    with pytest.raises(ValueError, match="no <think> token"):
        resolve("auto", Tokenizer.from_dir(tiny_model("llama")))


def test_a_server_whose_model_has_no_think_tokens_refuses_to_start() -> None:
    from tests.server_process import ServerProcess
    from tests.tiny_models import tiny_model

    process = ServerProcess(tiny_model("llama"), "--reasoning-parser", "qwen3", wait_ready=False)
    try:
        assert process.wait_exit(120) == 3, process.log()
        assert "--reasoning-parser qwen3: the model's vocabulary has no <think> token" in process.log()
        assert "killed" not in process.log()
        process.assert_nothing_left()
    finally:
        process.close_log()


def _message(client, **fields):
    answer = client.chat.completions.create(model="m", messages=USER, temperature=0, **fields)
    return answer.choices[0], answer.usage


def _streamed(client, **fields) -> tuple[dict, str | None, dict]:
    """The streamed answer's message, joined from its deltas, its finish reason and its usage."""
    stream = client.chat.completions.create(model="m", messages=USER, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, **fields)
    joined: dict = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}}
    finish_reason = usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            for field in ("content", "reasoning_content", "reasoning"):
                joined[field] += delta.get(field) or ""
            for call in delta.get("tool_calls") or []:
                whole = joined["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                whole["name"] += call["function"].get("name") or ""
                whole["arguments"] += call["function"].get("arguments") or ""
            finish_reason = choice.finish_reason or finish_reason
    return joined, finish_reason, usage


def _reasoning_tokens(usage) -> int:
    return usage.model_dump()["completion_tokens_details"]["reasoning_tokens"]


def test_qwen3_thinking_apart_from_the_answer_plain_and_streamed(qwen3) -> None:
    choice, usage = _message(qwen3)
    message = choice.message.model_dump()
    assert message["reasoning_content"] == message["reasoning"] == THOUGHT
    assert message["content"] == CALL  # no tools: the call's text is content
    assert choice.finish_reason == "stop"
    assert _reasoning_tokens(usage) == 3  # <think>, the thought, </think>
    joined, finish_reason, streamed_usage = _streamed(qwen3)
    assert (joined["reasoning_content"], joined["reasoning"], joined["content"]) == (THOUGHT, THOUGHT, CALL)
    assert finish_reason == "stop" and streamed_usage == usage.model_dump()


def test_qwen3_a_call_after_the_thinking_is_read_and_none_within_it(qwen3) -> None:
    choice, _ = _message(qwen3, tools=[WEATHER, TIME])
    message = choice.message
    assert message.model_dump()["reasoning_content"] == THOUGHT  # its get_time call is thinking, not a call
    assert message.content is None and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Oslo", "unit": "c"})]
    joined, finish_reason, _ = _streamed(qwen3, tools=[WEATHER, TIME])
    assert joined["reasoning_content"] == THOUGHT and joined["content"] == ""
    assert joined["tool_calls"] == {0: {"name": "get_weather", "arguments": CALL_ARGUMENTS}}
    assert finish_reason == "tool_calls"


def test_an_answer_sent_back_whole_is_taken(qwen3) -> None:
    """A client that appends the answer's message to the conversation sends its thinking back, under both
    names."""
    message = _message(qwen3)[0].message
    history = [*USER, message, {"role": "user", "content": "And in Bergen?"}]
    answer = qwen3.chat.completions.create(model="m", messages=history, temperature=0)
    assert answer.choices[0].message.model_dump()["reasoning"] == THOUGHT


def test_qwen3_with_thinking_turned_off_all_is_answer(qwen3) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    choice, usage = _message(qwen3, extra_body=off)
    assert "reasoning_content" not in choice.message.model_dump()
    assert choice.message.content == CALL and _reasoning_tokens(usage) == 0
    joined, _, _ = _streamed(qwen3, extra_body=off)
    assert (joined["reasoning_content"], joined["content"]) == ("", CALL)
    # Structured outputs then constrain the output from its first token.
    choice, _ = _message(qwen3, extra_body={**off, "structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.message.content in ("yes", "no")


def test_qwen3_structured_output_applies_after_the_thinking_it_may_open(qwen3) -> None:
    choice, _ = _message(qwen3, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.message.model_dump()["reasoning_content"] == THOUGHT
    assert choice.message.content in ("yes", "no")


def test_the_request_switches(qwen3) -> None:
    left_out, usage = _message(qwen3, extra_body={"include_reasoning": False})
    assert "reasoning_content" not in left_out.message.model_dump() and left_out.message.content == CALL
    assert _reasoning_tokens(usage) == 3
    together, _ = _message(qwen3, extra_body={"separate_reasoning": False})
    assert together.message.content == f"<think>{THOUGHT}</think>{CALL}"
    import openai

    with pytest.raises(openai.BadRequestError, match="stream_reasoning"):
        _streamed(qwen3, extra_body={"stream_reasoning": False})


def test_the_batch_apis_usage_sums_the_reasoning_tokens(qwen3) -> None:
    from tests.batch_helpers import chat_line, jsonl, submit, wait_for

    lines = [chat_line(f"line-{i}", USER[0]["content"], max_tokens=16) for i in range(2)]
    batch = wait_for(qwen3, submit(qwen3, jsonl(lines)).id)
    assert batch.status == "completed" and batch.usage.output_tokens_details.reasoning_tokens == 2 * 3


def test_deepseek_r1_output_starts_inside_the_thinking(deepseek) -> None:
    choice, usage = _message(deepseek)
    message = choice.message.model_dump()
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, CALL_ARGUMENTS)
    assert _reasoning_tokens(usage) == 2  # the thought and </think>: <think> was the prompt's
    joined, _, streamed_usage = _streamed(deepseek)
    assert (joined["reasoning"], joined["content"]) == (THOUGHT, CALL_ARGUMENTS)
    assert streamed_usage == usage.model_dump()


def test_deepseek_r1_structured_outputs_and_named_tools_apply_after_the_thinking(deepseek) -> None:
    schema = WEATHER["function"]["parameters"]
    formats = [{"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}},
               {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}]
    constrained = [_message(deepseek, **fields)[0].message for fields in formats]
    assert [m.model_dump()["reasoning_content"] for m in constrained] == [THOUGHT, THOUGHT]
    assert constrained[0].content == CALL_ARGUMENTS and constrained[1].content in ("yes", "no")
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice, _ = _message(deepseek, tools=[WEATHER], tool_choice=named)
    assert choice.message.model_dump()["reasoning_content"] == THOUGHT
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("get_weather", CALL_ARGUMENTS)]
    joined, _, _ = _streamed(deepseek, tools=[WEATHER], tool_choice=named)
    assert joined["reasoning"] == THOUGHT
    assert joined["tool_calls"] == {0: {"name": "get_weather", "arguments": CALL_ARGUMENTS}}


RESPONSES_TOOLS = [{"type": "function", "name": tool["function"]["name"],
                    "parameters": tool["function"]["parameters"]} for tool in (WEATHER, TIME)]


def test_responses_give_the_thinking_as_a_reasoning_item_and_take_it_back(qwen3) -> None:
    fields = {"model": "m", "input": USER[0]["content"], "tools": RESPONSES_TOOLS, "temperature": 0}
    response = qwen3.responses.create(**fields)
    thought, call = response.output
    assert thought.type == "reasoning" and [part.text for part in thought.content] == [THOUGHT]
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", CALL_ARGUMENTS)
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    events = list(qwen3.responses.create(**fields, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    streamed = events[-1].response
    assert [(item.type, item.status) for item in streamed.output] == [("reasoning", "completed"),
                                                                       ("function_call", "completed")]
    assert streamed.output[0].content == thought.content and streamed.usage == response.usage
    # The output given back with the call's result, as Codex CLI sends it: the reasoning item is taken.
    given_back = [*USER, *(item.model_dump(exclude_none=True) for item in response.output),
                  {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    assert qwen3.responses.create(**{**fields, "input": given_back}).status == "completed"


def test_messages_give_the_thinking_as_a_thinking_block_and_take_it_back(qwen3) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=str(qwen3.base_url).removesuffix("/v1/"), api_key="unused",
                                 max_retries=0)
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    # No temperature (this SDK takes none): the script's next token is all but certain at any.
    fields = {"model": "m", "max_tokens": 64, "messages": USER, "tools": tools}
    message = client.messages.create(**fields)
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == THOUGHT and message.stop_reason == "tool_use"
    assert message.content[1].input == json.loads(CALL_ARGUMENTS)
    with client.messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content][:1] == [message.content[0].model_dump()]
    history = [*USER, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": message.content[1].id,
                                             "content": "sunny"}]}]
    assert client.messages.create(**{**fields, "messages": history}).content[0].type == "thinking"
