"""The engine core: scheduler + executor behind a ZMQ busy loop, run in a process of its own.

The loop is receive → step (schedule → execute → update) → send. With no request pending it blocks on the
input socket (a poll without timeout), so an idle server costs no CPU.

Shutdown follows a small state machine: RUNNING → REQUESTED (a `Shutdown` message arrived; new requests
are refused, running ones may finish until the deadline) → SHUTTING_DOWN (what is left is aborted, the
executor stopped). With a timeout of 0 the deadline is now: everything is aborted at once. A later
`Shutdown` may only bring the deadline closer (an immediate stop during a drain). Each transition is logged
and the state is part of `stats()`, which the server exposes in `/metrics`.

Failure reporting: a loop that raises sends `FatalError` with its traceback, closes its sockets and then
sends SIGQUIT to its parent when the parent handles that signal (the server's supervisor does; a user's
program running the offline `Engine` may not, and the default action of SIGQUIT would kill it).

Containment: a fault that belongs to one request — its sampling (`Worker.sample_step`), its stop checks
(`Scheduler.update_from_output`) — ends that request with finish_reason "error" (`TokenOutput.fault` names
the stage) and the loop goes on; anything else that raises in a step (the forward pass, the KV cache, a
worker) is fatal as above.

Test-only faults (`lifecycle/faults.py`, never set in production) slow the load or the steps, or make
the loop raise, hang or exit once a number of steps have run, or one request's sampling raise.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import traceback
from typing import TYPE_CHECKING

import zmq

import gracelm.startup_timeline as startup_timeline
from gracelm.arith import cdiv
from gracelm.config import EngineConfig, UnsupportedModelError
from gracelm.engine import messages as msg
from gracelm.engine.kv_persistence import KVPersistence
from gracelm.engine.messages import CoreState
from gracelm.engine.request import Request
from gracelm.engine.request_timings import RequestTimings
from gracelm.engine.scheduler import RequestUpdate, Scheduler, SchedulerConfig
from gracelm.engine.speculation import SpeculationConfig
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.faults import faults
from gracelm.lifecycle.heartbeat import Heartbeat
from gracelm.lifecycle.ledger import Ledger, ResourceKind, ShutdownReport
from gracelm.lifecycle.processes import exit_process
from gracelm.lifecycle.stacks import catches_signal
from gracelm.lifecycle.startup_objects import freeze_startup_objects
from gracelm.model.file_hash import content_hash
from gracelm.model.pooling import Pooling, task_pooling
from gracelm.parallel.executor import Executor

if TYPE_CHECKING:
    from gracelm.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# How long the core's last messages (final outputs, a fatal error report) may wait for the frontend.
_SEND_LINGER_MS = 2000


class EngineCore:
    """Loads the model, sizes the KV cache and runs steps; knows nothing of sockets."""

    def __init__(self, config: EngineConfig) -> None:
        self.pooling = _embedding_pooling(config)
        config = dataclasses.replace(config, task="generate" if self.pooling is None else "embed")
        self.config = config
        self.executor = Executor(config)
        try:
            loaded = self.executor.load_model()
            startup_timeline.mark("repack")  # fused, packed; with tensor parallelism, sharded everywhere
            self.model_name = loaded.name
            self.model_path = loaded.path
            self.model_config = loaded.config
            self._tokenizer_of = loaded.tokenizer_of
            self.tokenizer_in_file = loaded.tokenizer_in_file
            self.max_model_len, num_blocks = self._size_kv_cache()
            # Checked before the cache is allocated: it refuses a cache too small for one request.
            scheduler_config = SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                num_blocks=num_blocks,
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                speculation=speculation_config(config),
            )
            self.executor.init_kv_cache(num_blocks)
            startup_timeline.mark("kv_cache")
            self.scheduler = Scheduler(scheduler_config)
            self.kv_persistence: KVPersistence | None = None
            if config.kv_cache_dir is not None:  # restored now: before the core says Ready
                self.kv_persistence = KVPersistence(config, self.executor, self.scheduler.kv_cache,
                                                    self.tokenizer)
                self.kv_persistence.restore()
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_preemptions = 0
        self.timings = RequestTimings()
        self.state = CoreState.RUNNING
        logger.info("engine core ready: %s, max_model_len %d, %d KV blocks of %d tokens", self.model_name,
                    self.max_model_len, num_blocks, config.block_size)
        timeline = startup_timeline.current()
        if timeline is not None:
            logger.info("model load: %s", timeline.load_split())

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's, built or read from the cache at the first use (`LoadedModel.tokenizer_of`)."""
        return self._tokenizer_of()

    def _size_kv_cache(self) -> tuple[int, int]:
        """max_model_len and the number of KV blocks."""
        model_limit, bound = self.model_config.context_limit()
        requested = self.config.max_model_len
        if requested is not None and requested > model_limit:
            raise UnsupportedModelError(f"max_model_len {requested} exceeds the model's limit of "
                                        f"{model_limit} tokens: {bound}")
        if model_limit < self.model_config.max_position_embeddings:
            logger.info("the model's context is %d tokens, not its %d: %s", model_limit,
                        self.model_config.max_position_embeddings, bound)
        available = self.executor.available_kv_blocks()
        max_model_len = requested
        if max_model_len is None:
            max_model_len = max(1, min(model_limit, available * self.config.block_size))
            if max_model_len < model_limit:
                logger.warning("max_model_len capped to %d tokens, what the KV cache holds", max_model_len)
        # Never more blocks than max_num_seqs full-length requests can use: the rest would be idle memory.
        useful = cdiv(max_model_len, self.config.block_size) * self.config.max_num_seqs
        return max_model_len, min(available, useful)

    def add_request(self, add: msg.AddRequest) -> list[msg.TokenOutput]:
        """Queues the request; returns an abort output for it when it is refused."""
        if self.state is not CoreState.RUNNING:
            return [msg.TokenOutput(add.request_id, None, "abort")]
        request = Request(add.request_id, add.prompt_token_ids, add.sampling_params,
                          tuple(add.eos_token_ids), add.arrival_time, add.priority, pooling=add.pooling)
        try:
            self.scheduler.add_request(request)
        except ValueError as e:  # an id in use: the frontend's bug, not a crash of the core
            logger.warning("request %s refused: %s", add.request_id, e)
            return [msg.TokenOutput(add.request_id, None, "abort")]
        self.timings.arrived(add.request_id)
        return []

    def abort_requests(self, request_ids: list[str]) -> list[msg.TokenOutput]:
        aborted = self.scheduler.abort_requests(request_ids)
        self.timings.forget(aborted)
        self.executor.release_requests(aborted)
        return [msg.TokenOutput(request_id, None, "abort") for request_id in aborted]

    def abort_all(self) -> list[msg.TokenOutput]:
        pending = [*self.scheduler.running, *self.scheduler.waiting]
        return self.abort_requests([request.request_id for request in pending])

    def step(self) -> list[msg.TokenOutput]:
        """Schedule → execute → update: one token for each request whose last token was computed, after the
        draft tokens it kept when it drafted (an embedding request's pooled vector instead)."""
        scheduled = self.scheduler.schedule()
        self.num_preemptions += len(scheduled.preempted_request_ids)
        if not scheduled.scheduled:
            return []
        self.timings.scheduled(item.request.request_id for item in scheduled.scheduled)
        result = self.executor.execute(scheduled.model_step(self.config.block_size))
        updates = self.scheduler.update_from_output(scheduled, result.sampled, result.prompt_logprobs,
                                                    result.pooled)
        for update in updates:
            self.timings.sampled(update.request_id, update.finished)
        self.executor.release_requests([u.request_id for u in updates if u.finished])
        return [_token_output(u) for u in updates]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "num_preemptions": self.num_preemptions, "state": self.state.value,
                "max_model_len": self.max_model_len, "kernel_paths": self.executor.kernel_paths(),
                "compiled_steps": self.executor.compiled_steps(), "memory": self.executor.memory_use()}

    def reset_prefix_cache(self) -> dict:
        """Empties the prefix cache, but only with no request unfinished: a running request's blocks would
        stay shared until it ends, so the cache would not be empty when the caller is told it is.
        `{"reset": bool, "num_unfinished": N}`."""
        unfinished = self.scheduler.num_running + self.scheduler.num_waiting
        if not unfinished:
            self.scheduler.kv_cache.reset_prefix_cache()
            logger.info("prefix cache emptied on request")
        return {"reset": not unfinished, "num_unfinished": unfinished}

    def set_state(self, state: CoreState) -> None:
        if state is not self.state:
            logger.info("engine core state %s -> %s", self.state.value, state.value)
            self.state = state


