"""`POST /v1/completions`: text or token-id prompts continued, answered plain or as SSE chunks. Several
prompts in one request run together (`prompt_batch.py`); choice `i * n + j` is the j-th of prompt i."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gracelm.engine.outputs import CompletionOutput, RequestOutput
from gracelm.entrypoints import request_ids
from gracelm.entrypoints.api_errors import APIError
from gracelm.entrypoints.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from gracelm.entrypoints.request_fields import refuse_unsupported, truncate_prompt
from gracelm.entrypoints.serving_base import ServingBase, StreamTally, final_usage, sse_data


class ServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest,
                     raw_request: Request) -> JSONResponse | StreamingResponse:
        self.check_model(req.model)
        refuse_unsupported(req)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported by this server: it needs the prompt's "
                                "logprobs, which are not supported yet", param="echo",
                           code="unsupported_parameter")
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
        prompts = self._prompts(req)
        for ids in prompts:
            self.check_room(ids, req.max_tokens)
        request_id = request_ids.assign(raw_request, req.request_id, "cmpl")
        run = await self.start(prompts, params, request_id, "prompt")
        echoes = [self.engine.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
                  for ids in prompts]
        num_prompt_tokens = sum(len(ids) for ids in prompts)
        if req.stream:
            events = self._stream(request_id, run.deltas, num_prompt_tokens, params.n, req, echoes)
            return self.sse(events, run)
        final = await self.final_output(raw_request, run)
        choices = [CompletionChoice(index=o.index, text=echoes[o.index // params.n] + o.text,
                                    finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                    logprobs=self._logprobs(o, 0, req.logprobs)) for o in final.outputs]
        usage = final_usage(num_prompt_tokens, final)
        body = CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Each prompt as token ids (a text is encoded with the tokenizer's special tokens unless
        `add_special_tokens` is false), truncated if asked."""
        prompt = req.prompt
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        batch = prompt if several else [prompt]
        add_special = req.add_special_tokens is not False
        assert self.engine.config.max_model_len is not None
        return [truncate_prompt(self.engine.tokenizer.encode(p, add_special_tokens=add_special)
                                if isinstance(p, str) else list(p),
                                req.truncate_prompt_tokens, self.engine.config.max_model_len) for p in batch]

    async def _stream(self, request_id: str, deltas: AsyncIterator[RequestOutput], num_prompt_tokens: int,
                      n: int, req: CompletionRequest, echoes: list[str]) -> AsyncGenerator[str]:
        """The SSE chunks of one request: a chunk per delta of each choice (the first of each led by its
        prompt when echoed), then the usage chunk if asked and an error event if the server aborted it
        (`sse` adds `[DONE]`)."""
        created = int(time.time())
        total = n * len(echoes)
        text_offsets = [0] * total  # characters each choice has streamed so far, for logprobs' text_offset
        started = [False] * total
        tally = StreamTally(num_prompt_tokens)
        async for delta in deltas:
            for o in delta.outputs:
                tally.add(o)
                text = o.text if started[o.index] else echoes[o.index // n] + o.text
                started[o.index] = True
                choice = CompletionChoice(index=o.index, text=text, finish_reason=o.finish_reason,
                                          stop_reason=o.stop_reason,
                                          logprobs=self._logprobs(o, text_offsets[o.index], req.logprobs))
                text_offsets[o.index] += len(o.text)
                usage = tally.usage() if req.continuous_usage else None
                yield self._chunk(request_id, created, req.include_usage or usage is not None, choice, usage)
        if req.include_usage:
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
