"""`POST /v1/responses`: OpenAI's Responses API served as chat is. The request is checked (its own refusals,
`responses_protocol.UNSUPPORTED`), translated into a chat completions request (input items to messages,
flat function tools to chat's, `text.format` to `response_format`), planned by `ServingChat.plan` and run
through `ServingBase.start` — the same engine, limits, admission, drain and metrics as chat, counted as
`api="responses"`. A refusal of the chat planning names the chat field (`max_tokens`, `messages.3.content`):
it is renamed to the field the client sent (`max_output_tokens`, `input.3.content`).

The output is built from the chat stream's deltas (`tool_calls.StreamedChoice`) by one `_OutputBuilder`,
plain or streamed, so that both give the same items: a message item with one `output_text` part per run of
text, a `function_call` item per call. Streamed, each step is an event of OpenAI's sequence
(docs/responses.md, "Streaming"), numbered by `sequence_number`; a response that does not end well
(aborted at a drain's deadline, failed, the engine dead) ends with an `error` event, then
`response.failed`.

Stored responses (`response_store.py`) keep the conversation; `previous_response_id` continues it. A
background response (`background: true`) is stored queued and answered at once; it runs in a task of its
own, which stores it in progress, then at its end (completed, incomplete, failed, or cancelled by
`cancel`), and holds its admission until that end is stored: a drain waits for it, as for any request, and
its deadline aborts it (failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, Literal

import pydantic
from fastapi.responses import StreamingResponse

from gracelm.engine.output_processor import RequestOutput
from gracelm.serving.api_errors import APIError, from_validation_error, validated
from gracelm.serving.openai_protocol import ChatCompletionRequest, DeltaMessage
from gracelm.serving.request_client import RequestClient
from gracelm.serving.request_fields import refuse_fields
from gracelm.serving.response_store import ResponseStore, StoredResponse
from gracelm.serving.responses_protocol import (
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    UNSUPPORTED,
    UNSUPPORTED_IN_CALLS,
    UNSUPPORTED_IN_STREAM_OPTIONS,
    UNSUPPORTED_IN_TEXT,
    UNSUPPORTED_IN_TOOLS,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputMessage,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseErrorInfo,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from gracelm.serving.serving_base import Run, ServingBase, SseDialect, StreamTally
from gracelm.serving.serving_chat import ChatPlan, ServingChat
from gracelm.serving.tool_calls import StreamedChoice

logger = logging.getLogger(__name__)

PREVIOUS = "previous_response_id"
UNFINISHED = ("queued", "in_progress")  # a background response's statuses before its end
# Keys a text part of an input message may have (an earlier output's annotations and logprobs come back
# with it; a cache breakpoint is a hint, the prefix cache is automatic).
_TEXT_PART_KEYS = {"input_text": {"type", "text", "prompt_cache_breakpoint"},
                   "output_text": {"type", "text", "annotations", "logprobs"}}
_NOT_TEXT = {"input_image": "image inputs", "input_file": "file inputs", "input_audio": "audio inputs"}
_JSON_SCHEMA_KEYS = {"type", "name", "schema", "description", "strict"}


class ServingResponses(ServingBase):
    def __init__(self, chat: ServingChat, store: ResponseStore) -> None:
        super().__init__(chat.engine, chat.state, chat.metrics, chat.served, chat.limits, chat.grammars)
        self.chat = chat
        self.store = store
        self._background: dict[str, asyncio.Task] = {}  # the background responses running, by id

    async def create(self, req: ResponsesRequest,
                     client: RequestClient) -> ResponseObject | StreamingResponse:
        """The answer to `req`: the response object, or with `stream` its SSE events; raises `APIError`."""
        stored = self._check(req)
        history = await self._history(req.previous_response_id)
        items = history + _given_items(req.input)
        conversation = _conversation(req.instructions, items, len(history))
        hex_id = uuid.uuid4().hex
        with _named_as_sent(conversation.origins):
            plan = await self.chat.plan(_chat_request(req, conversation))
            request_id = client.request_id(hex_id, "resp")
            run = await self.start(client, [plan.prompt_ids], plan.params, request_id, "messages",
                                   api="responses")
        shell = _shell(req, f"resp_{hex_id}", self.model_name, stored)
        saved = _Saved(self.store, items) if stored else None
        if saved is not None and req.background:
            return await self._in_background(run, plan, shell, saved, hex_id)
        if req.stream:
            events = _Events(shell, _OutputBuilder(hex_id))
            dialect = SseDialect(events.failure, None)
            return self.sse(self._stream(run.deltas, plan, events, saved, request_id), run, dialect)
        final = await self.final_output(client, run)
        output = final.outputs[0]
        builder = _OutputBuilder(hex_id)
        builder.feed(StreamedChoice(plan.tools).deltas(output.text, True))
        builder.finish(output.finish_reason)
        response = _ended(shell, builder, output.finish_reason, len(plan.prompt_ids), len(output.token_ids))
        if saved is not None:
            await saved.save(response)
        return response

    def _check(self, req: ResponsesRequest) -> bool:
        """The request's own refusals; returns whether its response is stored."""
        refuse_fields(req, UNSUPPORTED, "")
        if req.text is not None:
            refuse_fields(req.text, UNSUPPORTED_IN_TEXT, "text.")
        if req.stream_options is not None:
            if not req.stream:
                raise APIError(400, "stream_options is only for a streamed response (stream: true)",
                               param="stream_options", code="invalid_value")
            refuse_fields(req.stream_options, UNSUPPORTED_IN_STREAM_OPTIONS, "stream_options.")
        _check_metadata(req.metadata)
        if req.background:
            _check_background(req, self.store.enabled)
        if not self.store.enabled:
            asked = {"store": req.store is True, PREVIOUS: req.previous_response_id is not None}
            for field in (name for name, given in asked.items() if given):
                raise APIError(400, f"{field}: responses are stored in the server's state directory, and "
                                    f"this server runs without one: start it with --state-dir DIR",
                               param=field, code="state_dir_required")
        return req.store if req.store is not None else self.store.enabled

    async def _history(self, previous_id: str | None) -> list[dict[str, Any]]:
        """The conversation a previous response answered, and its output: what this request goes on from."""
        if previous_id is None:
            return []
        previous = await asyncio.to_thread(self.store.load, previous_id)
        if previous is None:
            raise APIError(404, f"Previous response with id '{previous_id}' not found.", param=PREVIOUS,
                           code="previous_response_not_found")
        status = previous.response["status"]
        if status in UNFINISHED:
            raise APIError(400, f"{PREVIOUS}: response {previous_id} is {status}; go on from it once it has "
                                f"finished", param=PREVIOUS, code="invalid_value")
        return previous.input_items + previous.response["output"]

    async def stored(self, response_id: str) -> StoredResponse:
        """A stored response; a 404 naming it when unknown (always, without `--state-dir`)."""
        found = await asyncio.to_thread(self.store.load, response_id) if self.store.enabled else None
        if found is None:
            why = "" if self.store.enabled else " (nothing is stored: this server runs without --state-dir)"
            raise APIError(404, f"Response with id '{response_id}' not found.{why}", param="response_id",
                           code="response_not_found")
        return found

    async def delete(self, response_id: str) -> None:
        """Deletes a stored response (a 404 when unknown); a background one running is cancelled first."""
        await self.stored(response_id)
        await self._stop_background(response_id)
        await asyncio.to_thread(self.store.delete, response_id)

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancels a background response still running and answers it as stored: cancelled. A 400 for one
        not created in the background, or already at its end otherwise."""
        await self._stop_background(response_id)
        response = (await self.stored(response_id)).response
        if not response.get("background"):
            raise APIError(400, "Only responses created with background=true can be cancelled; "
                                f"{response_id} was not", param="response_id", code="invalid_value")
        if response["status"] not in ("cancelled", *UNFINISHED):
            raise APIError(400, f"response {response_id} is {response['status']}: only a queued or "
                                f"in-progress response can be cancelled", param="response_id",
                           code="invalid_value")
        return response

    async def _stop_background(self, response_id: str) -> None:
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def _in_background(self, run: Run, plan: ChatPlan, shell: ResponseObject, saved: _Saved,
                             hex_id: str) -> ResponseObject:
        """The response stored queued, and run in a task of its own (`_run_in_background`)."""
        queued = shell.model_copy(update={"status": "queued"})
        try:
            await saved.save(queued)
        except BaseException:
            await run.deltas.aclose()
            run.admission.release()
            raise
        task = asyncio.create_task(self._run_in_background(run, plan, shell, saved, hex_id),
                                   name=f"background response {shell.id}")
        self._background[shell.id] = task
        task.add_done_callback(lambda _: self._background.pop(shell.id, None))
        return queued

    async def _run_in_background(self, run: Run, plan: ChatPlan, shell: ResponseObject, saved: _Saved,
                                 hex_id: str) -> None:
        """A background response to its end, each change of its status stored; its admission released only
        once its end is stored."""
        builder = _OutputBuilder(hex_id)
        try:
            try:
                end = await self._background_output(run, plan, shell, saved, builder)
            except asyncio.CancelledError:  # cancel(): closing the deltas aborts it in the engine
                end = shell.model_copy(update={"status": "cancelled", "output": list(builder.items)})
            except APIError as exc:
                end = _failed(shell, builder, exc)
            with contextlib.suppress(APIError):  # logged by `save`; the response stays as last stored
                await saved.save(end)
        finally:
            run.admission.release()

    async def _background_output(self, run: Run, plan: ChatPlan, shell: ResponseObject, saved: _Saved,
                                 builder: _OutputBuilder) -> ResponseObject:
        streamed = StreamedChoice(plan.tools)
        tally = StreamTally(len(plan.prompt_ids))
        finish_reason = None
        async with contextlib.aclosing(run.deltas) as deltas:
            async for delta in deltas:
                if tally.completion_tokens == 0:
                    await saved.save(shell.model_copy(update={"status": "in_progress"}))
                for o in delta.outputs:
                    tally.add(o)
                    finish_reason = o.finish_reason or finish_reason
                    builder.feed(streamed.deltas(o.text, o.finish_reason is not None))
        error = tally.error(run.request_id)
        if error is not None:
            return _failed(shell, builder, error)
        builder.finish(finish_reason)
        return _ended(shell, builder, finish_reason, tally.num_prompt_tokens, tally.completion_tokens)

    async def _stream(self, deltas: AsyncIterator[RequestOutput], plan: ChatPlan, events: _Events,
                      saved: _Saved | None, request_id: str) -> AsyncGenerator[str]:
        """The events of one response: created and in progress, each item's as it comes, then completed or
        incomplete; a response aborted or failed ends with its error (`_Events.failure`)."""
        yield events.lifecycle("response.created")
        yield events.lifecycle("response.in_progress")
        streamed = StreamedChoice(plan.tools)
        tally = StreamTally(len(plan.prompt_ids))
        finish_reason = None
        async for delta in deltas:
            for o in delta.outputs:
                tally.add(o)
                finish_reason = o.finish_reason or finish_reason
                for event in events.builder.feed(streamed.deltas(o.text, o.finish_reason is not None)):
                    yield events.write(*event)
        error = tally.error(request_id)
        if error is not None:
            yield events.failure(error)
            return
        for event in events.builder.finish(finish_reason):
            yield events.write(*event)
        response = _ended(events.shell, events.builder, finish_reason, tally.num_prompt_tokens,
                          tally.completion_tokens)
        if saved is not None:
            await saved.save(response)  # before the last event: a client may go on from it at once
        last = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield events.lifecycle(last, response)


# -- the request, in chat's terms ---------------------------------------------------------------------

@dataclasses.dataclass
class _Conversation:
    """The chat messages of a request, and where each came from: the field path of the message (or of its
    text), and of each of its tool calls, as the client sent them."""

    messages: list[dict[str, Any]]
    origins: list[tuple[str, list[str]]]


def _given_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as items: a string is one user message."""
    return [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given


def _conversation(instructions: str | None, items: list[dict[str, Any]], num_history: int) -> _Conversation:
    conversation = _Conversation([], [])
    if instructions is not None:
        conversation.messages.append({"role": "system", "content": instructions})
        conversation.origins.append(("instructions", []))
    for index, item in enumerate(items):
        where = PREVIOUS if index < num_history else f"input.{index - num_history}"
        _add_item(conversation, item, where)
    return conversation


def _add_item(conversation: _Conversation, item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object (an input item), got {type(item).__name__}",
                       param=where, code="invalid_value")
    kind = item.get("type", "message")
    if kind == "message":
        message = validated(InputMessage, item, where)
        chat_message = {"role": message.role, **_message_text(message, where)}
        conversation.messages.append(chat_message)
        conversation.origins.append((where, []))
    elif kind == "function_call":
        _add_call(conversation, validated(FunctionCallItem, item, where), where)
    elif kind == "function_call_output":
        result = validated(FunctionCallOutputItem, item, where)
        refuse_fields(result, UNSUPPORTED_IN_CALLS, f"{where}.")
        tool_message = {"role": "tool", "tool_call_id": result.call_id,
                        "content": _parts_text(result.output, f"{where}.output", ("input_text",))}
        if result.name is not None:
            tool_message["name"] = result.name
        conversation.messages.append(tool_message)
        conversation.origins.append((where, []))
    else:
        raise APIError(400, f"{where}.type: only message, function_call and function_call_output items are "
                            f"supported, got {json.dumps(kind)}", param=f"{where}.type",
                       code="unsupported_parameter")


def _add_call(conversation: _Conversation, call: FunctionCallItem, where: str) -> None:
    """A call joins the assistant message before it (chat's form: one message, its text and its calls)."""
    refuse_fields(call, UNSUPPORTED_IN_CALLS, f"{where}.")
    chat_call = {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
    messages, origins = conversation.messages, conversation.origins
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(chat_call)
        origins[-1][1].append(where)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [chat_call]})
        origins.append((where, [where]))