class EngineCoreProc:
    """The busy loop of the engine-core process around an `EngineCore` and its two sockets."""

    def __init__(self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 heartbeat: Heartbeat) -> None:
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.heartbeat = heartbeat
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self._deadline: float | None = None
        self._utilities = {"stats": core.stats, "request_timings": core.timings.since,
                           "reset_prefix_cache": core.reset_prefix_cache}
        self._steps = 0

    def run(self) -> None:
        """Serves until a `Shutdown`'s deadline passes or nothing is left to finish; then aborts the rest."""
        while True:
            # Once a stop is requested, never block: with nothing left to finish, the loop must end now.
            self._receive(block=not self.core.has_unfinished_requests()
                          and self.core.state is CoreState.RUNNING)
            self.heartbeat.beat()
            if self._stop_due():
                break
            if self.core.kv_persistence is not None:
                self.core.kv_persistence.tick(self._steps)
            if self.core.has_unfinished_requests():
                self._send_outputs(self.core.step())
                self._steps += 1
                faults().after_core_step(self._steps)
                self.heartbeat.beat()
        self.core.set_state(CoreState.SHUTTING_DOWN)
        self._send_outputs(self.core.abort_all())

    def _receive(self, block: bool) -> None:
        # Blocks only when no request is pending (an idle core costs no CPU); otherwise takes what is there.
        persistence = self.core.kv_persistence
        timeout = persistence.poll_timeout_ms(block) if persistence else (None if block else 0)
        while self.poller.poll(timeout):
            self._handle(msg.decode_to_core(self.input.recv(copy=False).buffer))
            timeout = 0

    def _handle(self, message: msg.ToCore) -> None:
        if isinstance(message, msg.AddRequest):
            self._send_outputs(self.core.add_request(message))
        elif isinstance(message, msg.AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, msg.UtilityCall):
            self._call_utility(message)
        elif isinstance(message, msg.Shutdown):
            self._request_shutdown(message.timeout)

    def _call_utility(self, call: msg.UtilityCall) -> None:
        method = self._utilities.get(call.method)
        if method is None:
            reply = msg.UtilityReply(call.call_id, error=f"unknown utility method {call.method!r}")
        else:
            reply = msg.UtilityReply(call.call_id, result=method(*call.args))
        self.output.send(msg.encode(reply))

    def _request_shutdown(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self.core.state is CoreState.RUNNING:
            logger.info("engine core: shutdown requested, %.1f s to finish running requests", timeout)
            self.core.set_state(CoreState.REQUESTED)
            self._deadline = deadline
        elif self._deadline is not None and deadline < self._deadline:
            logger.info("engine core: shutdown deadline brought forward to %.1f s from now", timeout)
            self._deadline = deadline

    @property
    def deadline(self) -> float:
        """The drain's deadline (monotonic), once a stop is requested."""
        return self._deadline if self._deadline is not None else time.monotonic()

    def _stop_due(self) -> bool:
        if self.core.state is not CoreState.REQUESTED:
            return False
        assert self._deadline is not None
        return not self.core.has_unfinished_requests() or time.monotonic() >= self._deadline

    def _send_outputs(self, outputs: list[msg.TokenOutput]) -> None:
        if outputs:
            self.output.send(msg.encode(msg.OutputsBatch(outputs)))


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, heartbeat_path: str,
                    log_level: int) -> None:
    """Entry point of the engine-core process: handshake, busy loop, and a report of any failure.

    `log_level` is the frontend's, so that the core is as verbose as the process that started it.
    """
    startup_timeline.begin().mark("core_import")
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, _SEND_LINGER_MS)
    input_socket.connect(input_address)
    output_socket.connect(output_address)
    heartbeat = Heartbeat.open(heartbeat_path)
    exit_code = ExitCode.FATAL
    try:
        exit_code = _serve(config, input_socket, output_socket, heartbeat)
    finally:
        heartbeat.close()
        input_socket.close(linger=0)
        output_socket.close()
        context.term()
    if exit_code is ExitCode.FATAL:
        _signal_parent()
    exit_process(exit_code)


