"""Forward-pass speed of the model runtime against transformers and against this machine's own limits.

    .venv/bin/python bench/forward.py                         # float32 and bfloat16, batches 1, 16, 64
    .venv/bin/python bench/forward.py --quick                 # fewer repetitions, bfloat16 only
    .venv/bin/python bench/forward.py --dtypes bfloat16 --batches 1,64 --json out.json
    .venv/bin/python bench/forward.py --int4                  # decode: dense vs int4 vs the dispatch
    .venv/bin/python bench/forward.py --decode-graph          # one sequence's decode: compiled vs eager
    .venv/bin/python bench/forward.py --llama-bench           # beside llama-bench -t 2 -p 512 -n 128
    .venv/bin/python bench/forward.py --llama-bench --dense-weights on   # prompts through the dense copy

On the default model (SmolLM2-135M-Instruct; `--gguf FILE` another, such as a `bench/model_shapes.py`
file of real size), frozen as the engine runs it (`LoadedModel.freeze()`: in bfloat16, its 4-bit matrices
serve steps of few rows through the int4 kernel, see `gracelm/model/quantized_linear.py`): decode steps
of `--batches` sequences at `--context` tokens of context each, and one `--prefill`-token prompt, in tokens
per second. Beside each figure: transformers on the same dequantized weights (its `LlamaForCausalLM`,
decoding through a `DynamicCache` of the same length), and the machine's limits measured in the same run
(before and after, the better kept): large square matmul GFLOP/s per dtype, giving the model-FLOPs
utilisation, and read bandwidth (a sum over a tensor far larger than the caches), giving the bandwidth
utilisation of a decode step (weights + KV read per step, over bandwidth, against the step time).
The machine may be shared and noisy: every figure is the median of several repetitions after a warm-up,
and ours and transformers' alternate within each repetition, so that a busy spell slows both alike.

`--decode-graph` times the decode step of `--batches` sequences (default 1, 4, 8) eager against the compiled
one (`gracelm/model/decode_graph.py`; its packages from gracelm's cache, compiled here and kept there when
missing), alternating, at each of `--contexts`, and says how far apart their logits are.

`--int4` compares the linear kernels instead, on the same frozen model in the engine's dtype (bfloat16, or
float32 on a CPU that emulates bfloat16) with the low-bit forms `--quantization` asks for (auto: the
8-bit-activation kernel of the file's blocks where the CPU has AVX-512 VNNI, else torch's int4 kernel):
decode steps with dense weights at every batch size, with the low-bit form at every batch size, and with
the dispatch the engine uses (`quantized_linear.rows_for`), the three alternating within each repetition;
read the ratios to dense, which is where the crossover is.

`--llama-bench` is a mode of its own: gracelm's batch-1 decode and 512-token prefill per `--dtypes` (the model
frozen as the engine runs it, with its compiled decode steps where they apply), beside
llama.cpp's `llama-bench -m GGUF -t T -p 512 -n 128` on the same file (built by `bench/serve.py
setup-llama-cpp`), as ratios. llama-bench's tg128 decodes 128 tokens at positions 0 .. 127, so gracelm's
decode is measured at their mean context, 64 tokens. `--llama-rounds` rounds alternate which side runs first;
the ratio of each round is printed, and their median.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gracelm.config import DENSE_WEIGHTS_CHOICES, EngineConfig, ModelConfig
from gracelm.model.attention import allocate_kv_cache
from gracelm.model.decode_graph import DecodeGraph, compile_graph, graph_batches, graph_key, graph_path
from gracelm.model.file_hash import content_hash
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.llama import FrozenLinear, describe_linear_kernels, low_bit_layout, set_int4_max_rows
from gracelm.model.loader import DTYPES, LoadedModel, load_model
from gracelm.model.model_files import default_model_path
from gracelm.parallel.decode_graph_build import graph_applies

BLOCK_SIZE = 16
LLAMA_BENCH = Path.home() / ".cache/gracelm-bench/llama.cpp/build/bin/llama-bench"
LLAMA_BENCH_DECODE = 128  # llama-bench -n
LLAMA_BENCH_DECODE_CONTEXT = LLAMA_BENCH_DECODE // 2  # the mean context of its decode steps


@dataclass
class Limits:
    matmul_gflops: dict[str, float]  # dtype name -> GFLOP/s of a large square matmul
    read_gbps: float  # GB/s of a sum over a large tensor


@dataclass
class Row:
    case: str  # "decode" or "prefill"
    dtype: str
    batch: int  # sequences
    tokens: int  # tokens computed per step
    ours_ms: float
    hf_ms: float | None
    flops_per_step: float
    bytes_per_step: float

    def tokens_per_s(self, ms: float | None) -> float | None:
        return None if ms is None else self.tokens / ms * 1e3


# The linear kernels `--int4` compares, by name: the `int4_max_rows` of each but the dispatch's, which is
# the engine's for the model's dtype.
KERNEL_CHOICES = {"dense": 0, "int4": sys.maxsize, "dispatch": None}


@dataclass
class KernelRow:
    batch: int
    ms: dict[str, float]  # kernel choice -> median ms of a decode step


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def interleaved_ms(fns: list[Callable[[], object]], repeats: int, warmup: int = 2) -> list[float]:
    """Median ms of each function, running them in turn within every repetition."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def measure_limits(dtypes: list[str], repeats: int) -> Limits:
    gflops = {}
    n = 2048
    for name in dtypes:
        a = torch.randn(n, n).to(DTYPES[name])
        b = torch.randn(n, n).to(DTYPES[name])
        ms = median_ms(lambda a=a, b=b: torch.mm(a, b), repeats)
        gflops[name] = 2 * n**3 / ms / 1e6
    # 256 MiB: far beyond any cache level, so the sum streams from memory.
    big = torch.ones(64 * 2**20, dtype=torch.float32)
    ms = median_ms(lambda: big.sum(), repeats)
    return Limits(gflops, big.numel() * big.element_size() / ms / 1e6)