def _message_text(message: InputMessage, where: str) -> dict[str, Any]:
    """A message's text (its refusal apart, for an assistant's earlier answer), its parts joined."""
    if isinstance(message.content, str):
        return {"content": message.content}
    kinds = ("input_text", "output_text", "refusal") if message.role == "assistant" else ("input_text",)
    texts = [p for p in message.content if not (isinstance(p, dict) and p.get("type") == "refusal")]
    refusals = [p for p in message.content if isinstance(p, dict) and p.get("type") == "refusal"]
    fields: dict[str, Any] = {"content": _parts_text(texts, f"{where}.content", kinds)}
    if refusals and message.role == "assistant":
        fields["refusal"] = "".join(str(p.get("refusal", "")) for p in refusals)
    return fields


def _parts_text(parts: str | list[Any], where: str, kinds: tuple[str, ...]) -> str:
    """Text content parts joined; any other part refused, naming it."""
    if isinstance(parts, str):
        return parts
    texts = []
    for index, part in enumerate(parts):
        at = f"{where}.{index}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _NOT_TEXT:
            raise APIError(400, f"{at}.type: {_NOT_TEXT[kind]} are not supported; this server reads text",
                           param=f"{at}.type", code="unsupported_parameter")
        if kind not in kinds:
            raise APIError(400, f"{at}.type must be one of {', '.join(kinds)}, got {json.dumps(kind)}",
                           param=f"{at}.type", code="invalid_value")
        unknown = sorted(set(part) - _TEXT_PART_KEYS.get(kind, {"type", "text"}))
        if unknown:
            raise APIError(400, f"Unrecognized request argument supplied: {at}.{unknown[0]}",
                           param=f"{at}.{unknown[0]}", code="unrecognized_argument")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{at}.text must be a string", param=f"{at}.text", code="invalid_value")
        texts.append(part["text"])
    return "".join(texts)


