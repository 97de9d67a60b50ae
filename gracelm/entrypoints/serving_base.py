"""What the chat and completion endpoints share: validation, admission, running a request in the engine
with its metrics, watching the client so a disconnect aborts the request at once, and SSE framing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gracelm.engine.errors import EngineDeadError
from gracelm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from gracelm.entrypoints.api_errors import APIError, from_value_error
from gracelm.entrypoints.openai_protocol import SamplingFields, Usage
from gracelm.entrypoints.server_state import Admission, Lifecycle, ServerState
from gracelm.metrics import ServerMetrics
from gracelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# Renders one choice's new tokens: (output, first unsent token, first unsent character) -> an SSE event.
ChoiceChunk = Callable[[CompletionOutput, int, int], str]


class ServingBase:
    """One endpoint's access to the engine; subclasses turn requests and outputs into OpenAI's shapes."""

    def __init__(self, engine, state: ServerState, metrics: ServerMetrics, model_name: str) -> None:
        self.engine = engine
        self.state = state
        self.metrics = metrics
        self.model_name = model_name
        self.max_model_len: int = engine.config.max_model_len

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"the model `{requested}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")

    def sampling_params(self, req: SamplingFields, *, max_tokens: int | None,
                        logprobs: int | None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        fields = dict(n=req.n, max_tokens=max_tokens, seed=req.seed, stop=stop,
                      presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                      ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids or []),
                      logprobs=logprobs, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      min_p=req.min_p, repetition_penalty=req.repetition_penalty)
        try:
            # Fields the client left out keep SamplingParams' defaults.
            return SamplingParams(**{k: v for k, v in fields.items() if v is not None or k == "max_tokens"})
        except ValueError as exc:
            raise from_value_error(exc) from None

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> None:
        """Refuses prompts that leave no room, or not `max_tokens` of room, in the context."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens but this model's context is "
                                f"{limit} tokens; shorten the prompt", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(400, f"this model's context is {limit} tokens, but {num_prompt_tokens} prompt "
                                f"tokens plus max_tokens={max_tokens} exceed it; lower max_tokens",
                           param="max_tokens", code="context_length_exceeded")

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       admission: Admission) -> AsyncIterator[RequestOutput]:
        """The engine's cumulative outputs for one request, with metrics; closing it aborts the request.

        The caller releases `admission` when the request leaves; this marks it started at the first output.
        """
        tracker = self.metrics.request_tracker(len(prompt_token_ids))
        last: RequestOutput | None = None
        try:
            stream = self.engine.generate(prompt_token_ids, params, request_id)
            async with contextlib.aclosing(stream) as outs:
                async for out in outs:
                    admission.started()
                    tracker.on_output(sum(len(o.token_ids) for o in out.outputs))
                    last = out
                    yield out
        except ValueError as exc:
            raise from_value_error(exc) from None
        except EngineDeadError as exc:
            self.state.set(Lifecycle.DEAD)
            raise APIError(500, f"the engine is dead: {exc}", code="engine_dead") from None
        finally:
            if last is not None:  # a request the engine refused outright never ran: nothing to count
                tracker.on_finish([o.finish_reason for o in last.outputs])

    async def final_output(self, raw_request: Request,
                           outputs: AsyncGenerator[RequestOutput]) -> RequestOutput:
        """The last output of a request, unless the client leaves first: then the request is aborted."""
        collect = asyncio.ensure_future(_last(outputs))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (collect, disconnect):
                task.cancel()
        if not collect.done() or collect.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            await outputs.aclose()  # aborts the request in the engine, also if the task never started
            logger.info("client disconnected; request aborted")
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        final = collect.result()
        if any(o.finish_reason == "abort" for o in final.outputs):
            raise aborted_error()
        return final

    async def stream(self, outputs: AsyncIterator[RequestOutput], n: int, first: list[str],
                     choice_chunk: ChoiceChunk, usage_chunk: Callable[[Usage], str] | None,
                     ) -> AsyncGenerator[str]:
        """A request's SSE events: `first`, then a chunk for each choice that moved
        (`choice_chunk(output, its first unsent token, its first unsent char)`), the usage chunk if asked,
        an error event if the request was aborted, and `[DONE]` in every case, so that no client waits on
        a stream that has ended."""
        sent_chars, sent_tokens, done = [0] * n, [0] * n, [False] * n
        last: RequestOutput | None = None
        try:
            for event in first:
                yield event
            async for last in outputs:
                for o in last.outputs:
                    i = o.index
                    if done[i] or (len(o.token_ids) == sent_tokens[i] and not o.finished):
                        continue
                    event = choice_chunk(o, sent_tokens[i], sent_chars[i])
                    sent_chars[i], sent_tokens[i], done[i] = len(o.text), len(o.token_ids), o.finished
                    yield event
            if usage_chunk is not None and last is not None:
                yield usage_chunk(usage_of(last))
            if last is not None and any(o.finish_reason == "abort" for o in last.outputs):
                yield sse_data(aborted_error().body())
        except APIError as exc:
            yield sse_data(exc.body())
        yield "data: [DONE]\n\n"

    def token_text(self, token_id: int, logprob: Logprob) -> str:
        if logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.engine.tokenizer.decode([token_id])

    @staticmethod
    def sse(events: AsyncGenerator[str], admission: Admission) -> StreamingResponse:
        return _AdmittedStream(events, admission)


class _AdmittedStream(StreamingResponse):
    """An SSE response that, however it ends (done, client gone, cancelled, never started), closes its
    event generator, which aborts the request in the engine, and releases the request's admission."""

    def __init__(self, events: AsyncGenerator[str], admission: Admission) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._admission = admission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            self._admission.release()


def sse_data(payload: BaseModel | dict | str, exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude=exclude)
    elif isinstance(payload, dict):
        text = json.dumps(payload)
    else:
        text = payload
    return f"data: {text}\n\n"


def usage_of(out: RequestOutput) -> Usage:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in out.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def aborted_error() -> APIError:
    """What a request the server aborted gets: never a 200 with half an answer (vLLM #57082)."""
    return APIError(503, "the request was aborted by the server before it finished", code="request_aborted")


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in outputs:
        last = out
    if last is None:
        raise APIError(500, "the engine returned no output")
    return last


async def _wait_for_disconnect(raw_request: Request) -> None:
    # The body has been read already, so the next message the server gives us is the disconnect.
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
