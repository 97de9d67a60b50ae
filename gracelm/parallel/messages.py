"""The messages between rank 0 and the worker ranks, msgpack-encoded over one ZMQ DEALER pair per worker.

A step travels as plain lists (what the scheduler produced, flattened): every rank turns the same lists
into the same tensors, so the shards compute on identical inputs.
"""

from __future__ import annotations

import msgspec
import torch

from gracelm.model.forward_batch import ForwardBatch


class StepBatch(msgspec.Struct, tag=True, array_like=True):
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    sent_at: float = 0.0  # time.time() on rank 0 when sent: the broadcast latency, seen by the worker

    def to_forward_batch(self) -> ForwardBatch:
        return ForwardBatch(
            input_ids=torch.tensor(self.input_ids, dtype=torch.int64),
            positions=torch.tensor(self.positions, dtype=torch.int64),
            slot_mapping=torch.tensor(self.slot_mapping, dtype=torch.int64),
            query_lens=self.query_lens,
            seq_lens=self.seq_lens,
            block_tables=torch.tensor(self.block_tables, dtype=torch.int64),
            logits_indices=torch.tensor(self.logits_indices, dtype=torch.int64),
        )


# rank 0 -> worker
class InitKVCache(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int


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


class Stopped(msgspec.Struct, tag=True, array_like=True):
    """The worker's teardown, as `ShutdownReport.to_dict()`, and its communication figures."""

    report: dict
    steps: int
    receive_ms: float  # total latency from rank 0's send to the worker's receive
    collective_ms: float  # total time in all-reduce and gather


class Failed(msgspec.Struct, tag=True, array_like=True):
    error: str
    traceback: str


ToWorker = StepBatch | InitKVCache | Stop
FromWorker = Hello | Loaded | KVCacheReady | Stopped | Failed

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def encode(message: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(message)


def decode_to_worker(data: bytes | memoryview) -> ToWorker:
    return _to_worker.decode(data)


def decode_from_worker(data: bytes | memoryview) -> FromWorker:
    return _from_worker.decode(data)