def _serve(config: EngineConfig, input_socket: zmq.Socket, output_socket: zmq.Socket,
           heartbeat: Heartbeat) -> ExitCode:
    faults().before_model_load()
    try:
        core = EngineCore(config)
    except Exception as e:
        logger.error("engine core failed to start: %s", e)
        output_socket.send(msg.encode(msg.StartupFailed(f"{type(e).__name__}: {e}", traceback.format_exc())))
        return ExitCode.STARTUP_FAILURE
    # The executor releases the model, the KV cache and any tensor-parallel workers with a ledger of its
    # own; its itemised report goes into the core's, so the supervisor's report shows each of them.
    ledger = Ledger()
    executor_reports: list[ShutdownReport] = []
    ledger.acquire(ResourceKind.MODEL, f"engine core: executor of {core.model_name}",
                   lambda: executor_reports.append(core.executor.shutdown()), timeout=30)
    output_socket.send(msg.encode(msg.Ready(
        core.max_model_len, core.model_name, dataclasses.asdict(core.model_config), _tokenizer_sent(core),
        content_hash(core.model_path), core.scheduler.kv_cache.num_total_blocks, pooling=core.pooling,
        startup_marks=_startup_marks())))
    proc = EngineCoreProc(core, input_socket, output_socket, heartbeat)
    freeze_startup_objects()
    try:
        proc.run()
    except Exception as e:
        logger.exception("engine core failed")
        output_socket.send(msg.encode(msg.FatalError(f"{type(e).__name__}: {e}", traceback.format_exc())))
        ledger.release_all()
        return ExitCode.FATAL
    # After the last request, before the executor frees the KV cache: a fatal stop above saves nothing.
    saved = (core.kv_persistence.save_at_stop(proc.deadline, heartbeat.beat) if core.kv_persistence
             else ShutdownReport())
    report = ledger.release_all()
    resources = [r for part in (saved, *executor_reports, report) for r in part.to_dict()["resources"]]
    output_socket.send(msg.encode(msg.Stopped(resources)))
    return ExitCode.CLEAN_STOP


