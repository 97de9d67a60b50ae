"""A draft model for speculative decoding (`--speculative-model`): a smaller model of the same vocabulary,
on rank 0 beside the target, that proposes each drafting sequence's draft tokens at the start of a step.

Its KV cache has the target's blocks: as many, of the same size, addressed by the same block tables and
slots, so the scheduler's bookkeeping (allocation, prefix caching, preemption, the blocks of rejected
positions freed) serves both. To keep its cache in step with the target's, the draft model runs every token
the target runs — prompt chunks, decode tokens of sequences that do not draft — in its first pass of each
step, which also gives the first draft token of each drafting sequence; each further draft token is one
more pass of one row per sequence still drafting. A draft is the draft model's greedy choice: one token, so
verification keeps the target's distribution exactly (`spec_verify.py`) whatever the draft model computes.
Where its cache is stale (blocks restored from a snapshot of the target's cache, `--kv-cache-dir`), its
drafts are only worse.

The scheduler reserves each drafting sequence's draft rows with placeholder tokens (`speculation.py`);
`propose` returns the step with them filled in.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import msgspec
import torch

from gracelm.config import EngineConfig, UnsupportedModelError
from gracelm.model.attention import allocate_kv_cache, kv_cache_bytes_per_block
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.loader import LoadedModel, load_model
from gracelm.model.memory_use import tensor_bytes
from gracelm.model_step import ModelStep, StepBatch

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Drafting:
    """One drafting sequence of a step: its place in the batch and its draft rows."""

    sequence: int  # index in the batch's sequences
    first_draft_row: int  # row of its first draft token in the batch
    num_drafts: int
    sampling_index: int  # index among the step's sampling requests


class DraftModel:
    def __init__(self, loaded: LoadedModel, block_size: int) -> None:
        self.loaded = loaded
        self.block_size = block_size
        self.kv_caches: list[torch.Tensor] = []
        self.weight_bytes = tensor_bytes(loaded.model)

    @classmethod
    def load(cls, config: EngineConfig, target: LoadedModel, dense_weights: str) -> DraftModel:
        """Loads `config.speculative_model` where and as the target is loaded; refuses one whose vocabulary
        is not the target's, by both sizes."""
        assert config.speculative_model is not None
        loaded = load_model(config.speculative_model, config.dtype, config.quantization, target.device,
                            dense_weights)
        if loaded.config.vocab_size != target.config.vocab_size:
            raise UnsupportedModelError(
                f"speculative_model (--speculative-model) {loaded.name} has a vocabulary of "
                f"{loaded.config.vocab_size} tokens, the target {target.name} one of "
                f"{target.config.vocab_size}: a draft model must share the target's tokenizer")
        loaded.freeze()
        loaded.model.model.decode_attention = config.decode_attention
        logger.info("draft model %s loaded for speculative decoding (%d layers)", loaded.name,
                    loaded.config.num_hidden_layers)
        return cls(loaded, config.block_size)

    @staticmethod
    def config_of(config: EngineConfig) -> EngineConfig:
        """The engine's options as they apply to the draft model alone (what its decode graphs' compiler
        loads)."""
        assert config.speculative_model is not None
        return dataclasses.replace(config, model=config.speculative_model, speculative_model=None,
                                   speculative="off")

    def kv_block_bytes(self) -> int:
        return kv_cache_bytes_per_block(self.loaded.config, self.block_size, self.loaded.dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.loaded.config, num_blocks, self.block_size, self.loaded.dtype,
                                           self.loaded.device)

    def kv_cache_bytes(self) -> int:
        return sum(cache.numel() * cache.element_size() for cache in self.kv_caches)

    @torch.inference_mode()
    def propose(self, step: ModelStep) -> ModelStep:
        """Runs the step's tokens through the draft model and drafts each drafting sequence's tokens; the
        step with them in its batch and its `draft_token_ids`."""
        sequences = _sequence_of_rows(step.batch)
        drafting = _drafting(step, sequences)
        logits = self._forward(_first_pass(step, sequences, drafting, self.block_size))
        if not drafting:
            return step
        drafts = [[int(token)] for token in logits.argmax(-1).tolist()]
        for position in range(1, max(d.num_drafts for d in drafting)):
            more = [i for i, d in enumerate(drafting) if d.num_drafts > position]
            batch = _one_row_each(step.batch, [drafting[i] for i in more], [drafts[i][-1] for i in more],
                                  position)
            for i, token in zip(more, self._forward(batch).argmax(-1).tolist(), strict=True):
                drafts[i].append(int(token))
        return _filled(step, drafting, drafts)

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        return self.loaded.model(ForwardBatch.from_step_batch(batch, self.loaded.device), self.kv_caches)


