"""A model from a single GGUF file: config from its metadata, dequantized weights under Hugging Face names,
its 4-bit blocks in the int4 kernel's form (`gguf_int4.py`), and its tokenizer, all but the config converted
once and then kept in the cache directory."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from gracelm.config import ModelConfig, UnsupportedModelError
from gracelm.model.block_linear import TILE
from gracelm.model.file_embedding import FileEmbedding
from gracelm.model.file_hash import content_hash
from gracelm.model.gguf_config import ROPE_FREQS, gguf_model_config
from gracelm.model.gguf_int4 import INT4_TYPES
from gracelm.model.gguf_reader import GGUFFile, GGUFTensorInfo, read_gguf
from gracelm.model.load_progress import load_progress
from gracelm.model.quantized_linear import LowBitForm
from gracelm.model.tokenizer import Tokenizer
from gracelm.model.tokenizer_cache import cached_tokenizer
from gracelm.model.weight_cache import cached_tensors
from gracelm.startup_timeline import mark

# The storage types whose dequantization `gguf.quants` implements and this loader is tested with.
SUPPORTED_TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                 "Q5_K", "Q6_K")
)

_EMBEDDING = "token_embd.weight"
_GLOBAL_TENSORS = {
    _EMBEDDING: "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The matrices stacked with others after them (q with k and v, k with v, gate with up).
_STACKED_BEFORE_OTHERS = ("attn_q", "attn_k", "ffn_gate")
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, weights (dequantized to `dtype`, Hugging Face names) and tokenizer of a GGUF model file."""
    model_file = open_gguf(path)
    tokenizer = model_file.tokenizer()
    return model_file.config, model_file.weights(dtype), tokenizer


