"""Typed messages between the frontend and the engine-core process (msgspec, over ZMQ).

Frontend -> core: `AddRequest`, `AbortRequests`, `UtilityCall`, `Shutdown`.
Core -> frontend: `Ready` or `StartupFailed` (the handshake), then `OutputsBatch`, `UtilityReply` and, at the
end, `Stopped` (what the core released, for the shutdown report) or, if the core crashes, `FatalError`.
The frontend's reader of these is the core's monitor (`core_monitor.py`).
Every message is a tagged struct so one decoder reads a whole direction.
"""

from __future__ import annotations

import enum

import msgspec

from gracelm.model.pooling import Pooling
from gracelm.model_step import PromptLogprobs
from gracelm.sampling_params import SamplingParams


class CoreState(enum.Enum):
    """The core's shutdown state machine (see `core.py`), part of what its `stats` call returns."""

    RUNNING = "running"
    REQUESTED = "requested"
    SHUTTING_DOWN = "shutting_down"


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0  # lower runs first (`request.Request.priority`)
    pooling: str | None = None  # an embedding: its prompt pooled so (`model/pooling.py`), no token sampled


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    """Calls a method of the core by name (e.g. "stats", "reset_prefix_cache") and gets a `UtilityReply`
    with the same id."""

    call_id: int
    method: str
    args: list = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, tag=True):
    """Stop: let running requests finish for up to `timeout` seconds, then abort the rest and exit."""

    timeout: float


class Ready(msgspec.Struct, tag=True):
    """The core loaded the model and sized its KV cache; it now accepts requests."""

    max_model_len: int
    model_name: str
    model_config: dict  # `ModelConfig` fields
    # `Tokenizer.to_dict()`: the frontend rebuilds it without transformers or torch. None: the model file's
    # own, which the frontend builds itself without transformers (`engine/early_tokenizer.py`).
    tokenizer: dict | None
    # `file_hash.content_hash` of the model: the key of the tokenizer cache's entry, which the frontend may
    # have read while the core started instead of rebuilding `tokenizer`; and what the file the frontend
    # built its tokenizer from must be.
    model_hash: str
    num_kv_blocks: int  # the KV cache in blocks of --block-size tokens (the admission bound derives from it)
    # An embedding model's pooling (the task the core found in the model's files for --task); None: it
    # generates text.
    pooling: Pooling | None = None
    # (phase, monotonic time it ended) of the core's start, for the supervisor's timeline (startup_timeline)
    startup_marks: list[tuple[str, float]] = msgspec.field(default_factory=list)


class StartupFailed(msgspec.Struct, tag=True):
    error: str
    traceback: str


class TokenOutput(msgspec.Struct, array_like=True):
    """What one step produced for one request. `finish_reason` is None while it runs.

    `stop_reason` is the stop token id when the request ended on one; logprobs fields are set when the
    request asked for them: the sampled token's logprob and the top-N alternatives. `fault` names the stage
    whose exception ended this request alone (finish_reason "error", no token): "sampling" or "stop_check".
    A request that asked for prompt logprobs gets them all with its first token. An embedding request ends
    with its pooled vector in `embedding` and no token.
    """

    request_id: str
    token_id: int | None
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    fault: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    embedding: list[float] | None = None


class OutputsBatch(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]


class UtilityReply(msgspec.Struct, tag=True):
    call_id: int
    result: dict | None = None
    error: str | None = None


class FatalError(msgspec.Struct, tag=True):
    """The core's busy loop raised; it exits after sending this."""

    error: str
    traceback: str


class Stopped(msgspec.Struct, tag=True):
    """The core stopped on request; `resources` are its shutdown-report entries (`ResourceReport` dicts)."""

    resources: list[dict]


ToCore = AddRequest | AbortRequests | UtilityCall | Shutdown
FromCore = Ready | StartupFailed | OutputsBatch | UtilityReply | FatalError | Stopped

_encoder = msgspec.msgpack.Encoder()
_to_core_decoder = msgspec.msgpack.Decoder(ToCore)
_from_core_decoder = msgspec.msgpack.Decoder(FromCore)


def encode(message: ToCore | FromCore) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core_decoder.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core_decoder.decode(data)
