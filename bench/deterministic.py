"""Deterministic mode's cost: output tokens/s of `Engine(deterministic=True)` over the default engine's,
on the same prompts, in the same run.

    .venv/bin/python bench/deterministic.py                          # batches 1, 8, 32; 5 repetitions
    .venv/bin/python bench/deterministic.py --batches 1,8,32 --repeats 3 --output-len 64

Decode-dominated: `--prompt-len`-token prompts of random ids, greedy, EOS ignored, `--output-len` tokens
each; a batch of B is one `generate` of the first B prompts; no prefix cache. Each repetition starts both
engines afresh, in alternating order (an engine core each; the idle one sleeps), and runs every batch size
on both, in alternating order, so that neither engine keeps an advantage of its own and a busy spell of a
shared machine slows both alike; a batch size's figure is the median over repetitions of that
repetition's ratio (`--control` runs two default engines: the spread of its ratios is the measurement's
own). Two ratios: of output tokens per second of wall-clock time, and per second of the engine core's CPU
time (user + system, all its threads), which a loaded machine disturbs far less: waiting for a core costs
wall time, not CPU time. `--prefill-len N` adds a prefill case: one N-token prompt, one output token. Also
checked, not timed: the deterministic engine gives every prompt the same tokens at every batch size.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gracelm import Engine, SamplingParams  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/lifecycle.py
_TOKEN_RANGE = (1000, 40000)  # past the special tokens at the start of SmolLM2's vocabulary


def timed(llm: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, float, list[list[int]]]:
    """Output tokens per wall-clock second and per CPU second of the engine core, for one `generate` of
    `prompts`, and their tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core = psutil.Process(llm._client.process.pid)
    cpu_before, started = sum(core.cpu_times()[:2]), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - started, sum(core.cpu_times()[:2]) - cpu_before
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    produced = sum(map(len, tokens))
    return produced / elapsed, produced / cpu, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=0, help="also time one prompt of this many tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None, help="of each engine (default: all CPUs)")
    parser.add_argument("--control", action="store_true",
                        help="an A/A run: the second engine in the default mode too, so that its ratios show "
                             "the measurement's own spread")
    args = parser.parse_args()

    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(*_TOKEN_RANGE) for _ in range(args.prompt_len)] for _ in range(max(batches))]
    cases = [(f"decode, batch {b}", prompts[:b], args.output_len) for b in batches]
    if args.prefill_len:
        long_prompt = [rng.randrange(*_TOKEN_RANGE) for _ in range(args.prefill_len)]
        cases.append((f"prefill, {args.prefill_len} tokens", [long_prompt], 1))
    # No prefix cache: every repetition computes its prompts again.
    options = {"dtype": args.dtype, "num_threads": args.num_threads, "max_num_seqs": max(batches),
               "enable_prefix_caching": False}
    modes = {"default": False, "deterministic": not args.control}
    rates: dict[tuple[str, str], list[tuple[float, float]]] = {  # (wall-clock, CPU) tok/s, per repetition
        (case, name): [] for case, _, _ in cases for name in modes}
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    for repeat in range(args.repeats):
        # Fresh engines each repetition, started in alternating order, so that neither keeps an advantage of
        # its own (where its memory landed, which cores its threads got).
        names = list(modes) if repeat % 2 == 0 else list(modes)[::-1]
        engines = {name: Engine(args.model, deterministic=modes[name], **options) for name in names}
        try:
            for index, (case, batch, output_len) in enumerate(cases):
                for name in names if index % 2 == 0 else names[::-1]:
                    wall, cpu, tokens[(case, name)] = timed(engines[name], batch, output_len)
                    rates[(case, name)].append((wall, cpu))
        finally:
            for engine in engines.values():
                engine.shutdown()
        print(f"repetition {repeat + 1}/{args.repeats} done", flush=True)
    for case, _, _ in cases:
        print(f"{case}:")
        for clock, index in (("wall-clock", 0), ("CPU", 1)):
            base = [r[index] for r in rates[(case, "default")]]
            det_rates = [r[index] for r in rates[(case, "deterministic")]]
            ratios = [d / b for d, b in zip(det_rates, base, strict=True)]
            print(f"  tok per {clock} s: default {statistics.median(base):.1f}, deterministic "
                  f"{statistics.median(det_rates):.1f}; ratio {statistics.median(ratios):.3f} "
                  f"(each repetition: {', '.join(f'{r:.2f}' for r in ratios)})")
    decodes = cases[:len(batches)]
    widest = tokens[(decodes[-1][0], "deterministic")]
    same = all(tokens[(case, "deterministic")] == widest[:len(batch)] for case, batch, _ in decodes)
    print(f"deterministic engine: every prompt's tokens the same at batch sizes {args.batches}: {same}")

if __name__ == "__main__":
    main()
