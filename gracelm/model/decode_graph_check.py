"""A compiled decode step proves itself before it serves (`check`).

A graph is code that inductor compiled on the fly for this CPU, these kernels and this model; a defect in it,
or in the way the engine calls it, must cost speed, never the server. So before a loaded graph serves, the
model runs two synthetic steps over a scratch KV cache of random values:
- a step of decode tokens that the graph serves (one sequence, or three of different lengths: within one
  block, across blocks, in blocks out of order), once with the graph and once eagerly; the graph serves only
  where both agree (`close`);
- a step that mixes a prompt with decode tokens, which no graph serves: with the graph loaded, it must run,
  and eagerly. Graphs loaded together share this step (a prompt's eager step costs several decode steps).
Neither may raise. What fails is logged by the caller (`parallel/decode_graph_build.py`), which serves
eagerly instead. What passes is not checked again at a later start with the same package and code
(`decode_graph_proof.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gracelm.arith import cdiv
from gracelm.model.attention import allocate_kv_cache
from gracelm.model.decode_graph import DecodeGraph
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.low_bit_gate import SHORT_PROMPT

# The decode tokens' contexts (`_contexts`).
_CONTEXTS = [40, 0, 17]
_PROMPT = SHORT_PROMPT + 4
_SEED = 20261205


def close(ours: torch.Tensor, eager: torch.Tensor) -> bool:
    """Whether a compiled step's logits equal eager's within bfloat16's rounding: a relative step (2^-6),
    or one step of the largest logit (a hidden state one step off moves a small logit by that much).
    Inductor rounds where eager rounds, but a fused reduction may sum in another order."""
    bound = max(1e-2, 2**-7 * float(eager.abs().max()))
    within = (ours - eager).abs() <= bound + 1.6e-2 * eager.abs()
    return bool(torch.isfinite(ours).all()) and bool(within.all())


def check(model: nn.Module, graphs: list[DecodeGraph], block_size: int,
          serving: tuple[DecodeGraph, ...] = ()) -> list[str | None]:
    """For each of `graphs`: None where it serves `model` (a frozen `LlamaForCausalLM`) as eager does, else
    what differs. Each runs its own decode step; the mixed step runs once, with every graph that passed
    loaded beside those `serving` already: one failing there fails them all (it is rare, and which of them
    took the step is what a later load would find out)."""
    problems = [_guarded(_decode_problem, model, graph, block_size) for graph in graphs]
    passed = [graph for graph, problem in zip(graphs, problems, strict=True) if problem is None]
    if not passed:
        return problems
    mixed = _guarded(_mixed_problem, model, [*serving, *passed], block_size)
    return [problem if problem is not None or mixed is None else mixed for problem in problems]


def _guarded(problem_of: Callable[..., str | None], *args: object) -> str | None:
    try:
        return problem_of(*args)
    except Exception as e:  # noqa: BLE001 - the graph's failure, reported
        return f"a check step raised {type(e).__name__}: {e}"


def _decode_problem(model: nn.Module, graph: DecodeGraph, block_size: int) -> str | None:
    decode = _decode_batch(_contexts(graph), block_size)
    caches = _scratch_cache(model, decode, block_size)
    ours, served, raised = _run(model, [graph], decode, caches)
    if raised is not None:
        return raised
    if not served:
        return "it does not serve a step of its own sequences"
    eager, _, _ = _run(model, [], decode, caches)
    if not close(ours, eager):
        return f"its logits differ from eager's by up to {float((ours - eager).abs().max()):.3g}"
    return None


def _mixed_problem(model: nn.Module, graphs: list[DecodeGraph], block_size: int) -> str | None:
    """The mixed step runs once, with the graphs: where none serves it, it takes the eager path, which a
    second, eager run would only compare with itself."""
    widest = max(graphs, key=lambda graph: len(_contexts(graph)))
    mixed = _mixed_batch(_decode_batch(_contexts(widest), block_size), block_size)
    logits, served, raised = _run(model, graphs, mixed, _scratch_cache(model, mixed, block_size))
    if raised is not None:
        return raised
    if served:
        return "a graph served a mixed step"
    return None if bool(torch.isfinite(logits).all()) else "a mixed step beside it gave logits not finite"


def _contexts(graph: DecodeGraph) -> list[int]:
    """The decode tokens' contexts: as many sequences as the graph serves, up to all of `_CONTEXTS`."""
    return _CONTEXTS[:min(len(_CONTEXTS), graph.rows.stop - 1)]


