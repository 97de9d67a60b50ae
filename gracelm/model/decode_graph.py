"""Decode steps of up to 64 sequences, compiled ahead of time by AOTInductor: for a model on the CPU whose
linears have low-bit forms (a GGUF file's 4- and 8-bit blocks, `model/quantized_linear.py`), in bfloat16
or, where bfloat16 is emulated, in float32.

Why. At few sequences per step the matmuls are a minority of the step: the ~1,700 small eager ops around
them (norms, rope, residuals, the attention's glue; a few microseconds each of dispatch) take most of the
rest. Compiled, those ops become a few fused C++ loops called from C++ (no Python, no dispatcher, no
guards), around the same kernels eager calls (the fused decode attention of `decode_attention.py`, the
low-bit matmuls). `bench/forward.py --decode-graph` measures it; the figures: bench/RESULTS.md, "Compiled
decode steps".

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
team the process has when it runs), so that its norms, rope and activations do not run on one thread while
the others wait.

Which steps (`DecodeGraph.serves`): decode steps only, of a graph's count of sequences, each of at most
`MAX_CONTEXT` tokens of context: inductor's fused softmax and casts over the context cost more than
eager's kernels as the context grows, and beyond about 1,000 tokens the compiled step no longer wins, so
longer contexts stay eager.

Kept on disk (`graph_path`): `<cache>/graphs/<key>.pt2`, each package its code only: its constants (the
layers' low-bit weights and norms) are the loaded model's own tensors, handed to it at load
(`DecodeGraph.load`), so the weights are in memory once whatever the graphs. Keyed by everything the
compiled code depends on (`graph_key`): the model file's content hash, dtype, block size, the low-bit
forms' layout, torch's version, the CPU (its vector capability, the features in use, its own flags), the
attention kernel, the graph's sequences and `FORMAT_VERSION`. Building them takes tens of seconds of one
core each; `parallel/decode_graph_build.py` does it in a child process after the first start while the
engine serves eagerly, and every later start loads them in a fraction of a second. Before a loaded
graph serves it proves itself (`decode_graph_check.py`), once for the same package and code: the proof is
kept beside it (`decode_graph_proof.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import gracelm.cpu_features as cpu_features
from gracelm.arith import cdiv
from gracelm.cache_dir import cache_dir, mtime
from gracelm.model import decode_attention
from gracelm.model.attention import AttentionMetadata, QueryGroup, allocate_kv_cache
from gracelm.model.decode_graph_proof import SUFFIX as PROOF_SUFFIX
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.kv_snapshot import pid_alive

logger = logging.getLogger(__name__)

# Part of the key: a change of what is exported or how must change it.
FORMAT_VERSION = 5
# Contexts up to this many tokens run compiled (see above).
MAX_CONTEXT = 1024
# Steps of more sequences than this run eagerly (the engine's default max_num_seqs).
MAX_ROWS = 64
# Packages kept in the cache folder, most recently used first: the graphs of eight models, or paths
# (`cpu_features.py`); a package holds code only, a few MB.
MAX_ENTRIES = 16
_FOLDER = "graphs"
# What torch's package loader names the directory it unpacks a package into.
_UNPACKED = "aotinductor_*"


class _DecoderStack(nn.Module):
    """What is exported: the model's decoder layers and final norm over the KV caches, for one decode token.
    The attention metadata is rebuilt here from tensors the caller computed with `AttentionMetadata.build`,
    so the layers run exactly the code of the eager forward."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.layers = decoder.layers
        self.norm = decoder.norm
        self.decode_attention = decoder.decode_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        _, kv_heads, _, block_size, head_dim = kv_caches[0].shape
        block_ids = block_tables.reshape(-1)
        keys = kv_caches[0].new_empty((kv_heads, block_ids.shape[0], block_size, head_dim))
        fused = decode_attention.applies(kv_caches[0], choice=self.decode_attention)
        group = QueryGroup(None, 1, False, block_ids, block_tables.shape[1], mask, keys, slots,
                           lengths=lengths, fused=fused)
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
    def load(cls, path: Path, rows: range, block_size: int, decoder: nn.Module) -> DecodeGraph:
        """The package at `path`, loaded, its constants (the layers' weights) those of `decoder` (the
        model's `LlamaModel`) itself: a package holds none of its own (`compile_graph`), so the weights are
        in memory once. torch's loader unpacks the package into a directory of its own under the temporary
        directory (`$TMPDIR`: the engine core's is inside its runtime directory) and leaves it there; its
        shared library is mapped once loaded, so the directory is removed at once, loaded or not (a partial
        unpacking into a full filesystem too)."""
        temp = Path(tempfile.gettempdir())
        before = set(temp.glob(_UNPACKED))
        try:
            # torch's `aoti_load_package` wraps this loader, but importing it imports inductor and dynamo (1.4
            # s of a start), and its call parses the call spec and flattens the arguments at every step.
            runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        finally:
            _remove_unpacked(set(temp.glob(_UNPACKED)) - before, path)
        stack = _DecoderStack(decoder)
        tensors = {**dict(stack.named_parameters()), **dict(stack.named_buffers())}
        names = runner.get_constant_fqns()
        missing = [name for name in names if name not in tensors]
        if missing:
            raise ValueError(f"the package needs constants the model lacks: {', '.join(missing[:4])}")
        # Not copied (user-managed): the graph reads the model's own tensors, which outlive it (it is the
        # model's, `LlamaModel.decode_graphs`).
        runner.load_constants({name: tensors[name] for name in names}, False, True, True)
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


