"""One rank of the model: its weights (or its shard of them), its KV cache and the per-request sampling
state.

A step arrives as a `StepBatch` (built once on rank 0 from the scheduler's output and, with tensor
parallelism, sent as it is to the other ranks), becomes a `ForwardBatch` and runs through the model. Only
rank 0 samples: the others run their shard of the forward pass and contribute to its collectives.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psutil
import torch

from gracelm.config import EngineConfig, ModelConfig, parse_size
from gracelm.engine.scheduler import ScheduledRequest, SchedulerOutput
from gracelm.model.attention import allocate_kv_cache, kv_cache_bytes_per_block
from gracelm.model.loader import LoadedModel, load_model
from gracelm.model.sampler import SamplingMetadata, make_generator, sample
from gracelm.parallel.messages import StepBatch
from gracelm.parallel.sharding import TensorParallelModel, check_shardable, shard_config

logger = logging.getLogger(__name__)

# Without `kv_cache_memory`, the cache takes this share of the memory available at start-up, up to a cap:
# on a CPU the cache competes with everything else on the host, and more than a few GiB is never used by
# the batch sizes such a machine can compute.
_DEFAULT_KV_SHARE = 0.25
_DEFAULT_KV_CAP = 2**30


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.loaded: LoadedModel | None = None
        self.shard: TensorParallelModel | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = make_generator(config.seed)

    @property
    def model_config(self) -> ModelConfig:
        assert self.loaded is not None
        return self.loaded.config

    def load_model(self) -> LoadedModel:
        # This rank's share of the CPUs this process may run on (the node's ranks split them), unless told
        # otherwise (tests of tiny models use one: a second thread only adds synchronisation to such small
        # matrices).
        local_ranks = self.world_size // self.config.nnodes
        share = max(1, len(os.sched_getaffinity(0)) // local_ranks)
        torch.set_num_threads(self.config.extra.get("torch_threads") or share)
        self.loaded = load_model(self.config.model, self.config.dtype)
        # Freezing fuses and repacks the HF-named linears, so it comes last: after sharding, which splits them
        # (the tensor-parallel shard freezes itself once split).
        if self.world_size > 1:
            check_shardable(self.loaded.config, self.world_size)
            self.shard = TensorParallelModel(self.loaded.model, self.rank, self.world_size)
        else:
            self.loaded.model.freeze()
        return self.loaded

    @property
    def shard_config(self) -> ModelConfig:
        """The shape of this rank's part of the model: what its KV cache holds."""
        return shard_config(self.model_config, self.world_size)

    def kv_block_bytes(self) -> int:
        assert self.loaded is not None
        return kv_cache_bytes_per_block(self.shard_config, self.config.block_size, self.loaded.dtype)

    def available_kv_blocks(self) -> int:
        """How many blocks the KV cache may take, from `kv_cache_memory` or the default share."""
        if self.config.kv_cache_memory is not None:
            budget = parse_size(self.config.kv_cache_memory)
        else:
            budget = min(int(psutil.virtual_memory().available * _DEFAULT_KV_SHARE), _DEFAULT_KV_CAP)
        return budget // self.kv_block_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        assert self.loaded is not None
        self.kv_caches = allocate_kv_cache(self.shard_config, num_blocks, self.config.block_size,
                                           self.loaded.dtype)

    def execute_model(self, step: SchedulerOutput) -> dict[str, SampledToken]:
        """Runs one step on this rank alone; the sampled token of every request whose last token was
        computed."""
        return self.sample_step(build_step_batch(step.scheduled, self.config.block_size), step)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's logits (None on a rank other than 0 of a tensor-parallel group)."""
        assert self.loaded is not None
        model = self.shard if self.shard is not None else self.loaded.model
        return model(batch.to_forward_batch(), self.kv_caches)

    @torch.inference_mode()
    def sample_step(self, batch: StepBatch, step: SchedulerOutput) -> dict[str, SampledToken]:
        """Rank 0: runs the forward pass of `batch` (the flattening of `step`) and samples."""
        logits = self.forward(batch)
        assert logits is not None
        sampling = [item.request for item in step.scheduled if item.samples]
        if not sampling:
            return {}
        meta = SamplingMetadata.build(
            [r.sampling_params for r in sampling],
            [self._generator(r.request_id, r.sampling_params.seed) for r in sampling],
            [r.prompt_token_ids for r in sampling],
            [r.output_token_ids for r in sampling],
            self.model_config.vocab_size,
            default_generator=self._default_generator,
        )
        out = sample(logits, meta)
        return {r.request_id: self._sampled(out, row, r.sampling_params.logprobs)
                for row, r in enumerate(sampling)}

    def release_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def free_kv_cache(self) -> None:
        self.kv_caches = []

    def free_model(self) -> None:
        self.shard = None
        self.loaded = None
        self._generators.clear()

    def shutdown(self) -> None:
        self.free_kv_cache()
        self.free_model()

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        """A seeded request draws from its own generator, so its tokens do not depend on its batch mates."""
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = make_generator(seed)
        return generator

    @staticmethod
    def _sampled(out, row: int, num_logprobs: int | None) -> SampledToken:
        token = SampledToken(int(out.token_ids[row]))
        if num_logprobs is not None and out.logprobs is not None:
            token.logprob = float(out.logprobs[row])
            if num_logprobs > 0 and out.top_logprob_ids is not None:
                token.top_ids = out.top_logprob_ids[row, :num_logprobs].tolist()
                token.top_logprobs = out.top_logprobs[row, :num_logprobs].tolist()
        return token


def build_step_batch(scheduled: list[ScheduledRequest], block_size: int) -> StepBatch:
    """Flattens the scheduled requests into the token rows of one forward pass."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    for item in scheduled:
        start, end = item.start_position, item.start_position + item.num_new_tokens
        input_ids.extend(item.request.all_token_ids[start:end])
        blocks = item.block_ids
        for pos in range(start, end):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        if item.samples:
            logits_indices.append(len(input_ids) - 1)
    width = max(len(item.block_ids) for item in scheduled)
    return StepBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        query_lens=[item.num_new_tokens for item in scheduled],
        seq_lens=[item.start_position + item.num_new_tokens for item in scheduled],
        block_tables=[item.block_ids + [0] * (width - len(item.block_ids)) for item in scheduled],
        logits_indices=logits_indices,
    )
