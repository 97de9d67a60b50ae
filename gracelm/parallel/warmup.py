"""The engine's first steps, run at start-up before the core says Ready: a server is ready only once it can
serve at full speed.

Why. The first step of each kind pays for what a process does only once: oneDNN creating the primitive of
each matmul shape it meets (the dense weights: tensor parallelism, `--dense-weights on`, models without
low-bit forms), the heap growing to a step's working size (kept afterwards, `heap.py`), the first calls of
the attention and sampling kernels, a compiled decode step's first run. Behind a router a server is given
users' requests as soon as `/ready` answers 200, so the first of them would pay it all.

What runs (`warmup_steps`): a prompt long enough for the prompt paths (the dense or tile-unit matmuls,
SDPA) and one short enough for the low-bit ones, prefilled in one step; decode steps of both (the compiled
graph of several sequences, or eager decode of several rows); then of the first alone (the graph of one).
Rank 0 samples each step as requests most often ask: one row greedy, one at a temperature with top-p, top-k
and logprobs.

Where long prompts take the matmul kernels decode rows take (`llama.long_prompts_differ`: a GGUF file's
forms alone, no tile unit), the first prompt is as short as the second. Its 16 rows more would multiply
every weight again, which is most of the warm-up's time, to pay SDPA's first call alone: that costs the
first long prompt a fraction of one of its rows' arithmetic.

Why it leaves nothing behind. It runs before the KV-cache manager exists (`EngineCore` builds it once the
executor's cache is set up), on the blocks the manager hands out first: nothing refers to them afterwards,
no prefix-cache entry, no request, no block in use, and every slot a request reads it has written first.
The counts a step adds to (compiled steps, time in collectives) and the default generator's draws are put
back (`Worker.unrecorded`). The engine core's own counters and metrics never see it: the executor runs it
below them. With tensor parallelism every rank runs the same batches (`WarmUp`), rank 0 sampling.

No option turns it off: it costs a few steps' time, a small share of a start (`warmup` in the start-up
timeline).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import gracelm.startup_timeline as startup_timeline
from gracelm.arith import cdiv
from gracelm.model.low_bit_gate import SHORT_PROMPT
from gracelm.model_step import ModelStep, PoolRows, StepBatch
from gracelm.parallel.worker import Worker
from gracelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Decode steps of every sequence, then as many of the first alone. One of each: a kind's first run pays what
# it pays once, and a second left a start's first request no faster (bench/RESULTS.md, "Serving against
# llama.cpp's llama-server").
DECODE_STEPS = 1


@dataclass(frozen=True)
class _Sequence:
    """One warm-up sequence: its prompt length, every token it will have, its blocks and its sampling."""

    request_id: str
    prompt_len: int
    token_ids: list[int]
    block_ids: list[int]
    params: SamplingParams


# The prompts' lengths: a long one takes the prompt paths, a short one the low-bit forms.
LONG_PROMPT_LEN = SHORT_PROMPT + 4
SHORT_PROMPT_LEN = 4
# (decode steps, sampling) of each sequence, in the order their blocks are taken: the first's prompt is the
# long one (where long prompts take paths of their own), the second's the short one.
_SEQUENCES = (
    (2 * DECODE_STEPS, SamplingParams(temperature=0.0)),
    (DECODE_STEPS, SamplingParams(temperature=0.7, top_p=0.9, top_k=40, logprobs=1)),
)


def warmup_steps(block_size: int, num_blocks: int, vocab_size: int, pooled: bool = False,
                 long_prompt: bool = True) -> list[ModelStep]:
    """The warm-up's steps over blocks 0 and up of a cache of `num_blocks`; a sequence whose blocks do not
    fit is left out (none fits: no step). `pooled`: an embedding model's, whose rows are pooled, not
    sampled. `long_prompt`: whether long prompts take paths of their own (else both prompts are short)."""
    prompt_lens = (LONG_PROMPT_LEN if long_prompt else SHORT_PROMPT_LEN, SHORT_PROMPT_LEN)
    sequences = _sequences(block_size, num_blocks, vocab_size, prompt_lens)
    if not sequences:
        return []
    first = sequences[0]
    steps = [_step([(s, 0, s.prompt_len) for s in sequences], block_size)]
    for decoded in range(DECODE_STEPS):
        steps.append(_step([(s, s.prompt_len + decoded, 1) for s in sequences], block_size))
    for decoded in range(DECODE_STEPS, 2 * DECODE_STEPS):
        steps.append(_step([(first, first.prompt_len + decoded, 1)], block_size))
    return [_pooled(step) for step in steps] if pooled else steps


def _pooled(step: ModelStep) -> ModelStep:
    """The step with each of its rows pooled instead of sampled."""
    return ModelStep(step.batch, [], [], [], [],
                     pool_rows=[PoolRows(request_id, 1) for request_id in step.request_ids])


def _sequences(block_size: int, num_blocks: int, vocab_size: int, prompt_lens: tuple[int, int]
               ) -> list[_Sequence]:
    sequences: list[_Sequence] = []
    next_block = 0
    for index, (prompt_len, (decoded, params)) in enumerate(zip(prompt_lens, _SEQUENCES, strict=True)):
        length = prompt_len + decoded
        width = cdiv(length, block_size)
        if next_block + width > num_blocks:
            break
        # Ids spread over the vocabulary, any of which a model of at least one token can embed.
        token_ids = [(7 + 31 * (index + 1) * position) % vocab_size for position in range(length)]
        sequences.append(_Sequence(f"warmup-{index}", prompt_len, token_ids,
                                   list(range(next_block, next_block + width)), params))
        next_block += width
    return sequences


def _step(parts: list[tuple[_Sequence, int, int]], block_size: int) -> ModelStep:
    """A step of `count` tokens of each sequence from position `start`, each row sampled."""
    batch = StepBatch(input_ids=[], positions=[], slot_mapping=[], query_lens=[], seq_lens=[],
                      block_tables=[], logits_indices=[], prompt_lens=[])
    width = max(len(sequence.block_ids) for sequence, _, _ in parts)
    for sequence, start, count in parts:
        positions = range(start, start + count)
        batch.input_ids += [sequence.token_ids[p] for p in positions]
        batch.positions += positions
        batch.slot_mapping += [sequence.block_ids[p // block_size] * block_size + p % block_size
                               for p in positions]
        batch.query_lens.append(count)
        batch.seq_lens.append(start + count)
        batch.block_tables.append(sequence.block_ids + [0] * (width - len(sequence.block_ids)))
        batch.logits_indices.append(len(batch.input_ids) - 1)
        batch.prompt_lens.append(sequence.prompt_len)
    sequences = [sequence for sequence, _, _ in parts]
    return ModelStep(batch, [s.request_id for s in sequences], [s.params for s in sequences],
                     [s.token_ids[:s.prompt_len] for s in sequences],
                     [s.token_ids[s.prompt_len:start + count] for s, start, count in parts])


def run_warmup(driver: Worker, steps: list[ModelStep]) -> None:
    """Rank 0: runs and samples `steps`, then marks the `warmup` phase of the start-up timeline."""
    started = time.perf_counter()
    with driver.unrecorded():
        for step in steps:
            driver.sample_step(step)
    prompts = ", ".join(map(str, steps[0].batch.query_lens)) if steps else "none"
    logger.info("warm-up: %d steps (prompts of %s tokens) in %.0f ms", len(steps), prompts,
                (time.perf_counter() - started) * 1000)
    startup_timeline.mark("warmup")


def run_warmup_batches(worker: Worker, batches: list[StepBatch]) -> None:
    """Another rank: its share of the forward passes of rank 0's warm-up steps, in the same order."""
    with worker.unrecorded():
        for batch in batches:
            worker.forward(batch)