def best_limits(a: Limits, b: Limits) -> Limits:
    """The machine's limits are what it reached at its best: on a shared machine, a measurement taken while
    another job ran is low, and utilisations computed from it would be flattering."""
    gflops = {name: max(a.matmul_gflops[name], b.matmul_gflops[name]) for name in a.matmul_gflops}
    return Limits(gflops, max(a.read_gbps, b.read_gbps))


def linear_params(config: ModelConfig) -> int:
    """Parameters of every matmul of a token's forward (the lm_head included, the embedding lookup not)."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    return per_layer * config.num_hidden_layers + config.vocab_size * h


def weight_bytes(loaded: LoadedModel, rows: int) -> int:
    """Bytes of weights a step of `rows` rows reads: each frozen linear's int4 form where it serves that many
    rows, else its dense weight; every matmul's dense weight in a model not frozen."""
    frozen = [m for m in loaded.model.modules() if isinstance(m, FrozenLinear)]
    if not frozen:
        return linear_params(loaded.config) * loaded.dtype.itemsize
    used = [(m.int4.packed, m.int4.scales_zeros) if m.int4 is not None and rows <= m.int4_max_rows
            else (m.weight if m.packed is None else m.packed,) for m in frozen]
    return sum(t.numel() * t.element_size() for tensors in used for t in tensors)


def attention_flops(config: ModelConfig, context: float) -> float:
    """Scores and weighted values of one query token attending to `context` keys, all layers."""
    return 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * context


def kv_bytes(config: ModelConfig, tokens: int, element_size: int) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * tokens * element_size


