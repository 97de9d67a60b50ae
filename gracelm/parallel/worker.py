"""One rank of the model: its weights (or its shard of them), its KV cache and the per-request sampling
state.

A step arrives as a `ModelStep` on rank 0 (its `StepBatch`, with tensor parallelism, sent as it is to the
other ranks), becomes a `ForwardBatch` and runs through the model. Only rank 0 samples: the others run their
shard of the forward pass and contribute to its collectives.

Containment of sampling: the forward pass is the engine's (a fault there is fatal), but each row's sampling
belongs to one request. When the batch's sampling raises, each row is sampled again alone, from the logits
and generator states it had before the batch began (so a request that did nothing wrong gets the token it
would have got), and only the rows that raise again become `SamplingFault`s: their requests end with an
error. Keeping those logits costs one copy of the sampled rows' logits per step with more than one row.

Token constraints (structured outputs, logit_bias, allowed_token_ids, bad_words) keep per-request state
here too (`model/token_constraints.py:ConstraintStates`), freed with the generators when a request ends:
the constrained rows' masks and biases are built for the sampler, and each constrained row's grammar
consumes the token it sampled; a constraint that fails is its request's fault.

Prompt logprobs: the step's logits rows after the sampling ones are prompt positions some request asked to
score (`ModelStep.prompt_rows`); `model/prompt_logprobs.py` turns them into logprobs, ranks and top-N. With
tensor parallelism those rows are gathered to rank 0 like the others, since every rank runs the same
`logits_indices`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Iterator

import psutil
import torch

import gracelm.cpu_features as cpu_features
from gracelm.config import EngineConfig, ModelConfig, parse_size
from gracelm.lifecycle.faults import faults
from gracelm.lifecycle.heap import keep_freed_memory, release_freed_memory
from gracelm.memory_budget import available_memory, gib, require
from gracelm.model import decode_attention, prefaulted_memory
from gracelm.model.attention import KV_CACHE_LAYOUT, allocate_kv_cache, kv_cache_bytes_per_block
from gracelm.model.batch_invariant import make_batch_invariant
from gracelm.model.device import resolve_device
from gracelm.model.entry_keeper import deferred_keeping, stop_keeping
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.kv_cache_commit import KVCacheCommit
from gracelm.model.llama import describe_linear_kernels, linear_path
from gracelm.model.loader import LoadedModel, load_model
from gracelm.model.memory_use import tensor_bytes
from gracelm.model.pooling import pooled_sums
from gracelm.model.prompt_logprobs import prompt_logprobs
from gracelm.model.sampler import SamplingMetadata, make_generator, sample
from gracelm.model.token_constraints import ConstraintStates, has_constraints
from gracelm.model_step import ModelStep, SampledToken, SamplingFault, StepBatch, StepResult
from gracelm.parallel.draft_model import DraftModel
from gracelm.parallel.layout import check_shardable, shard_config
from gracelm.parallel.sharding import CommTimer, TensorParallelModel
from gracelm.parallel.spec_verify import verify

logger = logging.getLogger(__name__)

# Without `kv_cache_memory`, the cache takes this share of the memory available at start-up, up to a cap:
# on a CPU the cache competes with everything else on the host, and more than a few GiB is never used by
# the batch sizes such a machine can compute.
_DEFAULT_KV_SHARE = 0.25
_DEFAULT_KV_CAP = 2**30
# On a GPU the cache is most of what the device memory left after the weights is for; the rest is kept for the
# forward pass's activations and the sampler. (The cap of blocks that `max_num_seqs` full-length requests
# can use still applies: `EngineCore._size_kv_cache`.)
_DEFAULT_GPU_KV_SHARE = 0.8


def dense_weights_for(config: EngineConfig) -> str:
    """`dense_weights` as the loader takes it: "auto" keeps the dense copy where what runs needs it (the
    ranks of tensor parallelism split dense weights; deterministic mode computes with them)."""
    return "on" if config.tensor_parallel_size > 1 or config.deterministic else config.dense_weights


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        cpu_features.mask(config.mask_cpu_features)  # before any kernel is chosen
        self.device = resolve_device(config.device, config.tensor_parallel_size)
        self.loaded: LoadedModel | None = None
        self.shard: TensorParallelModel | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._kv_commit: KVCacheCommit | None = None
        self.num_kv_blocks = 0
        self.weight_bytes = 0  # what the loaded model's tensors hold (`tensor_bytes`)
        self._generators: dict[str, torch.Generator] = {}
        self._constraints: ConstraintStates | None = None  # made at the first constrained request
        self._default_generator = make_generator(config.seed)
        self.draft: DraftModel | None = None  # `--speculative-model`, rank 0 only (one rank: config.py)

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
        torch.set_num_threads(self.config.num_threads or share)
        keep_freed_memory()
        try:
            with deferred_keeping():  # the cache entries it converts are written after the warm-up
                self.loaded = load_model(self.config.model, self.config.dtype, self.config.quantization,
                                         self.device, dense_weights_for(self.config),
                                         embedding=self.config.task == "embed")
        finally:
            prefaulted_memory.release()  # what the conversion did not take
        # Freezing fuses and repacks the HF-named linears, so it comes last: after sharding, which splits them
        # (the tensor-parallel shard freezes itself once split).
        if self.world_size > 1:
            check_shardable(self.loaded.config, self.world_size)
            if self.loaded.int4:
                # Sharding splits dense weights only; the int4 kernel's packed layout is not split here.
                logger.info("rank %d: tensor parallelism serves the 4-bit matrices dequantized", self.rank)
                self.loaded.int4 = {}
            self.shard = TensorParallelModel(self.loaded.model, self.rank, self.world_size)
        else:
            # Deterministic mode: one kernel for every batch size, the dense one (the int4 kernel's crossover
            # would make a row's bits depend on the size of its step).
            self.loaded.freeze(0 if self.config.deterministic else None)
        if self.config.deterministic and self.shard is not None:
            self.shard.make_batch_invariant()
        elif self.config.deterministic:
            make_batch_invariant(self.loaded.model)
        model = self.shard if self.shard is not None else self.loaded.model
        # Counted once: the weights do not change while serving, and counting walks every module (ms).
        self.weight_bytes = tensor_bytes(model)
        if self.config.speculative_model is not None:
            self.draft = DraftModel.load(self.config, self.loaded, dense_weights_for(self.config))
        release_freed_memory()
        self.loaded.model.model.decode_attention = self.config.decode_attention
        if self.rank == 0:
            logger.info("CPU features: %s", cpu_features.describe())
        logger.info("rank %d linear kernels: %s", self.rank, describe_linear_kernels(model))
        return self.loaded

    def kernel_paths(self) -> dict[str, str]:
        """The short names of the kernels this rank's steps take, for /metrics (`docs/kernel_paths.md`);
        none once the model is freed."""
        if self.loaded is None:
            return {}
        model = self.shard if self.shard is not None else self.loaded.model
        paths = {"linear": linear_path(model)}
        if self.kv_caches:
            paths["decode_attention"] = decode_attention.path(self.kv_caches[0], self.config.deterministic,
                                                              self.config.decode_attention)
        return paths

    def memory_use(self) -> dict[str, int]:
        """Bytes this rank's process holds (`/metrics`, `gracelm_memory_bytes`): its weights, in every form
        loaded; its KV cache; and the rest of its resident memory, the workspace (activations, the heap,
        torch's and Python's own); none once the model is freed."""
        if self.loaded is None:
            return {}
        weights = self.weight_bytes
        kv_cache = sum(cache.numel() * cache.element_size() for cache in self.kv_caches)
        if self.draft is not None:
            weights += self.draft.weight_bytes
            kv_cache += self.draft.kv_cache_bytes()
        resident = psutil.Process().memory_info().rss
        return {"weights": weights, "kv_cache": kv_cache, "workspace": max(0, resident - weights - kv_cache)}

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
        elif self.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * _DEFAULT_GPU_KV_SHARE)
        else:
            budget = min(int(psutil.virtual_memory().available * _DEFAULT_KV_SHARE), _DEFAULT_KV_CAP)
        return budget // self._block_bytes_with_draft()

    def _block_bytes_with_draft(self) -> int:
        """What one block id costs: the target's block and the draft model's, which has the same ids."""
        return self.kv_block_bytes() + (self.draft.kv_block_bytes() if self.draft is not None else 0)

    def init_kv_cache(self, num_blocks: int) -> None:
        assert self.loaded is not None
        if self.device.type == "cpu":
            self._check_kv_fits(num_blocks)
        self.num_kv_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(self.shard_config, num_blocks, self.config.block_size,
                                           self.loaded.dtype, self.device)
        if self.draft is not None:
            self.draft.init_kv_cache(num_blocks)
        if self.kv_caches:
            decode_attention.check_choice(self.config.decode_attention, self.kv_caches[0],
                                          self.config.deterministic)
            logger.info("rank %d decode attention: %s", self.rank,
                        decode_attention.describe(self.kv_caches[0], self.config.deterministic,
                                                  self.config.decode_attention))

    def _check_kv_fits(self, num_blocks: int) -> None:
        """Refuses (`MemoryBudgetError`) a KV cache that, with a step's workspace, would not fit in the
        memory left once the weights are loaded. The node's ranks each allocate as much at once, so each
        checks for all of them."""
        local_ranks = self.world_size // self.config.nnodes
        block = self._block_bytes_with_draft() * local_ranks
        workspace = self.workspace_bytes() * local_ranks
        available = available_memory()  # one reading: the figure refused and the one advised agree
        fits = max(0, available.bytes - workspace) // block * block
        require(num_blocks * block + workspace,
                f"the KV cache ({gib(num_blocks * block)}) and a step's workspace ({gib(workspace)})",
                f"a --kv-cache-memory of at most {gib(fits)} fits, or a smaller --max-model-len or "
                f"--max-num-seqs (which cap the blocks it is given)", available)

    def workspace_bytes(self) -> int:
        """What a step may hold beside the weights and the KV cache, at most: the activations of its
        `max_num_batched_tokens` rows, a prompt chunk's attention scores, the logits and the sampler's
        work on `max_num_seqs` rows, all in float32, the widest. (The freed heap the process keeps,
        `heap.py`, is what a step freed: the next one reuses it.)"""
        model = self.shard_config
        rows, seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        activations = rows * (6 * model.hidden_size + 3 * model.intermediate_size) * 4
        scores = model.num_attention_heads * rows * min(rows, 4096) * 4
        # logits, probabilities, sorted values (float32) and their indices (int64)
        sampling = seqs * model.vocab_size * (4 + 4 + 4 + 8)
        return activations + scores + sampling

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's logits (None on a rank other than 0 of a tensor-parallel group); for an embedding
        model (one rank), the final-norm hidden states of the same rows, which are pooled."""
        assert self.loaded is not None
        inputs = ForwardBatch.from_step_batch(batch, self.device)
        if not self.loaded.model.head:
            return self.loaded.model.model(inputs, self.kv_caches)
        model = self.shard if self.shard is not None else self.loaded.model
        return model(inputs, self.kv_caches)

    @torch.inference_mode()
    def sample_step(self, step: ModelStep) -> StepResult:
        """Rank 0: runs the forward pass of the step (after the draft model's, which fills in the draft
        tokens, `draft_model.py`), samples each sampling request's token, after the draft tokens it keeps
        when it drafted (`spec_verify.py`; a `SamplingFault` for a row whose sampling raised), scores the
        prompt rows asked for and sums the rows that embedding requests pool (an embedding model's steps
        have these alone)."""
        if self.draft is not None:
            step = self.draft.propose(step)
        out = self.forward(step.batch)
        assert out is not None
        num_sampling = step.num_sampling_rows
        num_scored = num_sampling + sum(len(rows.target_ids) for rows in step.prompt_rows)
        return StepResult(verify(out[:num_sampling], step, self._sample_rows),
                          prompt_logprobs(out[num_sampling:num_scored], step.prompt_rows),
                          pooled_sums(out[num_scored:], step.pool_rows))

    def _sample_rows(self, logits: torch.Tensor, step: ModelStep) -> list[SampledToken | SamplingFault]:
        if not step.request_ids:
            return []
        _hold_stop_tokens(logits, step.held_stop_ids)
        generators = [self._generator(request_id, params.seed)
                      for request_id, params in zip(step.request_ids, step.params, strict=True)]
        rows = range(len(step.request_ids))
        # The sampler overwrites float32 logits and advances generators: what a retry row by row starts from.
        kept = (logits.clone(), [g.get_state() if g is not None else None for g in generators]) \
            if len(rows) > 1 else None
        try:
            out = self._sample(logits, step, rows, generators)
            sampled = [self._sampled(out, row, step.params[row].logprobs) for row in rows]
        except Exception:
            if kept is None:
                return [self._fault(step, 0)]
            logger.warning("sampling a batch of %d rows raised; sampling each row alone", len(rows),
                           exc_info=True)
        else:
            return self._advance_constraints(step, sampled)
        original, states = kept
        for generator, state in zip(generators, states, strict=True):
            if generator is not None:
                generator.set_state(state)
        return self._advance_constraints(step, [self._sample_alone(original, step, row, generators)
                                                for row in rows])

    def _sample_alone(self, logits: torch.Tensor, step: ModelStep, row: int,
                      generators: list[torch.Generator | None]) -> SampledToken | SamplingFault:
        try:
            out = self._sample(logits[row:row + 1], step, [row], generators)
        except Exception:
            return self._fault(step, row)
        return self._sampled(out, 0, step.params[row].logprobs)

    def _sample(self, logits: torch.Tensor, step: ModelStep, rows: range | list[int],
                generators: list[torch.Generator | None]):
        """Samples `rows` of the step, whose logits are `logits` (one row each, in that order)."""
        params = [step.params[row] for row in rows]
        faults().in_sampling(p.seed for p in params)
        outputs = [step.output_token_ids[row] for row in rows]
        constraints = None
        if any(has_constraints(p) for p in params):
            constraints = self._constraint_states().build([step.request_ids[row] for row in rows], params,
                                                          outputs)
        meta = SamplingMetadata.build(params, [generators[row] for row in rows],
                                      [step.prompt_token_ids[row] for row in rows], outputs,
                                      self.model_config.vocab_size, default_generator=self._default_generator,
                                      constraints=constraints)
        return sample(logits, meta)

    def _constraint_states(self) -> ConstraintStates:
        if self._constraints is None:
            assert self.loaded is not None
            self._constraints = ConstraintStates(self.loaded.tokenizer, self.model_config.vocab_size)
        return self._constraints

    def _advance_constraints(self, step: ModelStep, sampled: list[SampledToken | SamplingFault],
                             ) -> list[SampledToken | SamplingFault]:
        """Each constrained row's grammar consumes the token it sampled; a row whose grammar refuses it (or
        whose constraint failed) ends with a fault."""
        if self._constraints is None:
            return sampled
        for row, token in enumerate(sampled):
            if isinstance(token, SampledToken):
                try:
                    self._constraints.advance(step.request_ids[row], token.token_id)
                except ValueError:
                    sampled[row] = self._fault(step, row)
        return sampled

    @staticmethod
    def _fault(step: ModelStep, row: int) -> SamplingFault:
        """Called in an `except` block: the row's request ends; the traceback goes to the log with its id."""
        logger.exception("request %s: its sampling raised", step.request_ids[row])
        return SamplingFault(traceback.format_exc(limit=0).strip().splitlines()[-1])

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Steps run inside leave no trace in what this rank counts or draws (the start-up warm-up,
        `warmup.py`): the compiled steps' count, the time in collectives, the default generator's state."""
        assert self.loaded is not None
        decoder = self.loaded.model.model
        timer = self.shard.timer if self.shard is not None else CommTimer()
        compiled_steps, collectives = decoder.compiled_steps, (timer.seconds, timer.calls)
        generator_state = self._default_generator.get_state()
        try:
            yield
        finally:
            decoder.compiled_steps = compiled_steps
            timer.seconds, timer.calls = collectives
            self._default_generator.set_state(generator_state)

    def release_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)
        if self._constraints is not None:
            self._constraints.release(request_ids)

    def kv_layout(self) -> dict:
        """What the bytes of one block mean (part of a KV snapshot's fingerprint)."""
        assert self.loaded is not None
        shard = self.shard_config
        return {"layout": KV_CACHE_LAYOUT, "dtype": str(self.loaded.dtype),
                "block_size": self.config.block_size, "num_layers": shard.num_hidden_layers,
                "kv_heads": shard.num_key_value_heads, "head_dim": shard.head_dim,
                "block_bytes": self.kv_block_bytes()}

    @torch.no_grad()
    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The contents of these blocks, each as one `kv_block_bytes()` string: every layer's K and V."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        # [blocks, 2, kv_heads, block_size, head_dim] of each layer, as bytes, side by side per block.
        layers = [cache.index_select(2, ids).permute(2, 0, 1, 3, 4).contiguous().view(torch.uint8)
                  .reshape(len(block_ids), -1) for cache in self.kv_caches]
        rows = torch.cat(layers, dim=1).cpu().numpy()
        return [row.tobytes() for row in rows]

    @torch.no_grad()
    def write_kv_blocks(self, block_ids: list[int], contents: list[bytes]) -> None:
        """Fills these blocks with contents `read_kv_blocks` gave (of a cache of the same layout)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = torch.frombuffer(bytearray(b"".join(contents)), dtype=torch.uint8).reshape(len(block_ids), -1)
        rows = rows.to(self.device)
        per_layer = rows.shape[1] // len(self.kv_caches)
        for index, cache in enumerate(self.kv_caches):
            _, heads, _, block_size, head_dim = cache.shape
            part = rows[:, index * per_layer:(index + 1) * per_layer].contiguous().view(cache.dtype)
            cache.index_copy_(2, ids, part.reshape(len(block_ids), 2, heads, block_size, head_dim)
                              .permute(1, 2, 0, 3, 4))

    def commit_kv_cache(self) -> None:
        """Starts mapping in the CPU cache's pages in the background (`kv_cache_commit.py`); once the rest
        of the start is done: the thread's memory calls would slow its file mappings."""
        if self.kv_caches and self.device.type == "cpu":  # a CUDA cache is allocated whole
            self._kv_commit = KVCacheCommit(self.kv_caches, f"rank {self.rank}")

    def free_kv_cache(self) -> None:
        if self._kv_commit is not None:  # its thread maps pages of these caches
            self._kv_commit.stop()
            self._kv_commit = None
        self.kv_caches = []
        if self.draft is not None:
            self.draft.kv_caches = []

    def free_model(self) -> None:
        stop_keeping()  # a cold start's cache entries still being written (`entry_keeper.py`)
        self.shard = None
        self.loaded = None
        self.draft = None
        self._generators.clear()
        self._constraints = None

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



def _hold_stop_tokens(logits: torch.Tensor, held: list[list[int]]) -> None:
    """`min_tokens`: each row's held stop tokens become impossible (in place, before sampling; their
    logprobs, if asked, read as impossible too)."""
    pairs = [(row, t) for row, ids in enumerate(held) for t in ids if t < logits.shape[1]]
    if pairs:
        logits[torch.tensor(pairs, dtype=torch.int64, device=logits.device).unbind(1)] = -torch.inf
