"""Frontend bookkeeping of in-flight requests: core outputs in, detokenized `RequestOutput` deltas out.

A request with `n` completions is n core requests (ids `<request_id>/<i>`; seeds `seed + i`), gathered
back here into one `RequestOutput`. Each call of `process` gives, for every request that moved, one delta:
the new tokens, text and logprobs of the completions that moved. Stop strings are found here, not in the
core: a completion that hits one is finished at once and its core request must be aborted
(`ProcessedOutputs.core_ids_to_abort`).

Containment: a fault of one request — reported by the core (its sampling or stop checks raised) or met here
(its detokenization raised) — ends that request, every completion of it with `finish_reason="error"`, and
nothing else; the faults are counted by stage (`faults`) and logged with the request id.

The outputs have vLLM's shapes (`RequestOutput`, `CompletionOutput`). A consumer that wants the whole
answer so far (the offline `Engine`, `AsyncEngine.generate` by default) adds the deltas up with
`RequestOutput.add`.
"""

from __future__ import annotations

import collections
import copy
import logging
import time
from dataclasses import dataclass, field

import msgspec

from gracelm.engine import messages as msg
from gracelm.engine.detokenizer import IncrementalDetokenizer, StopStrings
from gracelm.model.tokenizer import Tokenizer
from gracelm.model_step import PromptLogprobs
from gracelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# The stage of a fault met here, beside those the core reports (`TokenOutput.fault`).
DETOKENIZE_STAGE = "detokenize"


