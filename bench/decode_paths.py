"""Decode paths on CPU, measured against each other (see docs/performance.md, "Decode attention" and "Decode
paths measured and not taken").

    .venv/bin/python bench/decode_paths.py attention --batches 1,8,32,64 --contexts 128,512,2048
    .venv/bin/python bench/decode_paths.py attention --flex          # FlexAttention too (compiles per shape)
    .venv/bin/python bench/decode_paths.py step --batches 1,8,32,64

`attention`: one layer's decode attention of the default model's shape (9 query heads, 3 KV heads, head
dim 64, bfloat16 cache of 16-token blocks, every sequence's blocks interleaved with the others'), over
`--layers` distinct caches used in turn, so that each call reads its cache from memory as a step's layers
do: the fused kernel the engine runs (`model/decode_attention.py`) against the unfused path it replaced
(`attention._group_attention`: gathered keys, a bf16 `bmm`, `embedding_bag` over the values) and, with
`--flex`, FlexAttention compiled by inductor's C++ template, which streams the blocks a block mask lists
with an online softmax (the partial last block masked by a `mask_mod`). Each is checked against a float64
reference.

`step`: a whole decode step of the default model in bfloat16, eager against `torch.compile` of the 30
decoder layers as one graph (inductor's C++ backend, static shapes per batch size). Inductor cannot lower
oneDNN's packed linear with a weight that is a graph input, nor trace the paged attention's Python
metadata, so both run as opaque custom ops inside the graph; the norms, rope, residuals and activation are
compiled. Compile time is measured cold (an empty inductor cache) and warm (the same graphs again after
`torch._dynamo.reset()`, from inductor's on-disk FX graph cache).

Times are medians of repetitions in which the paths alternate; on a shared machine read the ratios.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from forward import BLOCK_SIZE, OursDecode, int_list, interleaved_ms, prepare_torch  # noqa: E402

from gracelm.model import decode_attention, llama  # noqa: E402
from gracelm.model.attention import AttentionMetadata, _group_attention, paged_attention  # noqa: E402
from gracelm.model.forward_batch import ForwardBatch  # noqa: E402
from gracelm.model.loader import load_model  # noqa: E402
from gracelm.model.rope import rope_cos_sin  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- attention ------------------------------------------------------------------------------------------


def decode_case(
    batch: int, context: int, dtype: torch.dtype, layers: int = 1
) -> tuple[torch.Tensor, list[torch.Tensor], ForwardBatch]:
    """`layers` caches of `batch` sequences of `context` tokens, block k of sequence s at s + batch * k."""
    per_seq = -(-context // BLOCK_SIZE)
    shape = (2, KV_HEADS, batch * per_seq, BLOCK_SIZE, HEAD_DIM)
    caches = [torch.randn(shape).to(dtype) for _ in range(layers)]
    tables = torch.tensor([[s + batch * k for k in range(per_seq)] for s in range(batch)])
    pos = context - 1
    fb = ForwardBatch(
        input_ids=torch.zeros(batch, dtype=torch.long), positions=torch.full((batch,), pos),
        slot_mapping=tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE, query_lens=[1] * batch,
        seq_lens=[context] * batch, block_tables=tables, logits_indices=torch.arange(batch),
    )
    return torch.randn(batch, HEADS, HEAD_DIM).to(dtype), caches, fb


def paged_block_mask(tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int):
    """Each sequence's full blocks as FlexAttention's unmasked blocks, its last block as its one partial
    block, masked to the tokens it holds. Inductor's CPU template wants the partial indices as wide as the
    cache."""
    from torch.nn.attention.flex_attention import BlockMask

    batch = tables.shape[0]
    blocks = (seq_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    partial = torch.zeros(batch, 1, 1, num_blocks, dtype=torch.int32)
    partial[:, 0, 0, 0] = tables.gather(1, (blocks - 1)[:, None])[:, 0]
    in_last = (seq_lens - 1) % BLOCK_SIZE + 1

    def in_context(b, h, q_idx, kv_idx):
        return kv_idx % BLOCK_SIZE < in_last[b]

    return BlockMask.from_kv_blocks(
        torch.ones(batch, 1, 1, dtype=torch.int32), partial,
        (blocks - 1).to(torch.int32).view(batch, 1, 1), tables.to(torch.int32).view(batch, 1, 1, -1),
        BLOCK_SIZE=(1, BLOCK_SIZE), mask_mod=in_context, seq_lengths=(1, num_blocks * BLOCK_SIZE),
        compute_q_blocks=False,
    )


def flex_decode(flex: Callable, q: torch.Tensor, cache: torch.Tensor, mask, partition: int) -> torch.Tensor:
    slots = cache.shape[2] * BLOCK_SIZE
    keys, values = cache[0].view(1, KV_HEADS, slots, HEAD_DIM), cache[1].view(1, KV_HEADS, slots, HEAD_DIM)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = flex(q[:, :, None, :], keys, values, block_mask=mask, enable_gqa=True, scale=scale,
               kernel_options={"PARTITION_SIZE": partition})
    return out.view(q.shape[0], -1)


def reference(q: torch.Tensor, cache: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """Float64 attention of each sequence over its gathered context."""
    rows = []
    for b, length in enumerate(fb.seq_lens):
        blocks = fb.block_tables[b, : -(-length // BLOCK_SIZE)]
        kv = cache.index_select(2, blocks).view(2, KV_HEADS, -1, HEAD_DIM)[:, :, :length].double()
        scores = q[b].double().view(KV_HEADS, -1, HEAD_DIM) @ kv[0].transpose(1, 2) / math.sqrt(HEAD_DIM)
        rows.append((scores.softmax(-1) @ kv[1]).reshape(-1))
    return torch.stack(rows)


def bench_attention(args: argparse.Namespace) -> None:
    flex = None
    if args.flex:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    print(f"{args.layers} caches in turn")
    flex_columns = f"{'flex ms':>9}{'unf/flex':>9}{'compile s':>10}" if flex else ""
    print(f"{'batch':>5}{'context':>8}{'unfused ms':>11}{'fused ms':>9}{'unf/fused':>10}{flex_columns}"
          f"{'err unfused':>12}{'err fused':>10}{'err flex' if flex else '':>9}")
    for batch in args.batches:
        for context in args.contexts:
            print(attention_case(flex, batch, context, args), flush=True)


def attention_case(flex: Callable | None, batch: int, context: int, args: argparse.Namespace) -> str:
    # Every shape is its own compile: without a reset, dynamo's recompile limit (8) would send the ninth
    # case to flex_attention's eager reference, silently.
    torch._dynamo.reset()
    q, caches, fb = decode_case(batch, context, torch.bfloat16, args.layers)
    group = AttentionMetadata.build(fb, caches[0]).groups[0]
    lengths, scale = torch.tensor(fb.seq_lens), 1 / math.sqrt(HEAD_DIM)
    layer = [0]

    def cache() -> torch.Tensor:  # the next layer's
        layer[0] = (layer[0] + 1) % len(caches)
        return caches[layer[0]]

    def unfused() -> torch.Tensor:
        return _group_attention(q, cache(), group, scale)

    def fused() -> torch.Tensor:
        out = decode_attention.paged_decode_attention(q, cache(), fb.block_tables, lengths, scale)
        return out.view(batch, -1)

    paths = [unfused, fused]
    if flex:
        mask = paged_block_mask(fb.block_tables, lengths, caches[0].shape[2])
        paths.append(lambda: flex_decode(flex, q, cache(), mask, args.partition_size))
        compile_s = timed(paths[-1])
    errors = []
    for path in paths:
        layer[0] = -1  # every path checked on the first cache
        errors.append((path().double() - reference(q, caches[0], fb)).abs().max().item())
    ms = interleaved_ms(paths, args.repeats)
    flex_columns = f"{ms[2]:>9.3f}{ms[0] / ms[2]:>9.2f}{compile_s:>10.1f}" if flex else ""
    return (f"{batch:>5}{context:>8}{ms[0]:>11.3f}{ms[1]:>9.3f}{ms[0] / ms[1]:>10.2f}{flex_columns}"
            + "".join(f"{e:>{w}.4f}" for e, w in zip(errors, (12, 10, 9)[:len(errors)], strict=True)))


# --- step -----------------------------------------------------------------------------------------------


@torch.library.custom_op("gracelm_bench::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, width: int
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, width: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], width))


_STEP_META: list[AttentionMetadata] = []  # the step's metadata, read by the opaque attention op


@torch.library.custom_op("gracelm_bench::paged_attention", mutates_args=("kv_cache",))
def opaque_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
) -> torch.Tensor:
    return paged_attention(q, k, v, kv_cache, _STEP_META[0])


@opaque_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


class StepPaths:
    """The frozen default model's decode step, eager or with its decoder layers compiled as one graph."""

    def __init__(self) -> None:
        loaded = load_model(None, dtype="bfloat16")
        loaded.model.freeze()
        self.model = loaded.model
        self.loaded = loaded
        self.compiled = torch.compile(self._layers, dynamic=False)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[torch.Tensor],
                meta: AttentionMetadata | None) -> torch.Tensor:
        inner = self.model.model
        for layer, cache in zip(inner.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, meta)
        return inner.norm(x)

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, caches: list[torch.Tensor], compiled: bool) -> torch.Tensor:
        inner = self.model.model
        x = inner.embed_tokens(batch.input_ids)
        cos, sin = rope_cos_sin(inner.inv_freq, batch.positions, x.dtype)
        meta = AttentionMetadata.build(batch, caches[0])
        if compiled:
            _STEP_META[:] = [meta]
            with _opaque_kernels():
                hidden = self.compiled(x, cos, sin, caches, None)
        else:
            hidden = self._layers(x, cos, sin, caches, meta)
        return self.model.logits_proj(hidden).float()


