"""Prefix-cache persistence (`--kv-cache-dir`): TTFT of a request with a long shared prefix (~1,500 tokens)
cold (nothing cached), warm (the prefix cached in memory) and first after a restart (the prefix restored
from the snapshot), the ratio restored / warm, and what the save adds to a graceful stop (its entry in the
shutdown report) with the snapshot's size. Offline `Engine` on the default model unless --model; each
request has a suffix of its own, so every measure computes that suffix and only the prefix differs. TTFT is
the time of a `generate` of one token: the prefill and the first sample, plus the offline frontend's small
overhead. Run by hand: `python bench/prefix_restore.py [--repeat 3] [--model PATH]`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gracelm import Engine, SamplingParams  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/lifecycle.py
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
PREFIX_TOKENS = 1500
SUFFIX_TOKENS = 16


def ttft(llm: Engine, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([prompt], FIRST_TOKEN, use_tqdm=False)
    return time.perf_counter() - started


def run_once(model: str | None, kv_dir: str, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    with Engine(model, kv_cache_dir=kv_dir) as llm:
        vocab = llm.tokenizer.vocab_size
        prefix = [rng.randrange(100, vocab) for _ in range(PREFIX_TOKENS)]

        def prompt() -> list[int]:
            return [*prefix, *(rng.randrange(100, vocab) for _ in range(SUFFIX_TOKENS))]

        figures = {"cold_ttft_s": ttft(llm, prompt()), "warm_ttft_s": ttft(llm, prompt())}
    report = llm.shutdown()
    [save] = [r for r in report.resources if r.kind.value == "kv snapshot"]
    figures["save_ms"] = save.ms
    figures["snapshot_mb"] = sum(p.stat().st_size for p in Path(kv_dir).glob("kv-*.snap")) / 1e6
    started = time.perf_counter()
    with Engine(model, kv_cache_dir=kv_dir) as llm:
        figures["restart_to_ready_s"] = time.perf_counter() - started
        figures["restored_ttft_s"] = ttft(llm, prompt())
        stats = llm.stats()
        assert stats["kv_restored_block_hits"] >= PREFIX_TOKENS // 16 - 1, stats
    figures["restored_over_warm"] = figures["restored_ttft_s"] / figures["warm_ttft_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    runs = []
    for seed in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="gracelm-bench-kv-") as kv_dir:
            runs.append(run_once(args.model, kv_dir, seed))
    for key in runs[0]:
        values = [run[key] for run in runs]
        print(f"{key:24s} median {statistics.median(values):9.3f}  (runs: "
              f"{', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