def _chat_request(req: ResponsesRequest, conversation: _Conversation) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": conversation.messages, "stream": bool(req.stream)}
    optional = {"model": req.model, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls, "user": req.user,
                "tools": [_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
                "tool_choice": _chat_tool_choice(req.tool_choice),
                "response_format": _response_format(req.text.format if req.text else None)}
    body.update({k: v for k, v in optional.items() if v is not None})
    try:
        return ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


def _chat_tool(value: Any, index: int) -> dict[str, Any]:
    where = f"tools.{index}"
    if not isinstance(value, dict) or value.get("type") != "function":
        got = json.dumps(value.get("type")) if isinstance(value, dict) else type(value).__name__
        raise APIError(400, f'{where}.type: only "function" tools are supported, got {got}',
                       param=f"{where}.type", code="unsupported_parameter")
    tool = validated(FunctionTool, value, where)
    try:
        refuse_fields(tool, UNSUPPORTED_IN_TOOLS, f"{where}.")
    except APIError as exc:  # the field's Python name is `async_`
        raise _renamed(exc, "async_", "async") from None
    function = tool.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Chat's form of a tool choice: a function named flat (`{"type", "name"}`) is nested under `function`;
    the strings are the same."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise APIError(400, f'tool_choice.type: only "function" (or "none", "auto", "required") is '
                            f"supported, got {json.dumps(choice.get('type'))}", param="tool_choice.type",
                       code="unsupported_parameter")
    unknown = sorted(set(choice) - {"type", "name"})
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: tool_choice.{unknown[0]}",
                       param=f"tool_choice.{unknown[0]}", code="unrecognized_argument")
    return {"type": "function", "function": {"name": choice.get("name")}}


