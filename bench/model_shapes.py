"""Random-weight GGUF files of published model shapes, with the default model's tokenizer (run by hand).

Speed and memory depend on a model's shape and storage types, not on its weights' values, so a file of
random blocks in a real model's shape measures serving at that size (`bench/serve.py compare --gguf FILE`)
without downloading it; its text is noise.

    .venv/bin/python bench/model_shapes.py --shape llama-3.2-1b --out /tmp/llama-3.2-1b.gguf
    .venv/bin/python bench/model_shapes.py --shape llama-3.1-8b --type q8_0 --out /tmp/llama-8b.gguf
    .venv/bin/python bench/model_shapes.py --shape qwen3-4b --layers 2 --out /tmp/qwen3-widths.gguf

What is kept of the real model, and what is not:

- every width, head count, layer count, rope theta, rms epsilon and tie of `SHAPES` as the model's
  config.json states it; Llama 3's rope scaling as llama.cpp stores it (`rope_freqs.weight`); Qwen3 as
  the qwen3 architecture, with its per-head q and k norms (gracelm and llama.cpp both run it);
- the published vocabulary's size: the embedding and output matrices have its rows, as they cost memory
  and time. The tokenizer is the default model's (49,152 tokens, its merges, special tokens and chat
  template), its token list padded to that size with tokens `[PAD<id>]` marked UNUSED, as llama.cpp's
  converter pads a vocabulary shorter than its model's. No text encodes to them; the model may generate
  them (gracelm prints them, llama.cpp prints nothing for an unused token);
- storage types as the default model stores each role: layer matrices in `--type` (Q4_1 there), the token
  embedding in its type (Q8_0; Q8_0 too for one this writer lacks), and an untied `output.weight` (the
  default model has none) in the embedding's type; norms float32 ones.

The blocks are random bytes with one float16 scale (and Q4_1's minimum) sized so that the weights
dequantize to mean ~0 and std `WEIGHT_STD`, an initialised model's: activations stay finite through the
layers. They are written a chunk at a time, never quantized from floats nor held whole, so the largest
file (an 8B) takes about as long as the disk takes to write it.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from gracelm.model.gguf_config import llama3_slowdowns
from gracelm.model.model_files import default_model_path


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF general.architecture
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    rms_eps: float
    tied: bool  # tie_word_embeddings: no output.weight
    context: int  # max_position_embeddings
    llama3_rope_factor: float | None = None  # Llama 3 rope scaling: low 1, high 4, over 8,192 positions
    pooling: gguf.PoolingType | None = None  # an embedding model's pooling (`<arch>.pooling_type`)
    experts: int = 0  # a mixture of experts: experts per layer (0: a dense feed-forward)
    experts_used: int = 0  # experts each token is routed to


SHAPES: dict[str, Shape] = {
    # meta-llama/Llama-3.2-1B config.json
    "llama-3.2-1b": Shape(arch="llama", layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8,
                          head_dim=64, vocab=128_256, rope_theta=500_000.0, rms_eps=1e-5, tied=True,
                          context=131_072, llama3_rope_factor=32.0),
    # HuggingFaceTB/SmolLM2-1.7B config.json
    "smollm2-1.7b": Shape(arch="llama", layers=24, hidden=2048, intermediate=8192, heads=32, kv_heads=32,
                          head_dim=64, vocab=49_152, rope_theta=130_000.0, rms_eps=1e-5, tied=True,
                          context=8192),
    # Qwen/Qwen3-4B config.json
    "qwen3-4b": Shape(arch="qwen3", layers=36, hidden=2560, intermediate=9728, heads=32, kv_heads=8,
                      head_dim=128, vocab=151_936, rope_theta=1_000_000.0, rms_eps=1e-6, tied=True,
                      context=40_960),
    # Qwen/Qwen3-Embedding-0.6B config.json and its sentence-transformers pooling (last token)
    "qwen3-embedding-0.6b": Shape(arch="qwen3", layers=28, hidden=1024, intermediate=3072, heads=16,
                                  kv_heads=8, head_dim=128, vocab=151_669, rope_theta=1_000_000.0,
                                  rms_eps=1e-6, tied=True, context=32_768, pooling=gguf.PoolingType.LAST),
    # Qwen/Qwen3-30B-A3B config.json: `intermediate` is its moe_intermediate_size, each expert's width
    "qwen3-30b-a3b": Shape(arch="qwen3moe", layers=48, hidden=2048, intermediate=768, heads=32, kv_heads=4,
                           head_dim=128, vocab=151_936, rope_theta=1_000_000.0, rms_eps=1e-6, tied=False,
                           context=40_960, experts=128, experts_used=8),
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": Shape(arch="llama", layers=32, hidden=4096, intermediate=14_336, heads=32, kv_heads=8,
                          head_dim=128, vocab=128_256, rope_theta=500_000.0, rms_eps=1e-5, tied=False,
                          context=131_072, llama3_rope_factor=8.0),
}
TYPES = {"q4_1": Q.Q4_1, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
FILE_TYPES = {Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
              Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0}
# The bytes before each block's quants: a float16 scale, and for Q4_1 a float16 minimum.
HEADER_BYTES = {Q.Q4_1: 4, Q.Q8_0: 2, Q.Q4_0: 2}
WEIGHT_STD = 0.02  # transformers' initializer_range: what an initialised model's matrices spread by
CHUNK_BYTES = 64 << 20  # random bytes made and written at a time


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, inputs) for a matrix
    ggml_type: Q
    values: np.ndarray | None = None  # a float32 vector's values; None: random blocks

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) // block * size

    @property
    def row_bytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return self.shape[-1] // block * size


@dataclass(frozen=True)
class Made:
    path: Path
    size: int
    parameters: int
    seconds: float


def tensor_specs(shape: Shape, layer_type: Q, embed_type: Q) -> list[TensorSpec]:
    """The file's tensors, llama.cpp's names and order."""
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    specs = [TensorSpec("token_embd.weight", (shape.vocab, shape.hidden), embed_type)]
    for i in range(shape.layers):
        specs += [_ones(f"blk.{i}.attn_norm.weight", shape.hidden),
                  TensorSpec(f"blk.{i}.attn_q.weight", (q_rows, shape.hidden), layer_type),
                  TensorSpec(f"blk.{i}.attn_k.weight", (kv_rows, shape.hidden), layer_type),
                  TensorSpec(f"blk.{i}.attn_v.weight", (kv_rows, shape.hidden), layer_type),
                  TensorSpec(f"blk.{i}.attn_output.weight", (shape.hidden, q_rows), layer_type)]
        if shape.arch in ("qwen3", "qwen3moe"):
            specs += [_ones(f"blk.{i}.attn_q_norm.weight", shape.head_dim),
                      _ones(f"blk.{i}.attn_k_norm.weight", shape.head_dim)]
        specs += [_ones(f"blk.{i}.ffn_norm.weight", shape.hidden), *_feed_forward(shape, i, layer_type)]
    specs.append(_ones("output_norm.weight", shape.hidden))
    if not shape.tied:
        specs.append(TensorSpec("output.weight", (shape.vocab, shape.hidden), embed_type))
    if shape.llama3_rope_factor is not None:
        specs.append(_rope_freqs(shape))
    return specs


def _feed_forward(shape: Shape, layer: int, layer_type: Q) -> list[TensorSpec]:
    """A layer's feed-forward matrices: gate, up and down; for a mixture of experts, each stacked over the
    experts (`ffn_*_exps`, [experts, rows, inputs]) beside the router, which llama.cpp keeps in float32."""
    rows, hidden, prefix = shape.intermediate, shape.hidden, f"blk.{layer}"
    if not shape.experts:
        return [TensorSpec(f"{prefix}.ffn_gate.weight", (rows, hidden), layer_type),
                TensorSpec(f"{prefix}.ffn_up.weight", (rows, hidden), layer_type),
                TensorSpec(f"{prefix}.ffn_down.weight", (hidden, rows), layer_type)]
    experts = shape.experts
    router = np.random.default_rng(layer).normal(0, WEIGHT_STD, (experts, hidden)).astype(np.float32)
    return [TensorSpec(f"{prefix}.ffn_gate_inp.weight", (experts, hidden), Q.F32, router),
            TensorSpec(f"{prefix}.ffn_gate_exps.weight", (experts, rows, hidden), layer_type),
            TensorSpec(f"{prefix}.ffn_up_exps.weight", (experts, rows, hidden), layer_type),
            TensorSpec(f"{prefix}.ffn_down_exps.weight", (experts, hidden, rows), layer_type)]


def _ones(name: str, size: int) -> TensorSpec:
    return TensorSpec(name, (size,), Q.F32, np.ones(size, dtype=np.float32))


def _rope_freqs(shape: Shape) -> TensorSpec:
    """Llama 3's rope scaling as llama.cpp stores it, each frequency's slowdown; gracelm's reader recovers
    the scaling from this same table (`gguf_config.llama3_slowdowns`), llama.cpp applies it as is."""
    scaling = {"factor": shape.llama3_rope_factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    table = llama3_slowdowns(shape.rope_theta, shape.head_dim, scaling).astype(np.float32)
    return TensorSpec("rope_freqs.weight", table.shape, Q.F32, table)


@functools.cache
def block_header(ggml_type: Q) -> np.ndarray:
    """The bytes each block starts with, so that random quants dequantize to mean ~0 and std `WEIGHT_STD`.

    A block's values are linear in its scale, so one sample at scale 1 and minimum 0, dequantized by
    gguf-py, sizes the scale (and Q4_1's minimum, which centres them) whatever the type's layout.
    """
    _, size = gguf.GGML_QUANT_SIZES[ggml_type]
    fields = HEADER_BYTES[ggml_type] // 2  # float16 fields: the scale, then Q4_1's minimum
    sample = np.random.default_rng(0).integers(0, 256, (4096, size), dtype=np.uint8)
    sample[:, : 2 * fields] = np.array([1.0, 0.0][:fields], dtype=np.float16).view(np.uint8)
    values = gguf.quants.dequantize(sample, ggml_type)
    scale = WEIGHT_STD / float(values.std())
    return np.array([scale, -float(values.mean()) * scale][:fields], dtype=np.float16).view(np.uint8)


def write_random_blocks(out: BinaryIO, spec: TensorSpec, rng: np.random.Generator) -> None:
    """`spec`'s blocks, random quants under `block_header`, made and written `CHUNK_BYTES` at a time."""
    _, size = gguf.GGML_QUANT_SIZES[spec.ggml_type]
    header = block_header(spec.ggml_type)
    blocks_left = spec.nbytes // size
    while blocks_left:
        count = min(blocks_left, CHUNK_BYTES // size)
        # The bit generator's raw words: faster than `rng.bytes` or `rng.integers`, and as seeded.
        words = rng.bit_generator.random_raw(-(-count * size // 8))
        chunk = words.view(np.uint8)[: count * size].reshape(count, size)
        chunk[:, : len(header)] = header
        chunk.tofile(out)
        blocks_left -= count


@functools.cache
def default_model() -> gguf.GGUFReader:
    """The default model's file, read once: gguf-py's reader takes seconds over its 49k-token vocabulary,
    but keeps each key's exact value type, which llama.cpp checks."""
    return gguf.GGUFReader(str(default_model_path()))


def embedding_type(default: gguf.GGUFReader) -> Q:
    """The default model's token embedding type, if this writer makes it; Q8_0 otherwise."""
    info = next(t for t in default.tensors if t.name == "token_embd.weight")
    return info.tensor_type if info.tensor_type in HEADER_BYTES else Q.Q8_0


def add_shape_metadata(writer: gguf.GGUFWriter, shape: Shape, name: str, layer_type: Q) -> None:
    writer.add_name(f"random {name}")
    writer.add_file_type(FILE_TYPES[layer_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    # Qwen3's heads are not hidden / heads wide (32 x 128 = 4,096 for a width of 2,560): stated always.
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    if shape.pooling is not None:
        writer.add_pooling_type(shape.pooling)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.intermediate)


def add_tokenizer(writer: gguf.GGUFWriter, default: gguf.GGUFReader, vocab: int) -> None:
    """Every `tokenizer.*` key of the default model (its chat template too), the token list and types
    padded to `vocab` with UNUSED tokens."""
    tokens = len(default.fields[gguf.Keys.Tokenizer.LIST].data)
    if vocab < tokens:
        raise ValueError(f"a vocabulary of {vocab} is smaller than the default model's {tokens} tokens")
    for key, field in default.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == gguf.Keys.Tokenizer.LIST:
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab)]
        elif key == gguf.Keys.Tokenizer.TOKEN_TYPE:
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if array else None)


def make_gguf(shape: Shape, out: str | Path, layer_type: Q = Q.Q4_1, seed: int = 0,
              name: str = "model") -> Made:
    """Writes a random-weight GGUF file of `shape` to `out`, with the default model's tokenizer."""
    start = time.perf_counter()
    out = Path(out)
    default = default_model()
    specs = tensor_specs(shape, layer_type, embedding_type(default))
    writer = gguf.GGUFWriter(str(out), shape.arch)
    add_shape_metadata(writer, shape, name, layer_type)
    add_tokenizer(writer, default, shape.vocab)
    for spec in specs:
        element = np.float32 if spec.values is not None else np.uint8
        byte_shape = spec.shape if spec.values is not None else (*spec.shape[:-1], spec.row_bytes)
        raw_type = None if spec.values is not None else spec.ggml_type
        writer.add_tensor_info(spec.name, byte_shape, np.dtype(element), spec.nbytes, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    _write_tensor_data(writer, specs, np.random.default_rng(seed))
    writer.close()
    # rope_freqs is a table of the rope scaling, not a parameter of the published count.
    parameters = sum(int(np.prod(spec.shape)) for spec in specs if spec.name != "rope_freqs.weight")
    return Made(out, out.stat().st_size, parameters, time.perf_counter() - start)


def _write_tensor_data(writer: gguf.GGUFWriter, specs: list[TensorSpec], rng: np.random.Generator) -> None:
    """The tensors' bytes, each aligned as the tensor infos' offsets say (what `write_tensor_data` does
    for a whole array, here for one written in chunks)."""
    assert writer.fout is not None
    out = writer.fout[0]
    writer.write_padding(out, out.tell())
    for spec in specs:
        if spec.values is not None:
            spec.values.tofile(out)
        else:
            write_random_blocks(out, spec, rng)
        writer.write_padding(out, spec.nbytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers of the same widths")
    parser.add_argument("--out", required=True, help="the GGUF file to write")
    parser.add_argument("--type", choices=sorted(TYPES), default="q4_1",
                        help="the layer matrices' type (default q4_1, the default model's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.layers is not None:
        shape = replace(shape, layers=args.layers)
    made = make_gguf(shape, args.out, TYPES[args.type], args.seed, args.shape)
    print(f"{made.path}: {made.size / 1e9:.2f} GB, {made.parameters / 1e9:.3f} B parameters "
          f"({args.type}, layers: {shape.layers}), written in {made.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
