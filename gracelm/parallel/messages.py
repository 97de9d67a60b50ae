"""The messages between rank 0 and the worker ranks, msgpack-encoded over one ZMQ DEALER pair per worker.

A step travels as its `StepBatch` (plain lists, `gracelm.model_step`): every rank turns the same lists into
the same tensors, so the shards compute on identical inputs.
"""

from __future__ import annotations

import msgspec

from gracelm.model_step import StepBatch


# rank 0 -> worker
class InitKVCache(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int


class SaveKVBlocks(msgspec.Struct, tag=True, array_like=True):
    """The stop's save of the prefix cache: each rank writes its shard of these blocks, most recent first,
    to its own snapshot file (`kv_persistence.save_shard`)."""

    directory: str
    fingerprint_inputs: dict  # `kv_snapshot.fingerprint`'s arguments but the rank's own: rank, kv_layout
    bound: int  # this rank's share of --kv-cache-dir-size
    blocks: list[tuple[bytes, int]]  # (hash, block id), most recent first
    seconds: float  # left until the stop's deadline cuts the save (clocks differ across nodes)


class RestoreKVBlocks(msgspec.Struct, tag=True, array_like=True):
    """At start: each rank fills these blocks (placed by rank 0) from its own snapshot file."""

    directory: str
    fingerprint_inputs: dict
    blocks: list[tuple[bytes, int]]  # (hash, block id), most recent first


class WarmUp(msgspec.Struct, tag=True, array_like=True):
    """At start, after the KV cache: the forward passes of rank 0's warm-up steps (`warmup.py`), run by
    every rank in this order and counted by none."""

    batches: list[StepBatch]


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


# worker -> rank 0
class Hello(msgspec.Struct, tag=True, array_like=True):
    rank: int
    pid: int
    host: str


class Loaded(msgspec.Struct, tag=True, array_like=True):
    available_kv_blocks: int


class KVCacheReady(msgspec.Struct, tag=True, array_like=True):
    pass


class KVBlocksSaved(msgspec.Struct, tag=True, array_like=True):
    path: str
    blocks: int
    bytes: int
    error: str | None  # the save failed (the rank goes on: a snapshot is never worth a failed stop)


class KVBlocksRestored(msgspec.Struct, tag=True, array_like=True):
    block_ids: list[int]  # those filled with verified contents; a block missing here is used by no rank


class Stopped(msgspec.Struct, tag=True, array_like=True):
    """The worker's teardown, as `ShutdownReport.to_dict()`, and its communication figures."""

    report: dict
    steps: int
    receive_ms: float  # total latency from rank 0's send to the worker's receive
    collective_ms: float  # total time in all-reduce and gather


class Failed(msgspec.Struct, tag=True, array_like=True):
    error: str
    traceback: str


ToWorker = StepBatch | InitKVCache | WarmUp | SaveKVBlocks | RestoreKVBlocks | Stop
FromWorker = Hello | Loaded | KVCacheReady | KVBlocksSaved | KVBlocksRestored | Stopped | Failed

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def encode(message: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(message)


def decode_to_worker(data: bytes | memoryview) -> ToWorker:
    return _to_worker.decode(data)


def decode_from_worker(data: bytes | memoryview) -> FromWorker:
    return _from_worker.decode(data)
