"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API, served as a chat request.

A Messages request is read into the `ChatCompletionRequest` it asks for (`messages_request.py`), which the
chat endpoint plans (`ServingChat.plan`: the template, the tools, the sampling, the checks) and this endpoint
runs (`ServingBase.start`, counted as `api="messages"`), so that both go through the same engine, limits,
admission, drain and metrics. The answer is shaped back: a `thinking` block (with `--reasoning-parser`),
text and `tool_use` content blocks, a stop reason (`end_turn`, `max_tokens`, `stop_sequence` with the
sequence, `tool_use`), and the usage; a stream is Anthropic's events.

A tool call's id is chat's with Anthropic's prefix (`toolu_`); a client sends the ids back as it got them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gracelm.engine.output_processor import CompletionOutput, RequestOutput
from gracelm.serving.api_errors import APIError, anthropic_body
from gracelm.serving.messages_protocol import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    CountTokensResponse,
    InputJsonDelta,
    MessageDeltaEvent,
    MessagesRequest,
    MessagesResponse,
    MessageStartEvent,
    MessageStopEvent,
    MessagesUsage,
    OutputUsage,
    StopDelta,
    TextContent,
    TextDelta,
    ThinkingContent,
    ThinkingDelta,
    ToolUseContent,
)
from gracelm.serving.messages_request import chat_request, renamed
from gracelm.serving.openai_protocol import AssistantMessage, DeltaMessage
from gracelm.serving.request_client import RequestClient
from gracelm.serving.serving_base import ServingBase, SseDialect, StreamTally, sse_event
from gracelm.serving.serving_chat import ChatPlan, ServingChat
from gracelm.serving.tool_calls import StreamedChoice, final_message

# A message's id is Anthropic's prefix and its request's: the engine's id (in the log and the status page)
# is `msg-` and the client's X-Request-Id or a fresh one, the message's `msg_` and the same.
ENGINE_ID_PREFIX = "msg"
MESSAGE_ID_PREFIX = "msg_"
# Anthropic's prefix of a tool call's id, in the place of chat's.
TOOL_ID_PREFIX = "toolu_"
_CHAT_TOOL_ID_PREFIX = "call_"


def messages_event(event: BaseModel | dict) -> str:
    """An event of a Messages stream: its type as the SSE event's name, the event as its data."""
    return sse_event(event.type if isinstance(event, BaseModel) else event["type"], event)


# A Messages stream ends with its own last event (message_stop), or with an error event: no `[DONE]`.
MESSAGES_SSE = SseDialect(lambda error: messages_event(anthropic_body(error)), None)


class ServingMessages(ServingBase):
    """The Messages API over the chat endpoint's planning (`chat`)."""

    def __init__(self, chat: ServingChat) -> None:
        super().__init__(chat.engine, chat.state, chat.metrics, chat.served, chat.limits, chat.grammars)
        self.chat = chat

    async def create(self, req: MessagesRequest,
                     client: RequestClient) -> MessagesResponse | StreamingResponse:
        """The answer to `req`: a message, or with `stream` Anthropic's events; raises `APIError`."""
        plan = await self._plan(req)
        request_id = client.request_id(None, ENGINE_ID_PREFIX)
        run = await self.start(client, [plan.prompt_ids], plan.params, request_id, "messages", api="messages")
        message_id = MESSAGE_ID_PREFIX + request_id.removeprefix(f"{ENGINE_ID_PREFIX}-")
        if req.stream:
            events = self._stream(message_id, request_id, run.deltas, plan)
            return self.sse(events, run, MESSAGES_SSE)
        final = await self.final_output(client, run)
        output = final.outputs[0]
        message, finish_reason = final_message(output.text, output.finish_reason, plan.tools,
                                               plan.text_reading)
        stop_reason, stop_sequence = _stop(finish_reason, output)
        usage = MessagesUsage(input_tokens=len(plan.prompt_ids), output_tokens=len(output.token_ids))
        return MessagesResponse(id=message_id, content=_content(message), model=self.model_name,
                                stop_reason=stop_reason, stop_sequence=stop_sequence, usage=usage)

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        """The tokens of the prompt `req` would run: the same translation and chat template."""
        plan = await self._plan(req)
        return CountTokensResponse(input_tokens=len(plan.prompt_ids))

    async def _plan(self, req: CountTokensRequest) -> ChatPlan:
        chat_req, places = chat_request(req)
        try:
            return await self.chat.plan(chat_req)
        except APIError as exc:
            raise renamed(exc, places) from None

    async def _stream(self, message_id: str, request_id: str, deltas: AsyncIterator[RequestOutput],
                      plan: ChatPlan) -> AsyncGenerator[str]:
        """message_start; each content block's start, deltas and stop; message_delta (stop reason, output
        tokens) and message_stop; or, if the request was aborted or failed, an error event after what was
        sent (`sse` adds no last line)."""
        num_prompt_tokens = len(plan.prompt_ids)
        tally = StreamTally(num_prompt_tokens)
        streamed = StreamedChoice(plan.tools, plan.text_reading)
        blocks = _BlockEvents()
        usage = MessagesUsage(input_tokens=num_prompt_tokens, output_tokens=0)
        start = MessagesResponse(id=message_id, content=[], model=self.model_name, stop_reason=None,
                                 usage=usage)
        yield messages_event(MessageStartEvent(message=start))
        stop: tuple[str, str | None] = ("end_turn", None)
        async for delta in deltas:
            for output in delta.outputs:
                tally.add(output)
                for piece in streamed.deltas(output.text, output.finish_reason is not None):
                    for event in blocks.of(piece):
                        yield event
                if output.finish_reason is not None:
                    stop = _stop(streamed.finish_reason(output.finish_reason), output)
        error = tally.error(request_id)
        if error is not None:
            yield MESSAGES_SSE.error_event(error)
            return
        for event in blocks.close():
            yield event
        yield messages_event(MessageDeltaEvent(delta=StopDelta(stop_reason=stop[0], stop_sequence=stop[1]),
                                               usage=OutputUsage(output_tokens=tally.completion_tokens)))
        yield messages_event(MessageStopEvent())


