"""`POST /v1/completions`: a text or token-id prompt continued, answered plain or as SSE chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gracelm.engine.outputs import CompletionOutput, RequestOutput
from gracelm.entrypoints.api_errors import APIError
from gracelm.entrypoints.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from gracelm.entrypoints.serving_base import ServingBase, StreamTally, final_usage, sse_data


class ServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest,
                     raw_request: Request) -> JSONResponse | StreamingResponse:
        self.check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        self.check_logprobs(req.logprobs, "logprobs")
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
        prompt_ids = self._prompt_ids(req.prompt)
        self.check_room(prompt_ids, req.max_tokens)
        run = self.start(prompt_ids, params, "cmpl", "prompt")
        request_id = run.request_id
        if req.stream:
            events = self._stream(request_id, run.deltas, len(prompt_ids), params.n, req.logprobs,
                                  req.include_usage)
            return self.sse(events, run)
        final = await self.final_output(raw_request, run)
        choices = [CompletionChoice(index=o.index, text=o.text, finish_reason=o.finish_reason,
                                    logprobs=self._logprobs(o, 0, req.logprobs)) for o in final.outputs]
        usage = final_usage(len(prompt_ids), final)
        body = CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())

    def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        """One prompt as token ids; a batch of one is unwrapped, a larger batch refused."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        return self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    async def _stream(self, request_id: str, deltas: AsyncIterator[RequestOutput], num_prompt_tokens: int,
                      n: int, top: int | None, include_usage: bool) -> AsyncGenerator[str]:
        """The SSE chunks of one request: a chunk per delta of each choice, then the usage chunk if asked
        and an error event if the server aborted it (`sse` adds `[DONE]`)."""
        created = int(time.time())
        text_offsets = [0] * n  # characters each choice has streamed so far, for logprobs' text_offset
        tally = StreamTally(num_prompt_tokens)
        async for delta in deltas:
            for o in delta.outputs:
                tally.add(o)
                choice = CompletionChoice(index=o.index, text=o.text, finish_reason=o.finish_reason,
                                          logprobs=self._logprobs(o, text_offsets[o.index], top))
                text_offsets[o.index] += len(o.text)
                yield self._chunk(request_id, created, include_usage, choice)
        if include_usage:
            yield self._chunk(request_id, created, True, None, tally.usage())
        event = tally.error_event(request_id)
        if event is not None:
            yield event

    def _chunk(self, request_id: str, created: int, include_usage: bool, choice: CompletionChoice | None,
               usage: Usage | None = None) -> str:
        # OpenAI streams the completions endpoint's chunks in the shape of its plain answer.
        chunk = CompletionResponse(id=request_id, created=created, model=self.model_name,
                                   choices=[choice] if choice else [], usage=usage)
        return sse_data(chunk, None if include_usage else {"usage"})

    def _logprobs(self, o: CompletionOutput, offset: int, top: int | None) -> CompletionLogprobs | None:
        """The legacy logprobs object for the tokens of `o`, their text starting at char `offset`."""
        if top is None or o.logprobs is None:
            return None
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, candidates in zip(o.token_ids, o.logprobs, strict=False):
            text = self.token_text(token_id, candidates[token_id])
            ranked = sorted(candidates.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top]
            result.tokens.append(text)
            result.token_logprobs.append(candidates[token_id].logprob)
            result.top_logprobs.append({self.token_text(t, lp): lp.logprob for t, lp in ranked})
            result.text_offset.append(offset)
            offset += len(text)
        return result
