"""The public engines: `Engine` (offline, blocking) and `AsyncEngine` (asyncio, streaming).

Both run the same frontend — tokenize, validate, fan out `n`, detokenize — in the caller's process, and
the model in an engine-core process of their own (`EngineCoreClient`).

Lifecycle: every resource is recorded in a `Ledger` (the engine's own, or the server's when it passes one)
and `shutdown()` — explicit, from the context manager, at garbage collection or at interpreter exit, once
whichever comes first — releases them newest first and returns the shutdown report (logged as a table and,
with `shutdown_report=PATH`, written as JSON). Two watcher threads supervise the core: one wakes on its
process sentinel the moment it dies, one reads its heartbeat and calls a hang after `engine_hang_timeout`
seconds without a step while work is pending (stacks dumped first). Either calls `on_fatal(reason)`; the
default logs it, and every later call raises `EngineDeadError`. The offline `Engine` installs no signal
handler: Ctrl-C in `generate()` is the user's `KeyboardInterrupt`, and the requests are aborted on its way.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gracelm.config import EngineConfig, ModelConfig
from gracelm.engine import messages as msg
from gracelm.engine.core_client import EngineCoreClient
from gracelm.engine.errors import EngineDeadError
from gracelm.engine.output_processor import OutputProcessor
from gracelm.engine.outputs import RequestOutput
from gracelm.lifecycle.ledger import Ledger, ResourceKind, ShutdownReport
from gracelm.lifecycle.stacks import request_stack_dumps
from gracelm.lifecycle.watchdog import HangWatchdog, ProcessSentinelWatch, describe_exit
from gracelm.model.loader import load_tokenizer
from gracelm.model.tokenizer import Tokenizer
from gracelm.parallel.sharding import check_parallel_config
from gracelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Messages = list[dict[str, Any]]
FatalHandler = Callable[[str], None]
# After asking a hung core for its stacks, how long to give it to write them before it is killed.
_HANG_DUMP_WAIT_S = 0.5
# A core declared dead (hung, or reported a fatal error) gets this long to exit before it is forced.
_DEAD_CORE_WAIT_S = 0.5


class _Frontend:
    """What both engines share: the core client, the tokenizer, validation and output processing."""

    def __init__(self, config: EngineConfig, ledger: Ledger | None = None,
                 on_fatal: FatalHandler | None = None) -> None:
        self._ledger = ledger if ledger is not None else Ledger()
        self._on_fatal = on_fatal
        self._fatal_reason: str | None = None
        self._lock = threading.Lock()
        self._shut_down = False
        check_parallel_config(config)  # an unsplittable model is refused before any process starts
        # The tokenizer loads here while the core loads the weights; a core start-up failure wins, as it
        # names the cause from the process that tried.
        with ThreadPoolExecutor(1, thread_name_prefix="gracelm-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, config.model)
            self._client = EngineCoreClient(config, self._ledger)
            try:
                self.tokenizer: Tokenizer = tokenizer.result()
            except BaseException:
                self._client.shutdown(timeout=0)
                raise
        try:
            self._start_watchers(config)
        except BaseException:
            self._client.shutdown(timeout=0)
            raise
        ready = self._client.ready
        self.config = dataclasses.replace(config, max_model_len=ready.max_model_len)
        fields = dict(ready.model_config)
        fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
        self.model_config = ModelConfig(**fields)
        self.model_name = ready.model_name
        self._processor = OutputProcessor(self.tokenizer)
        # Stop the core when the engine is garbage-collected or, at the latest, at interpreter exit. The
        # atexit hook is registered here, after multiprocessing's own (which joins every child and would
        # wait for ever on a running core), so that it runs first. Neither holds on to the engine.
        self._finalizer = weakref.finalize(self, _stop, self._client, config.shutdown_timeout,
                                           config.shutdown_report)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    def _start_watchers(self, config: EngineConfig) -> None:
        """The sentinel watch and the hang watchdog; they hold the engine weakly, so that it can still be
        garbage-collected while they run."""
        ref = weakref.ref(self)

        def on_exit(name: str, pid: int, exitcode: int | None) -> None:
            engine = ref()
            if engine is not None:
                engine._on_core_exit_seen(name, pid, exitcode)

        def on_hang(pid: int, stalled: float) -> None:
            engine = ref()
            if engine is not None:
                engine._on_hang(pid, stalled)

        assert self._client.process is not None
        watch = ProcessSentinelWatch(on_exit)
        watch.watch(self._client.process)
        watch.start()
        self._ledger.acquire(ResourceKind.THREAD, "child sentinel watch", watch.stop, timeout=2)
        hang = HangWatchdog(self._client.heartbeat, config.engine_hang_timeout, on_hang)
        hang.start()
        if config.engine_hang_timeout > 0:
            self._ledger.acquire(ResourceKind.THREAD, f"hang watchdog ({config.engine_hang_timeout:g} s)",
                                 hang.stop, timeout=2)

    def _on_core_exit_seen(self, name: str, pid: int, exitcode: int | None) -> None:
        if self._shut_down or (self._client.stop_requested and exitcode == 0):
            return
        self._fatal(describe_exit("engine core", pid, exitcode))

    def _on_hang(self, pid: int, stalled: float) -> None:
        request_stack_dumps([pid])
        time.sleep(_HANG_DUMP_WAIT_S)  # the dump is written by the hung process itself
        self._fatal(f"engine core pid {pid} hung: no step finished for {stalled:.1f} s with work pending")

    def declare_failed(self, reason: str) -> None:
        """The owner learnt of a failure of the core by other means (a SIGQUIT with its report)."""
        self._fatal(reason)

    def _fatal(self, reason: str) -> None:
        """A failure of the core seen by a watcher (from its thread): once, mark it dead, tell the caller."""
        with self._lock:
            if self._fatal_reason is not None or self._shut_down:
                return
            self._fatal_reason = reason
        self._client.mark_dead(reason)
        self._client.set_stop_wait(_DEAD_CORE_WAIT_S)
        self._on_core_failed(reason)
        if self._on_fatal is not None:
            self._on_fatal(reason)
        else:
            logger.error("engine failed: %s; its calls now raise EngineDeadError", reason)

    def _on_core_failed(self, reason: str) -> None:
        """What the engine itself does when its core failed; runs on a watcher thread."""

    @property
    def runtime_dir(self) -> Path:
        """The instance's runtime directory (ipc sockets; other per-instance files may live there)."""
        return self._client.runtime_dir.path

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Validates a prompt; raises `ValueError` before anything is queued."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty")
        limit = self.config.max_model_len
        assert limit is not None
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {limit}, which leaves no "
                             f"room to generate (the prompt must be shorter than max_model_len)")
        return text, ids

    def _conversation_ids(self, messages: Messages) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    @property
    def errored(self) -> bool:
        return not self._shut_down and not self._client.is_alive

    @property
    def is_running(self) -> bool:
        return not self._shut_down and self._client.is_alive

    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        """Stops the engine core (letting running requests finish for up to `timeout` s, by default the
        configured `shutdown_timeout`) and releases everything; idempotent and thread-safe. Returns the
        shutdown report (the same one on every call)."""
        with self._lock:
            first = not self._shut_down
            self._shut_down = True
        if not first:
            return self._ledger.release_all()
        self._finalizer.detach()
        atexit.unregister(self._finalizer)
        return _stop(self._client, self.config.shutdown_timeout if timeout is None else timeout,
                     self.config.shutdown_report)

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


