"""One rank of the model: its weights, its KV cache and the per-request sampling state.

The worker turns a scheduler step into a `ForwardBatch`, runs the forward pass and samples. With tensor
parallelism each rank runs the same step on its shard; only rank 0's sampled tokens are reported.
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
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.loader import LoadedModel, load_model
from gracelm.model.sampler import SamplingMetadata, make_generator, sample

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
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.loaded: LoadedModel | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = make_generator(config.seed)

    @property
    def model_config(self) -> ModelConfig:
        assert self.loaded is not None
        return self.loaded.config

    def load_model(self) -> LoadedModel:
        # All the CPUs this process may run on, unless told otherwise (tests of tiny models use one: a
        # second thread only adds synchronisation to such small matrices).
        torch.set_num_threads(self.config.extra.get("torch_threads") or len(os.sched_getaffinity(0)))
        self.loaded = load_model(self.config.model, self.config.dtype)
        return self.loaded

    def kv_block_bytes(self) -> int:
        assert self.loaded is not None
        return kv_cache_bytes_per_block(self.model_config, self.config.block_size, self.loaded.dtype)

    def available_kv_blocks(self) -> int:
        """How many blocks the KV cache may take, from `kv_cache_memory` or the default share."""
        if self.config.kv_cache_memory is not None:
            budget = parse_size(self.config.kv_cache_memory)
        else:
            budget = min(int(psutil.virtual_memory().available * _DEFAULT_KV_SHARE), _DEFAULT_KV_CAP)
        return budget // self.kv_block_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        assert self.loaded is not None
        self.kv_caches = allocate_kv_cache(self.model_config, num_blocks, self.config.block_size,
                                           self.loaded.dtype)

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> dict[str, SampledToken]:
        """Runs one step; returns the sampled token of every request whose last token was computed."""
        assert self.loaded is not None
        batch = self._build_batch(step.scheduled)
        logits = self.loaded.model(batch, self.kv_caches)
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

    def shutdown(self) -> None:
        self.kv_caches = []
        self.loaded = None
        self._generators.clear()

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        """A seeded request draws from its own generator, so its tokens do not depend on its batch mates."""
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = make_generator(seed)
        return generator

    def _build_batch(self, scheduled: list[ScheduledRequest]) -> ForwardBatch:
        block_size = self.config.block_size
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
        tables = [item.block_ids + [0] * (width - len(item.block_ids)) for item in scheduled]
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_lens=[item.num_new_tokens for item in scheduled],
            seq_lens=[item.start_position + item.num_new_tokens for item in scheduled],
            block_tables=torch.tensor(tables, dtype=torch.int64),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        )

    @staticmethod
    def _sampled(out, row: int, num_logprobs: int | None) -> SampledToken:
        token = SampledToken(int(out.token_ids[row]))
        if num_logprobs is not None and out.logprobs is not None:
            token.logprob = float(out.logprobs[row])
            if num_logprobs > 0 and out.top_logprob_ids is not None:
                token.top_ids = out.top_logprob_ids[row, :num_logprobs].tolist()
                token.top_logprobs = out.top_logprobs[row, :num_logprobs].tolist()
        return token
