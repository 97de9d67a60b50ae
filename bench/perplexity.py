"""Perplexity of a model through gracelm beside llama.cpp's `llama-perplexity` on the same file, the same text
and the same context size: does gracelm keep the model's quality (float32, bfloat16, and any weight path an
engine option selects)?

    .venv/bin/python bench/perplexity.py                          # float32 and bfloat16, -c 512, llama.cpp
    .venv/bin/python bench/perplexity.py --dtypes bfloat16 --chunks 8 --json ppl.json
    .venv/bin/python bench/perplexity.py --dtypes bfloat16 --device cuda --no-llama
    .venv/bin/python bench/perplexity.py --dtypes bfloat16 --int4-every-row   # the 4-bit path of small steps

The protocol is llama-perplexity's default (`tools/perplexity/perplexity.cpp`, `perplexity()`): the text,
less one trailing newline (as its `-f` reads a file), is tokenized with the vocabulary's own rule for special
tokens (a BOS first only where the GGUF says `add_bos_token`: SmolLM2 does not); the tokens are cut into
`T // c` non-overlapping chunks of `c` tokens (the tail is dropped); each chunk is evaluated from an empty
cache at positions 0 .. c-1 (its first token replaced by BOS where the vocabulary adds one), and only its
second half is scored: the logits at positions c/2 .. c-2 predict the tokens at c/2+1 .. c-1, c - c/2 - 1
per chunk. Perplexity = exp(mean negative log-likelihood); each log-softmax is taken in float64.

gracelm's side runs the model as the engine core does, through `parallel/worker.py:Worker`: loaded, frozen
and placed by the same code, so every engine option applies (`--dtypes` sets `--dtype` per run; `--device`,
`--num-threads`, `--quantization`). A chunk is a step of `c` rows, so its linears take the dense weights;
`--int4-every-row` scores through the 4-bit kernel that decode steps of few sequences use. Each chunk is
one forward pass over the paged KV cache (`Worker.forward`), with the scored positions as its logits
rows: the model's own numerics, with no scheduler, sampler or HTTP in between (the engine's prompt logprobs
come from the same logits, through `log_softmax` in float32).

llama.cpp's side: `llama-perplexity -m GGUF -f TEXT -c C -t T` (built by `bench/serve.py setup-llama-cpp`).
That the two tokenize alike is checked, not assumed: llama.cpp's token ids come from its `llama-server`'s
`/tokenize` (`add_special`, no parsing of special tokens: what `llama-perplexity` does) and are compared with
gracelm's, id by id. Different tokens would score different texts, so the script stops there.

The text (`bench/data/alice_chapters_1-7.txt`, `bench/data/README.md`) is public domain and ships with the
repository: 22,779 tokens of the default model, 44 chunks of 512.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
from serve import LLAMA_DIR, Server, free_port

from gracelm import options
from gracelm.config import DTYPE_CHOICES, EngineConfig
from gracelm.model.llama import describe_linear_kernels, set_int4_max_rows
from gracelm.model.model_files import resolve_model_path
from gracelm.model_step import StepBatch
from gracelm.parallel.worker import Worker

DEFAULT_TEXT = Path(__file__).parent / "data" / "alice_chapters_1-7.txt"
LLAMA_BIN = LLAMA_DIR / "build" / "bin"


@dataclass
class Perplexity:
    label: str
    ppl: float
    plus_minus: float  # llama-perplexity's uncertainty: ppl * standard error of the mean NLL
    scored_tokens: int
    chunks: int
    seconds: float


def read_text(path: Path) -> str:
    """The text as llama-perplexity's `-f` reads it: the file, less one trailing newline."""
    text = path.read_text()
    return text[:-1] if text.endswith("\n") else text


def perplexity_of(nll: list[float], label: str, chunks: int, seconds: float) -> Perplexity:
    mean = sum(nll) / len(nll)
    variance = sum(x * x for x in nll) / len(nll) - mean * mean
    ppl = math.exp(mean)
    return Perplexity(label, ppl, ppl * math.sqrt(max(variance, 0.0) / (len(nll) - 1)), len(nll), chunks,
                      seconds)


# -- gracelm ----------------------------------------------------------------------------------------------

def gracelm_tokens(worker: Worker, text: str) -> tuple[list[int], int | None]:
    """The text's tokens with the vocabulary's special tokens, and the BOS id where the vocabulary adds one
    (as llama.cpp's `llama_vocab_get_add_bos`)."""
    tokenizer = worker.loaded.tokenizer
    tokens = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokens[:1] == [bos] and tokenizer.encode(text, False)[:1] != [bos]
    return tokens, bos if adds_bos else None