class OursDecode:
    """`batch` sequences of `context` tokens each, their blocks interleaved (no sequence is contiguous)."""

    def __init__(self, loaded: LoadedModel, batch: int, context: int, kv_dtype: torch.dtype) -> None:
        per_seq = -(-context // BLOCK_SIZE)
        self.model = loaded.model
        self.caches = allocate_kv_cache(loaded.config, batch * per_seq, BLOCK_SIZE, kv_dtype)
        for cache in self.caches:
            cache.normal_()
        tables = torch.tensor([[seq + batch * k for k in range(per_seq)] for seq in range(batch)])
        pos = context - 1
        slots = tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        self.batch = ForwardBatch(
            input_ids=torch.randint(1000, 40000, (batch,)),
            positions=torch.full((batch,), pos),
            slot_mapping=slots,
            query_lens=[1] * batch,
            seq_lens=[context] * batch,
            block_tables=tables,
            logits_indices=torch.arange(batch),
        )

    def __call__(self) -> torch.Tensor:
        return self.model(self.batch, self.caches)


class OursPrefill:
    def __init__(self, loaded: LoadedModel, length: int, kv_dtype: torch.dtype) -> None:
        blocks = -(-length // BLOCK_SIZE)
        self.model = loaded.model
        self.caches = allocate_kv_cache(loaded.config, blocks, BLOCK_SIZE, kv_dtype)
        self.batch = ForwardBatch(
            input_ids=torch.randint(1000, 40000, (length,)),
            positions=torch.arange(length),
            slot_mapping=torch.arange(length),
            query_lens=[length],
            seq_lens=[length],
            block_tables=torch.arange(blocks)[None, :],
            logits_indices=torch.tensor([length - 1]),
        )

    def __call__(self) -> torch.Tensor:
        return self.model(self.batch, self.caches)


def transformers_model(loaded: LoadedModel) -> torch.nn.Module:
    """transformers' Llama on exactly our dequantized weights (so both compute the same function)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = loaded.config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    state = {name: t for name, t in loaded.model.state_dict().items()}
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.original_inv_freq = loaded.model.model.inv_freq.clone()
    return model.eval()


class HFDecode:
    """One decode token per sequence after `context - 1` cached tokens; the cache is cropped back after each
    step so every step sees the same context, as ours does."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, batch: int, context: int,
                 dtype: torch.dtype) -> None:
        from transformers import DynamicCache

        self.model, self.context = model, context
        self.cache = DynamicCache(config=model.config)
        shape = (batch, config.num_key_value_heads, context - 1, config.head_dim)
        for layer in range(config.num_hidden_layers):
            self.cache.update(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), layer)
        self.input_ids = torch.randint(1000, 40000, (batch, 1))
        self.position_ids = torch.full((batch, 1), context - 1)
        # transformers 5.24 renamed `past_key_values` to `cache`; the project allows versions on both sides.
        parameters = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in parameters else "past_key_values"

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        out = self.model(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=True,
                         **{self.cache_arg: self.cache})
        self.cache.crop(-1)  # back to `context - 1` tokens
        return out.logits


class HFPrefill:
    def __init__(self, model: torch.nn.Module, length: int) -> None:
        self.model = model
        self.input_ids = torch.randint(1000, 40000, (1, length))

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        return self.model(input_ids=self.input_ids, use_cache=True, logits_to_keep=1).logits


