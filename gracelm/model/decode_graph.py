"""Decode steps of up to 64 sequences, compiled ahead of time by AOTInductor: for a model on the CPU whose
linears have low-bit forms (a GGUF file's 4- and 8-bit blocks, `model/quantized_linear.py`), in bfloat16
or, where bfloat16 is emulated, in float32.

Why. At few sequences per step the matmuls are a third of the step: the int4 kernel reads the 30 layers'
weights in about 2.5 ms and the logits head takes 1.1 ms, while the ~1,700 small eager ops around them
(norms, rope, residuals, the attention's glue; a few microseconds each of dispatch) took most of the rest
of a ~10.9 ms step (default model, one sequence, context 256, 2 threads). Compiled, those ops become a few
fused C++ loops called from C++ (no Python, no dispatcher, no guards): 7.3 ms for the same step (with the
fused decode attention of `decode_attention.py`, which the graphs call as eager does: 7.2 ms against
11.3 eager at one sequence, 18.1 against 24.8 at eight; with the blocks' kernel of `block_linear.py`,
5.9 against 12.9 at one, 10.0 against 14.6 at eight, 27.6 against 37.0 at 32, context 256).
`bench/forward.py --decode-graph` measures it.

What is compiled (`_DecoderStack`): the decoder layers and the final norm, the very modules and code the
eager forward runs (`LlamaDecoderLayer.forward`, `paged_attention`), traced by `torch.export` with the
context length dynamic (1 to `MAX_CONTEXT` tokens, whole blocks) and the KV cache written in place. Two
graphs (`graph_batches`): one sequence, with static shapes otherwise, and 2 up to the rows the low-bit
forms serve (64 with the blocks' kernel, `MAX_ROWS`; 8 with torch's int4 kernel), the count dynamic.
Left eager: the embedding lookup, the rotary cos/sin and the attention metadata
(once per step, as the eager forward builds them) and the logits head (one oneDNN call). Inductor's
`emulate_precision_casts` rounds to bfloat16 where eager rounds, so the one-sequence graph gave eager's
logits bit for bit on the default model at contexts of 40 to 600 tokens on this project's machine;
tests/test_decode_graph.py holds both graphs to eager within bfloat16 rounding, since a fused reduction
may sum in another order. The one-sequence graph's generated loops run on one thread (one row is too
little to share out); the other graph's are compiled parallel over the rows (`#pragma omp parallel`, the
team the process has when it runs): at 32 sequences its norms, rope and activations took ~2 ms of a step
on one thread while the second one waited, and 22.6 ms against 23.2 a step (8 sequences: 7.85 against
8.11; 64: 36.5 against 37.7; context 80).

Which steps (`DecodeGraph.serves`): decode steps only, of a graph's count of sequences, each of at most
`MAX_CONTEXT` tokens of context: inductor's fused softmax and casts over the context cost more than
eager's kernels as the context grows (compiled/eager at one sequence, measured: 0.6 at 40 tokens, 0.7 at
256, 0.8 at 600, 0.8-0.95 at 1,000, above 1 at 2,000), so longer contexts stay eager.

Kept on disk (`graph_path`): `<cache>/graphs/<key>.pt2`, each package with its constants (the layers'
low-bit weights and norms: 70 MB for the default model, and as much memory once loaded), keyed by
everything the compiled code depends on (`graph_key`): the model file's content hash, dtype, block size,
the low-bit forms' layout, torch's version, the CPU's vector capability, the graph's sequences and
`FORMAT_VERSION`. Building them takes about 40 s each of one core for the default model;
`parallel/decode_graph_build.py` does it in a child process after the first start while the engine serves
eagerly, and every later start loads them in 0.1 s each.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from gracelm.arith import cdiv
from gracelm.cache_dir import cache_dir, mtime
from gracelm.model import decode_attention
from gracelm.model.attention import AttentionMetadata, QueryGroup, allocate_kv_cache
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.kv_snapshot import pid_alive

logger = logging.getLogger(__name__)

# Part of the key: a change of what is exported or how must change it.
FORMAT_VERSION = 3
# Contexts up to this many tokens run compiled (see above).
MAX_CONTEXT = 1024
# Steps of more sequences than this run eagerly (the engine's default max_num_seqs).
MAX_ROWS = 64
# Packages kept in the cache folder, most recently used first: the graphs of two models.
MAX_ENTRIES = 4
_FOLDER = "graphs"


class _DecoderStack(nn.Module):
    """What is exported: the model's decoder layers and final norm over the KV caches, for one decode token.
    The attention metadata is rebuilt here from tensors the caller computed with `AttentionMetadata.build`,
    so the layers run exactly the code of the eager forward."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.layers = decoder.layers
        self.norm = decoder.norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        _, kv_heads, _, block_size, head_dim = kv_caches[0].shape
        block_ids = block_tables.reshape(-1)
        keys = kv_caches[0].new_empty((kv_heads, block_ids.shape[0], block_size, head_dim))
        group = QueryGroup(None, 1, False, block_ids, block_tables.shape[1], mask, keys, slots,
                           lengths=lengths, fused=decode_attention.applies(kv_caches[0]))
        meta = AttentionMetadata(slot_mapping, x.shape[0], [group], [])
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)


