"""A cold start's GGUF tokenizer build: `Tokenizer.from_gguf` on the default model (or --model), each run in a
fresh process, against transformers' build of the same file (`PreTrainedTokenizerFast(gguf_file=...)`, the
path `from_gguf` falls back on), alternating so that a drift of the host's load touches both alike. Each run
times the build alone (reading the file's metadata included, importing gracelm's modules not) and says
whether it imported transformers or torch. `--torch-first` imports torch before the timed build, as the engine
core has when it builds the tokenizer (transformers imports torch: without it, its build pays for that too).
Run by hand:

    .venv/bin/python bench/gguf_tokenizer.py --repeat 7 [--torch-first]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_RUN = """
import json, sys, time
if {torch_first!r}:
    import torch
from pathlib import Path
from gracelm.model import tokenizer
from gracelm.model.gguf_reader import read_gguf
from gracelm.model.model_files import default_model_path
path = Path({model!r} or default_model_path()).resolve()
start = time.perf_counter()
if {through_transformers!r}:
    read_gguf(path)  # as `from_gguf` reads it, for the end-of-turn ids
    tokenizer.Tokenizer._of_transformers(tokenizer._gguf_through_transformers(path), path.stem)
else:
    tokenizer.Tokenizer.from_gguf(path)
print(json.dumps({{"seconds": time.perf_counter() - start, "transformers": "transformers" in sys.modules,
                  "torch": "torch" in sys.modules}}))
"""


def run(model: str | None, through_transformers: bool, torch_first: bool) -> dict:
    code = _RUN.format(model=model, through_transformers=through_transformers, torch_first=torch_first)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF file (default: the default model's)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--torch-first", action="store_true", help="import torch before the timed build")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"tokenizers": [], "transformers": []}
    for _ in range(args.repeat):
        runs["transformers"].append(run(args.model, True, args.torch_first))
        runs["tokenizers"].append(run(args.model, False, args.torch_first))
    for name, results in runs.items():
        seconds = sorted(r["seconds"] for r in results)
        imported = {key: any(r[key] for r in results) for key in ("transformers", "torch")}
        print(f"{name:>12}: median {statistics.median(seconds):.3f} s, "
              f"range {seconds[0]:.3f}-{seconds[-1]:.3f} s over {len(seconds)} runs; "
              f"imported transformers: {imported['transformers']}, "
              f"torch: {imported['torch']}")


if __name__ == "__main__":
    main()
