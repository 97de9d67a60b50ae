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
from gracelm.entrypoints.serving_base import ServingBase, sse_data, usage_of


class ServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest,
                     raw_request: Request) -> JSONResponse | StreamingResponse:
        self.check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
        prompt_ids = self._prompt_ids(req.prompt)
        self.check_length(len(prompt_ids), req.max_tokens, "prompt")
        request_id = self.new_request_id("cmpl")
        admission = self.state.admit()
        outputs = self.generate(prompt_ids, params, request_id, admission)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(request_id, outputs, params.n, req.logprobs, include_usage)
            return self.sse(events, admission)
        try:
            final = await self.final_output(raw_request, outputs)
        finally:
            admission.release()
        choices = [CompletionChoice(index=o.index, text=o.text, finish_reason=o.finish_reason,
                                    logprobs=self._logprobs(o, 0, 0, req.logprobs)) for o in final.outputs]
        body = CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=usage_of(final))
        return JSONResponse(body.model_dump())

    def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        """One prompt as token ids; a batch of one is unwrapped, a larger batch refused."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        # Checked here, not left to the engine: a stream has answered 200 before the engine sees the prompt.
        vocab = self.engine.model_config.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return ids

    def _events(self, request_id: str, outputs: AsyncIterator[RequestOutput], n: int,
                top: int | None, include_usage: bool) -> AsyncGenerator[str]:
        created = int(time.time())
        exclude = None if include_usage else {"usage"}

        def chunk(choice: CompletionChoice | None, usage: Usage | None = None) -> str:
            return sse_data(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                               choices=[choice] if choice else [], usage=usage), exclude)

        def choice_chunk(o: CompletionOutput, start_token: int, start_char: int) -> str:
            return chunk(CompletionChoice(index=o.index, text=o.text[start_char:],
                                          logprobs=self._logprobs(o, start_token, start_char, top),
                                          finish_reason=o.finish_reason))

        usage = (lambda u: chunk(None, u)) if include_usage else None
        return self.stream(outputs, n, [], choice_chunk, usage)

    def _logprobs(self, o: CompletionOutput, start: int, offset: int,
                  top: int | None) -> CompletionLogprobs | None:
        """The legacy logprobs object for tokens from `start` on, their text starting at char `offset`."""
        if top is None or o.logprobs is None:
            return None
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, candidates in zip(o.token_ids[start:], o.logprobs[start:], strict=False):
            text = self.token_text(token_id, candidates[token_id])
            ranked = sorted(candidates.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top]
            result.tokens.append(text)
            result.token_logprobs.append(candidates[token_id].logprob)
            result.top_logprobs.append({self.token_text(t, lp): lp.logprob for t, lp in ranked})
            result.text_offset.append(offset)
            offset += len(text)
        return result