@dataclass
class Logprob:
    """One candidate token at one generated position: its logprob, rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request, cumulative so far.

    `finish_reason` is None while it runs, then "stop" (EOS, a stop token or a stop string), "length",
    "abort" or "error" (a fault of this request in the engine: it ended, the engine serves on).
    `stop_reason` is the stop string or stop token id that ended it, if any. `logprobs` has, for
    each generated token, a dict from token id to `Logprob` holding the sampled token and the top-N ones.
    `prompt_logprobs` (when asked for) has the same for each prompt token, None for the first (vLLM's
    shape); the first delta of the completion carries it. An embedding request's one completion has no
    token: its `embedding` is the pooled vector, as the engine computed it (`Pooling.finished` finishes it).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Appends a later delta of the same completion."""
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.cumulative_logprob is not None:
            self.cumulative_logprob = delta.cumulative_logprob  # a running total already
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class RequestOutput:
    """A request's output: as a delta, `outputs` holds the completions that moved, each with what is new."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))

    def add(self, delta: RequestOutput) -> None:
        """Adds a later delta of the same request into this output (completions matched by index)."""
        by_index = {o.index: o for o in self.outputs}
        for part in delta.outputs:
            if part.index in by_index:
                by_index[part.index].add(part)
            else:
                self.outputs.append(copy.deepcopy(part))
        self.outputs.sort(key=lambda o: o.index)
        self.finished = delta.finished
        self.metrics = delta.metrics

    def copy(self) -> RequestOutput:
        return copy.deepcopy(self)


@dataclass
class _Completion:
    index: int
    core_id: str
    detokenizer: IncrementalDetokenizer
    wants_logprobs: bool
    include_stop: bool = False  # the stop token's text stays in the text
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
    # What is new since the last delta.
    text: str = ""  # released text only: a possible stop-string start is held back by the detokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None
    moved: bool = False
    num_generated: int = 0  # every token so far, for the progress of `open_requests`

    def take_delta(self) -> CompletionOutput:
        delta = CompletionOutput(
            index=self.index, text=self.text, token_ids=self.token_ids, finish_reason=self.finish_reason,
            logprobs=self.logprobs if self.wants_logprobs else None,
            cumulative_logprob=self.cumulative_logprob if self.wants_logprobs else None,
            stop_reason=self.stop_reason, prompt_logprobs=self.prompt_logprobs, embedding=self.embedding)
        self.text, self.token_ids, self.logprobs, self.moved = "", [], [], False
        self.prompt_logprobs = self.embedding = None
        return delta


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    metrics: RequestMetrics
    max_tokens: int | None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def take_delta(self) -> RequestOutput:
        moved = [c.take_delta() for c in self.completions if c.moved]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, moved, self.finished,
                             self.metrics)


@dataclass(frozen=True)
class OpenRequest:
    """A read-only view of one request in flight: its progress, all `n` completions together."""

    request_id: str
    arrival_time: float  # wall clock
    first_token_time: float | None  # None while it waits for its first token (queued or in prefill)
    num_prompt_tokens: int
    n: int
    num_generated: int
    max_tokens: int | None  # per completion; None: up to the model's context


@dataclass
class ProcessedOutputs:
    deltas: list[RequestOutput]  # one per request that moved, in first-update order
    core_ids_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # Each token's own text, for logprobs: 21 of them per token of a request that asks for 20.
        self._token_texts: dict[int, str] = {}
        self._special_ids = frozenset(i for i, t in tokenizer.backend.get_added_tokens_decoder().items()
                                      if t.special)
        self._requests: dict[str, _RequestState] = {}
        self._by_core_id: dict[str, tuple[_RequestState, _Completion]] = {}
        self.faults: collections.Counter[str] = collections.Counter()  # requests ended by a fault, by stage

    def has_unfinished(self) -> bool:
        """Whether some core request is still expected to produce outputs."""
        return bool(self._by_core_id)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0,
                    pooling: str | None = None) -> list[msg.AddRequest]:
        """Tracks a request; returns the core requests to send for it, each with the request's priority
        (and `pooling`, for an embedding)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time()
        state = _RequestState(request_id, prompt, prompt_token_ids, [], RequestMetrics(arrival),
                              params.max_tokens)
        adds = []
        stops = StopStrings(params.stop)  # one automaton for the n completions
        for index in range(params.n):
            core_id = f"{request_id}/{index}"
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, stops, params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                special_ids=self._special_ids, min_tokens=params.min_tokens,
                include_stop=params.include_stop_str_in_output)
            completion = _Completion(index, core_id, detokenizer, params.logprobs is not None,
                                     params.include_stop_str_in_output)
            state.completions.append(completion)
            self._by_core_id[core_id] = (state, completion)
            core_params = msgspec.structs.replace(params, n=1, seed=params.choice_seed(index))
            adds.append(msg.AddRequest(core_id, prompt_token_ids, core_params,
                                       list(self.tokenizer.eos_token_ids), arrival, priority, pooling))
        self._requests[request_id] = state
        return adds

    def process(self, outputs: list[msg.TokenOutput]) -> ProcessedOutputs:
        moved: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        now = time.time()
        for out in outputs:
            entry = self._by_core_id.get(out.request_id)
            if entry is None:  # aborted here already
                continue
            state, completion = entry
            fault = out.fault
            if fault is None:
                try:
                    if out.prompt_logprobs is not None:
                        completion.prompt_logprobs = self._prompt_logprobs(state.prompt_token_ids,
                                                                           out.prompt_logprobs)
                    if self._apply(completion, out):
                        to_abort.append(completion.core_id)
                except Exception:  # this request's own fault: it ends, the others go on
                    logger.exception("request %s: its output processing raised", completion.core_id)
                    fault = DETOKENIZE_STAGE
            if fault is not None:
                to_abort.extend(self._fail(state, fault))
            if completion.finish_reason is not None:
                self._by_core_id.pop(completion.core_id, None)
            if out.token_id is not None and state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            moved[state.request_id] = state
        for state in moved.values():
            if state.finished:
                state.metrics.finish_time = now
                del self._requests[state.request_id]
        return ProcessedOutputs([state.take_delta() for state in moved.values()], to_abort)

    def open_requests(self) -> list[OpenRequest]:
        """The requests in flight, oldest first."""
        return [OpenRequest(s.request_id, s.metrics.arrival_time, s.metrics.first_token_time,
                            len(s.prompt_token_ids), len(s.completions),
                            sum(c.num_generated for c in s.completions), s.max_tokens)
                for s in self._requests.values()]

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Finishes every unfinished completion of the request with "abort"; returns its last delta and the
        core ids to abort (None and [] for a request no longer tracked)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None, []
        core_ids = []
        for completion in state.completions:
            if completion.finish_reason is None:
                self._finish(completion, "abort")
                del self._by_core_id[completion.core_id]
                core_ids.append(completion.core_id)
        state.metrics.finish_time = time.time()
        return state.take_delta(), core_ids

    def _fail(self, state: _RequestState, stage: str) -> list[str]:
        """Ends every unfinished completion of the request with "error" (its detokenizer, which may be the
        faulty part, is not called again); returns their core ids, to abort."""
        self.faults[stage] += 1
        logger.error("request %s ended with an error: a fault in its %s (the engine serves on)",
                     state.request_id, stage)
        core_ids = []
        for completion in state.completions:
            if completion.finish_reason is None:
                completion.moved = True
                completion.finish_reason = "error"
                self._by_core_id.pop(completion.core_id, None)
                core_ids.append(completion.core_id)
        return core_ids

    def _apply(self, completion: _Completion, out: msg.TokenOutput) -> bool:
        """Applies one core output; True when a stop string ended the completion here (abort it)."""
        completion.moved = True
        completion.embedding = out.embedding
        if out.token_id is None:
            self._finish(completion, out.finish_reason or "abort")
            return False
        completion.token_ids.append(out.token_id)
        completion.num_generated += 1
        if out.logprob is not None:
            self._add_logprobs(completion, out)
        # A "stop" from the core is always a stop token (EOS or stop_token_ids): it adds no text, unless
        # the request keeps its stop strings (vLLM's include_stop_str_in_output).
        hidden = out.finish_reason == "stop" and not completion.include_stop
        stop_string = completion.detokenizer.add_token(out.token_id, hidden=hidden)
        if stop_string is not None:
            self._finish(completion, "stop", stop_string)
            return out.finish_reason is None
        if out.finish_reason is not None:
            self._finish(completion, out.finish_reason, out.stop_reason)
        else:
            completion.text += completion.detokenizer.stream_delta()
        return False

    def _add_logprobs(self, completion: _Completion, out: msg.TokenOutput) -> None:
        assert out.logprob is not None
        entry = {}
        for rank, (token_id, logprob) in enumerate(zip(out.top_ids or [], out.top_logprobs or [],
                                                       strict=True), start=1):
            entry[token_id] = Logprob(logprob, rank, self._token_text(token_id))
        if out.token_id not in entry:
            entry[out.token_id] = Logprob(out.logprob, None, self._token_text(out.token_id))
        completion.logprobs.append(entry)
        completion.cumulative_logprob += out.logprob

    def _prompt_logprobs(self, prompt_token_ids: list[int],
                         scored: PromptLogprobs) -> list[dict[int, Logprob] | None]:
        """vLLM's shape: None for the first prompt token, then per token its top-N and itself."""
        entries: list[dict[int, Logprob] | None] = [None]
        for token_id, logprob, rank, top_ids, top_logprobs in zip(
                prompt_token_ids[1:], scored.logprobs, scored.ranks, scored.top_ids, scored.top_logprobs,
                strict=True):
            entry = {t: Logprob(lp, r, self._token_text(t))
                     for r, (t, lp) in enumerate(zip(top_ids, top_logprobs, strict=True), start=1)}
            entry.setdefault(token_id, Logprob(logprob, rank, self._token_text(token_id)))
            entries.append(entry)
        return entries

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    @staticmethod
    def _finish(completion: _Completion, reason: str, stop_reason: str | int | None = None) -> None:
        completion.moved = True
        completion.detokenizer.finish()
        completion.text += completion.detokenizer.stream_delta()
        completion.finish_reason = reason
        completion.stop_reason = stop_reason