class _BlockEvents:
    """A stream's chat deltas as content blocks: a thinking block for the thinking, a text block for a run
    of text, a tool_use block per call (its input as `input_json_delta` pieces); each block stops when the
    next starts, the last at the end."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use"

    def of(self, piece: DeltaMessage) -> list[str]:
        events = []
        if piece.reasoning_content:
            if self.open != "thinking":
                events += self._start(ThinkingContent(thinking=""))
            thought = ThinkingDelta(thinking=piece.reasoning_content)
            events.append(messages_event(ContentBlockDeltaEvent(index=self.index, delta=thought)))
        if piece.content:
            if self.open != "text":
                events += self._start(TextContent(text=""))
            delta = TextDelta(text=piece.content)
            events.append(messages_event(ContentBlockDeltaEvent(index=self.index, delta=delta)))
        for call in piece.tool_calls or []:
            if call.id is not None:
                events += self._start(ToolUseContent(id=_tool_use_id(call.id), name=call.function.name or "",
                                                     input={}))
            if call.function.arguments:
                piece_of_input = InputJsonDelta(partial_json=call.function.arguments)
                events.append(messages_event(ContentBlockDeltaEvent(index=self.index, delta=piece_of_input)))
        return events

    def _start(self, block: ThinkingContent | TextContent | ToolUseContent) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block.type
        return [*events, messages_event(ContentBlockStartEvent(index=self.index, content_block=block))]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [messages_event(ContentBlockStopEvent(index=self.index))]


def _stop(finish_reason: str | None, output: CompletionOutput) -> tuple[str, str | None]:
    """Anthropic's stop reason and stop sequence of a choice that ended with chat's `finish_reason`."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(output.stop_reason, str):  # a stop string; a stop token or EOS ends the turn
        return "stop_sequence", output.stop_reason
    return "end_turn", None


def _content(message: AssistantMessage) -> list[ThinkingContent | TextContent | ToolUseContent]:
    blocks: list[ThinkingContent | TextContent | ToolUseContent] = []
    if message.reasoning_content:
        blocks.append(ThinkingContent(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextContent(text=message.content))
    for call in message.tool_calls or []:
        blocks.append(ToolUseContent(id=_tool_use_id(call.id), name=call.function.name,
                                     input=_input(call.function.arguments)))
    return blocks


def _input(arguments: str) -> dict[str, Any]:
    """A call's input; a call cut by max_tokens has arguments that do not parse, and an empty input (the
    stop reason says it was cut)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use_id(call_id: str) -> str:
    return TOOL_ID_PREFIX + call_id.removeprefix(_CHAT_TOOL_ID_PREFIX)