def _response_format(text_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's `response_format` of `text.format`: the JSON schema's fields are nested under `json_schema`."""
    if text_format is None or text_format.get("type") == "text":
        return None
    if text_format.get("type") != "json_schema":
        return text_format  # json_object as chat has it; another type is refused there, naming text.format
    unknown = sorted(set(text_format) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: text.format.{unknown[0]}",
                       param=f"text.format.{unknown[0]}", code="unrecognized_argument")
    spec = {k: v for k, v in text_format.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
                       param="metadata", code="invalid_value")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise APIError(400, f"metadata: keys are at most {MAX_METADATA_KEY} characters and values "
                                f"at most {MAX_METADATA_VALUE}", param=f"metadata.{key[:MAX_METADATA_KEY]}",
                           code="invalid_value")



# -- the chat fields' names, renamed --------------------------------------------------------------------

@contextlib.contextmanager
def _named_as_sent(origins: list[tuple[str, list[str]]]) -> Iterator[None]:
    """An `APIError` of the chat planning names the field the client sent instead of chat's."""
    try:
        yield
    except APIError as exc:
        if exc.param is not None:
            raise _renamed(exc, exc.param, _responses_param(exc.param, origins)) from None
        raise


def _renamed(exc: APIError, old: str, new: str) -> APIError:
    if exc.param is None or old == new:
        return exc
    param = exc.param.replace(old, new, 1)
    return APIError(exc.status, exc.message.replace(old, new), param=param, code=exc.code,
                    headers=exc.headers)


_CALL = re.compile(r"^tool_calls\.(\d+)(?:\.function)?(.*)$")


def _responses_param(param: str, origins: list[tuple[str, list[str]]]) -> str:
    head, _, rest = param.partition(".")
    if head == "max_tokens":
        return "max_output_tokens"
    if head == "response_format":
        return "text.format"
    if head == "tools":
        return re.sub(r"^tools\.(\d+)\.function\b", r"tools.\1", param)
    if param.startswith("tool_choice.function"):
        return "tool_choice" + param[len("tool_choice.function"):]
    if head != "messages":
        return param
    index, _, rest = rest.partition(".")
    if not index.isdigit() or int(index) >= len(origins):
        return "input"
    where, calls = origins[int(index)]
    m = _CALL.match(rest)
    if m is not None and int(m.group(1)) < len(calls):
        where, rest = calls[int(m.group(1))], m.group(2).lstrip(".")
    if where in (PREVIOUS, "instructions") or not rest:
        return where
    return f"{where}.{rest}"


# -- the response ---------------------------------------------------------------------------------------

def _shell(req: ResponsesRequest, response_id: str, model: str, stored: bool) -> ResponseObject:
    """The response object before its output: what the request asked, echoed."""
    text = req.text.model_dump(exclude_none=True) if req.text is not None else {}
    return ResponseObject(
        id=response_id, status="in_progress", instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, max_tool_calls=req.max_tool_calls,
        metadata=req.metadata or {}, model=model, parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id, store=stored, temperature=req.temperature,
        top_p=req.top_p, text={"format": {"type": "text"}, **text}, tool_choice=req.tool_choice or "auto",
        tools=req.tools or [], user=req.user, safety_identifier=req.safety_identifier,
        prompt_cache_key=req.prompt_cache_key,
        service_tier="default" if req.service_tier is not None else None, background=bool(req.background))


def _ended(shell: ResponseObject, builder: _OutputBuilder, finish_reason: str | None, input_tokens: int,
           output_tokens: int) -> ResponseObject:
    """The response once its output is complete: incomplete when cut by max_output_tokens."""
    cut = finish_reason == "length"
    usage = ResponseUsage(input_tokens=input_tokens, output_tokens=output_tokens,
                          total_tokens=input_tokens + output_tokens)
    return shell.model_copy(update={
        "status": "incomplete" if cut else "completed", "output": list(builder.items), "usage": usage,
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
        "completed_at": int(time.time())})


def _failed(shell: ResponseObject, builder: _OutputBuilder, error: APIError) -> ResponseObject:
    """The response that did not end well: the items given so far, and the error as OpenAI's
    `server_error` (the SDK knows a fixed set of codes)."""
    return shell.model_copy(update={"status": "failed", "output": list(builder.items),
                                    "error": ResponseErrorInfo(message=error.message)})


def _check_background(req: ResponsesRequest, can_store: bool) -> None:
    """A background response is stored (polled with GET) and not streamed."""
    if not can_store:
        raise APIError(400, "background: a background response is kept in the server's state directory, and "
                            "this server runs without one: start it with --state-dir DIR", param="background",
                       code="state_dir_required")
    if req.store is False:
        raise APIError(400, "store: a background response must be stored (store: true)", param="store",
                       code="invalid_value")
    if req.stream:
        raise APIError(400, "stream: a background response is not streamed here; poll GET /v1/responses/{id}",
                       param="stream", code="unsupported_parameter")


class _Saved:
    """Where a stored response goes, with the conversation it answered."""

    def __init__(self, store: ResponseStore, items: list[dict[str, Any]]) -> None:
        self._store = store
        self._items = items

    async def save(self, response: ResponseObject) -> None:
        try:
            await asyncio.to_thread(self._store.save, response.model_dump(), self._items)
        except Exception:
            logger.exception("response %s could not be stored", response.id)
            raise APIError(500, f"response {response.id} could not be stored; the details are in the "
                                f"server's log", code="store_failed") from None


Event = tuple[str, dict[str, Any]]


class _OutputBuilder:
    """The output items of one response, from the chat deltas of its text, and the events that build them.
    Text only of blanks is held back until more text comes: blanks around calls make no message."""

    def __init__(self, hex_id: str) -> None:
        self._hex_id = hex_id
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._blank = ""

    def feed(self, deltas: list[DeltaMessage]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            if delta.content:
                events += self._text(delta.content)
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    events += self._close("completed")
                    self._blank = ""
                    events += self._open_item(FunctionCallOutput(
                        id=f"fc_{uuid.uuid4().hex}", call_id=piece.id, name=piece.function.name or "",
                        arguments="", status="in_progress"))
                if piece.function.arguments:
                    events += self._arguments(piece.function.arguments)
        return events

    def finish(self, finish_reason: str | None) -> list[Event]:
        """The last events: an answer with no item at all is one message, however blank."""
        events: list[Event] = []
        if not self.items:
            events += self._open_message()
            events += self._delta(self._blank)
        return events + self._close("incomplete" if finish_reason == "length" else "completed")

    def _text(self, text: str) -> list[Event]:
        if isinstance(self._open, OutputMessage):
            return self._delta(text)
        self._blank += text
        if not self._blank.strip():
            return []
        text, self._blank = self._blank, ""
        return self._close("completed") + self._open_message() + self._delta(text)

    def _open_message(self) -> list[Event]:
        message = OutputMessage(id=f"msg_{self._hex_id}_{len(self.items)}", status="in_progress",
                                content=[OutputText(text="")])
        added = self._open_item(message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return added + [("response.content_part.added", {**self._at(), "content_index": 0, "part": part})]

    def _open_item(self, item: OutputItem) -> list[Event]:
        self.items.append(item)
        self._open = item
        shown = item.model_dump()
        if isinstance(item, OutputMessage):
            shown["content"] = []  # its part comes with an event of its own
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": shown})]

    def _delta(self, text: str) -> list[Event]:
        assert isinstance(self._open, OutputMessage)
        self._open.content[0].text += text
        if not text:
            return []
        return [("response.output_text.delta", {**self._at(), "content_index": 0, "delta": text,
                                                "logprobs": []})]

    def _arguments(self, piece: str) -> list[Event]:
        assert isinstance(self._open, FunctionCallOutput)
        self._open.arguments += piece
        return [("response.function_call_arguments.delta", {**self._at(), "delta": piece})]

    def _close(self, status: Literal["completed", "incomplete"]) -> list[Event]:
        item = self._open
        if item is None:
            return []
        item.status = status
        events: list[Event]
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [("response.output_text.done", {**self._at(), "content_index": 0, "text": part.text,
                                                     "logprobs": []}),
                      ("response.content_part.done", {**self._at(), "content_index": 0,
                                                      "part": part.model_dump()})]
        else:
            events = [("response.function_call_arguments.done", {**self._at(), "arguments": item.arguments})]
        events.append(("response.output_item.done", {"output_index": len(self.items) - 1,
                                                     "item": item.model_dump()}))
        self._open = None
        return events

    def _at(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.items) - 1}


class _Events:
    """One response's SSE events, numbered in order (`sequence_number`), as OpenAI frames them:
    `event: TYPE` then `data: JSON`."""

    def __init__(self, shell: ResponseObject, builder: _OutputBuilder) -> None:
        self.shell = shell
        self.builder = builder
        self._next = 0

    def write(self, kind: str, fields: dict[str, Any]) -> str:
        payload = {"type": kind, **fields, "sequence_number": self._next}
        self._next += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def lifecycle(self, kind: str, response: ResponseObject | None = None) -> str:
        return self.write(kind, {"response": (response or self.shell).model_dump()})

    def failure(self, error: APIError) -> str:
        """How a response that did not end well ends: the `error` event (our code, message and param), then
        `response.failed` with the items given so far and the error as OpenAI's `server_error`."""
        event = self.write("error", {"code": error.code, "message": error.message, "param": error.param})
        return event + self.lifecycle("response.failed", _failed(self.shell, self.builder, error))