class DecodeGraph:
    """A loaded package: the decoder stack of the decode tokens of `rows` sequences, compiled."""

    def __init__(self, runner: torch._C._aoti.AOTIModelPackageLoader, rows: range, block_size: int) -> None:
        self.runner = runner
        in_spec, out_spec = (pytree.treespec_loads(spec) for spec in runner.get_call_spec())
        if out_spec.num_leaves != 1:
            raise ValueError(f"a decode graph gives one tensor; this package gives {out_spec.num_leaves}")
        self.num_inputs = in_spec.num_leaves
        self.rows = rows
        self.block_size = block_size
        self.min_blocks = _min_blocks(rows)

    @classmethod
    def load(cls, path: Path, rows: range, block_size: int) -> DecodeGraph:
        # torch's `aoti_load_package` wraps this loader, but importing it imports inductor and dynamo (1.4 s
        # of a start), and its call parses the call spec and flattens the arguments at every step.
        runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used
        return cls(runner, rows, block_size)

    def serves(self, batch: ForwardBatch) -> bool:
        return (len(batch.query_lens) in self.rows and all(q == 1 for q in batch.query_lens)
                and max(batch.seq_lens) <= MAX_CONTEXT)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The final norm's output [B, hidden] for the step of `meta` (its one decode group)."""
        group = meta.groups[0]
        block_ids, mask, slots = group.block_ids.view(x.shape[0], -1), group.mask, group.slots
        missing = self.min_blocks - block_ids.shape[1]
        if missing > 0:  # every sequence within fewer blocks than the graph takes (`_min_blocks`)
            positions = missing * self.block_size
            block_ids = F.pad(block_ids, (0, missing))  # block 0: masked, past every length, never read
            mask = F.pad(mask, (0, positions), value=float("-inf"))
            slots = F.pad(slots, (0, positions))
        inputs = [x, cos, sin, meta.slot_mapping, block_ids, mask, slots, group.lengths, *kv_caches]
        if len(inputs) != self.num_inputs:
            raise ValueError(f"the decode graph takes {self.num_inputs} tensors, given {len(inputs)}")
        return self.runner.boxed_run(inputs)[0]


def graph_batches(model: nn.Module) -> tuple[range, ...]:
    """The graphs built for a frozen `LlamaForCausalLM`, by the sequences of their steps: one (static
    shapes), and 2 up to the rows its low-bit forms serve (`Int4Gate`; 8 for torch's int4 kernel, and at
    most `MAX_ROWS`): the graph is traced through them, and larger steps take other kernels."""
    most = min(model.model.int4_gate.max_rows, MAX_ROWS)
    return (range(1, 2),) + ((range(2, most + 1),) if most >= 2 else ())


