"""Iteration-level continuous batching: each step, which requests run and how many of their tokens.

Order: a request's place is its key (priority, arrival order): a lower priority value first, then first
come, first served. `running` and `waiting` are each kept in key order, and the invariant behind admission
and preemption is that, within one priority, every running request arrived before every waiting one.
Each step walks both lists merged in key order while the token budget lasts, so a request of higher
priority gets its tokens (decode or prefill chunk) before any of lower priority, whether it runs or waits:
- a running request gets its next tokens; when blocks run out it preempts the tail of `running` (the
  lowest priority, latest arrived, never one scheduled earlier in the step), itself last;
- the waiting head is admitted when a seat (`max_num_seqs`) and blocks are free, or can be freed by
  preempting running requests of strictly lower priority (tail first); never one of equal or higher
  priority. A head that cannot be admitted stops admission for the step: nobody overtakes it;
- a preempted request goes back into `waiting` at its key (recomputed on resumption), so among its priority
  it resumes before anything that arrived after it. After a preemption the cache is short: in that step
  only requests of strictly higher priority than every victim are admitted (a victim let back in would be
  preempted again).
With one priority this is plain FCFS: running requests first in arrival order, then the waiting head, and
the request preempted is always the most recently arrived running one.

Embedding requests (`Request.pooling`) are scheduled as any prefill, by the same order and budget: their
chunks' pooled positions become rows whose hidden states come back summed (`ModelStep.pool_rows`), and the
step that computes the last prompt token finishes them with their pooled vector ("stop"), sampling nothing.

Speculative decoding (`speculation.py`): a decoding request may be scheduled its last token and draft tokens
after it (`ScheduledRequest.draft_token_ids`, counted in the budget and given KV slots). Its sampled tokens
come back as a run: the drafts the target model kept, then the token it sampled where it kept no more.
Each is taken as a token of its own (stop checks included, so a stop inside the run ends the request
there), the kept drafts count as computed, and the blocks that held only rejected positions are freed
at once. A rejected draft never reaches `all_token_ids`, so the prefix cache never holds one.

Containment: a request whose sampling failed (a `SamplingFault` in place of its token) or whose own update
raises (its stop checks) finishes with `finish_reason="error"`, its blocks freed; the other requests of the
step are updated as usual. The KV-cache bookkeeping is not guarded: a fault there is the engine's, fatal.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from gracelm.arith import cdiv
from gracelm.engine.kv_cache_manager import KVCacheManager
from gracelm.engine.request import Request, RequestStatus
from gracelm.engine.speculation import OFF_STATS, Speculation, SpeculationConfig
from gracelm.model_step import (
    ModelStep,
    PooledSum,
    PoolRows,
    PromptLogprobs,
    PromptRows,
    SampledToken,
    SamplingFault,
    StepBatch,
)

logger = logging.getLogger(__name__)
# The stages of a request's own faults, as `RequestUpdate.fault` names them.
SAMPLING_STAGE = "sampling"
STOP_CHECK_STAGE = "stop_check"


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int  # token budget of one step, prefill chunks and decodes together
    max_model_len: int  # prompt plus output tokens of one request
    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int | None = None  # caps one request's prefill chunk per step
    speculation: SpeculationConfig | None = None  # speculative decoding, when on

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        blocks_per_request = cdiv(self.max_model_len, self.block_size)
        if blocks_per_request > self.num_blocks:
            # Otherwise a lone long request could never be scheduled, and waiting for it would never end.
            raise ValueError(
                f"not enough KV-cache memory: {self.num_blocks} blocks of {self.block_size} tokens = "
                f"{self.num_blocks * self.block_size} tokens fit, one request of max_model_len "
                f"{self.max_model_len} tokens ({blocks_per_request} blocks) does not; raise "
                f"kv_cache_memory or lower max_model_len"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(f"long_prefill_token_threshold must be at least 1, got "
                             f"{self.long_prefill_token_threshold}")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start_position: int  # position of the first new token: the request's computed tokens before the step
    block_ids: list[int]  # the request's whole block table for this step (a copy)
    samples: bool  # the step computes the request's last token: a next token is sampled, or it is pooled
    # Draft tokens after its last token (`speculation.py`), counted in num_new_tokens.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def draws(self) -> bool:
        """Whether a token is sampled for the request this step (an embedding request is pooled instead)."""
        return self.samples and self.request.pooling is None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    preempted_request_ids: list[str] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0

    @property
    def sampling(self) -> list[ScheduledRequest]:
        """The scheduled requests that sample a token this step, in batch order (the logits' order)."""
        return [item for item in self.scheduled if item.draws]

    def model_step(self, block_size: int) -> ModelStep:
        """The step as the executor takes it: the token rows of one forward pass and, for each row that
        samples, its request's sampling inputs; then the rows of the prompt positions whose logprobs are
        asked for (those not computed before a preemption), and those of embedding requests' pooled
        positions (likewise).

        A request that drafted is laid out as one sequence of one token per position verified (its last
        token, then each draft), each with the context up to itself: the step is a decode step of more
        rows, which the decode kernels and the compiled decode graphs serve (the K/V of a step's tokens
        are written before any is attended, so each row sees the rows before it)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        prompt_indices: list[int] = []
        prompt_rows: list[PromptRows] = []
        pool_indices: list[int] = []
        pool_rows: list[PoolRows] = []
        query_lens: list[int] = []
        tables: list[list[int]] = []
        prompt_lens: list[int] = []
        seq_lens: list[int] = []
        for item in self.scheduled:
            start, end = item.start_position, item.start_position + item.num_new_tokens
            request = item.request
            # Position p scores prompt token p + 1: the last prompt position's logits sample instead.
            first, last = max(start, request.num_prompt_logprobs), min(end, request.num_prompt_tokens - 1)
            if request.gathers_prompt_logprobs and first < last:
                prompt_indices.extend(range(len(input_ids) + first - start, len(input_ids) + last - start))
                targets = request.prompt_token_ids[first + 1:last + 1]
                prompt_rows.append(PromptRows(request.request_id, targets,
                                              request.sampling_params.prompt_logprobs or 0))
            pooled = request.pooled_positions
            first, last = max(start, request.num_pooled, pooled.start), min(end, pooled.stop)
            if first < last:
                pool_indices.extend(range(len(input_ids) + first - start, len(input_ids) + last - start))
                pool_rows.append(PoolRows(request.request_id, last - first))
            drafts = item.draft_token_ids
            input_ids.extend(item.request.all_token_ids[start:end - len(drafts)])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            slots.extend(item.block_ids[pos // block_size] * block_size + pos % block_size
                         for pos in range(start, end))
            if item.draws:  # the last token's row, and each draft's: the positions verified
                logits_indices.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
            sequences = range(start + 1, end + 1) if drafts else [end]  # each sequence's context after it
            query_lens.extend([1] * len(sequences) if drafts else [item.num_new_tokens])
            seq_lens.extend(sequences)
            tables.extend([item.block_ids] * len(sequences))
            prompt_lens.extend([request.num_prompt_tokens] * len(sequences))
        width = max(len(table) for table in tables)
        batch = StepBatch(input_ids=input_ids, positions=positions, slot_mapping=slots,
                          query_lens=query_lens, seq_lens=seq_lens,
                          block_tables=[table + [0] * (width - len(table)) for table in tables],
                          logits_indices=logits_indices + prompt_indices + pool_indices,
                          prompt_lens=prompt_lens)
        sampling = [item.request for item in self.sampling]
        return ModelStep(batch, [r.request_id for r in sampling], [r.sampling_params for r in sampling],
                         [r.prompt_token_ids for r in sampling], [r.output_token_ids for r in sampling],
                         [r.held_stop_ids() for r in sampling], prompt_rows, pool_rows,
                         [item.draft_token_ids for item in self.sampling])


@dataclass(frozen=True)
class RequestUpdate:
    request_id: str
    sampled: SampledToken | None  # None when a fault ended the request
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "error" once finished
    stop_reason: int | None  # the stop_token_ids entry that ended it
    fault: str | None = None  # the stage whose exception ended this request ("error")
    prompt_logprobs: PromptLogprobs | None = None  # with the first token of a request that asked
    embedding: list[float] | None = None  # an embedding request's pooled vector, when it finishes

    @property
    def token_id(self) -> int | None:
        return self.sampled.token_id if self.sampled is not None else None


def _key(request: Request) -> tuple[int, int]:
    """A request's place in the scheduler's order: priority (lower first), then arrival."""
    return request.priority, request.arrival_order


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: list[Request] = []  # in key order (see the module's docstring), as is `running`
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._arrivals = itertools.count()
        self.speculation = Speculation(config.speculation) if config.speculation is not None else None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def add_request(self, request: Request) -> None:
        """Queues a request at its place: after every request of its priority or higher. Its prompt was
        checked by the frontend (`frontend.check_prompt`); a request whose id is in use is refused, queueing
        nothing."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        request.arrival_order = next(self._arrivals)
        self._requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_key)

    def schedule(self) -> SchedulerOutput:
        """Picks this step's work: running and waiting requests together in key order while the budget
        lasts; running ones get their next tokens (a decode token or the next prefill chunk), waiting ones
        are admitted while seats and blocks last (see the module's docstring for preemption)."""
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        num_visited = 0  # running[:num_visited] got their tokens this step (admitted ones included)
        admitting = True
        while budget > 0:
            head = self.waiting[0] if admitting and self.waiting else None
            following = self.running[num_visited] if num_visited < len(self.running) else None
            drafts: list[int] = []
            if head is not None and (following is None or _key(head) < _key(following)):
                num_new = self._admit(head, budget, output)
                if num_new is None:
                    admitting = False  # nobody overtakes the head
                    continue
                request = head
            elif following is not None:
                request = following
                num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
                drafts = self._draft(request, num_new, budget)
                # Drafts only where blocks are free: never a preemption for them.
                if not (drafts and self.kv_cache.allocate_slots(request, num_new + len(drafts))):
                    drafts = []
                    if not self._allocate_or_preempt(request, num_new, output):
                        break  # it was the tail of `running` and preempted itself: nothing after it is left
            else:
                break
            budget -= self._add(output, request, num_new, drafts)
            num_visited += 1
        return output

    def _draft(self, request: Request, num_new: int, budget: int) -> list[int]:
        """A decoding request's draft tokens for this step: none while speculation does not apply, and never
        more than the step's budget, the model's length or the request's max_tokens leave room for (the
        step yields up to one token more than it drafts)."""
        speculation = self.speculation
        if (speculation is None or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1
                or request.pooling is not None or not speculation.applies(len(self.running))):
            return []
        room = min(budget - 1, self.config.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(request.output_token_ids) - 1)
        return speculation.draft(request, room, len(self.running))

    def update_from_output(self, output: SchedulerOutput, sampled: list[list[SampledToken | SamplingFault]],
                           prompt_logprobs: dict[str, PromptLogprobs] | None = None,
                           pooled: dict[str, PooledSum] | None = None) -> list[RequestUpdate]:
        """Records a step's results: computed tokens, newly full blocks, prompt logprobs, pooled sums,
        sampled tokens and stops. `sampled` holds a run per request of `output.sampling`, in that order: its
        token (or fault), after the drafts kept when it drafted; `prompt_logprobs` and `pooled` what the step
        computed of the prompt logprobs of requests that asked and of embedding requests' pooled rows. A
        request gets an update per token it took."""
        prompt_logprobs = prompt_logprobs or {}
        pooled = pooled or {}
        updates = []
        any_finished = False
        runs = iter(sampled)
        for item in output.scheduled:
            request = item.request
            run = next(runs) if item.draws else None
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids)
            self.kv_cache.cache_full_blocks(request)
            if request.request_id in prompt_logprobs:
                request.add_prompt_logprobs(prompt_logprobs[request.request_id])
            if request.pooling is not None:
                request.add_pooled(pooled.get(request.request_id), request.num_computed_tokens)
                if item.samples:
                    updates.append(self._embedded(request))
                    any_finished = True
                continue
            if run is None:
                continue
            if item.draft_token_ids and self.speculation is not None:
                self.speculation.record(request.request_id, len(item.draft_token_ids), len(run) - 1)
            updates.extend(self._take_run(request, run))
            if request.is_finished:
                any_finished = True
            elif item.draft_token_ids:
                self.kv_cache.trim(request, request.num_computed_tokens + 1)
        if any_finished:
            self.running = [request for request in self.running if not request.is_finished]
        return updates

    def _take_run(self, request: Request, run: list[SampledToken | SamplingFault]) -> list[RequestUpdate]:
        """A request's tokens of one step, in order, until one ends it: each but the last is a kept draft,
        whose KV entry the step computed."""
        updates = []
        for index, token in enumerate(run):
            if isinstance(token, SamplingFault):
                updates.append(self._fail(request, SAMPLING_STAGE, token.error))
                break
            try:
                request.append_output_token(token.token_id)
                status = self._stop_status(request, token.token_id)
            except Exception as e:  # this request's own fault: it ends, the step goes on
                logger.exception("request %s: its stop checks raised", request.request_id)
                updates.append(self._fail(request, STOP_CHECK_STAGE, f"{type(e).__name__}: {e}"))
                break
            if index < len(run) - 1:
                request.num_computed_tokens += 1
                self.kv_cache.cache_full_blocks(request)
            if status is not None:
                self._finish(request, status)
            updates.append(RequestUpdate(request.request_id, token, request.is_finished,
                                         request.finish_reason, request.stop_reason,
                                         prompt_logprobs=request.take_prompt_logprobs()))
            if request.is_finished:
                break
        return updates

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Aborts the requests, freeing their blocks at once; returns the ids that were unfinished."""
        aborted = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request_id)
        return aborted

    def stats(self) -> dict[str, int | float]:
        kv = self.kv_cache
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            # Requests of priority > 0 ("background": batch lines, for instance).
            "num_running_background": sum(1 for request in self.running if request.priority > 0),
            "num_waiting_background": sum(1 for request in self.waiting if request.priority > 0),
            # What the waiting requests will take in once admitted (SGLang's load counts them).
            "num_waiting_tokens": sum(request.num_tokens for request in self.waiting),
            "kv_blocks_total": kv.num_total_blocks,
            "kv_block_size": kv.block_size,
            "prefix_caching": kv.enable_prefix_caching,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_usage": kv.usage,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "kv_restored_blocks": kv.num_restored_blocks,
            "kv_restored_block_hits": kv.restored_block_hits,
            "spec_decode": self.speculation.stats() if self.speculation is not None else OFF_STATS,
        }

    def _chunk(self, num_remaining: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold or num_remaining
        return min(num_remaining, budget, threshold)

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Reserves blocks for a running request, preempting from the tail of `running` until they fit.

        Returns False when the request had to preempt itself. The victims come after it in `running`
        (key order), so none of them has been scheduled in this step yet.
        """
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = self.running[-1]
            self._preempt(victim, output)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, budget: int, output: SchedulerOutput) -> int | None:
        """Moves the head of `waiting` to `running` with blocks for its first chunk, preempting running
        requests of strictly lower priority when seats or blocks are short; returns the chunk's size, or
        None when it cannot be admitted in this step. The victims stay preempted then: they come after it
        in key order, and would wait behind it anyway."""
        victims = (self._requests[request_id] for request_id in output.preempted_request_ids)
        if any(victim.priority <= request.priority for victim in victims):
            return None  # the cache is short (see the module's docstring)
        while len(self.running) >= self.config.max_num_seqs:
            if not self._preempt_lower(request, output):
                return None
        # Cached blocks have no logits nor hidden states: `takes_cached_prefix` says who needs neither.
        computed_blocks, num_cached = [], 0
        if request.takes_cached_prefix:
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
        num_new = self._chunk(request.num_tokens - num_cached, budget)
        # Preempting only frees blocks, so the cached prefix found above stays valid meanwhile.
        while not self.kv_cache.allocate_slots(request, num_new, computed_blocks):
            if not self._preempt_lower(request, output):
                return None
        self.waiting.pop(0)  # still the head: the victims queued behind it
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        bisect.insort(self.running, request, key=_key)
        return num_new

    def _preempt_lower(self, request: Request, output: SchedulerOutput) -> bool:
        """Preempts the tail of `running` if its priority is strictly lower than the request's."""
        if not self.running or self.running[-1].priority <= request.priority:
            return False
        self._preempt(self.running[-1], output)
        return True

    def _preempt(self, victim: Request, output: SchedulerOutput) -> None:
        """Sends the tail of `running` back to `waiting`, at its place, its blocks freed."""
        assert self.running[-1] is victim
        self.running.pop()
        self.kv_cache.free(victim)
        victim.num_computed_tokens = 0  # recomputed on resumption, output tokens included
        victim.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, victim, key=_key)
        output.preempted_request_ids.append(victim.request_id)

    @staticmethod
    def _add(output: SchedulerOutput, request: Request, num_new: int, drafts: list[int]) -> int:
        """Schedules the request's `num_new` tokens, then its drafts; the budget they take."""
        start, total = request.num_computed_tokens, num_new + len(drafts)
        output.scheduled.append(ScheduledRequest(request, total, start, list(request.block_ids),
                                                 start + num_new == request.num_tokens, drafts))
        output.total_num_scheduled_tokens += total
        return total

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        # Stop tokens first: a model that ends its answer on its last allowed token did stop.
        params = request.sampling_params
        # While `min_tokens` holds them off, the stop tokens are masked in the sampler, and none ends it.
        if len(request.output_token_ids) > params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if request.num_tokens >= self.config.max_model_len or (
                max_tokens is not None and len(request.output_token_ids) >= max_tokens):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _embedded(self, request: Request) -> RequestUpdate:
        """Ends an embedding request whose last prompt token was computed, with its pooled vector."""
        assert request.pooled is not None
        embedding = request.pooled.mean()
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return RequestUpdate(request.request_id, None, True, request.finish_reason, None, embedding=embedding)

    def _fail(self, request: Request, stage: str, error: str) -> RequestUpdate:
        """Ends a request whose own processing raised, with finish_reason "error"."""
        logger.error("request %s ended with an error: its %s failed (%s); the engine serves on",
                     request.request_id, stage, error)
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return RequestUpdate(request.request_id, None, True, request.finish_reason, None, stage)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        del self._requests[request.request_id]
        if self.speculation is not None:
            self.speculation.forget(request.request_id)
