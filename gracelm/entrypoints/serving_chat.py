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
from gracelm.entrypoints.serving_base import ServingBase, sse_data, usage_of


class ServingChat(ServingBase):
    async def create(self, req: ChatCompletionRequest,
                     raw_request: Request) -> JSONResponse | StreamingResponse:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be between 0 and 20, got {req.top_logprobs}",
                           param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=top)
        prompt_ids = self._apply_template(req.messages)
        self.check_length(len(prompt_ids), max_tokens, "messages")
        request_id = self.new_request_id("chatcmpl")
        admission = self.state.admit()
        outputs = self.generate(prompt_ids, params, request_id, admission)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self.sse(self._events(request_id, outputs, params.n, top, include_usage), admission)
        try:
            final = await self.final_output(raw_request, outputs)
        finally:
            admission.release()
        return JSONResponse(self._response(request_id, final, top).model_dump())

    def _apply_template(self, messages: list[ChatMessage]) -> list[int]:
        plain = [{"role": m.role, "content": _text_of(m, i)} for i, m in enumerate(messages)]
        try:
            return list(self.engine.tokenizer.apply_chat_template(plain, add_generation_prompt=True))
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise APIError(400, f"the messages do not fit the model's chat template: {exc}",
                           param="messages") from None

    def _response(self, request_id: str, final: RequestOutput, top: int | None) -> ChatCompletionResponse:
        choices = [ChatChoice(index=o.index, message=AssistantMessage(content=o.text),
                              logprobs=self._logprobs(o, 0, top), finish_reason=o.finish_reason)
                   for o in final.outputs]
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=usage_of(final))

    def _events(self, request_id: str, outputs: AsyncIterator[RequestOutput], n: int, top: int | None,
                include_usage: bool) -> AsyncGenerator[str]:
        created = int(time.time())
        exclude = None if include_usage else {"usage"}

        def chunk(choice: ChatChunkChoice | None, usage: Usage | None = None) -> str:
            return sse_data(ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                                choices=[choice] if choice else [], usage=usage), exclude)

        def choice_chunk(o: CompletionOutput, start_token: int, start_char: int) -> str:
            text = o.text[start_char:]
            delta = DeltaMessage(content=text) if text else DeltaMessage()
            logprobs = self._logprobs(o, start_token, top)
            return chunk(ChatChunkChoice(index=o.index, delta=delta, logprobs=logprobs,
                                         finish_reason=o.finish_reason))

        roles = [chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
                 for i in range(n)]
        usage = (lambda u: chunk(None, u)) if include_usage else None
        return self.stream(outputs, n, roles, choice_chunk, usage)

    def _logprobs(self, o: CompletionOutput, start: int, top: int | None) -> ChatLogprobs | None:
        """OpenAI's per-token logprobs for the tokens of `o` from position `start` on."""
        if top is None or o.logprobs is None:
            return None
        content = []
        for token_id, candidates in zip(o.token_ids[start:], o.logprobs[start:], strict=False):
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
