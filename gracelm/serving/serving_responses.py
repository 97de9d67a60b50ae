"""`POST /v1/responses`: OpenAI's Responses API served as chat is. The request is checked (its own refusals,
`responses_protocol.UNSUPPORTED`), translated into a chat completions request (`responses_request.py`),
planned by `ServingChat.plan` and run through `ServingBase.start` — the same engine, limits, admission, drain
and metrics as chat, counted as `api="responses"`. Its output items and stream events are
`responses_output.py`'s.

Stored responses (`response_store.py`) keep the conversation; `previous_response_id` continues it. A
background response (`background: true`) is stored queued and answered at once; it runs in a task of its
own, which stores it in progress, then at its end (completed, incomplete, failed, or cancelled by
`cancel`), and holds its admission until that end is stored: a drain waits for it, as for any request, and
its deadline aborts it (failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from gracelm.engine.output_processor import RequestOutput
from gracelm.serving.api_errors import APIError
from gracelm.serving.request_client import RequestClient
from gracelm.serving.request_fields import refuse_fields
from gracelm.serving.response_store import ResponseStore, StoredResponse
from gracelm.serving.responses_output import Events, OutputBuilder, ended, failed, shell
from gracelm.serving.responses_protocol import (
    UNSUPPORTED,
    UNSUPPORTED_IN_STREAM_OPTIONS,
    UNSUPPORTED_IN_TEXT,
    ResponseObject,
    ResponsesRequest,
)
from gracelm.serving.responses_request import (
    PREVIOUS,
    chat_request,
    check_background,
    check_metadata,
    conversation,
    given_items,
    named_as_sent,
)
from gracelm.serving.serving_base import Run, ServingBase, SseDialect, StreamTally, final_usage
from gracelm.serving.serving_chat import ChatPlan, ServingChat
from gracelm.serving.tool_calls import StreamedChoice

logger = logging.getLogger(__name__)

UNFINISHED = ("queued", "in_progress")  # a background response's statuses before its end


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
        items = history + given_items(req.input)
        translated = conversation(req.instructions, items, len(history))
        hex_id = uuid.uuid4().hex
        with named_as_sent(translated.origins):
            plan = await self.chat.plan(chat_request(req, translated))
            request_id = client.request_id(hex_id, "resp")
            run = await self.start(client, [plan.prompt_ids], plan.params, request_id, "messages",
                                   api="responses")
        echoed = shell(req, f"resp_{hex_id}", self.model_name, stored)
        saved = _Saved(self.store, items) if stored else None
        if saved is not None and req.background:
            return await self._in_background(run, plan, echoed, saved, hex_id)
        if req.stream:
            events = Events(echoed, OutputBuilder(hex_id))
            dialect = SseDialect(events.failure, None)
            return self.sse(self._stream(run.deltas, plan, events, saved, request_id), run, dialect)
        final = await self.final_output(client, run)
        output = final.outputs[0]
        builder = OutputBuilder(hex_id)
        builder.feed(StreamedChoice(plan.tools, plan.text_reading).deltas(output.text, True))
        builder.finish(output.finish_reason)
        response = ended(echoed, builder, output.finish_reason,
                         final_usage(len(plan.prompt_ids), final, plan.reasoning))
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
        check_metadata(req.metadata)
        if req.background:
            check_background(req, self.store.enabled)
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
        builder = OutputBuilder(hex_id)
        try:
            try:
                end = await self._background_output(run, plan, shell, saved, builder)
            except asyncio.CancelledError:  # cancel(): closing the deltas aborts it in the engine
                end = shell.model_copy(update={"status": "cancelled", "output": list(builder.items)})
            except APIError as exc:
                end = failed(shell, builder, exc)
            with contextlib.suppress(APIError):  # logged by `save`; the response stays as last stored
                await saved.save(end)
        finally:
            run.admission.release()

    async def _background_output(self, run: Run, plan: ChatPlan, shell: ResponseObject, saved: _Saved,
                                 builder: OutputBuilder) -> ResponseObject:
        streamed = StreamedChoice(plan.tools, plan.text_reading)
        tally = StreamTally(len(plan.prompt_ids), plan.reasoning)
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
            return failed(shell, builder, error)
        builder.finish(finish_reason)
        return ended(shell, builder, finish_reason, tally.usage())

    async def _stream(self, deltas: AsyncIterator[RequestOutput], plan: ChatPlan, events: Events,
                      saved: _Saved | None, request_id: str) -> AsyncGenerator[str]:
        """The events of one response: created and in progress, each item's as it comes, then completed or
        incomplete; a response aborted or failed ends with its error (`Events.failure`)."""
        yield events.lifecycle("response.created")
        yield events.lifecycle("response.in_progress")
        streamed = StreamedChoice(plan.tools, plan.text_reading)
        tally = StreamTally(len(plan.prompt_ids), plan.reasoning)
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
        response = ended(events.shell, events.builder, finish_reason, tally.usage())
        if saved is not None:
            await saved.save(response)  # before the last event: a client may go on from it at once
        last = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield events.lifecycle(last, response)


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

