"""The decode step of one sequence, compiled ahead of time by AOTInductor: for a bfloat16 model on the CPU
whose linears have 4-bit forms (a GGUF file's Q4 blocks, `model/quantized_linear.py`).

Why. With one sequence per step the matmuls are a third of the step: the int4 kernel reads the 30 layers'
weights in about 2.5 ms and the logits head takes 1.1 ms, while the ~1,700 small eager ops around them
(norms, rope, residuals, the attention's glue; a few microseconds each of dispatch) take most of the rest
of a ~10.9 ms step (default model, context 256, 2 threads). Compiled, those ops become a few fused C++
loops called from C++ (no Python, no dispatcher, no guards): 7.3 ms for the same step. `bench/forward.py
--decode-graph` measures it.

What is compiled (`_DecoderStack`): the decoder layers and the final norm, the very modules and code the
eager forward runs (`LlamaDecoderLayer.forward`, `paged_attention`), traced by `torch.export` with the
context length dynamic (1 to `MAX_CONTEXT` tokens, whole blocks) and the KV cache written in place. Left
eager: the embedding lookup, the rotary cos/sin and the attention metadata (once per step, as the eager
forward builds them) and the logits head (one oneDNN call). Inductor's `emulate_precision_casts` rounds to
bfloat16 where eager rounds, so the compiled step gives eager's logits bit for bit as measured on this
project's machine (default model, contexts 40 to 2,000); tests/test_decode_graph.py holds the graph to
eager within bfloat16 rounding, since a fused reduction may sum in another order.

Which steps (`DecodeGraph.serves`): decode steps of exactly one sequence (the exported batch is static:
with the batch dynamic the compiled step was no faster than eager from 4 sequences on, and slower at 8),
of at most `MAX_CONTEXT` tokens of context: inductor's fused softmax and casts over the context cost
more than eager's kernels as the context grows (measured: compiled/eager 0.61 at 40 tokens, 0.68 at 256,
0.79 at 600, 0.94 at 1,000, 1.10-1.19 at 2,000), so longer contexts stay eager.

Kept on disk (`graph_path`): `<cache>/graphs/<key>.pt2`, the package with its constants (the layers' int4
weights and norms: 70 MB for the default model, and as much memory once loaded), keyed by everything the
compiled code depends on (`graph_key`): the model file's content hash, dtype, block size, the int4 kernel's
packed layout, torch's version, the CPU's vector capability and `FORMAT_VERSION`. Building it takes about
a minute of one core for the default model; `parallel/decode_graph_build.py` does it in a child process
after the first start while the engine serves eagerly, and every later start loads it in 0.1 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import nn

from gracelm.arith import cdiv
from gracelm.cache_dir import cache_dir
from gracelm.model.attention import AttentionMetadata, QueryGroup, allocate_kv_cache
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.quantized_linear import layout_id

logger = logging.getLogger(__name__)

# Part of the key: a change of what is exported or how must change it.
FORMAT_VERSION = 1
# Contexts up to this many tokens run compiled (see above).
MAX_CONTEXT = 1024
# Packages kept in the cache folder, most recently used first.
MAX_ENTRIES = 2
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
                block_ids: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        _, kv_heads, _, block_size, head_dim = kv_caches[0].shape
        keys = kv_caches[0].new_empty((kv_heads, block_ids.shape[0], block_size, head_dim))
        group = QueryGroup(None, 1, False, block_ids, block_ids.shape[0], mask, keys, slots)
        meta = AttentionMetadata(slot_mapping, 1, [group], [])
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)


class DecodeGraph:
    """A loaded package: the decoder stack of one decode token, compiled."""

    def __init__(self, runner: object, path: Path) -> None:
        self.runner = runner
        self.path = path

    @classmethod
    def load(cls, path: Path) -> DecodeGraph:
        runner = torch._inductor.aoti_load_package(str(path))
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used
        return cls(runner, path)

    @staticmethod
    def serves(batch: ForwardBatch) -> bool:
        return batch.query_lens == [1] and batch.seq_lens[0] <= MAX_CONTEXT

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The final norm's output [1, hidden] for the step of `meta` (its one decode group)."""
        group = meta.groups[0]
        return self.runner(x, cos, sin, meta.slot_mapping, group.block_ids, group.mask, group.slots,
                           kv_caches)


def graph_key(model_hash: str, dtype: torch.dtype, block_size: int) -> str:
    parts = [model_hash, str(dtype), f"block {block_size}", f"int4 layout {layout_id()}", torch.__version__,
             torch.backends.cpu.get_cpu_capability(), f"max context {MAX_CONTEXT}", f"v{FORMAT_VERSION}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def graph_path(key: str) -> Path:
    return cache_dir(_FOLDER) / f"{key}.pt2"


def compile_graph(model: nn.Module, block_size: int, path: Path) -> None:
    """Exports and compiles the decode step of `model` (a frozen `LlamaForCausalLM` with int4 forms) into
    the package `path`, written whole or not at all (a temporary file renamed)."""
    decoder = model.model
    stack = _DecoderStack(decoder)
    args = _example_inputs(decoder, model.config, block_size)
    blocks = torch.export.Dim("blocks", min=1, max=cdiv(MAX_CONTEXT, block_size))
    cache_blocks = torch.export.Dim("cache_blocks", min=2)
    context = block_size * blocks
    dynamic = (None, None, None, None, {0: blocks}, {4: context}, {1: context},
               [{2: cache_blocks}] * len(args[-1]))
    decoder.int4_gate.prompt_step = False
    with torch.inference_mode():
        exported = torch.export.export(stack, args, dynamic_shapes=dynamic, strict=False)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.pt2")
    try:
        torch._inductor.aoti_compile_and_package(exported, package_path=str(temporary),
                                                 inductor_configs={"emulate_precision_casts": True})
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    _prune(path.parent)


def _example_inputs(decoder: nn.Module, config: object, block_size: int) -> tuple:
    """A decode token at position 2 * block_size + 1 of a sequence over three blocks of a small cache:
    every size that is dynamic differs from the others and from 1."""
    caches = allocate_kv_cache(config, 5, block_size, torch.bfloat16)
    position = 2 * block_size + 1
    batch = ForwardBatch(input_ids=torch.tensor([1]), positions=torch.tensor([position]),
                         slot_mapping=torch.tensor([3 * block_size + 1]), query_lens=[1],
                         seq_lens=[position + 1], block_tables=torch.tensor([[1, 2, 3, 4]]),
                         logits_indices=torch.tensor([0]))
    with torch.inference_mode():
        x, cos, sin, meta = decoder.step_inputs(batch, caches)
    group = meta.groups[0]
    return x, cos, sin, meta.slot_mapping, group.block_ids, group.mask, group.slots, caches


def _prune(folder: Path) -> None:
    """Keeps the `MAX_ENTRIES` most recently used packages, and no temporary file of a dead compiler."""
    packages = sorted(folder.glob("*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in packages[MAX_ENTRIES:]:
        stale.unlink(missing_ok=True)
    for temporary in folder.glob(".*.pt2"):
        pid = temporary.stem.rsplit(".", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            temporary.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