def chunk_batch(tokens: list[int], bos: int | None, block_size: int, low_bit: bool = False) -> StepBatch:
    """One chunk as a forward pass from an empty cache (blocks 0, 1, ...: each chunk overwrites the last),
    asking for the logits of the scored positions. A prompt of its length; with `low_bit`, one of 0
    tokens, which the low-bit gate hands to the low-bit forms as it hands them short prompts."""
    ctx = len(tokens)
    input_ids = [bos, *tokens[1:]] if bos is not None else list(tokens)
    return StepBatch(input_ids=input_ids, positions=list(range(ctx)), slot_mapping=list(range(ctx)),
                     query_lens=[ctx], seq_lens=[ctx], block_tables=[list(range(-(-ctx // block_size)))],
                     logits_indices=list(range(ctx // 2, ctx - 1)), prompt_lens=[0 if low_bit else ctx])


def chunk_nll(logits: torch.Tensor, targets: list[int]) -> list[float]:
    """Negative log-likelihood of each target under its row of logits, the log-softmax in float64."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    index = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
    return (-logprobs.gather(1, index).squeeze(1)).cpu().tolist()


def gracelm_perplexity(config: EngineConfig, text: str, ctx: int, max_chunks: int | None,
                       int4_every_row: bool = False) -> tuple[Perplexity, list[int]]:
    worker = Worker(config)
    try:
        worker.load_model()
        if int4_every_row:  # a chunk has ctx rows: without this, the dense weights would score it
            set_int4_max_rows(worker.loaded.model, sys.maxsize)
        tokens, bos = gracelm_tokens(worker, text)
        if len(tokens) < 2 * ctx:  # llama-perplexity's own requirement
            raise SystemExit(f"the text has {len(tokens)} tokens: at least {2 * ctx} are needed for -c {ctx}")
        chunks = len(tokens) // ctx if max_chunks is None else min(max_chunks, len(tokens) // ctx)
        worker.init_kv_cache(-(-ctx // config.block_size))
        nll: list[float] = []
        started = time.perf_counter()
        for i in range(chunks):
            chunk = tokens[i * ctx:(i + 1) * ctx]
            logits = worker.forward(chunk_batch(chunk, bos, config.block_size, int4_every_row))
            nll += chunk_nll(logits, chunk[ctx // 2 + 1:])
        dtype = str(worker.loaded.dtype).removeprefix("torch.")
        label = f"gracelm {dtype} on {worker.device}{describe_options(config)}"
        if int4_every_row:
            label += f" ({describe_linear_kernels(worker.loaded.model)})"
        return perplexity_of(nll, label, chunks, time.perf_counter() - started), tokens
    finally:
        worker.free_kv_cache()
        worker.free_model()


def describe_options(config: EngineConfig) -> str:
    """The engine options given beyond the model, dtype and device, as they would be on a command line."""
    defaults = asdict(EngineConfig())
    shown = {name: value for name, value in asdict(config).items()
             if name not in ("model", "dtype", "device") and value != defaults[name]}
    return "".join(f", --{name.replace('_', '-')} {value}" for name, value in shown.items())


# -- llama.cpp --------------------------------------------------------------------------------------------

def llama_tokens(binary: Path, gguf: Path, text: str) -> list[int]:
    """llama.cpp's tokens of the text, as llama-perplexity makes them (`common_tokenize(ctx, text, true)`:
    special tokens added, none parsed), from `llama-server`'s `/tokenize`."""
    with tempfile.TemporaryDirectory(prefix="gracelm-ppl-") as logs:
        port = free_port()
        server = Server("llama-server", [str(binary), "-m", str(gguf), "-c", "512", "-np", "1", "--host",
                                         "127.0.0.1", "--port", str(port)], port, Path(logs) / "server.log",
                        "/health")
        try:
            server.wait_ready(120)
            reply = httpx.post(f"{server.base_url}/tokenize", timeout=120,
                               json={"content": text, "add_special": True, "parse_special": False})
            reply.raise_for_status()
            return reply.json()["tokens"]
        finally:
            server.stop()


def check_same_tokens(ours: list[int], theirs: list[int]) -> None:
    if ours == theirs:
        print(f"tokenization: identical ({len(ours)} tokens, gracelm and llama.cpp)")
        return
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                 min(len(ours), len(theirs)))
    raise SystemExit(f"tokenization differs: gracelm {len(ours)} tokens, llama.cpp {len(theirs)}; first "
                     f"difference at token {first}: {ours[first:first + 5]} vs {theirs[first:first + 5]}")


def llama_perplexity(binary: Path, gguf: Path, text_file: Path, ctx: int, threads: int,
                     max_chunks: int | None) -> Perplexity:
    command = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-t", str(threads)]
    if max_chunks is not None:
        command += ["--chunks", str(max_chunks)]
    print("$ " + " ".join(command), flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    output = result.stdout + result.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", output)
    if result.returncode != 0 or final is None or chunks is None:
        raise SystemExit(f"llama-perplexity failed ({result.returncode}):\n{output[-3000:]}")
    scored = int(chunks.group(1)) * (ctx - ctx // 2 - 1)
    return Perplexity(f"llama.cpp llama-perplexity -t {threads}", float(final.group(1)),
                      float(final.group(2)), scored, int(chunks.group(1)), seconds)


# -- main -------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text file scored")
    p.add_argument("-c", "--ctx", type=int, default=512, help="tokens per chunk, as llama-perplexity's -c")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help=f"comma-separated, one gracelm run each: {', '.join(DTYPE_CHOICES)}")
    p.add_argument("--llama-bin", type=Path, default=LLAMA_BIN,
                   help="folder of llama-perplexity and llama-server (default: setup-llama-cpp's)")
    p.add_argument("--llama-threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-llama", dest="llama", action="store_false", help="gracelm only")
    p.add_argument("--int4-every-row", action="store_true",
                   help="score through the int4 kernel at every row (what decode steps of few sequences "
                        "use), where the model has 4-bit weights, not the dense ones a whole chunk takes")
    p.add_argument("--json", type=Path, help="also write the results here")
    options.add_arguments(p.add_argument_group("gracelm engine options"), EngineConfig)
    args = p.parse_args(argv)
    if "dtype" in vars(args):
        p.error("--dtype: give --dtypes (one run each)")
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in args.dtypes if d not in DTYPE_CHOICES]
    if unknown:
        p.error(f"--dtypes: unknown {', '.join(unknown)}; choose among {', '.join(DTYPE_CHOICES)}")
    if args.ctx < 4 or args.ctx % 2 or (args.chunks is not None and args.chunks < 1):
        p.error("-c must be even and at least 4, --chunks at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = []
    for dtype in args.dtypes:
        try:
            configs.append(options.from_args(EngineConfig, args, dtype=dtype))
        except ValueError as e:
            raise SystemExit(f"perplexity.py: {e}") from e
    if configs[0].tensor_parallel_size > 1 or configs[0].nnodes > 1:
        raise SystemExit("perplexity.py runs one rank: --tensor-parallel-size and --nnodes must be 1")
    gguf = resolve_model_path(configs[0].model)
    text = read_text(args.text)
    print(f"{args.text.name}: {len(text)} characters; -c {args.ctx}; model {gguf}", flush=True)
    results = []
    tokens: list[int] = []
    for config in configs:
        result, tokens = gracelm_perplexity(config, text, args.ctx, args.chunks, args.int4_every_row)
        print(format_row(result), flush=True)
        results.append(result)
    if args.llama and gguf.suffix == ".gguf":
        check_same_tokens(tokens, llama_tokens(args.llama_bin / "llama-server", gguf, text))
        reference = llama_perplexity(args.llama_bin / "llama-perplexity", gguf, args.text, args.ctx,
                                     args.llama_threads, args.chunks)
        print(format_row(reference))
        for result in results:
            if result.scored_tokens != reference.scored_tokens:
                raise SystemExit(f"scored {result.scored_tokens} tokens, llama.cpp {reference.scored_tokens}")
            print(f"{result.label} / llama.cpp: {result.ppl / reference.ppl:.4f}")
        results.append(reference)
    elif args.llama:
        print(f"{gguf} is not a GGUF file: no llama.cpp run")
    if args.json:
        args.json.write_text(json.dumps({"text": str(args.text), "ctx": args.ctx,
                                         "results": [asdict(r) for r in results]}, indent=2))
    return 0


def format_row(r: Perplexity) -> str:
    return (f"{r.label}: PPL = {r.ppl:.4f} +/- {r.plus_minus:.5f} ({r.scored_tokens} tokens scored in "
            f"{r.chunks} chunks, {r.seconds:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