def graph_key(model_hash: str, dtype: torch.dtype, block_size: int, rows: range, layout: str) -> str:
    """`layout`: the model's low-bit forms' (`low_bit_layout`)."""
    parts = [model_hash, str(dtype), f"block {block_size}", f"low-bit layout {layout}", torch.__version__,
             torch.backends.cpu.get_cpu_capability(), f"max context {MAX_CONTEXT}", f"rows {rows}",
             f"fused attention {decode_attention.LOADED}", f"v{FORMAT_VERSION}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def graph_path(key: str) -> Path:
    return cache_dir(_FOLDER) / f"{key}.pt2"


def compile_graph(model: nn.Module, block_size: int, rows: range, path: Path) -> None:
    """Exports and compiles the decode step of `rows` sequences (one of `graph_batches`) of `model` (a frozen
    `LlamaForCausalLM` with low-bit forms) into the package `path`, written whole or not at all (a temporary
    file renamed)."""
    decoder = model.model
    example = 1 if len(rows) == 1 else 3
    args = _example_inputs(decoder, model.config, block_size, example)
    blocks = torch.export.Dim("blocks", min=_min_blocks(rows), max=cdiv(MAX_CONTEXT, block_size))
    context = block_size * blocks
    cache_blocks = torch.export.Dim("cache_blocks", min=2)
    if len(rows) == 1:  # static: one sequence
        dynamic = (None, None, None, None, {1: blocks}, {4: context}, {1: context}, None,
                   [{2: cache_blocks}] * len(args[-1]))
    else:
        seqs = torch.export.Dim("seqs", min=rows.start, max=rows.stop - 1)
        dynamic = ({0: seqs}, {0: seqs}, {0: seqs}, {0: seqs}, {0: seqs, 1: blocks}, {1: seqs, 4: context},
                   {0: seqs, 1: context}, {0: seqs}, [{2: cache_blocks}] * len(args[-1]))
    decoder.int4_gate.rows = True  # traced as a step of decode tokens alone
    with torch.inference_mode():
        exported = torch.export.export(_DecoderStack(decoder), args, dynamic_shapes=dynamic, strict=False)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.pt2")
    threads = torch.get_num_threads()
    # Inductor makes its loops parallel when it compiles with more than one thread (see above). Always 2,
    # whatever the machine: the loops take the running team's size, so a package fits every thread count.
    torch.set_num_threads(1 if len(rows) == 1 else 2)
    try:
        torch._inductor.aoti_compile_and_package(exported, package_path=str(temporary),
                                                 inductor_configs={"emulate_precision_casts": True})
        os.replace(temporary, path)
    finally:
        torch.set_num_threads(threads)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    _prune(path.parent)


def _min_blocks(rows: range) -> int:
    """Blocks per sequence a graph takes at least. The graph of several sequences, exported with both
    counts dynamic, computed wrong logits for all rows but the first when every sequence fits in one block
    (measured: top-1 agreement with eager 1 / rows); from two blocks on it equals eager bit for bit. So it
    is exported for two blocks or more, and a step whose sequences all fit in one gets a second, masked
    block (`DecodeGraph.__call__`): the first steps of short prompts run compiled too (they ran eagerly,
    ~5 steps of a new batch of 32 ten-token prompts, 1.5-2x as long each)."""
    return 1 if len(rows) == 1 else 2


def _example_inputs(decoder: nn.Module, config: object, block_size: int, seqs: int) -> tuple:
    """Decode tokens of `seqs` sequences at position 2 * block_size + 1, over three blocks each of a small
    cache: every size that is dynamic differs from the others and from 1."""
    caches = allocate_kv_cache(config, 3 * seqs + 2, block_size, decoder.embed_tokens.weight.dtype)
    position = 2 * block_size + 1
    tables = torch.arange(1, 3 * seqs + 1).view(seqs, 3)
    batch = ForwardBatch(input_ids=torch.ones(seqs, dtype=torch.long),
                         positions=torch.full((seqs,), position),
                         slot_mapping=tables[:, 2] * block_size + 1, query_lens=[1] * seqs,
                         seq_lens=[position + 1] * seqs, block_tables=tables,
                         logits_indices=torch.arange(seqs))
    with torch.inference_mode():
        x, cos, sin, meta = decoder.step_inputs(batch, caches)
    group = meta.groups[0]
    return (x, cos, sin, meta.slot_mapping, group.block_ids.view(seqs, -1), group.mask, group.slots,
            group.lengths, caches)


def _prune(folder: Path) -> None:
    """Keeps the `MAX_ENTRIES` most recently used packages, and no temporary file of a dead compiler."""
    packages = sorted(folder.glob("*.pt2"), key=mtime, reverse=True)
    for stale in packages[MAX_ENTRIES:]:
        stale.unlink(missing_ok=True)
    for temporary in folder.glob(".*.pt2"):
        pid = temporary.stem.rsplit(".", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            temporary.unlink(missing_ok=True)