def bench_dtype(dtype: str, args: argparse.Namespace) -> list[Row]:
    loaded = load_model(args.gguf, dtype=dtype, dense_weights=args.dense_weights)
    config = loaded.config
    kv_dtype = DTYPES[args.kv_dtype] if args.kv_dtype else loaded.dtype
    hf = transformers_model(loaded) if args.hf else None  # built from the HF-named weights, before freezing
    if args.freeze:
        loaded.freeze()
    rows = []
    for batch in args.batches:
        ours = OursDecode(loaded, batch, args.context, kv_dtype)
        fns: list[Callable[[], object]] = [ours]
        if hf is not None:
            fns.append(HFDecode(hf, config, batch, args.context, loaded.dtype))
        times = interleaved_ms(fns, args.repeats)
        flops = batch * (2.0 * linear_params(config) + attention_flops(config, args.context))
        read = weight_bytes(loaded, batch) + kv_bytes(config, batch * args.context, kv_dtype.itemsize)
        rows.append(Row("decode", dtype, batch, batch, times[0], times[1] if hf else None, flops, read))
        del ours, fns
    if args.prefill:
        fns = [OursPrefill(loaded, args.prefill, kv_dtype)]
        if hf is not None:
            fns.append(HFPrefill(hf, args.prefill))
        times = interleaved_ms(fns, max(3, args.repeats // 2), warmup=1)
        # The lm_head runs for the last token only; causal attention sees (L + 1) / 2 keys on average.
        lm_head = config.vocab_size * config.hidden_size
        flops = args.prefill * (2.0 * (linear_params(config) - lm_head)
                                + attention_flops(config, (args.prefill + 1) / 2)) + 2.0 * lm_head
        read = weight_bytes(loaded, args.prefill) + kv_bytes(config, args.prefill, kv_dtype.itemsize)
        rows.append(Row("prefill", dtype, 1, args.prefill, times[0], times[1] if hf else None, flops, read))
    return rows


def bench_kernels(args: argparse.Namespace) -> tuple[list[KernelRow], int]:
    """The rows, and the dispatch's int4 rows."""
    # The engine's dtype: bfloat16, or float32 where bfloat16 is emulated.
    loaded = load_model(args.gguf, quantization=args.quantization)
    if not loaded.int4:
        sys.exit("--int4: the default model has no low-bit form here (`quantized_linear.int4_serves`)")
    loaded.freeze()
    print(f"model in {loaded.dtype}, linear kernels: {describe_linear_kernels(loaded.model)}")
    dispatch = loaded.model.model.int4_gate.max_rows
    choices = [dispatch if n is None else n for n in KERNEL_CHOICES.values()]
    rows = []
    for batch in args.batches:
        step = OursDecode(loaded, batch, args.context, loaded.dtype)

        def with_kernels(max_rows: int, step: OursDecode = step) -> torch.Tensor:
            set_int4_max_rows(loaded.model, max_rows)
            return step()

        fns = [lambda n=n: with_kernels(n) for n in choices]
        times = interleaved_ms(fns, args.repeats)
        rows.append(KernelRow(batch, dict(zip(KERNEL_CHOICES, times, strict=True))))
    return rows, dispatch


def bench_decode_graph(args: argparse.Namespace) -> list[dict]:
    """Decode steps of `--batches` sequences (up to 8), eager against the compiled graphs (from
    the cache, else compiled here and kept there), alternating, at each `--contexts` length; and how far
    apart their logits are."""
    loaded = load_model(args.gguf)  # the engine's dtype: bfloat16, or float32 where bfloat16 is emulated
    loaded.freeze()
    if not graph_applies(EngineConfig(), loaded, 1):
        sys.exit("--decode-graph: it does not apply here (the model has no int4 forms)")
    graphs = decode_graphs(loaded)
    decoder, results = loaded.model.model, []
    for batch in args.batches:
        for context in args.contexts:
            step = OursDecode(loaded, batch, context, loaded.dtype)

            def run(with_graphs: bool, step: OursDecode = step) -> torch.Tensor:
                decoder.decode_graphs = graphs if with_graphs else []
                return step()

            eager, compiled = run(False), run(True)
            times = interleaved_ms([lambda: run(False), lambda: run(True)], args.repeats)
            results.append({"batch": batch, "context": context, "eager_ms": times[0], "compiled_ms": times[1],
                            "max_logit_diff": float((eager - compiled).abs().max()),
                            "bit_equal": bool(torch.equal(eager, compiled))})
    return results


def decode_graphs(loaded: LoadedModel) -> list[DecodeGraph]:
    """The engine's compiled decode steps of the frozen `loaded`, from gracelm's cache, compiled here and kept
    there when missing."""
    graphs = []
    layout = low_bit_layout(loaded.model)
    for rows in graph_batches(loaded.model):
        key = (content_hash(loaded.path), loaded.dtype, BLOCK_SIZE, rows, layout, "auto")
        path = graph_path(graph_key(*key))
        if not path.exists():
            started = time.perf_counter()
            compile_graph(loaded.model, BLOCK_SIZE, rows, path)
            print(f"compiled {path} in {time.perf_counter() - started:.0f} s")
        graphs.append(DecodeGraph.load(path, rows, BLOCK_SIZE, loaded.model.model))
    return graphs


def format_decode_graph_table(rows: list[dict]) -> str:
    lines = [f"{'batch':>6}{'context':>8}{'eager ms':>10}{'compiled ms':>13}{'compiled/eager':>16}"
             f"{'max |dlogit|':>14}{'bit-equal':>11}"]
    lines += [f"{r['batch']:>6}{r['context']:>8}{r['eager_ms']:>10.2f}{r['compiled_ms']:>13.2f}"
              f"{r['compiled_ms'] / r['eager_ms']:>16.2f}{r['max_logit_diff']:>14.4f}"
              f"{str(r['bit_equal']):>11}" for r in rows]
    return "\n".join(lines)


def format_kernel_table(rows: list[KernelRow], context: int, dispatch: int) -> str:
    names = list(KERNEL_CHOICES)
    head = f"{'decode':<20}" + "".join(f"{n + ' tok/s':>17}" for n in names) + "".join(
        f"{n + '/dense':>15}" for n in names[1:])
    lines = [head, "-" * len(head)]
    for r in rows:
        dense = r.ms[names[0]]
        lines.append(f"{f'b={r.batch} ctx={context}':<20}"
                     + "".join(f"{r.batch / r.ms[n] * 1e3:>17.1f}" for n in names)
                     + "".join(f"{dense / r.ms[n]:>15.2f}" for n in names[1:]))
    lines.append(f"dispatch: int4 for steps of <= {dispatch} rows; x/dense: speed relative to dense "
                 f"(above 1: faster); {torch.get_num_threads()} threads")
    return "\n".join(lines)


def format_table(rows: list[Row], limits: Limits, context: int, frozen: bool) -> str:
    head = (f"{'case':<22}{'dtype':<10}{'ours tok/s':>11}{'hf tok/s':>10}{'ours/hf':>9}{'ours ms':>9}"
            f"{'hf ms':>9}{'MFU':>7}{'BW util':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        label = f"decode b={r.batch} ctx={context}" if r.case == "decode" else f"prefill {r.tokens}"
        ours, hf = r.tokens_per_s(r.ours_ms), r.tokens_per_s(r.hf_ms)
        mfu = r.flops_per_step / (r.ours_ms * 1e-3) / (limits.matmul_gflops[r.dtype] * 1e9)
        bw = r.bytes_per_step / (limits.read_gbps * 1e9) / (r.ours_ms * 1e-3)
        hf_s = f"{hf:>10.1f}{ours / hf:>9.2f}" if hf else f"{'-':>10}{'-':>9}"
        hf_ms = f"{r.hf_ms:>9.1f}" if r.hf_ms else f"{'-':>9}"
        bw_s = f"{bw:>9.0%}" if r.case == "decode" else f"{'-':>9}"
        lines.append(f"{label:<22}{r.dtype:<10}{ours:>11.1f}{hf_s}{r.ours_ms:>9.1f}{hf_ms}{mfu:>7.0%}{bw_s}")
    peaks = ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in limits.matmul_gflops.items())
    lines.append(f"machine: matmul {peaks}; read bandwidth {limits.read_gbps:.1f} GB/s; "
                 f"{torch.get_num_threads()} threads; model {'frozen' if frozen else 'as loaded'}")
    lines.append("MFU = model FLOPs per step / step time / matmul peak of the dtype; BW util = (weights + KV "
                 "read per step) / bandwidth / step time")
    return "\n".join(lines)


# -- beside llama-bench ----------------------------------------------------------------------------------

def llama_bench(binary: Path, gguf: Path, threads: int, prefill: int) -> dict[str, float]:
    """llama-bench's tok/s on the model file `gguf`: {"decode": tg128, "prefill": pp<prefill>}."""
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prefill),
               "-n", str(LLAMA_BENCH_DECODE), "-o", "json"]
    tests = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return {"decode": next(t["avg_ts"] for t in tests if t["n_gen"] == LLAMA_BENCH_DECODE),
            "prefill": next(t["avg_ts"] for t in tests if t["n_prompt"] == prefill and t["n_gen"] == 0)}