def graph_key(model_hash: str, dtype: torch.dtype, block_size: int, rows: range, layout: str,
              attention: str) -> str:
    """`layout`: the model's low-bit forms' (`low_bit_layout`); `attention`: `--decode-attention`. The CPU
    features in use (`cpu_features.py`) are part of it, since a graph calls the kernels they choose, and so
    is the host CPU's fingerprint: inductor compiles for this very CPU, whose code another CPU of the same
    vector width may not run (a cache folder shared between a Sapphire Rapids and a Zen 4)."""
    parts = [model_hash, str(dtype), f"block {block_size}", f"low-bit layout {layout}", torch.__version__,
             torch.backends.cpu.get_cpu_capability(), f"features {cpu_features.describe()}",
             f"cpu {cpu_features.fingerprint()}",
             f"max context {MAX_CONTEXT}", f"rows {rows}", f"attention {attention} {decode_attention.isa()} "
             f"{decode_attention.LOADED}", f"v{FORMAT_VERSION}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def graph_path(key: str) -> Path:
    return cache_dir(_FOLDER) / f"{key}.pt2"


def inductor_cache() -> Path:
    """Inductor's own cache (its compiled kernels, by their source): a compile that a stop cut short, run
    again, finds there what it had compiled."""
    return cache_dir(_FOLDER, "inductor")


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
        # Without its constants: the loaded graph takes the model's own (`DecodeGraph.load`).
        configs = {"emulate_precision_casts": True, "cpp.march": cpu_features.compiler_arch(),
                   "aot_inductor.package_constants_in_so": False}
        torch._inductor.aoti_compile_and_package(exported, package_path=str(temporary),
                                                 inductor_configs=configs)
        os.replace(temporary, path)
    finally:
        torch.set_num_threads(threads)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    _prune(path.parent)


def _min_blocks(rows: range) -> int:
    """Blocks per sequence a graph takes at least. The graph of several sequences, exported with both
    counts dynamic, computed wrong logits for all rows but the first when every sequence fits in one block
    (only the first row agreed with eager); from two blocks on it equals eager bit for bit. So it is
    exported for two blocks or more, and a step whose sequences all fit in one gets a second, masked block
    (`DecodeGraph.__call__`): the first steps of a new batch of short prompts run compiled too."""
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


def _remove_unpacked(directories: set[Path], package: Path) -> None:
    """Removes the directories torch's loader unpacked `package` into: of those made during its load, the
    ones that hold the package's own top folder (another process may be unpacking beside it)."""
    try:
        with zipfile.ZipFile(package) as archive:
            top = archive.namelist()[0].split("/")[0]
    except (OSError, zipfile.BadZipFile, IndexError):
        top = None
    for directory in directories:
        if top is None or (directory / top).exists():
            shutil.rmtree(directory, ignore_errors=True)


def damaged(package: Path) -> bool:
    """Whether `package` is not a whole zip archive (a failure to load it may be the filesystem's instead)."""
    try:
        with zipfile.ZipFile(package) as archive:
            return archive.testzip() is not None
    except (OSError, zipfile.BadZipFile):
        return True


def _prune(folder: Path) -> None:
    """Keeps the `MAX_ENTRIES` most recently used packages, the proofs of their checks
    (`decode_graph_proof.py`) and no others, and no temporary file of a dead compiler."""
    packages = sorted(folder.glob("*.pt2"), key=mtime, reverse=True)
    for stale in packages[MAX_ENTRIES:]:
        stale.unlink(missing_ok=True)
    for proof in folder.glob(f"*{PROOF_SUFFIX}"):
        if not proof.with_suffix(".pt2").exists():
            proof.unlink(missing_ok=True)
    for temporary in folder.glob(".*.pt2"):
        pid = temporary.stem.rsplit(".", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            temporary.unlink(missing_ok=True)