def _scratch_cache(model: nn.Module, batch: ForwardBatch, block_size: int) -> list[torch.Tensor]:
    """A KV cache of random values holding every block `batch` refers to."""
    blocks = int(batch.block_tables.max()) + 1
    caches = allocate_kv_cache(model.config, blocks, block_size, model.model.embed_tokens.weight.dtype)
    generator = torch.Generator().manual_seed(_SEED)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    return caches


def _run(model: nn.Module, graphs: list[DecodeGraph], batch: ForwardBatch, caches: list[torch.Tensor]
         ) -> tuple[torch.Tensor, bool, str | None]:
    """The logits of `batch` over a copy of `caches`, with `graphs` as the model's graphs (none: eager);
    whether a graph ran; and why it failed where one raised (the model then ran the step eagerly). The
    model's graphs and counts are left as they were."""
    decoder = model.model
    kept = decoder.decode_graphs, decoder.decode_graph_failure, decoder.compiled_steps
    try:
        decoder.decode_graphs = list(graphs)
        logits = model(batch, [cache.clone() for cache in caches])
        return logits, decoder.compiled_steps > kept[2], decoder.decode_graph_failure
    finally:
        decoder.decode_graphs, decoder.decode_graph_failure, decoder.compiled_steps = kept


def _decode_batch(contexts: list[int], block_size: int) -> ForwardBatch:
    """The decode token of each sequence after `contexts[i]` cached tokens; the sequences' blocks taken
    from the top of the cache down, so that none lies after its predecessor."""
    widths = [cdiv(context + 1, block_size) for context in contexts]
    ids = iter(range(sum(widths) + _PROMPT, 0, -1))  # block 0 unused, below the prompt's blocks
    tables = torch.zeros(len(contexts), max(widths), dtype=torch.long)
    for row, width in enumerate(widths):
        tables[row, :width] = torch.tensor([next(ids) for _ in range(width)])
    slots = [int(tables[i, c // block_size]) * block_size + c % block_size for i, c in enumerate(contexts)]
    return ForwardBatch(input_ids=torch.arange(7, 7 + len(contexts)), positions=torch.tensor(contexts),
                        slot_mapping=torch.tensor(slots), query_lens=[1] * len(contexts),
                        seq_lens=[c + 1 for c in contexts], block_tables=tables,
                        logits_indices=torch.arange(len(contexts)), prompt_lens=[1] * len(contexts))


def _mixed_batch(decode: ForwardBatch, block_size: int) -> ForwardBatch:
    """A new prompt of `_PROMPT` tokens (in blocks 1 and up) followed by `decode`'s tokens."""
    width = cdiv(_PROMPT, block_size)
    prompt_table = torch.arange(1, width + 1)
    columns = max(width, decode.block_tables.shape[1])
    tables = torch.zeros(1 + len(decode.query_lens), columns, dtype=torch.long)
    tables[0, :width] = prompt_table
    tables[1:, :decode.block_tables.shape[1]] = decode.block_tables
    positions = torch.arange(_PROMPT)
    prompt_slots = prompt_table[positions // block_size] * block_size + positions % block_size
    return ForwardBatch(
        input_ids=torch.cat([torch.arange(3, 3 + _PROMPT), decode.input_ids]),
        positions=torch.cat([positions, decode.positions]),
        slot_mapping=torch.cat([prompt_slots, decode.slot_mapping]),
        query_lens=[_PROMPT, *decode.query_lens], seq_lens=[_PROMPT, *decode.seq_lens], block_tables=tables,
        logits_indices=torch.cat([torch.tensor([_PROMPT - 1]), decode.logits_indices + _PROMPT]),
        prompt_lens=[_PROMPT, *decode.prompt_lens])
