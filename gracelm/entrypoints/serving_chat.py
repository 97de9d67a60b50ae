"""`POST /v1/chat/completions`: messages through the chat template, answers plain or as SSE chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gracelm.engine.outputs import CompletionOutput, RequestOutput
from gracelm.entrypoints.api_errors import APIError
from gracelm.entrypoints.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    Usage,
)
from gracelm.entrypoints.serving_base import ServingBase, StreamTally, final_usage, sse_data


class ServingChat(ServingBase):
    async def create(self, req: ChatCompletionRequest,
                     raw_request: Request) -> JSONResponse | StreamingResponse:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=top)
        prompt_ids = self._apply_template(req.messages)
        self.check_room(prompt_ids, max_tokens)
        run = self.start(prompt_ids, params, "chatcmpl", "messages")
        request_id = run.request_id
        if req.stream:
            events = self._stream(request_id, run.deltas, len(prompt_ids), params.n, top, req.include_usage)
            return self.sse(events, run)
        final = await self.final_output(raw_request, run)
        choices = [ChatChoice(index=o.index, message=AssistantMessage(content=o.text),
                              logprobs=self._logprobs(o, top), finish_reason=o.finish_reason)
                   for o in final.outputs]
        usage = final_usage(len(prompt_ids), final)
        body = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())

    def _apply_template(self, messages: list[ChatMessage]) -> list[int]:
        plain = [{"role": m.role, "content": _text_of(m, i)} for i, m in enumerate(messages)]
        try:
            return list(self.engine.tokenizer.apply_chat_template(plain, add_generation_prompt=True))
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise APIError(400, f"the messages do not fit the model's chat template: {exc}",
                           param="messages") from None

    async def _stream(self, request_id: str, deltas: AsyncIterator[RequestOutput], num_prompt_tokens: int,
                      n: int, top: int | None, include_usage: bool) -> AsyncGenerator[str]:
        """The SSE chunks of one request: a role chunk per choice, a chunk per delta of each choice, then
        the usage chunk if asked and an error event if it was aborted or failed (`sse` adds `[DONE]`)."""
        created = int(time.time())
        tally = StreamTally(num_prompt_tokens)
        for index in range(n):
            role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            yield self._chunk(request_id, created, include_usage, role)
        async for delta in deltas:
            for o in delta.outputs:
                tally.add(o)
                content = DeltaMessage(content=o.text) if o.text else DeltaMessage()
                choice = ChatChunkChoice(index=o.index, delta=content, logprobs=self._logprobs(o, top),
                                         finish_reason=o.finish_reason)
                yield self._chunk(request_id, created, include_usage, choice)
        if include_usage:
            yield self._chunk(request_id, created, True, None, tally.usage())
        event = tally.error_event(request_id)
        if event is not None:
            yield event

    def _chunk(self, request_id: str, created: int, include_usage: bool, choice: ChatChunkChoice | None,
               usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                    choices=[choice] if choice else [], usage=usage)
        return sse_data(chunk, None if include_usage else {"usage"})

    def _logprobs(self, o: CompletionOutput, top: int | None) -> ChatLogprobs | None:
        """OpenAI's per-token logprobs for the tokens of `o`."""
        if top is None or o.logprobs is None:
            return None
        content = []
        for token_id, candidates in zip(o.token_ids, o.logprobs, strict=False):
            ranked = sorted(candidates.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top]
            alternatives = [TopLogprob(token=self.token_text(t, lp), logprob=lp.logprob,
                                       bytes=list(self.token_text(t, lp).encode())) for t, lp in ranked]
            sampled = candidates[token_id]
            text = self.token_text(token_id, sampled)
            content.append(ChatTokenLogprob(token=text, logprob=sampled.logprob, bytes=list(text.encode()),
                                            top_logprobs=alternatives))
        return ChatLogprobs(content=content)


def _text_of(message: ChatMessage, index: int) -> str:
    """A message's content as text; content parts other than text are refused, this server reads text."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{index}]: only text content parts are supported, got "
                                f"{part.get('type')!r}", param=f"messages.{index}.content")
        texts.append(part["text"])
    return "".join(texts)
