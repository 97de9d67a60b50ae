"""What `Engine` and `AsyncEngine` share: the core client, the tokenizer, the one check of a prompt, output
processing, the reaction to the core's end, and the stop.

Lifecycle: every resource is recorded in a `Ledger` (the engine's own, or the server's when it passes one)
and `shutdown()` — explicit, from the context manager, at garbage collection or at interpreter exit, once
whichever comes first — releases them newest first and returns the shutdown report (logged as a table and,
with `shutdown_report=PATH`, written as JSON). The core's monitor announces how the core ended, once; a
fatal end goes to `on_fatal(end)` (by default a log line) and every later call raises `EngineDeadError`.
See docs/architecture.md.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gracelm.config import EngineConfig, ModelConfig
from gracelm.engine import early_tokenizer
from gracelm.engine import messages as msg
from gracelm.engine.core_client import EngineCoreClient
from gracelm.engine.errors import EngineDeadError
from gracelm.lifecycle.ledger import Ledger, ResourceKind, ShutdownReport
from gracelm.lifecycle.process_end import ProcessEnd
from gracelm.model.pooling import Pooling
from gracelm.parallel.layout import check_parallel_config
from gracelm.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported where the core's Ready is taken: the core starts without waiting for them
    from gracelm.engine.output_processor import OpenRequest

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Messages = list[dict[str, Any]]
FatalHandler = Callable[[ProcessEnd], None]


# What an embedding request runs with: its one completion, of no token (the core samples none).
EMBEDDING_PARAMS = SamplingParams(max_tokens=1)

# The priorities a request may have: a signed 32-bit integer, wide enough for a deadline in epoch seconds.
MIN_PRIORITY, MAX_PRIORITY = -2**31, 2**31 - 1


def check_priority(priority: int) -> None:
    """Raises `ValueError` for a priority outside [MIN_PRIORITY, MAX_PRIORITY] or not an integer."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
            MIN_PRIORITY <= priority <= MAX_PRIORITY):
        raise ValueError(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")


class PromptError(ValueError):
    """A prompt the engine cannot run; `too_long` tells a context overflow from other faults."""

    def __init__(self, message: str, too_long: bool = False) -> None:
        super().__init__(message)
        self.too_long = too_long


class TaskError(ValueError):
    """A request of the task the engine does not serve: text from an embedding model, or the reverse."""


def check_task(pooling: Pooling | None, embedding: bool) -> None:
    """Raises `TaskError` unless the engine (an embedding model where `pooling` is set) serves the request
    (an embedding where `embedding`)."""
    if embedding and pooling is None:
        raise TaskError("this model generates text (task generate): embeddings need an embedding model, "
                        "served with --task embed")
    if not embedding and pooling is not None:
        raise TaskError("this model is served for embeddings (task embed): it generates no text; ask "
                        "/v1/embeddings (Engine.embed), or serve a generation model")


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int,
                 max_tokens: int | None = None, *, embedding: bool = False) -> None:
    """The one check of a prompt, before anything is queued: non-empty, known token ids, and shorter than
    `max_model_len`, so that at least one token can be generated within the context (an `embedding`'s
    input may fill it). Raises `PromptError` (an overflow in OpenAI's words, counting `max_tokens`, or the
    one token, as the completion)."""
    if not prompt_token_ids:
        raise PromptError("the prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt_token_ids):
        raise PromptError(f"prompt token ids must be integers in [0, {vocab_size})")
    if embedding:
        if len(prompt_token_ids) > max_model_len:
            raise PromptError(f"This model's maximum context length is {max_model_len} tokens. However, "
                              f"you requested {len(prompt_token_ids)} tokens in the input for embedding. "
                              f"Please reduce the length of the input.", too_long=True)
        return
    if len(prompt_token_ids) >= max_model_len:
        completion = max_tokens if max_tokens is not None else 1
        raise PromptError(context_overflow_message(max_model_len, len(prompt_token_ids), completion),
                          too_long=True)


def context_overflow_message(max_model_len: int, num_prompt_tokens: int, num_completion_tokens: int) -> str:
    """OpenAI's words for a request over the context, which clients match ("maximum context length")."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + num_completion_tokens} tokens ({num_prompt_tokens} in the messages, "
            f"{num_completion_tokens} in the completion). Please reduce the length of the messages or "
            f"completion.")


class EngineFrontend:
    def __init__(self, config: EngineConfig, ledger: Ledger | None = None,
                 on_fatal: FatalHandler | None = None,
                 beside_load: Callable[[], object] | None = None) -> None:
        """Starts the engine core and waits until it is ready; `beside_load`, the caller's own work (a
        server's imports), runs once the core's process has started, so that it delays neither the core's
        start nor the caller's use of the engine."""
        self._ledger = ledger if ledger is not None else Ledger()
        self._on_fatal = on_fatal
        self._lock = threading.Lock()
        self._shut_down = False
        self._calls_pending = 0  # utility calls sent and not answered
        check_parallel_config(config)  # an unsplittable model is refused before any process starts
        if config.task == "embed" and config.tensor_parallel_size > 1:  # found in the files: by the core
            raise ValueError("task embed (--task) is served on one rank: tensor_parallel_size must be 1")
        self._client = EngineCoreClient(config, self._ledger)
        with self._client.starting():  # the threads start after the core's process: none delays it
            tokenizer_read = early_tokenizer.begin(config.model)
            if beside_load is not None:
                beside_load()
            ready = self._client.wait_ready()
        try:
            self._take_ready(config, ready, tokenizer_read)
        except BaseException:
            # Nothing would stop the running core: multiprocessing's exit would wait for it for ever.
            _stop(self._client, config.shutdown_timeout, config.shutdown_report)
            raise
        ref = weakref.ref(self)  # the monitor's thread must not keep the engine from garbage collection
        self._client.monitor.add_listener(lambda end: _call_if_alive(ref, end))
        # Stop the core when the engine is garbage-collected or, at the latest, at interpreter exit. The
        # atexit hook is registered here, after multiprocessing's own (which joins every child and would
        # wait for ever on a running core), so that it runs first. Neither holds on to the engine.
        self._finalizer = weakref.finalize(self, _stop, self._client, config.shutdown_timeout,
                                           config.shutdown_report)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    def _take_ready(self, config: EngineConfig, ready: msg.Ready, tokenizer_read: Future[early_tokenizer.Got]
                    ) -> None:
        """What the core's Ready message says of the model it loaded."""
        from gracelm.engine.output_processor import OutputProcessor

        self.tokenizer = early_tokenizer.take(ready, config.model, tokenizer_read)
        # The core found the task in the model's files (`--task auto`).
        self.pooling = ready.pooling
        self.config = dataclasses.replace(config, max_model_len=ready.max_model_len,
                                          task="generate" if ready.pooling is None else "embed")
        self.model_config = ModelConfig(**{**ready.model_config,
                                           "eos_token_ids": tuple(ready.model_config["eos_token_ids"])})
        self.model_name = ready.model_name
        self.num_kv_blocks = ready.num_kv_blocks  # of `config.block_size` tokens each
        self._processor = OutputProcessor(self.tokenizer)

    @property
    def model_path(self) -> str:
        """The model as the server was given it (its path), else the name the core gave it."""
        return self.config.model or self.model_name

    # -- the one state: how the core ended -----------------------------------------------------------

    @property
    def core_end(self) -> ProcessEnd | None:
        """None while the engine core lives; then how it ended (the core's monitor decides, once)."""
        return self._client.end

    @property
    def failed(self) -> bool:
        end = self._client.end
        return end is not None and end.fatal

    @property
    def errored(self) -> bool:
        return not self._shut_down and self.failed

    @property
    def is_running(self) -> bool:
        return not self._shut_down and self._client.end is None

    def _on_core_end(self, end: ProcessEnd) -> None:
        """The monitor's announcement (from its thread); the outputs before it are still being delivered."""
        if not end.fatal or self._shut_down:
            return
        if self._on_fatal is not None:
            self._on_fatal(end)
        else:
            logger.error("engine failed: %s; its calls now raise EngineDeadError", end.message)

    def _dead_error(self) -> EngineDeadError:
        end = self._client.end
        if self._shut_down or end is None or not end.fatal:
            return EngineDeadError("the engine has been shut down")
        return EngineDeadError(end.message)

    def _check_usable(self) -> None:
        if self._shut_down or self._client.end is not None:
            raise self._dead_error()

    # -- requests ------------------------------------------------------------------------------------

    @property
    def runtime_dir(self) -> Path:
        """The instance's runtime directory (ipc sockets, heartbeat; the server's metrics files)."""
        return self._client.runtime_dir.path

    def _prepare(self, prompt: Prompt, params: SamplingParams, priority: int, *,
                 embedding: bool = False) -> tuple[str | None, list[int]]:
        """Tokenizes and checks a prompt and its request's priority and task (`embedding` or generation);
        raises `ValueError` before anything is queued."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        check_task(self.pooling, embedding)
        check_priority(priority)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        # The one check of a prompt: raises `PromptError`, a `ValueError`.
        assert self.config.max_model_len is not None
        check_prompt(ids, self.config.max_model_len, self.model_config.vocab_size, params.max_tokens,
                     embedding=embedding)
        return text, ids

    def open_requests(self) -> list[OpenRequest]:
        """A snapshot of the requests in flight, oldest first (read it from the thread or loop that runs
        the requests)."""
        return self._processor.open_requests()

    @property
    def stop_deadline(self) -> float | None:
        """When (`time.monotonic()`) the core's drain aborts what is left; None before a stop begins."""
        return self._client.stop_deadline

    @property
    def request_faults(self) -> dict[str, int]:
        """Requests ended by a fault of their own (finish_reason "error"), by stage: "sampling",
        "stop_check" (in the core) or "detokenize" (here); the engine served on."""
        return dict(self._processor.faults)

    def _conversation_ids(self, messages: Messages) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _add(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
             priority: int, *, embedding: bool = False) -> None:
        """Sends the request to the core: generation, or with `embedding` its prompt pooled."""
        pooling = self.pooling.method if embedding and self.pooling is not None else None
        for add in self._processor.add_request(request_id, text, ids, params, priority, pooling):
            self._client.send(add)
        self._update_busy()

    def _abort(self, request_id: str):
        """Ends the request here and in the core; its last delta (None for a request no longer known)."""
        delta, core_ids = self._processor.abort(request_id)
        if core_ids and not self._shut_down:
            self._client.abort_requests(core_ids)
        self._update_busy()
        return delta

    @contextlib.contextmanager
    def _utility_call(self, method: str, *args) -> Iterator[int]:
        """Sends a utility call and, until the block ends, tells the monitor an answer is due; yields the
        call's id (its `UtilityReply` carries it)."""
        call_id = self._client.call(method, *args)
        self._calls_pending += 1
        self._update_busy()
        try:
            yield call_id
        finally:
            self._calls_pending -= 1
            self._update_busy()

    def _update_busy(self) -> None:
        """Tells the monitor whether progress is due from the core: what was sent is not all answered."""
        busy = self._processor.has_unfinished() or self._calls_pending > 0 or self._client.stop_requested
        self._client.monitor.set_busy(busy)

    # -- stop ----------------------------------------------------------------------------------------

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


def _call_if_alive(ref: weakref.ref, end: ProcessEnd) -> None:
    engine = ref()
    if engine is not None:
        engine._on_core_end(end)


def _stop(client: EngineCoreClient, timeout: float, report_path: str | None) -> ShutdownReport:
    """Stops the core and releases every resource of the ledger; publishes the report. A module function,
    so that the finalizer and the atexit hook hold the client, never the engine."""
    client.shutdown(timeout)
    report = client.ledger.release_all()
    if client.core_report and not any(r in report.resources for r in client.core_report):
        # What the core released itself (the model, the KV cache) goes right before the core process.
        at = next((i for i, r in enumerate(report.resources) if r.kind is ResourceKind.PROCESS),
                  len(report.resources))
        report.resources[at:at] = client.core_report
    report.publish(report_path)
    return report
