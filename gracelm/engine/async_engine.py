"""`AsyncEngine`: streaming inference for servers, on one asyncio event loop (bound at its first call).

The core's monitor puts what the core says into an inbox and wakes the loop, which reads it in order:
outputs become deltas for each request's stream, replies resolve their calls, and the core's end, last,
ends whatever is still open — with an error after a failure, with `finish_reason="abort"` after a stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from gracelm.config import EngineConfig
from gracelm.engine import messages as msg
from gracelm.engine.frontend import EMBEDDING_PARAMS, EngineFrontend, FatalHandler, Prompt
from gracelm.lifecycle.ledger import Ledger
from gracelm.lifecycle.process_end import ProcessEnd
from gracelm.sampling_params import SamplingParams

if TYPE_CHECKING:  # the output processor is imported where the core's Ready is taken (`EngineFrontend`)
    from gracelm.engine.output_processor import RequestOutput

logger = logging.getLogger(__name__)


class _Stream:
    """What one request's consumer has not read yet: the deltas since its last read, added up."""

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, delta: RequestOutput) -> None:
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.add(delta)
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def get(self) -> RequestOutput:
        while self._pending is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._pending is not None:
            delta, self._pending = self._pending, None
            return delta
        assert self._error is not None
        raise self._error


class AsyncEngine(EngineFrontend):
    """`AsyncEngine(model, **options)`: the options are `EngineConfig`'s fields. Constructing it starts the
    engine core and waits until it is ready (raising on a start-up failure)."""

    def __init__(self, model: str | None = None, *, on_fatal: FatalHandler | None = None,
                 **options: Any) -> None:
        self._init_async(EngineConfig(model=model, **options), None, on_fatal, None)

    @classmethod
    def from_config(cls, config: EngineConfig, *, ledger: Ledger | None = None,
                    on_fatal: FatalHandler | None = None,
                    beside_load: Callable[[], object] | None = None) -> AsyncEngine:
        """`ledger`: record the engine's resources in the caller's (the server's), whose release then
        stops the engine too. `beside_load`: the caller's work while the core loads (`EngineFrontend`)."""
        engine = cls.__new__(cls)
        engine._init_async(config, ledger, on_fatal, beside_load)
        return engine

    def _init_async(self, config: EngineConfig, ledger: Ledger | None, on_fatal: FatalHandler | None,
                    beside_load: Callable[[], object] | None) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ended: asyncio.Event | None = None  # set once the core's end has been handled in the loop
        super().__init__(config, ledger, on_fatal, beside_load)

    # -- the API -------------------------------------------------------------------------------------

    def generate(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str, *,
                 delta: bool = False, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The outputs of one request: with `delta`, each holds what is new; otherwise the whole answer so
        far. The last has `finished=True`. The prompt and the priority (lower runs first; equal ones first
        come, first served) are checked now (raising `ValueError` before anything is queued); closing or
        cancelling the iteration aborts the request in the core at once."""
        return self._start(prompt, sampling_params, request_id, delta, priority, embedding=False)

    def embed(self, prompt: Prompt, request_id: str, *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The outputs of one embedding request (an engine of task embed): one, finished, whose completion's
        `embedding` is the pooled vector, which `pooling.finished` truncates and normalises. Checked and
        aborted as `generate`'s."""
        return self._start(prompt, EMBEDDING_PARAMS, request_id, True, priority, embedding=True)

    def _start(self, prompt: Prompt, params: SamplingParams, request_id: str, delta: bool, priority: int, *,
               embedding: bool) -> AsyncIterator[RequestOutput]:
        self._bind_loop()
        self._check_usable()
        text, ids = self._prepare(prompt, params, priority, embedding=embedding)
        stream = self._streams[request_id] = _Stream()
        try:
            self._add(request_id, text, ids, params, priority, embedding=embedding)
        except BaseException:
            self._streams.pop(request_id, None)
            self._abort(request_id)
            raise
        return self._outputs(request_id, stream, delta)

    async def _outputs(self, request_id: str, stream: _Stream, delta: bool) -> AsyncGenerator[RequestOutput]:
        total: RequestOutput | None = None
        try:
            while True:
                output = await stream.get()
                if not delta:
                    total = output if total is None else total
                    if output is not total:
                        total.add(output)
                    output = total.copy()
                yield output
                if output.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Ends the request: its stream gets a last output with `finish_reason="abort"`."""
        last = self._abort(request_id)
        stream = self._streams.get(request_id)
        if last is not None and stream is not None:
            stream.put(last)

    async def stats(self) -> dict:
        return await self._call("stats")

    async def request_timings(self, seen: int) -> dict:
        """The core's phase timings of the sequences finished after the first `seen` (`RequestTimings`)."""
        return await self._call("request_timings", seen)

    async def reset_prefix_cache(self) -> dict:
        """Empties the core's prefix cache unless a request is unfinished there:
        `{"reset": bool, "num_unfinished": N}` (`EngineCore.reset_prefix_cache`)."""
        return await self._call("reset_prefix_cache")

    async def _call(self, method: str, *args) -> dict:
        self._bind_loop()
        self._check_usable()
        assert self._loop is not None
        with self._utility_call(method, *args) as call_id:
            reply = self._calls[call_id] = self._loop.create_future()
            try:
                return await reply
            finally:
                self._calls.pop(call_id, None)

    def begin_shutdown(self, timeout: float) -> None:
        """Starts the engine core's drain and returns at once: it takes no new request, finishes the running
        ones within `timeout` s and aborts the rest, whose streams get `finish_reason="abort"`; outputs keep
        flowing meanwhile. A second call may only shorten the deadline (0: abort now)."""
        self._client.request_stop(timeout)
        self._update_busy()

    async def wait_end(self) -> ProcessEnd:
        """Returns how the core ended, once that end has been handled here (its last outputs delivered)."""
        self._bind_loop()
        assert self._ended is not None
        await self._ended.wait()
        end = self._client.end
        assert end is not None
        return end

    def shutdown(self, timeout: float | None = None) -> Any:
        """Stops the core; streams still open get a last output with `finish_reason="abort"`."""
        if not self._shut_down:
            self._end_streams()
        return super().shutdown(timeout)

    # -- the loop's side of the core's messages ------------------------------------------------------

    def _bind_loop(self) -> None:
        if self._loop is not None:
            return
        loop = self._loop = asyncio.get_running_loop()
        self._ended = asyncio.Event()
        ref = weakref.ref(self)  # the monitor's thread must not keep the engine from garbage collection
        self._client.monitor.set_waker(lambda: _wake(loop, ref))

    def _read_inbox(self) -> None:
        """Handles one message, and comes back for the next after whatever else the loop has to do: when
        the core's steps come faster than their outputs are handled here, the backlog must not hold the loop
        (`/health` included) for the time of all of it, only for one step's outputs at a time."""
        inbox = self._client.monitor.inbox
        if inbox.empty():
            return
        item = inbox.get_nowait()
        if not inbox.empty():
            assert self._loop is not None
            self._loop.call_soon(_read_inbox, weakref.ref(self))
        if isinstance(item, ProcessEnd):
            self._on_end(item)
        elif isinstance(item, msg.OutputsBatch):
            self._on_outputs(item)
        elif isinstance(item, msg.UtilityReply):
            self._on_reply(item)

    def _on_outputs(self, batch: msg.OutputsBatch) -> None:
        processed = self._processor.process(batch.outputs)
        self._client.abort_requests(processed.core_ids_to_abort)
        self._update_busy()
        for delta in processed.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put(delta)

    def _on_reply(self, reply: msg.UtilityReply) -> None:
        future = self._calls.get(reply.call_id)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(RuntimeError(reply.error))
        else:
            future.set_result(reply.result)

    def _on_end(self, end: ProcessEnd) -> None:
        """After a failure every stream and call fails; after a requested stop what is open ends aborted."""
        if end.fatal:
            error = self._dead_error()
            for stream in self._streams.values():
                stream.fail(error)
        else:
            logger.info("engine core exited at the end of its drain")
            self._end_streams()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self._dead_error())
        assert self._ended is not None
        self._ended.set()

    def _end_streams(self) -> None:
        """Each stream still open gets a last output with `finish_reason="abort"`."""
        for request_id, stream in list(self._streams.items()):
            last = self._abort(request_id)
            if last is not None:
                stream.put(last)


def _wake(loop: asyncio.AbstractEventLoop, ref: weakref.ref[AsyncEngine]) -> None:
    """From the monitor's thread: the engine reads its inbox in `loop`, unless the loop or the engine is
    gone (then nobody is left to read)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_read_inbox, ref)


def _read_inbox(ref: weakref.ref[AsyncEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine._read_inbox()