def ours_beside_llama_bench(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, float]:
    """gracelm's tok/s for llama-bench's two tests: decode at batch 1, and one `args.prefill`-token prompt."""
    decode = OursDecode(loaded, 1, LLAMA_BENCH_DECODE_CONTEXT, loaded.dtype)
    prefill = OursPrefill(loaded, args.prefill, loaded.dtype)
    return {"decode": 1e3 / median_ms(decode, args.repeats),
            "prefill": args.prefill * 1e3 / median_ms(prefill, max(3, args.repeats // 2), warmup=1)}


def compare_with_llama_bench(args: argparse.Namespace) -> list[dict]:
    """Rounds of gracelm's figures (every dtype) and llama-bench's, the first side alternating; one row per
    dtype and test with each round's tok/s and ratio (gracelm / llama-bench), and the median ratio."""
    if not args.llama_bench.exists():
        raise SystemExit(f"no llama-bench at {args.llama_bench}; run `bench/serve.py setup-llama-cpp` first")
    models = {}
    for dtype in args.dtypes:  # as the engine runs it: int4 forms and compiled decode steps where they apply
        models[dtype] = load_model(args.gguf, dtype=dtype, dense_weights=args.dense_weights)
        models[dtype].freeze()
        if graph_applies(EngineConfig(), models[dtype], 1):
            models[dtype].model.model.decode_graphs = decode_graphs(models[dtype])
    ours: list[dict[str, dict[str, float]]] = []
    theirs: list[dict[str, float]] = []
    for round_ in range(args.llama_rounds):
        sides = [lambda: ours.append({d: ours_beside_llama_bench(m, args) for d, m in models.items()}),
                 lambda: theirs.append(llama_bench(args.llama_bench, args.gguf or Path(default_model_path()),
                                                       args.llama_threads, args.prefill))]
        for side in sides if round_ % 2 == 0 else reversed(sides):
            side()
    rows = []
    for dtype in args.dtypes:
        for test in ("decode", "prefill"):
            ratios = [o[dtype][test] / t[test] for o, t in zip(ours, theirs, strict=True)]
            rows.append({"dtype": dtype, "test": test, "ours_tokens_per_s": [o[dtype][test] for o in ours],
                         "llama_tokens_per_s": [t[test] for t in theirs], "ratios": ratios,
                         "median_ratio": statistics.median(ratios)})
    return rows


def format_llama_bench(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"gracelm beside llama-bench -t {args.llama_threads} -p {args.prefill} -n {LLAMA_BENCH_DECODE} "
             f"(tok/s per round; gracelm torch threads {torch.get_num_threads()}; decode at batch 1, context "
             f"{LLAMA_BENCH_DECODE_CONTEXT})",
             f"{'test':<16}{'dtype':<10}{'gracelm':>18}{'llama-bench':>18}{'gracelm/llama':>26}"]
    for r in rows:
        test = "decode b=1" if r["test"] == "decode" else f"prefill {args.prefill}"
        ours = " ".join(f"{x:.1f}" for x in r["ours_tokens_per_s"])
        theirs = " ".join(f"{x:.1f}" for x in r["llama_tokens_per_s"])
        ratios = f"{r['median_ratio']:.2f} (" + ", ".join(f"{x:.2f}" for x in r["ratios"]) + ")"
        lines.append(f"{test:<16}{r['dtype']:<10}{ours:>18}{theirs:>18}{ratios:>26}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="the model file (default: the default model)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--kv-dtype", choices=sorted(DTYPES), help="KV cache dtype (default: the model's)")
    p.add_argument("--batches", help="decode batch sizes, comma-separated (default: 1,16,64)")
    p.add_argument("--context", type=int, default=256, help="tokens of context of each decode sequence")
    p.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill case (0: none)")
    p.add_argument("--repeats", type=int, default=9, help="timed repetitions per case (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--unfrozen", dest="freeze", action="store_false",
                   help="run the model as loaded (default: after model.freeze(), as the engine runs it)")
    p.add_argument("--quick", action="store_true", help="bfloat16 only, 3 repetitions")
    p.add_argument("--int4", action="store_true",
                   help="compare decode with dense, int4 and the dispatch (default batches "
                        "1,2,4,8,16,32)")
    p.add_argument("--dense-weights", default="auto", choices=DENSE_WEIGHTS_CHOICES,
                   help="the model's dense copy, as gracelm serve's option (its default: auto)")
    p.add_argument("--quantization", default="auto", choices=["auto", "blocks", "int4"],
                   help="--int4's low-bit form (see gracelm serve --help)")
    p.add_argument("--decode-graph", action="store_true",
                   help="one sequence's decode step, eager vs the compiled graph, at --contexts")
    p.add_argument("--contexts", default="40,256,600,1000", help="with --decode-graph: contexts (<= 1024)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--llama-bench", nargs="?", type=Path, const=LLAMA_BENCH, default=None, metavar="BINARY",
                   help=f"the mode beside llama-bench (default binary: {LLAMA_BENCH})")
    p.add_argument("--llama-threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama-bench -t (default: the CPUs this process may run on)")
    p.add_argument("--llama-rounds", type=int, default=2, help="rounds of the --llama-bench mode")
    args = p.parse_args(argv)
    if args.quick:
        args.dtypes, args.repeats = "bfloat16", 3
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        p.error(f"unknown dtype {', '.join(unknown)}; choose among {', '.join(DTYPES)}")
    default_batches = "1,2,4,8,16,32" if args.int4 else "1,4,8" if args.decode_graph else "1,16,64"
    args.batches = int_list(args.batches or default_batches)
    args.contexts = int_list(args.contexts)
    if args.llama_bench is not None and (args.prefill < 1 or args.llama_rounds < 1):
        p.error("--llama-bench needs --prefill and --llama-rounds of at least 1")
    return args


def int_list(text: str) -> list[int]:
    """A comma-separated option's integers."""
    return [int(x) for x in text.split(",") if x]


def prepare_torch(threads: int | None) -> None:
    """The thread count (if given) and a fixed seed, before anything is measured."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prepare_torch(args.threads)
    if args.int4:
        kernel_rows, dispatch = bench_kernels(args)
        print(format_kernel_table(kernel_rows, args.context, dispatch))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"context": args.context, "threads": torch.get_num_threads(), "int4_max_rows":
                           dispatch, "rows": [asdict(r) for r in kernel_rows]}, f, indent=2)
        return
    if args.decode_graph:
        graph_rows = bench_decode_graph(args)
        print(format_decode_graph_table(graph_rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"decode_graph": graph_rows}, indent=2))
        return
    if args.llama_bench is not None:
        rows = compare_with_llama_bench(args)
        print(format_llama_bench(rows, args))
        if args.json:
            Path(args.json).write_text(json.dumps({"llama_bench": rows}, indent=2))
        return
    dtypes = sorted({"float32", "bfloat16", *args.dtypes})
    before = measure_limits(dtypes, max(5, args.repeats))
    rows = [row for dtype in args.dtypes for row in bench_dtype(dtype, args)]
    limits = best_limits(before, measure_limits(dtypes, max(5, args.repeats)))
    print(format_table(rows, limits, args.context, args.freeze))
    if args.json:
        result = {"limits": asdict(limits), "context": args.context, "threads": torch.get_num_threads(),
                  "frozen": args.freeze, "kv_dtype": args.kv_dtype,
                  "rows": [{**asdict(r), "ours_tokens_per_s": r.tokens_per_s(r.ours_ms),
                            "hf_tokens_per_s": r.tokens_per_s(r.hf_ms)} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