class _opaque_kernels:
    """Routes the packed linears and the attention through the opaque ops while the compiled graph runs."""

    def __enter__(self) -> None:
        self.linear, self.attention = llama.FrozenLinear.forward, llama.paged_attention
        llama.FrozenLinear.forward = _packed_forward
        llama.paged_attention = lambda q, k, v, kv_cache, meta: opaque_attention(q, k, v, kv_cache)

    def __exit__(self, *exc: object) -> None:
        llama.FrozenLinear.forward, llama.paged_attention = self.linear, self.attention


def _packed_forward(self: llama.FrozenLinear, x: torch.Tensor) -> torch.Tensor:
    if self.packed is None:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return packed_linear(x, self.packed, self.bias, sum(self.output_sizes))


def bench_step(args: argparse.Namespace) -> None:
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True  # round where eager rounds: compiled equals eager
    paths = StepPaths()
    print(f"{'batch':>5}{'eager ms':>10}{'compiled ms':>12}{'eager/comp':>11}{'cold s':>8}{'warm s':>8}"
          f"{'max |dlogit|':>13}{'top-1 same':>11}")
    for batch in args.batches:
        print(step_case(paths, OursDecode(paths.loaded, batch, args.context, torch.bfloat16), args.repeats),
              flush=True)


def step_case(paths: StepPaths, case: OursDecode, repeats: int) -> str:
    def eager() -> torch.Tensor:
        return paths.step(case.batch, case.caches, False)

    def compiled() -> torch.Tensor:
        return paths.step(case.batch, case.caches, True)

    reference = eager()
    cold = timed(compiled)
    torch._dynamo.reset()
    warm = timed(compiled)
    out = compiled()
    same = (out.argmax(-1) == reference.argmax(-1)).float().mean().item()
    ms = interleaved_ms([eager, compiled], repeats)
    return (f"{len(case.batch.query_lens):>5}{ms[0]:>10.2f}{ms[1]:>12.2f}{ms[0] / ms[1]:>11.2f}{cold:>8.1f}"
            f"{warm:>8.1f}{(out - reference).abs().max().item():>13.4f}{same:>11.0%}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("attention", "step"))
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes, comma-separated")
    p.add_argument("--contexts", default="128,512,2048", help="attention: tokens of context, comma-separated")
    p.add_argument("--layers", type=int, default=30,
                   help="attention: caches used in turn, so that each is read from memory (default 30)")
    p.add_argument("--flex", action="store_true", help="attention: FlexAttention too (compiled per shape)")
    p.add_argument("--partition-size", type=int, default=128,
                   help="attention: inductor's PARTITION_SIZE (default 128: the split-KV template once the "
                        "cache is long enough; one not a multiple of the block size, e.g. 24: the plain one)")
    p.add_argument("--context", type=int, default=256, help="step: tokens of context of each sequence")
    p.add_argument("--repeats", type=int, default=21, help="timed repetitions per case (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    args.batches, args.contexts = int_list(args.batches), int_list(args.contexts)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prepare_torch(args.threads)
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:  # cold: nothing compiled before
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
        (bench_attention if args.what == "attention" else bench_step)(args)


if __name__ == "__main__":
    main()
