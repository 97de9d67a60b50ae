"""Offline throughput: gracelm's `Engine` against transformers' batched `generate`, same prompts, same run.

    .venv/bin/python bench/throughput.py                       # the full run: 256 prompts, 128 tokens each
    .venv/bin/python bench/throughput.py --num-prompts 32 --hf-num-prompts 16 --output-len 32

Prompts are random token ids (32-512 tokens, fixed seed); generation is greedy with EOS ignored, so every
request produces exactly `--output-len` tokens. transformers runs padded static batches of
`--hf-batch-size` (left padding), the way a script without a serving engine would. The shared-prefix
variant puts the same `--prefix-len`-token system prompt before every prompt and runs gracelm with and
without prefix caching, reporting the cache's hit rate and the speed-up. On a small shared machine, shrink
the run; the figures are rates (output tokens per second), comparable across sizes only roughly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from pathlib import Path

import torch

from gracelm import Engine, SamplingParams
from gracelm.model.loader import DTYPES

# Ids sampled for prompts: past the special tokens at the start of SmolLM2's vocabulary.
_TOKEN_RANGE = (1000, 40000)


def make_prompts(count: int, min_len: int, max_len: int, seed: int, prefix: list[int] | None = None):
    rng = random.Random(seed)
    return [[*(prefix or []), *(rng.randrange(*_TOKEN_RANGE) for _ in range(rng.randint(min_len, max_len)))]
            for _ in range(count)]


def run_gracelm(llm: Engine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = llm.stats()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    after = llm.stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {"seconds": elapsed, "output_tokens": produced, "tokens_per_s": produced / elapsed,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "first_tokens": [o.outputs[0].token_ids[:8] for o in outputs]}


def load_hf_model(model: str | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from gracelm.model.model_files import default_model_path

    path = Path(model) if model else default_model_path()
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


@torch.inference_mode()
def run_transformers(hf_model, prompts: list[list[int]], output_len: int, batch_size: int,
                     pad_id: int) -> dict:
    produced, first_tokens = 0, []
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad_id)
        new = out[:, width:]
        produced += new.numel()
        first_tokens += new[:, :8].tolist()
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "output_tokens": produced, "tokens_per_s": produced / elapsed,
            "first_tokens": first_tokens}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of prompts whose first 8 greedy tokens are the same in both (bf16 rounding may differ)."""
    pairs = list(zip(a, b, strict=False))
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-num-prompts", type=int, default=None,
                        help="run transformers on the first N prompts only (default: all)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="threads of both engines (default: all CPUs; 1 may be faster on a busy machine)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="also run gracelm with this many ranks on the same prompts (its per-step "
                             "communication time is logged when it stops)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.tensor_parallel_size > 1:
        logging.basicConfig(level=logging.INFO, format="%(processName)s %(name)s: %(message)s")

    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, args.seed)
    shared = make_prompts(1, args.prefix_len, args.prefix_len, args.seed + 1)[0]
    prefixed = make_prompts(args.num_prompts, args.min_len, args.max_len, args.seed + 2, prefix=shared)
    engine_args = {"model": args.model, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "extra": {"torch_threads": args.torch_threads}}
    results: dict = {"args": vars(args) | {"json": str(args.json)}}

    with Engine(**engine_args) as llm:
        pad_id = llm.tokenizer.pad_token_id or llm.tokenizer.eos_token_ids[0]
        results["gracelm"] = run_gracelm(llm, prompts, args.output_len)
        report("gracelm", results["gracelm"])
        if not args.skip_prefix:
            results["gracelm_shared_prefix"] = run_gracelm(llm, prefixed, args.output_len)
            report("gracelm, shared prefix, prefix cache on", results["gracelm_shared_prefix"])
    if args.tensor_parallel_size > 1:
        with Engine(**engine_args, tensor_parallel_size=args.tensor_parallel_size) as llm:
            results["gracelm_tp"] = run_gracelm(llm, prompts, args.output_len)
            report(f"gracelm, tensor parallel {args.tensor_parallel_size}", results["gracelm_tp"])
        same = agreement(results["gracelm"]["first_tokens"], results["gracelm_tp"]["first_tokens"])
        print(f"TP={args.tensor_parallel_size} / TP=1: "
              f"{results['gracelm_tp']['tokens_per_s'] / results['gracelm']['tokens_per_s']:.2f}x; "
              f"first 8 greedy tokens identical for {same:.0%} of prompts")
    if not args.skip_prefix:
        with Engine(**engine_args, enable_prefix_caching=False) as llm:
            results["gracelm_shared_prefix_nocache"] = run_gracelm(llm, prefixed, args.output_len)
            report("gracelm, shared prefix, prefix cache off", results["gracelm_shared_prefix_nocache"])
        speedup = (results["gracelm_shared_prefix"]["tokens_per_s"]
                   / results["gracelm_shared_prefix_nocache"]["tokens_per_s"])
        print(f"prefix cache: hit rate {results['gracelm_shared_prefix']['prefix_cache_hit_rate']:.1%}, "
              f"speed-up {speedup:.2f}x")
    if not args.skip_transformers:
        hf_prompts = prompts[:args.hf_num_prompts or len(prompts)]
        torch.set_num_threads(args.torch_threads or len(os.sched_getaffinity(0)))
        hf_model = load_hf_model(args.model, DTYPES[args.dtype])
        results["transformers"] = run_transformers(hf_model, hf_prompts, args.output_len, args.hf_batch_size,
                                                   pad_id)
        report(f"transformers (static batches of {args.hf_batch_size})", results["transformers"])
        ratio = results["gracelm"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
        same = agreement(results["gracelm"]["first_tokens"], results["transformers"]["first_tokens"])
        print(f"gracelm / transformers: {ratio:.2f}x; "
              f"first 8 greedy tokens identical for {same:.0%} of prompts")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def report(name: str, result: dict) -> None:
    line = (f"{name}: {result['output_tokens']} output tokens in {result['seconds']:.1f} s = "
            f"{result['tokens_per_s']:.1f} tok/s")
    if result.get("prefix_cache_hit_rate"):
        line += f" (prefix-cache hit rate {result['prefix_cache_hit_rate']:.1%})"
    print(line, flush=True)


if __name__ == "__main__":
    main()