def _embedding_pooling(config: EngineConfig) -> Pooling | None:
    """The pooling of the model `--task` serves as an embedding model (read from its files: here, not in the
    frontend, whose start would otherwise wait for the read before the core's), or None where it generates."""
    pooling = task_pooling(config.task, config.model)
    if pooling is not None and config.tensor_parallel_size > 1:
        raise ValueError(f"{config.model or 'the model'} is an embedding model (task embed), served on one "
                         f"rank: tensor_parallel_size must be 1")
    return pooling


def speculation_config(config: EngineConfig) -> SpeculationConfig | None:
    """The scheduler's speculation settings; None when it is off. An embedding model samples nothing to
    speculate on, so it refuses the option by name."""
    if config.speculative == "off":
        return None
    if config.task == "embed":
        raise UnsupportedModelError(f"speculative {config.speculative} (--speculative) applies to text "
                                    f"generation; this server serves embeddings (--task embed)")
    return SpeculationConfig(config.speculative, config.num_speculative_tokens, config.prompt_lookup_min,
                             config.prompt_lookup_max, config.speculative_max_batch)


def _token_output(update: RequestUpdate) -> msg.TokenOutput:
    sampled = update.sampled
    if update.embedding is not None:
        return msg.TokenOutput(update.request_id, None, update.finish_reason, embedding=update.embedding)
    if sampled is None:  # a fault ended the request (containment: `Scheduler.update_from_output`)
        return msg.TokenOutput(update.request_id, None, update.finish_reason, fault=update.fault)
    return msg.TokenOutput(update.request_id, sampled.token_id, update.finish_reason, update.stop_reason,
                           sampled.logprob, sampled.top_ids, sampled.top_logprobs,
                           prompt_logprobs=update.prompt_logprobs)


def _tokenizer_sent(core: EngineCore) -> dict | None:
    """The tokenizer Ready carries: none where the frontend builds it from the model file itself
    (`engine/early_tokenizer.py`), the core building its own only where a request needs it."""
    return None if core.tokenizer_in_file else core.tokenizer.to_dict()


def _startup_marks() -> list[tuple[str, float]]:
    """This process's start-up, for the supervisor's timeline: its creation ends the spawn."""
    timeline = startup_timeline.current()
    assert timeline is not None  # begun by `run_engine_core`
    timeline.mark("scheduler")
    return [("spawn", timeline.origin), *timeline.marks]


def _signal_parent() -> None:
    """SIGQUIT to the supervisor after a fatal error (its report went first), so that it stops at once even
    if it is not reading the channel; only to a parent that handles SIGQUIT, which would otherwise kill it."""
    parent = os.getppid()
    if parent > 1 and catches_signal(parent, signal.SIGQUIT):
        os.kill(parent, signal.SIGQUIT)