def open_gguf(path: str | Path) -> GGUFModel:
    """The GGUF model file at `path`, its header read and checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}" + (" (a directory)" if path.is_dir() else ""))
    gguf = read_gguf(path)
    config = gguf_model_config(gguf)
    _check_tensor_types(gguf)
    names = {name: _hf_name(gguf, name) for name in gguf.tensors if name != ROPE_FREQS}
    mark("read")
    model_hash = content_hash(path)
    mark("verify")
    return GGUFModel(gguf, config, names, model_hash)


@dataclass
class GGUFModel:
    """A GGUF model file whose header is read: what it converts to is converted once per file (and dtype),
    then taken from the cache (`tokenizer_cache`, `weight_cache`), keyed by the file's content hash."""

    gguf: GGUFFile
    config: ModelConfig
    names: dict[str, str]  # GGUF tensor name -> Hugging Face name
    model_hash: str

    def tokenizer(self) -> Tokenizer:
        path, metadata = self.gguf.path, self.gguf.metadata
        return cached_tokenizer(self.model_hash, lambda: Tokenizer.from_gguf(path, metadata=metadata))

    def weights(self, dtype: torch.dtype, without: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Every tensor dequantized to `dtype`, under its Hugging Face name, but those named in `without`
        (the matrices served in their blocks alone: an entry of its own in the cache)."""
        names = {gguf_name: hf_name for gguf_name, hf_name in self.names.items() if hf_name not in without}
        expected = {hf_name: (self.gguf.tensors[gguf_name].shape, dtype)
                    for gguf_name, hf_name in names.items()}
        kind = dtype if not without else f"{str(dtype).removeprefix('torch.')}-beside-blocks"
        return cached_tensors(self.model_hash, kind, expected, lambda: _converted(self, dtype, names))

    def int4_matrices(self) -> dict[str, str]:
        """GGUF name -> Hugging Face name of the matrices stored in blocks the low-bit kernels take
        (`gguf_int4.INT4_TYPES`: 4-bit ones and Q8_0)."""
        return {gguf_name: hf_name for gguf_name, hf_name in self.names.items()
                if self.gguf.tensors[gguf_name].ggml_type in INT4_TYPES}

    def unstackable_blocks(self) -> str | None:
        """Why the blocks kernel cannot serve every `int4_matrices` entry (q, k and v are stacked, and gate
        and up: every part but the last must be whole tiles of outputs), or None."""
        for gguf_name in self.int4_matrices():
            rows = self.gguf.tensors[gguf_name].shape[0]
            if gguf_name.split(".")[-2] in _STACKED_BEFORE_OTHERS and rows % TILE:
                return f"{gguf_name} has {rows} rows, not whole tiles of {TILE}, which stacked matrices need"
        return None

    def embedding(self, dtype: torch.dtype) -> FileEmbedding:
        """The token embedding looked up in the file's own blocks (`file_embedding.py`)."""
        return FileEmbedding(self.gguf, self.gguf.tensors[_EMBEDDING], dtype)

    def low_bit_weights(self, form: type[LowBitForm]) -> dict[str, LowBitForm]:
        """The `int4_matrices` in `form` (`BlockLinear`, or `Int4Linear`: torch's int4 kernel), under their
        Hugging Face names, from the cache or packed there."""
        blocks = self.int4_matrices()
        infos = {hf_name: self.gguf.tensors[gguf_name] for gguf_name, hf_name in blocks.items()}
        shapes = {hf_name: (info.shape[0], info.shape[1]) for hf_name, info in infos.items()}
        parts = {hf_name: form.stored_form_of(shapes[hf_name], info.ggml_type)
                 for hf_name, info in infos.items()}
        expected = {f"{hf_name}.{part}": stored
                    for hf_name, stored_parts in parts.items() for part, stored in stored_parts.items()}
        tensors = cached_tensors(self.model_hash, form.layout(), expected,
                                 lambda: _converted_forms(self, blocks, form))
        return {hf_name: form.from_tensors({part: tensors[f"{hf_name}.{part}"] for part in parts[hf_name]},
                                           shapes[hf_name], info.ggml_type)
                for hf_name, info in infos.items()}


def _converted(model: GGUFModel, dtype: torch.dtype, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors `names` names (GGUF name -> HF name) dequantized, llama.cpp's rotary layout undone, cast to
    `dtype`, under their HF names."""
    gguf = model.gguf
    rotary_heads = _rotary_permuted_heads(gguf, model.config)
    weights = {}
    for gguf_name, hf_name in load_progress(names.items(), len(names), "converting weights"):
        weight = _dequantized(gguf, gguf.tensors[gguf_name])
        weights[hf_name] = _in_hf_row_order(gguf_name, weight, rotary_heads).to(dtype)
    return weights


def _converted_forms(model: GGUFModel, blocks: dict[str, str], form: type[LowBitForm]
                     ) -> dict[str, torch.Tensor]:
    """The matrices `blocks` names (GGUF name -> HF name) in `form`, llama.cpp's rotary layout undone (a
    permutation of whole rows, blocks and all), as the cache keeps them."""
    gguf = model.gguf
    rotary_heads = _rotary_permuted_heads(gguf, model.config)
    tensors = {}
    for gguf_name, hf_name in load_progress(blocks.items(), len(blocks), "packing 4/8-bit weights"):
        info = gguf.tensors[gguf_name]
        raw = _in_hf_row_order(gguf_name, torch.from_numpy(gguf.raw_tensor(info)), rotary_heads).numpy()
        for name, tensor in form.from_file(raw, info.ggml_type).tensors().items():
            tensors[f"{hf_name}.{name}"] = tensor
    return tensors


def _check_tensor_types(gguf: GGUFFile) -> None:
    for info in gguf.tensors.values():
        if info.ggml_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
            raise UnsupportedModelError(
                f"{gguf.path}: tensor {info.name} is stored as {info.ggml_type.name}, "
                f"which this loader cannot dequantize; supported: {supported}"
            )


def _hf_name(gguf: GGUFFile, name: str) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_TENSOR_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        raise UnsupportedModelError(f"{gguf.path}: unexpected tensor {name} for a Llama-family model")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def _dequantized(gguf: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    return torch.from_numpy(dequantize(gguf.raw_tensor(info), info.ggml_type))


def _rotary_permuted_heads(gguf: GGUFFile, config: ModelConfig) -> dict[str, int]:
    """Which projections llama.cpp reordered for its rotary layout, with their head counts.

    For its "llama" architecture llama.cpp interleaves the two rotary halves of each q and k head (it
    rotates adjacent pairs; HF weights rotate the first half against the second). Qwen models keep HF's
    layout (llama.cpp's NEOX rope), so nothing is undone for them.
    """
    if gguf.metadata.get("general.architecture") != "llama":
        return {}
    return {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}


def _in_hf_row_order(gguf_name: str, rows: torch.Tensor, rotary_heads: dict[str, int]) -> torch.Tensor:
    """The rows of the GGUF tensor `gguf_name` (its values, or its stored blocks) in Hugging Face's order:
    llama.cpp's rotary permutation undone where it applied one (`_rotary_permuted_heads`)."""
    part = gguf_name.split(".")[-2]
    return _unpermute_rotary(rows, rotary_heads[part]) if part in rotary_heads else rows


def _unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permutation: per head, rows (pair i, half j) go back to (half j, pair i). Rows
    of any tensor of the weight's rows (its stored blocks, say) move the same way."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return weight.index_select(0, order)
