"""`POST /v1/chat/completions`: messages through the chat template, answers plain or as SSE chunks."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec
from fastapi.responses import StreamingResponse

from gracelm.engine.output_processor import CompletionOutput, RequestOutput
from gracelm.sampling_params import SamplingParams
from gracelm.serving import chat_prompt, tool_calls, tool_parsers
from gracelm.serving.api_errors import APIError
from gracelm.serving.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    Usage,
)
from gracelm.serving.reasoning_parsers import NO_REASONING, ReasoningPlan
from gracelm.serving.request_client import RequestClient
from gracelm.serving.request_fields import refuse_unsupported
from gracelm.serving.serving_base import (
    ServingBase,
    StreamTally,
    final_usage,
    sse_data,
    token_label,
)
from gracelm.serving.tool_calls import StreamedChoice, ToolPlan, final_message

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ChatPlan:
    """A chat request as it would run: its prompt after the chat template, its sampling, its tools, the
    top-N logprobs its answer shows (None: no logprobs), and how its thinking is read (None: the server
    has no reasoning parser)."""

    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan
    top: int | None
    reasoning: ReasoningPlan | None = None

    @property
    def text_reading(self) -> ReasoningPlan:
        return self.reasoning or NO_REASONING


class ServingChat(ServingBase):
    async def create(self, req: ChatCompletionRequest,
                     client: RequestClient) -> ChatCompletionResponse | StreamingResponse:
        """The answer to `req` from `client`: whole, or with `stream` an SSE response; raises `APIError`."""
        plan = await self.plan(req)
        prompt_ids, params, top = plan.prompt_ids, plan.params, plan.top
        request_id = client.request_id(req.named_id, "chatcmpl")
        run = await self.start(client, [prompt_ids], params, request_id, "messages",
                               api="chat_completions", priority=client.priority(req.priority))
        echo = chat_prompt.echo_text(req)
        # OpenAI names the tier that served the request when one was asked for: here, always the default.
        tier = "default" if req.service_tier is not None else None
        if req.stream:
            events = self._stream(request_id, run.deltas, len(prompt_ids), params.n, top, req, echo, tier,
                                  plan)
            return self.sse(events, run)
        final = await self.final_output(client, run)
        choices = []
        for o in final.outputs:
            message, finish_reason = final_message(o.text, o.finish_reason, plan.tools, plan.text_reading)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatChoice(index=o.index, message=message, logprobs=self._logprobs(o, top, req),
                                      finish_reason=finish_reason, stop_reason=o.stop_reason))
        usage = final_usage(len(prompt_ids), final, plan.reasoning)
        scored = self.vllm_prompt_logprobs(prompt_ids, final.outputs[0].prompt_logprobs, req.prompt_logprobs)
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage,
                                      service_tier=tier, prompt_logprobs=scored)

    async def plan(self, req: ChatCompletionRequest) -> ChatPlan:
        """`req` checked (a field refused, a value out of range, no room for `max_tokens`: `APIError`) and
        turned into what the engine runs; the render route answers this without running it."""
        self.check_model(req.model)
        refuse_unsupported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = await self.sampling_params(req, max_tokens=max_tokens, logprobs=top)
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        params = self.with_prompt_logprobs(params, req.stream, req.prompt_logprobs)
        tools = tool_calls.plan(req.tools, req.tool_choice, req.parallel_tool_calls, self._tool_parser)
        params = tool_calls.constrained(params, tools)
        if tools.schema is not None:
            await self.grammars.check(params.structured_outputs, "tools", params.allowed_token_ids)
        assert self.engine.config.max_model_len is not None
        prompt_ids = await chat_prompt.prompt_ids(self.engine.tokenizer, req,
                                                  self.engine.config.max_model_len, tools.tools,
                                                  self.served.template_budget)
        self.check_room(prompt_ids, max_tokens)
        reasoning = self._reasoning(req, prompt_ids)
        if reasoning is not None and reasoning.span is not None and params.structured_outputs is not None:
            params = msgspec.structs.replace(params, thinking=reasoning.span)
        return ChatPlan(prompt_ids, params, tools, top, reasoning)

    def _reasoning(self, req: ChatCompletionRequest, prompt_ids: list[int]) -> ReasoningPlan | None:
        """How the output of `prompt_ids` is read, with the request's switches: SGLang's
        `separate_reasoning` (false: the thinking stays in the content) and vLLM's `include_reasoning`
        (false: the thinking is left out)."""
        parser = self.served.reasoning
        if parser is None:
            return None
        if req.stream and not req.stream_reasoning:
            raise APIError(400, "stream_reasoning: false is not supported: the reasoning is streamed as it "
                                "comes (send include_reasoning: false to leave it out)",
                           param="stream_reasoning", code="unsupported_parameter")
        return dataclasses.replace(parser.plan(prompt_ids, self.engine.tokenizer),
                                   separated=req.separate_reasoning, shown=req.include_reasoning)

    async def _stream(self, request_id: str, deltas: AsyncIterator[RequestOutput], num_prompt_tokens: int,
                      n: int, top: int | None, req: ChatCompletionRequest, echo: str,
                      tier: str | None, plan: ChatPlan) -> AsyncGenerator[str]:
        """The SSE chunks of one request: a role chunk per choice (with the echoed text, if asked), a chunk
        per delta of each choice, then the usage chunk if asked and an error event if it was aborted or
        failed (`sse` adds `[DONE]`). A tool call takes chunks of its own: its id and name, then its
        arguments."""
        created = int(time.time())
        streamed = [StreamedChoice(plan.tools, plan.text_reading) for _ in range(n)]
        tally = StreamTally(num_prompt_tokens, plan.reasoning)
        usage_in_chunks = req.include_usage or req.continuous_usage

        def chunk(choice: ChatChunkChoice | None, usage: Usage | None = None) -> str:
            body = ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                       choices=[choice] if choice else [], usage=usage, service_tier=tier)
            return sse_data(body, None if usage_in_chunks else {"usage"})

        for index in range(n):
            yield chunk(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=echo)))
        async for delta in deltas:
            for o in delta.outputs:
                tally.add(o)
                *before, last = streamed[o.index].deltas(o.text, o.finish_reason is not None)
                for piece in before:
                    yield chunk(ChatChunkChoice(index=o.index, delta=piece))
                finish_reason = streamed[o.index].finish_reason(o.finish_reason)
                choice = ChatChunkChoice(index=o.index, delta=last, logprobs=self._logprobs(o, top, req),
                                         finish_reason=finish_reason, stop_reason=o.stop_reason)
                yield chunk(choice, tally.usage() if req.continuous_usage else None)
        if req.include_usage:
            yield chunk(None, tally.usage())
        event = tally.error_event(request_id)
        if event is not None:
            yield event

    @functools.cached_property
    def _tool_parser(self) -> str:
        """The family parser `auto` tool choices are read with; resolved at the first request, after
        `--chat-template` has set the template."""
        chosen = tool_parsers.resolve(self.served.tool_call_parser, self.engine.tokenizer.chat_template)
        logger.info("tool calls are read with the %s parser (--tool-call-parser %s)", chosen,
                    self.served.tool_call_parser)
        return chosen

    def _logprobs(self, o: CompletionOutput, top: int | None,
                  req: ChatCompletionRequest) -> ChatLogprobs | None:
        """OpenAI's per-token logprobs for the tokens of `o` (named "token_id:N" if the request asks)."""
        if top is None or o.logprobs is None:
            return None
        content = []
        as_ids, tokenizer = req.return_tokens_as_token_ids, self.engine.tokenizer
        for token_id, candidates in zip(o.token_ids, o.logprobs, strict=False):
            ranked = sorted(candidates.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top]
            labels = [(token_label(tokenizer, t, lp, as_ids), lp.logprob) for t, lp in ranked]
            alternatives = [TopLogprob(token=label, logprob=logprob, bytes=list(label.encode()))
                            for label, logprob in labels]
            sampled = candidates[token_id]
            text = token_label(tokenizer, token_id, sampled, as_ids)
            content.append(ChatTokenLogprob(token=text, logprob=sampled.logprob, bytes=list(text.encode()),
                                            top_logprobs=alternatives))
        return ChatLogprobs(content=content)

