"""Admission control: how many sequences the server takes in flight (`--max-num-queued-reqs`), how long a
request may wait for its first output (`--max-queue-wait`), and the answer beyond either bound.

Beyond either, a request is answered 429 with `Retry-After` and OpenAI's rate-limit error body (type
`requests`, code `rate_limit_exceeded`), and the connection is kept: the server is healthy (`/health` and
`/ready` stay 200), it has enough work, and a router or client should go elsewhere or come back. A request
that waited too long is first aborted in the engine, which frees its KV cache; a stream, whose 200 and
headers are sent before its first output, gets that error body as an SSE event, then `[DONE]`, as for any
error after its start. Each refusal is counted in `gracelm_request_rejections_total{reason}`. Batch lines
are outside admission control (`ServerState.admit`): they queue in the engine at a lower priority, admitted
by their runner, and are neither counted, refused nor timed by it.

The bound's default is derived from the KV cache the engine sized: twice the requests of the full context
length it holds, and never fewer than `--max-num-seqs`. The KV cache's full-context capacity is what the
engine can run at once whatever the requests' lengths; as many again waiting keeps the next batch ready while
a newcomer waits for about one turnover of the running requests, not for many. The floor lets short requests
fill every seat of a step: a bound below `--max-num-seqs` would refuse work the engine could start at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from gracelm.arith import cdiv
from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.output_processor import RequestOutput
from gracelm.lifecycle.server_state import QueueFull, ServerState
from gracelm.observability.metrics import ServerMetrics
from gracelm.serving.api_errors import APIError
from gracelm.serving.request_client import HeldAdmission, RequestClient

FULL_CONTEXT_FACTOR = 2
# When a seat frees depends on the lengths of the answers in flight, which the server cannot know: a second
# brings a client back soon, and a router takes the 429 itself as the sign to try another instance first.
RETRY_AFTER_S = 1


def default_max_in_flight(num_kv_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int) -> int:
    """The bound `--max-num-queued-reqs` defaults to (the module's docstring says why)."""
    full_context = num_kv_blocks // cdiv(max_model_len, block_size)
    return max(max_num_seqs, FULL_CONTEXT_FACTOR * full_context)


def max_in_flight(option: int | None, engine: AsyncEngine) -> int | None:
    """The bound that `--max-num-queued-reqs` sets: the value given, none for 0, and when unset the default
    of the KV cache the engine sized."""
    if option is not None:
        return option or None
    config = engine.config
    assert config.max_model_len is not None
    return default_max_in_flight(engine.num_kv_blocks, config.block_size, config.max_model_len,
                                 config.max_num_seqs)


def rate_limited(message: str) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


def admit(client: RequestClient, state: ServerState, slots: int, metrics: ServerMetrics) -> HeldAdmission:
    """The admission of `client`'s request of `slots` sequences, or a 429 (counted) if it would pass the
    bound; a refusal for the server's state is raised as it is (`AdmissionRefused`)."""
    try:
        return client.admit(state, slots)
    except QueueFull as exc:
        metrics.count_rejection("queue_full")
        raise rate_limited(str(exc)) from None


def within_queue_wait(deltas: AsyncIterator[RequestOutput], admission: HeldAdmission,
                      metrics: ServerMetrics) -> AsyncIterator[RequestOutput]:
    """`deltas`, whose first must come within the admission's queue wait (none: `deltas` as they are)."""
    if admission.queue_wait_left() is None:
        return deltas
    return _first_in_time(deltas, admission, metrics)


async def _first_in_time(deltas: AsyncIterator[RequestOutput], admission: HeldAdmission,
                         metrics: ServerMetrics) -> AsyncGenerator[RequestOutput]:
    """`deltas`, closed with this: past the queue wait without a first delta they are closed, which aborts
    the request in the engine, and the request is a 429 (counted)."""
    async with contextlib.aclosing(deltas):
        timeout = asyncio.timeout(admission.queue_wait_left())
        try:
            async with timeout:
                first = await anext(deltas, None)
        except TimeoutError:
            if not timeout.expired():
                raise
            metrics.count_rejection("queue_wait")
            raise rate_limited("the request did not start within this server's --max-queue-wait; retry "
                               "later or elsewhere") from None
        if first is None:
            return
        yield first
        async for delta in deltas:
            yield delta