def _drafting(step: ModelStep, sequences: list[int]) -> list[_Drafting]:
    """The step's drafting sequences, from the logits rows (`ModelStep.own_rows`); `sequences`: each row's
    sequence (`_sequence_of_rows`)."""
    drafting: list[_Drafting] = []
    if not step.draft_token_ids:  # a step that drafts nothing (the start-up's warm-up) may leave them out
        return drafting
    for index, (row, drafts) in enumerate(zip(step.own_rows(), step.draft_token_ids, strict=True)):
        own = step.batch.logits_indices[row]
        if drafts:
            drafting.append(_Drafting(sequences[own], own + 1, len(drafts), index))
    return drafting


def _sequence_of_rows(batch: StepBatch) -> list[int]:
    return [sequence for sequence, count in enumerate(batch.query_lens) for _ in range(count)]


def _lookbacks(step: ModelStep, sequences: list[int], block_size: int) -> dict[int, tuple[int, int, int]]:
    """(token, position, slot) of the position before each decoding sequence's token: the draft model
    computes it again. A draft kept whole ends with a token the draft model drafted but never ran (the
    target's next token follows it), and this fills that hole at the next step, drafting or not."""
    batch, lookbacks = step.batch, {}
    for index, row in enumerate(step.own_rows()):
        own = batch.logits_indices[row]
        sequence, position = sequences[own], batch.positions[own]
        if batch.query_lens[sequence] == 1 and position >= 1:
            before, prompt, output = position - 1, step.prompt_token_ids[index], step.output_token_ids[index]
            token = prompt[before] if before < len(prompt) else output[before - len(prompt)]
            slot = batch.block_tables[sequence][before // block_size] * block_size + before % block_size
            lookbacks[sequence] = (token, before, slot)
    return lookbacks


def _first_pass(step: ModelStep, sequences: list[int], drafting: list[_Drafting], block_size: int
                ) -> StepBatch:
    """The step's batch as the draft model runs it first: without the draft rows (each a sequence of its
    own, `SchedulerOutput.model_step`), with each decoding sequence's previous position (`_lookbacks`), its
    logits rows each drafting sequence's last token."""
    batch, lookbacks = step.batch, _lookbacks(step, sequences, block_size)
    dropped = {sequences[d.first_draft_row + i] for d in drafting for i in range(d.num_drafts)}
    kept = [sequence for sequence in range(len(batch.query_lens)) if sequence not in dropped]
    input_ids, positions, slots, query_lens, last_rows = [], [], [], [], {}
    starts = list(itertools.accumulate(batch.query_lens, initial=0))
    for sequence in kept:
        if sequence in lookbacks:
            token, position, slot = lookbacks[sequence]
            input_ids.append(token)
            positions.append(position)
            slots.append(slot)
        rows = range(starts[sequence], starts[sequence + 1])
        input_ids.extend(batch.input_ids[row] for row in rows)
        positions.extend(batch.positions[row] for row in rows)
        slots.extend(batch.slot_mapping[row] for row in rows)
        query_lens.append(len(rows) + (sequence in lookbacks))
        last_rows[sequence] = len(input_ids) - 1
    return StepBatch(input_ids=input_ids, positions=positions, slot_mapping=slots, query_lens=query_lens,
                     seq_lens=[batch.seq_lens[s] for s in kept],
                     block_tables=[batch.block_tables[s] for s in kept],
                     logits_indices=[last_rows[d.sequence] for d in drafting],
                     prompt_lens=[batch.prompt_lens[s] for s in kept])


def _one_row_each(batch: StepBatch, drafting: list[_Drafting], tokens: list[int], position: int) -> StepBatch:
    """A decode pass of the draft model: each sequence's draft token at `position` - 1 fed at its row."""
    rows = [d.first_draft_row + position - 1 for d in drafting]
    return StepBatch(
        input_ids=tokens, positions=[batch.positions[row] for row in rows],
        slot_mapping=[batch.slot_mapping[row] for row in rows], query_lens=[1] * len(rows),
        seq_lens=[batch.positions[row] + 1 for row in rows],
        block_tables=[batch.block_tables[d.sequence] for d in drafting],
        logits_indices=list(range(len(rows))), prompt_lens=[batch.prompt_lens[d.sequence] for d in drafting])


def _filled(step: ModelStep, drafting: list[_Drafting], drafts: list[list[int]]) -> ModelStep:
    input_ids = list(step.batch.input_ids)
    draft_token_ids = [list(d) for d in step.draft_token_ids]
    for d, tokens in zip(drafting, drafts, strict=True):
        input_ids[d.first_draft_row:d.first_draft_row + d.num_drafts] = tokens
        draft_token_ids[d.sampling_index] = tokens
    return dataclasses.replace(step, batch=msgspec.structs.replace(step.batch, input_ids=input_ids),
                               draft_token_ids=draft_token_ids)
