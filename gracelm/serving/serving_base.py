"""What the chat and completion endpoints share: sampling parameters from a request, the prompt's checks,
admission, running a request in the engine with its metrics, watching the client so that a disconnect
aborts the request at once, and SSE framing. Each endpoint writes its own SSE loop over the engine's deltas.
Who sent the request (an HTTP client or a batch line) is a `RequestClient` (`request_client.py`).

How tokens are named in answers' logprobs, and vLLM's `prompt_logprobs`: the request fields that ask for
them and the shape they are answered in.

`return_tokens_as_token_ids` (vLLM's) names each token of the logprobs "token_id:N", so that a client can
tell tokens apart whose text is the same or not valid UTF-8 on its own. `prompt_logprobs: N` returns, for
each prompt token after the first, its logprob and rank and the N most likely tokens at its place; it is
refused on a stream, as vLLM refuses it. Prompt logprobs are computed in prefill, which then skips the prefix
cache (cached blocks have no logits).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable

import msgspec
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.errors import EngineDeadError
from gracelm.engine.frontend import PromptError, TaskError, check_priority, context_overflow_message
from gracelm.engine.output_processor import CompletionOutput, Logprob, RequestOutput
from gracelm.lifecycle.server_state import ServerState
from gracelm.model.tokenizer import Tokenizer
from gracelm.observability.metrics import ServerMetrics
from gracelm.sampling_params import SamplingParams
from gracelm.serving import admission_control, prompt_batch
from gracelm.serving.api_errors import APIError, from_value_error
from gracelm.serving.grammar_checker import GrammarChecker
from gracelm.serving.openai_protocol import (
    CompletionTokensDetails,
    PromptLogprob,
    PromptLogprobs,
    SamplingFields,
    Usage,
)
from gracelm.serving.reasoning_parsers import ReasoningPlan
from gracelm.serving.request_client import HeldAdmission, RequestClient
from gracelm.serving.request_fields import RequestLimits, constraint_fields
from gracelm.serving.serving_options import ServingOptions

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


class ServingBase:
    """One endpoint's access to the engine; subclasses turn requests and outputs into OpenAI's shapes."""

    def __init__(self, engine: AsyncEngine, state: ServerState, metrics: ServerMetrics,
                 served: ServingOptions, limits: RequestLimits, grammars: GrammarChecker) -> None:
        self.engine = engine
        self.state = state
        self.metrics = metrics
        self.served = served
        self.model_name = served.model_name
        self.limits = limits
        self.grammars = grammars

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in self.served.model_names:
            names = ", ".join(f"`{name}`" for name in self.served.model_names)
            raise APIError(404, f"the model `{requested}` does not exist; this server serves {names}",
                           param="model", code="model_not_found")

    def check_logprobs(self, value: int | None, param: str) -> None:
        """`--max-logprobs` bounds `logprobs` (completions) and `top_logprobs` (chat)."""
        limit = self.served.max_logprobs
        if value is not None and not 0 <= value <= limit:
            raise APIError(400, f"{param} must be between 0 and {limit} (this server's --max-logprobs), got "
                                f"{value}", param=param, code="limit_exceeded")

    async def sampling_params(self, req: SamplingFields, *, max_tokens: int | None,
                              logprobs: int | None) -> SamplingParams:
        """The request's sampling; its structured-output constraint compiled (a 400 naming its field)."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.limits.check_stop(stop)
        fields = dict(n=req.n, max_tokens=max_tokens, seed=req.seed, stop=stop,
                      presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                      ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids or []),
                      logprobs=logprobs, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      min_p=req.min_p, repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                      include_stop_str_in_output=req.keeps_stop_str,
                      skip_special_tokens=req.skip_special_tokens,
                      spaces_between_special_tokens=req.spaces_between_special_tokens)
        # Fields the client left out take the model's generation defaults (--generation-config), if any,
        # else SamplingParams' own; max_tokens left out runs to the end of the context.
        defaults = self.served.defaults
        fields = {k: defaults[k] if v is None and k in defaults else v for k, v in fields.items()}
        fields = {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
        constraints, field = constraint_fields(req, self.engine.model_config.vocab_size)
        fields.update(constraints)
        try:
            params = SamplingParams(**fields)
        except ValueError as exc:
            raise from_value_error(exc) from None
        self._check_min_tokens(params)
        if field is not None:
            await self.grammars.check(params.structured_outputs, field, params.allowed_token_ids)
        return params

    def _check_min_tokens(self, params: SamplingParams) -> None:
        """`min_tokens` holds the tokens that end a generation: with `allowed_token_ids` all such tokens, no
        token would be left (a 400, never a token outside the set)."""
        if not params.min_tokens or params.allowed_token_ids is None:
            return
        ending = set(self.engine.tokenizer.eos_token_ids) | set(params.stop_token_ids)
        if set(params.allowed_token_ids) <= ending:
            raise APIError(400, "min_tokens: every token of allowed_token_ids ends the generation, which "
                                "min_tokens holds off: no token could be generated", param="min_tokens",
                           code="invalid_value")

    def check_room(self, prompt_token_ids: list[int], max_tokens: int | None) -> None:
        """Room for `max_tokens` after a prompt that fits: a 400 naming max_tokens, in OpenAI's words. The
        prompt itself is the engine's to check (`start`), once."""
        limit = self.engine.config.max_model_len
        assert limit is not None
        if max_tokens is not None and len(prompt_token_ids) <= limit < len(prompt_token_ids) + max_tokens:
            raise APIError(400, context_overflow_message(limit, len(prompt_token_ids), max_tokens),
                           param="max_tokens", code="context_length_exceeded")

    async def start(self, client: RequestClient, prompts: list[list[int]], params: SamplingParams,
                    request_id: str, prompt_param: str, *, api: str | None, priority: int = 0,
                    embedding: bool = False) -> Run:
        """Admits the request (as `client` is admitted; a 429 beyond admission control's bounds,
        `admission_control.py`) and starts each of its prompts in the engine (several only for a batch of
        completions prompts: one engine request each, `prompt_batch.py`), which checks them (a 400 naming
        `prompt_param`), at `priority` (lower runs first; a 400 naming `priority` outside its range). Its
        deltas come with metrics; closing them aborts the request. The admission is released when the answer
        ends (`sse`, `final_output`); it is marked started at the first output. `api`: the API it came
        through, for /metrics (`metrics.APIS`); None for the server's own probe (/health_generate).
        `embedding`: each prompt's pooled vector is asked for, not text; the engine refuses the task it does
        not serve (a 400 naming `model`)."""
        try:
            check_priority(priority)
        except ValueError as exc:
            raise APIError(400, str(exc), param="priority", code="invalid_value") from None
        admission = admission_control.admit(client, self.state, len(prompts) * params.n, self.metrics)
        if api is not None:
            self.metrics.count_api_request(api)
        if self.served.log_requests:
            logger.info("request %s: %s prompt tokens, %s%s", request_id,
                        "+".join(str(len(p)) for p in prompts), _params_summary(params),
                        f", priority {priority}" if priority else "")
        engine_ids = prompt_ids_named(request_id, len(prompts))
        streams = []
        try:
            for engine_id, ids in zip(engine_ids, prompts, strict=True):
                deltas = (self.engine.embed(ids, engine_id, priority=priority) if embedding
                          else self.engine.generate(ids, params, engine_id, delta=True, priority=priority))
                streams.append(self._tracked(deltas, len(ids), params, admission))
        except BaseException as exc:
            admission.release()
            for engine_id in engine_ids[:len(streams)]:
                await self.engine.abort(engine_id)
            if isinstance(exc, PromptError):
                raise prompt_error(exc, prompt_param, len(streams), len(prompts)) from None
            if isinstance(exc, EngineDeadError):
                raise engine_dead_error(exc) from None
            if isinstance(exc, TaskError):
                raise task_error(exc, self.model_name) from None
            if isinstance(exc, ValueError):  # the id is in use by a request in flight
                raise APIError(400, f"{exc}; send another X-Request-Id or request_id", param="request_id",
                               code="invalid_value") from None
            raise
        merged = streams[0] if len(streams) == 1 else prompt_batch.merged(request_id, streams, params.n)
        return Run(request_id, admission, merged)

    async def _tracked(self, deltas: AsyncIterator[RequestOutput], num_prompt_tokens: int,
                       params: SamplingParams, admission: HeldAdmission) -> AsyncGenerator[RequestOutput]:
        tracker = self.metrics.request_tracker(num_prompt_tokens, params.n, params.max_tokens)
        finish_reasons: dict[int, str | None] = {}
        try:
            async with contextlib.aclosing(admission_control.within_queue_wait(deltas, admission,
                                                                               self.metrics)) as outs:
                async for delta in outs:
                    admission.started()
                    tracker.on_output(sum(len(o.token_ids) for o in delta.outputs))
                    finish_reasons.update((o.index, o.finish_reason) for o in delta.outputs)
                    yield delta
        except EngineDeadError as exc:
            raise engine_dead_error(exc) from None
        finally:
            if finish_reasons:  # a request that never produced anything is not counted
                tracker.on_finish(list(finish_reasons.values()))

    async def final_output(self, client: RequestClient, run: Run) -> RequestOutput:
        """The whole answer of a request, unless the client leaves first: then the request is aborted."""
        try:
            return await self._final_output(client, run.deltas)
        finally:
            run.admission.release()

    async def _final_output(self, client: RequestClient,
                            deltas: AsyncGenerator[RequestOutput]) -> RequestOutput:
        collect = asyncio.ensure_future(_whole(deltas))
        disconnect = asyncio.ensure_future(client.disconnected())
        try:
            await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (collect, disconnect):
                task.cancel()
        if not collect.done() or collect.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            await deltas.aclose()  # aborts the request in the engine, also if the task never started
            logger.info("client disconnected; request aborted")
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        final = collect.result()
        if any(o.finish_reason == "error" for o in final.outputs):
            raise failed_error(final.request_id)
        if any(o.finish_reason == "abort" for o in final.outputs):
            raise aborted_error()
        return final

    @staticmethod
    def sse(events: AsyncGenerator[str], run: Run, dialect: SseDialect | None = None) -> StreamingResponse:
        """The response of an endpoint's SSE events over `run`, ended as every stream of its API ends
        (`_ended`; `dialect`: that API's error event and last line; None: chat's and completions')."""
        return _AdmittedStream(_ended(events, dialect or OPENAI_SSE), run)

    @staticmethod
    def with_prompt_logprobs(params: SamplingParams, stream: bool, *counts: int | None) -> SamplingParams:
        """`params` asking for the prompt logprobs of the largest of `counts` (the top-N the answer shows at
        each prompt token), or as they are when none is set; `counts[0]` is the `prompt_logprobs` field."""
        asked = [c for c in counts if c is not None]
        if not asked:
            return params
        if stream and counts[0] is not None:
            raise APIError(400, "prompt_logprobs is not supported with stream: true (as in vLLM); ask "
                                "without streaming", param="prompt_logprobs", code="unsupported_parameter")
        return msgspec.structs.replace(params, prompt_logprobs=max(asked))

    @staticmethod
    def vllm_prompt_logprobs(prompt_token_ids: list[int], entries: list[dict[int, Logprob] | None] | None,
                             num_top: int | None) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` answer: per prompt token (None for the first), itself and the `num_top`
        most likely tokens at its place, by token id."""
        if entries is None or num_top is None:
            return None
        return [None if entry is None else
                {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                 for t, lp in entry.items() if t == token_id or (lp.rank is not None and lp.rank <= num_top)}
                for token_id, entry in zip(prompt_token_ids, entries, strict=True)]


@dataclasses.dataclass
class Run:
    """A request started in the engine: its id, its admission, and its deltas."""

    request_id: str
    admission: HeldAdmission
    deltas: AsyncGenerator[RequestOutput]


class StreamTally:
    """What a stream's loop counts as it goes: completion tokens (for the usage chunk) and whether the
    server aborted the request or a fault ended it (for the error event it then ends with)."""

    def __init__(self, num_prompt_tokens: int, reasoning: ReasoningPlan | None = None) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.completion_tokens = 0
        self.aborted = False
        self.failed = False
        self._reasoning = reasoning  # set: the usage counts the reasoning tokens
        self._token_ids: dict[int, list[int]] = {}  # each choice's tokens, to count them

    def add(self, output: CompletionOutput) -> None:
        self.completion_tokens += len(output.token_ids)
        if self._reasoning is not None:
            self._token_ids.setdefault(output.index, []).extend(output.token_ids)
        self.aborted = self.aborted or output.finish_reason == "abort"
        self.failed = self.failed or output.finish_reason == "error"

    def error(self, request_id: str) -> APIError | None:
        """What a request that did not end well ends with, after its last chunk: never a silent end after
        half an answer."""
        if self.failed:
            return failed_error(request_id)
        if self.aborted:
            return aborted_error()
        return None

    def error_event(self, request_id: str) -> str | None:
        """`error` as OpenAI's chat and completions streams send it."""
        error = self.error(request_id)
        return None if error is None else OPENAI_SSE.error_event(error)

    def usage(self) -> Usage:
        return usage_of(self.num_prompt_tokens, self.completion_tokens,
                        _reasoning_tokens(self._reasoning, self._token_ids.values()))


@dataclasses.dataclass(frozen=True)
class SseDialect:
    """How one API's streams end: the event an error becomes, and the line after the last event (None:
    none; the Responses and Messages APIs end with their own final event)."""

    error_event: Callable[[APIError], str]
    last_line: str | None


OPENAI_SSE = SseDialect(lambda error: sse_data(error.body()), DONE)


async def _ended(events: AsyncGenerator[str], dialect: SseDialect) -> AsyncGenerator[str]:
    """`events`, then an error event if they raised an `APIError` (the engine died), and the dialect's last
    line in every case. Closing this closes `events`, which aborts the request in the engine."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield dialect.error_event(exc)
    if dialect.last_line is not None:
        yield dialect.last_line


class _AdmittedStream(StreamingResponse):
    """An SSE response that, however it ends (done, client gone, cancelled, never started), closes its
    events and the request's deltas, which aborts the request in the engine at once, and releases the
    request's admission."""

    def __init__(self, events: AsyncGenerator[str], run: Run) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await self._run.deltas.aclose()
            self._run.admission.release()


def _params_summary(params: SamplingParams) -> str:
    """The sampling fields a request set (those unlike the defaults), for the request log line: numbers and
    flags as they are; text (stop strings, bad words, a constraint's schema, regex or grammar) never, but
    its size and a hash; collections by their size."""
    fields = msgspec.structs.asdict(params)
    shown = {k: _summary(v) for k, v in fields.items() if v != getattr(_DEFAULT_PARAMS, k)}
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "default sampling"


def _summary(value: object) -> str:
    """A request-supplied value as the log may show it: bounded, without its text, on one line."""
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, str):
        return f"<{len(value)} chars, sha256 {hashlib.sha256(value.encode()).hexdigest()[:12]}>"
    if isinstance(value, msgspec.Struct):  # structured outputs: which kind, and its text's summary
        set_fields = {k: v for k, v in msgspec.structs.asdict(value).items() if v not in (None, False)}
        return "{" + ", ".join(f"{k}: {_summary(v)}" for k, v in set_fields.items()) + "}"
    if isinstance(value, list | tuple | dict):
        return f"<{len(value)} items>"
    return f"<{type(value).__name__}>"


_DEFAULT_PARAMS = SamplingParams()


def sse_data(payload: BaseModel | dict | str, exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude=exclude)
    elif isinstance(payload, dict):
        text = json.dumps(payload)
    else:
        text = payload
    return f"data: {text}\n\n"


def sse_event(kind: str, payload: BaseModel | dict) -> str:
    """A named event, as the Responses and Messages APIs send them: `event: KIND`, then its data."""
    return f"event: {kind}\n{sse_data(payload)}"


def usage_of(num_prompt_tokens: int, num_completion_tokens: int,
             reasoning_tokens: int | None = None) -> Usage:
    details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=num_prompt_tokens + num_completion_tokens, completion_tokens_details=details)


def final_usage(num_prompt_tokens: int, final: RequestOutput,
                reasoning: ReasoningPlan | None = None) -> Usage:
    """The usage of a whole answer: every choice's tokens (and with `reasoning`, those that are thinking)."""
    return usage_of(num_prompt_tokens, sum(len(o.token_ids) for o in final.outputs),
                    _reasoning_tokens(reasoning, (o.token_ids for o in final.outputs)))


def _reasoning_tokens(reasoning: ReasoningPlan | None, choices: Iterable[list[int]]) -> int | None:
    return None if reasoning is None else sum(reasoning.reasoning_tokens(ids) for ids in choices)


def aborted_error() -> APIError:
    """What a request the server aborted gets: never a 200 with half an answer (vLLM #57082)."""
    return APIError(503, "the request was aborted by the server before it finished", code="request_aborted")


def failed_error(request_id: str) -> APIError:
    """What a request ended by a fault of its own gets (finish_reason "error"; the engine serves on): the
    details are in the server's log under the request's id."""
    return APIError(500, f"request {request_id} failed in the engine; the details are in the server's log "
                         f"under its id", code="request_failed")


def prompt_ids_named(request_id: str, num_prompts: int) -> list[str]:
    """The engine's id of each prompt of a request: the request's own, or one each for a batch of
    completions prompts (`prompt_batch.py`)."""
    return [request_id] if num_prompts == 1 else [f"{request_id}-{i}" for i in range(num_prompts)]


def prompt_error(exc: PromptError, prompt_param: str, index: int, num_prompts: int) -> APIError:
    """The 400 of a prompt the engine's check refused (`check_prompt`), naming its field, and its place when
    the request has several."""
    code = "context_length_exceeded" if exc.too_long else "invalid_prompt"
    param = prompt_param if num_prompts == 1 else f"{prompt_param}.{index}"
    return APIError(400, str(exc), param=param, code=code)


def task_error(exc: TaskError, model_name: str) -> APIError:
    """The 400 of a request of the task the model is not served for (`frontend.check_task`)."""
    return APIError(400, f"the model `{model_name}`: {exc}", param="model", code="unsupported_task")


def engine_dead_error(exc: EngineDeadError) -> APIError:
    """What a request gets when the engine died before it could be answered."""
    return APIError(500, f"the engine is dead: {exc}", code="engine_dead")


async def _whole(deltas: AsyncIterator[RequestOutput]) -> RequestOutput:
    whole: RequestOutput | None = None
    async for delta in deltas:
        if whole is None:
            whole = delta
        else:
            whole.add(delta)
    if whole is None:
        raise APIError(500, "the engine returned no output")
    return whole


def token_label(tokenizer: Tokenizer, token_id: int, logprob: Logprob | None, as_ids: bool) -> str:
    """The name of a token in logprobs: "token_id:N" if asked, else its own text."""
    if as_ids:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])