class Engine(_Frontend):
    """Offline batch inference: `generate()` and `chat()` block until every request is done.

    One caller at a time: the calls are not meant to run concurrently from several threads.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: str | int | None = None, shutdown_timeout: float = 30.0,
                 on_fatal: FatalHandler | None = None, **kwargs: Any) -> None:
        super().__init__(EngineConfig(
            model=model, dtype=dtype, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=kv_cache_memory, shutdown_timeout=shutdown_timeout, **kwargs), on_fatal=on_fatal)
        self._request_ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, *, on_fatal: FatalHandler | None = None) -> Engine:
        engine = cls.__new__(cls)
        _Frontend.__init__(engine, config, on_fatal=on_fatal)
        engine._request_ids = itertools.count()
        return engine

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt (a string or a token-id list, or a list of them) to completion, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, text or token ids
        prepared = []
        all_params = self._params_per_prompt(sampling_params, len(prompts))
        for prompt, params in zip(prompts, all_params, strict=True):
            prepared.append((*self._prepare(prompt, params), params))
        return self._run(prepared, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation (a list of messages) or to several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self._conversation_ids(c) for c in conversations], sampling_params, use_tqdm)

    def stats(self) -> dict:
        call = self._client.new_utility_call("stats")
        self._client.send(call)
        while True:
            message = self._next_message()
            if isinstance(message, msg.UtilityReply) and message.call_id == call.call_id:
                if message.error is not None:
                    raise RuntimeError(message.error)
                assert message.result is not None
                return message.result
            if isinstance(message, msg.OutputsBatch):
                self._processor.process(message.outputs)

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                           count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return list(params)

    def _run(self, prepared: list[tuple[str | None, list[int], SamplingParams]],
             use_tqdm: bool) -> list[RequestOutput]:
        request_ids = [str(next(self._request_ids)) for _ in prepared]
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prepared), desc="generating", disable=not use_tqdm)
        try:
            for request_id, (text, ids, params) in zip(request_ids, prepared, strict=True):
                for add in self._processor.add_request(request_id, text, ids, params):
                    self._client.add_request(add)
            while len(results) < len(request_ids):
                message = self._next_message()
                if isinstance(message, msg.OutputsBatch):
                    for output in self._process(message.outputs):
                        results[output.request_id] = output
                        bar.update(1)
        finally:
            bar.close()
            self._abort_unfinished(request_ids)
        return [results[request_id] for request_id in request_ids]

    def _next_message(self) -> msg.FromCore:
        if self._shut_down:
            raise EngineDeadError("the engine has been shut down")
        message = self._client.get_output(timeout=None)
        if isinstance(message, msg.FatalError):
            raise EngineDeadError(f"engine core failed: {message.error}")
        assert message is not None
        return message

    def _process(self, outputs: list[msg.TokenOutput]) -> list[RequestOutput]:
        processed = self._processor.process(outputs)
        self._client.abort_requests(processed.core_ids_to_abort)
        return [state.output() for state in processed.updated if state.finished]

    def _abort_unfinished(self, request_ids: list[str]) -> None:
        """After an interruption (Ctrl-C, a dead core), the core must not keep working for nobody."""
        core_ids = []
        for request_id in request_ids:
            core_ids += self._processor.abort(request_id)[1]
        if core_ids and self._client.is_alive:
            self._client.abort_requests(core_ids)


class _Stream:
    """The latest cumulative output of one request, for its consumer; outputs are cumulative, so one that
    the consumer has not read yet is simply replaced by the next."""

    def __init__(self) -> None:
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._latest = output
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def get(self) -> RequestOutput:
        while self._latest is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._latest is not None:
            output, self._latest = self._latest, None
            return output
        assert self._error is not None
        raise self._error


class AsyncEngine(_Frontend):
    """Streaming inference for servers. Constructing it starts the engine core and waits until it is ready
    (raising on a start-up failure); the asyncio side binds to the loop of the first call."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: str | int | None = None, shutdown_timeout: float = 30.0,
                 on_fatal: FatalHandler | None = None, **kwargs: Any) -> None:
        self._init_async(EngineConfig(
            model=model, dtype=dtype, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=kv_cache_memory, shutdown_timeout=shutdown_timeout, **kwargs), None, on_fatal)

    @classmethod
    def from_config(cls, config: EngineConfig, *, ledger: Ledger | None = None,
                    on_fatal: FatalHandler | None = None) -> AsyncEngine:
        """`ledger`: record the engine's resources in the caller's (the server's), whose release then
        stops the engine too."""
        engine = cls.__new__(cls)
        engine._init_async(config, ledger, on_fatal)
        return engine

    def _init_async(self, config: EngineConfig, ledger: Ledger | None, on_fatal: FatalHandler | None) -> None:
        # Set before the watchers start: a failure they report may come at once.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_error: EngineDeadError | None = None
        self._dead = asyncio.Event()  # set with _dead_error
        self._core_exited = asyncio.Event()  # set by the core's sentinel, in the loop
        super().__init__(config, ledger, on_fatal)
        self._streams: dict[str, _Stream] = {}
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._output_task: asyncio.Task | None = None

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; the last has `finished=True`. Closing or cancelling the
        iteration aborts the request in the engine core at once."""
        self._check_usable()
        text, ids = self._prepare(prompt, sampling_params)
        self._start_output_loop()
        adds = self._processor.add_request(request_id, text, ids, sampling_params)
        stream = self._streams[request_id] = _Stream()
        try:
            for add in adds:
                self._client.add_request(add)
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._abort_locally(request_id)

    async def abort(self, request_id: str) -> None:
        """Ends the request: its stream gets a last output with `finish_reason="abort"`."""
        state, core_ids = self._processor.abort(request_id)
        if state is None:
            return
        if self._client.is_alive:
            self._client.abort_requests(core_ids)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(state.output())

    async def stats(self) -> dict:
        self._check_usable()
        self._start_output_loop()
        assert self._loop is not None
        call = self._client.new_utility_call("stats")
        reply = self._utility_calls[call.call_id] = self._loop.create_future()
        self._client.send(call)
        return await reply

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def begin_shutdown(self, timeout: float) -> None:
        """Starts the engine core's drain and returns at once: it takes no new request, finishes the running
        ones within `timeout` s and aborts the rest, whose streams get `finish_reason="abort"`; outputs keep
        flowing meanwhile. A second call may only shorten the deadline (0: abort now)."""
        self._client.request_stop(timeout)

    @property
    def stop_requested(self) -> bool:
        return self._client.stop_requested

    @property
    def core_stopped(self) -> bool:
        """The core has exited (after `begin_shutdown`, once its drain is over)."""
        process = self._client.process
        return process is None or process.exitcode is not None

    async def wait_core_exit(self) -> None:
        """Returns once the core process has ended; woken by its sentinel in this loop, without polling."""
        if self._core_exited.is_set() or self._shut_down or self.core_stopped:
            return
        self._start_output_loop()  # which watches the sentinel
        await self._core_exited.wait()

    async def wait_dead(self) -> None:
        """Returns once the engine is known dead (`dead_error` set)."""
        await self._dead.wait()

    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        """Stops the core; streams still open get a last output with `finish_reason="abort"`."""
        if not self._shut_down:
            self._stop_output_loop()
            self._end_streams()
        return super().shutdown(timeout)

    def _on_core_failed(self, reason: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail, EngineDeadError(f"engine core failed: {reason}"))

    def _check_usable(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._shut_down:
            raise EngineDeadError("the engine has been shut down")
        if not self._client.is_alive:
            self._fail(EngineDeadError(self._client.dead_reason or "the engine core is not running"))
            assert self._dead_error is not None
            raise self._dead_error

    def _abort_locally(self, request_id: str) -> None:
        _, core_ids = self._processor.abort(request_id)
        if core_ids and self._client.is_alive and not self._shut_down:
            self._client.abort_requests(core_ids)

    def _start_output_loop(self) -> None:
        if self._output_task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._client.watch_process(self._loop, self._on_core_exit)
        self._output_task = self._loop.create_task(self._output_loop(), name="gracelm-engine-outputs")
        self._ledger.acquire(ResourceKind.TASK, "asyncio task gracelm-engine-outputs", self._stop_output_loop,
                             inline=True)

    def _stop_output_loop(self) -> None:
        loop, task = self._loop, self._output_task
        if loop is None or task is None or loop.is_closed():
            return
        if _running_loop() is loop:
            task.cancel()
            self._client.unwatch_process(loop)
        else:
            loop.call_soon_threadsafe(task.cancel)
            loop.call_soon_threadsafe(self._client.unwatch_process, loop)

    async def _output_loop(self) -> None:
        try:
            while True:
                self._handle(await self._client.get_output_async())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave streams waiting for ever
            logger.exception("engine output handling failed")
            self._fail(EngineDeadError(f"engine output handling failed: {e}"))

    def _handle(self, message: msg.FromCore) -> None:
        if isinstance(message, msg.OutputsBatch):
            processed = self._processor.process(message.outputs)
            self._client.abort_requests(processed.core_ids_to_abort)
            for state in processed.updated:
                stream = self._streams.get(state.request_id)
                if stream is not None:
                    stream.put(state.output())
        elif isinstance(message, msg.UtilityReply):
            future = self._utility_calls.pop(message.call_id, None)
            if future is not None and not future.done():
                if message.error is not None:
                    future.set_exception(RuntimeError(message.error))
                else:
                    future.set_result(message.result)
        elif isinstance(message, msg.FatalError):
            self._fail(EngineDeadError(f"engine core failed: {message.error}"))

    def _on_core_exit(self) -> None:
        assert self._loop is not None
        self._client.unwatch_process(self._loop)
        self._core_exited.set()
        if self._shut_down:
            return
        # What the core sent before it died is delivered first.
        for message in self._client.drain_nowait():
            self._handle(message)
        # The sentinel closes a moment before the exit status can be read.
        if self._client.stop_requested and self._client.wait_exit(1.0) and self._client.process.exitcode == 0:
            logger.info("engine core exited at the end of its drain")
            self._end_streams()  # the drain is over: its last outputs came above
            for future in self._utility_calls.values():
                if not future.done():
                    future.set_exception(EngineDeadError("the engine core has stopped"))
            self._utility_calls.clear()
            return
        reason = self._client.dead_reason or self._client.process_exit_description()
        self._fail(EngineDeadError(f"engine core died: {reason}"))

    def _end_streams(self) -> None:
        """Each stream still open gets a last output with `finish_reason="abort"`."""
        for request_id in list(self._streams):
            state, _ = self._processor.abort(request_id)
            if state is not None:
                self._streams[request_id].put(state.output())

    def _fail(self, error: EngineDeadError) -> None:
        if self._dead_error is not None:
            return
        self._dead_error = error
        self._dead.set()
        logger.error("%s", error)
        if self._output_task is not None and self._output_task is not asyncio.current_task():
            self._output_task.cancel()
        for stream in self._streams.values():
            stream.fail(error)
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
        self._utility_calls.clear()


def _stop(client: EngineCoreClient, timeout: float, report_path: str | None) -> ShutdownReport:
    """Stops the core and releases every resource of the ledger; logs the report and writes it as JSON.
    A module function, so that the finalizer and the atexit hook hold the client, never the engine."""
    client.shutdown(timeout)
    report = client.ledger.release_all()
    if client.core_report and not any(r in report.resources for r in client.core_report):
        # What the core released itself (the model, the KV cache) goes right before the core process.
        at = next((i for i, r in enumerate(report.resources) if r.kind is ResourceKind.PROCESS),
                  len(report.resources))
        report.resources[at:at] = client.core_report
    logger.info("shutdown report:\n%s", report.as_table())
    if report_path:
        report.to_json(report_path)
    return report


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
