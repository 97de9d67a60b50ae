"""`POST /v1/completions`: text or token-id prompts continued, answered plain or as SSE chunks. Several
prompts in one request run together (`prompt_batch.py`); choice `i * n + j` is the j-th of prompt i.

`echo` with `logprobs` scores the prompt too (its tokens lead the choice's logprobs, the first without a
logprob, as OpenAI answers); with `max_tokens: 0` it scores the prompt only: one token is generated, as the
engine always does, and left out of the answer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable

from fastapi.responses import StreamingResponse

from gracelm.engine.output_processor import CompletionOutput, Logprob, RequestOutput
from gracelm.sampling_params import SamplingParams
from gracelm.serving.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from gracelm.serving.request_client import RequestClient
from gracelm.serving.request_fields import refuse_unsupported, truncate_prompt
from gracelm.serving.serving_base import (
    ServingBase,
    StreamTally,
    final_usage,
    sse_data,
    token_label,
)


@dataclasses.dataclass
class CompletionPlan:
    """A completions request as it would run: each prompt's token ids and the sampling they share;
    `score_only`: the prompts are scored and the one token generated is left out of the answer."""

    prompts: list[list[int]]
    params: SamplingParams
    score_only: bool


class ServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest,
                     client: RequestClient) -> CompletionResponse | StreamingResponse:
        """The answer to `req` from `client`: whole, or with `stream` an SSE response; raises `APIError`."""
        plan = await self.plan(req)
        prompts, params = plan.prompts, plan.params
        request_id = client.request_id(req.named_id, "cmpl")
        run = await self.start(client, prompts, params, request_id, "prompt",
                               api="completions", priority=client.priority(req.priority))
        echoes = [self.engine.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
                  for ids in prompts]
        num_prompt_tokens = sum(len(ids) for ids in prompts)
        if req.stream:
            events = self._stream(request_id, run.deltas, num_prompt_tokens, params.n, req, echoes, prompts)
            return self.sse(events, run)
        final = await self.final_output(client, run)
        if plan.score_only:
            final.outputs = [_prompt_only(o) for o in final.outputs]
        choices = []
        for o in final.outputs:
            prompt, echo = prompts[o.index // params.n], echoes[o.index // params.n]
            choices.append(CompletionChoice(
                index=o.index, text=echo + o.text, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                logprobs=self._logprobs(o, len(echo), req, prompt if req.echo else None),
                prompt_logprobs=self.vllm_prompt_logprobs(prompt, o.prompt_logprobs, req.prompt_logprobs)))
        usage = final_usage(num_prompt_tokens, final)
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    async def plan(self, req: CompletionRequest) -> CompletionPlan:
        """`req` checked (a field refused, a value out of range, no room for `max_tokens`: `APIError`) and
        turned into what the engine runs; the render route answers this without running it."""
        self.check_model(req.model)
        refuse_unsupported(req)
        self.check_logprobs(req.logprobs, "logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        score_only = req.echo and req.max_tokens == 0
        params = await self.sampling_params(req, max_tokens=1 if score_only else req.max_tokens,
                                            logprobs=req.logprobs)
        params = self.with_prompt_logprobs(params, req.stream, req.prompt_logprobs,
                                           req.logprobs if req.echo else None)
        prompts = self._prompts(req)
        for ids in prompts:
            self.check_room(ids, req.max_tokens)
        return CompletionPlan(prompts, params, score_only)

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
                      n: int, req: CompletionRequest, echoes: list[str],
                      prompts: list[list[int]]) -> AsyncGenerator[str]:
        """The SSE chunks of one request: a chunk per delta of each choice (the first of each led by its
        prompt and, with logprobs, the prompt's logprobs, when echoed), then the usage chunk if asked and an
        error event if the server aborted it (`sse` adds `[DONE]`)."""
        created = int(time.time())
        total = n * len(echoes)
        # Where each choice's next token starts, for logprobs' text_offset: counted over the tokens' texts,
        # as the plain answer counts them (a delta's text can differ: some of it may be held back).
        text_offsets = [len(echoes[index // n]) for index in range(total)]
        started = [False] * total
        tally = StreamTally(num_prompt_tokens)
        async for delta in deltas:
            for o in delta.outputs:
                if req.echo and req.max_tokens == 0:
                    o = _prompt_only(o)
                tally.add(o)
                leads = req.echo and not started[o.index]
                text = echoes[o.index // n] + o.text if leads else o.text
                started[o.index] = True
                prompt = prompts[o.index // n] if leads else None
                logprobs = self._logprobs(o, text_offsets[o.index], req, prompt)
                choice = CompletionChoice(index=o.index, text=text, finish_reason=o.finish_reason,
                                          stop_reason=o.stop_reason, logprobs=logprobs)
                if logprobs is not None and logprobs.tokens:
                    text_offsets[o.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
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

    def _logprobs(self, o: CompletionOutput, offset: int, req: CompletionRequest,
                  prompt: list[int] | None) -> CompletionLogprobs | None:
        """The legacy logprobs object: the echoed `prompt`'s tokens first, if given (their text from char 0),
        then the tokens of `o`, their text starting at char `offset`."""
        if req.logprobs is None or o.logprobs is None:
            return None
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        if prompt is not None and o.prompt_logprobs is not None:
            self._add_logprobs(result, zip(prompt, o.prompt_logprobs, strict=True), 0, req)
        self._add_logprobs(result, zip(o.token_ids, o.logprobs, strict=False), offset, req)
        return result

    def _add_logprobs(self, result: CompletionLogprobs,
                      tokens: Iterable[tuple[int, dict[int, Logprob] | None]], offset: int,
                      req: CompletionRequest) -> None:
        """Appends each token with its logprob and the `logprobs` most likely at its place (none for the
        prompt's first token, which nothing before it scores)."""
        as_ids, tokenizer = req.return_tokens_as_token_ids, self.engine.tokenizer
        for token_id, candidates in tokens:
            text = token_label(tokenizer, token_id, candidates[token_id] if candidates else None, as_ids)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if candidates is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            ranked = sorted(candidates.items(), key=lambda kv: kv[1].logprob, reverse=True)[:req.logprobs]
            result.token_logprobs.append(candidates[token_id].logprob)
            result.top_logprobs.append({token_label(tokenizer, t, lp, as_ids): lp.logprob
                                        for t, lp in ranked})


def _prompt_only(o: CompletionOutput) -> CompletionOutput:
    """A choice of a request that scores its prompt only (`echo` with `max_tokens: 0`): the token the engine
    generated is left out; a choice that ended badly keeps its finish reason."""
    finish_reason = o.finish_reason if o.finish_reason in (None, "abort", "error") else "length"
    return dataclasses.replace(o, text="", token_ids=[], logprobs=[] if o.logprobs is not None else None,
                               finish_reason=finish_reason, stop_reason=None)
