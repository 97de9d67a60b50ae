"""A model from a single GGUF file: config from its metadata, dequantized weights under Hugging Face names,
its 4-bit blocks in the int4 kernel's form (`gguf_int4.py`), and its tokenizer, all but the config converted
once and then kept in the cache directory."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from gracelm.config import ModelConfig, UnsupportedModelError
from gracelm.model.block_linear import TILE
from gracelm.model.expert_weights import gguf_expert_part, gguf_expert_stacks, split_gguf_experts
from gracelm.model.file_embedding import FileEmbedding
from gracelm.model.file_hash import content_hash
from gracelm.model.fused_weights import split_gguf
from gracelm.model.gemma_config import GGUF_ARCHITECTURES as GEMMA_GGUF_ARCHITECTURES
from gracelm.model.gguf_config import NOT_WEIGHTS, gguf_model_config
from gracelm.model.gguf_int4 import INT4_TYPES
from gracelm.model.gguf_reader import GGUFFile, GGUFTensorInfo, read_gguf
from gracelm.model.load_progress import load_progress
from gracelm.model.model_files import ModelLoadError
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
    # Mixtures of experts (`model/moe.py`): the router, Qwen2-MoE's shared expert and its gate; the experts'
    # own entries are split from their stacks (`expert_weights.py`).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The matrices the model stacks by rows (`llama.FrozenLinear`), in order, beside each expert's gate and up
# (`_stacks`); all but the last of each are stacked with others after them, so their rows must be whole tiles.
_STACKS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_shexp", "ffn_up_shexp"))
# Gemma's norms (`gemma.py`): `ffn_norm` is the one before the MLP, two more follow the attention and the MLP.
# llama.cpp's converter stores each norm's 1 + weight, which the model adds itself.
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                        "post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, weights (dequantized to `dtype`, Hugging Face names) and tokenizer of a GGUF model file."""
    model_file = open_gguf(path)
    tokenizer = model_file.tokenizer()
    return model_file.config, model_file.weights(dtype), tokenizer


def open_gguf(path: str | Path) -> GGUFModel:
    """The GGUF model file at `path`, its header read and checked: all but its string arrays (the
    vocabulary, the merges: most of the header's parsing), which only a tokenizer missing from the cache
    needs (`GGUFModel.tokenizer`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}" + (" (a directory)" if path.is_dir() else ""))
    gguf = read_gguf(path, string_arrays=False)
    config = gguf_model_config(gguf)
    _check_tensor_types(gguf)
    gguf = split_gguf_experts(split_gguf(gguf, config), config)
    names = {name: _hf_name(gguf, name) for name in gguf.tensors if name not in NOT_WEIGHTS}
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
        """From the cache, else built from the file's metadata, read whole then: a server's engine core builds
        it at its first use, long after the load, and a file changed since is refused (ModelLoadError)
        rather than giving another model's tokenizer."""
        return cached_tokenizer(self.model_hash, self._built_tokenizer)

    def _built_tokenizer(self) -> Tokenizer:
        path = self.gguf.path
        tokenizer = Tokenizer.from_gguf(path)
        if content_hash(path) != self.model_hash:
            raise ModelLoadError(f"{path} changed since its model was loaded: its tokenizer is not the "
                                 f"served model's; restart the server to serve the file as it is now")
        return tokenizer

    def weights(self, dtype: torch.dtype, without: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Every tensor dequantized to `dtype`, under its Hugging Face name, but those named in `without`
        (the matrices served in their blocks alone: an entry of its own in the cache)."""
        names = {gguf_name: hf_name for gguf_name, hf_name in self.names.items() if hf_name not in without}
        expected = {hf_name: (self.gguf.tensors[gguf_name].shape, dtype)
                    for gguf_name, hf_name in names.items()}
        kind = dtype if not without else f"{str(dtype).removeprefix('torch.')}-beside-blocks"
        return cached_tensors(self.model_hash, kind, expected, functools.partial(_convert, self, names))

    def int4_matrices(self) -> dict[str, str]:
        """GGUF name -> Hugging Face name of the matrices stored in blocks the low-bit kernels take
        (`gguf_int4.INT4_TYPES`: 4-bit ones and Q8_0)."""
        return {gguf_name: hf_name for gguf_name, hf_name in self.names.items()
                if self.gguf.tensors[gguf_name].ggml_type in INT4_TYPES}

    def unstackable_blocks(self) -> str | None:
        """Why the blocks kernel cannot serve every `int4_matrices` entry (q, k and v are stacked, and gate
        and up: every part but the last must be whole tiles of outputs), or None."""
        stacked_before_others = {kind for stack in _stacks(self.config) for kind in stack[:-1]}
        for gguf_name in self.int4_matrices():
            rows = self.gguf.tensors[gguf_name].shape[0]
            if gguf_name.split(".")[-2] in stacked_before_others and rows % TILE:
                return f"{gguf_name} has {rows} rows, not whole tiles of {TILE}, which stacked matrices need"
        return None

    def embedding(self, dtype: torch.dtype) -> FileEmbedding:
        """The token embedding looked up in the file's own blocks (`file_embedding.py`)."""
        return FileEmbedding(self.gguf, self.gguf.tensors[_EMBEDDING], dtype)

    def low_bit_weights(self, form: type[LowBitForm]) -> dict[str, LowBitForm]:
        """The `int4_matrices` in `form` (`BlockLinear`, or `Int4Linear`: torch's int4 kernel), under their
        Hugging Face names, from the cache or packed there. A form whose stacks are views
        (`stacks_as_views`) is kept with each layer's q/k/v and gate/up stacked, each matrix a view of its
        stack, so that the model's stacking copies nothing."""
        infos = {hf_name: self.gguf.tensors[gguf_name] for gguf_name, hf_name in self.int4_matrices().items()}
        entries = self._cache_entries(infos, form)
        shapes = {entry: (sum(infos[name].shape[0] for name in names), infos[names[0]].shape[1])
                  for entry, names in entries.items()}
        parts = {entry: form.stored_form_of(shapes[entry], infos[names[0]].ggml_type)
                 for entry, names in entries.items()}
        expected = {f"{entry}.{part}": stored
                    for entry, stored_parts in parts.items() for part, stored in stored_parts.items()}
        tensors = cached_tensors(self.model_hash, form.layout(), expected,
                                 functools.partial(_pack, self, entries, form))
        forms: dict[str, LowBitForm] = {}
        for entry, names in entries.items():
            whole = form.from_tensors({part: tensors[f"{entry}.{part}"] for part in parts[entry]},
                                      shapes[entry], infos[names[0]].ggml_type)
            split = whole.split_rows([infos[name].shape[0] for name in names]) if len(names) > 1 else [whole]
            forms.update(zip(names, split, strict=True))
        return forms

    def _cache_entries(self, infos: dict[str, GGUFTensorInfo], form: type[LowBitForm]
                       ) -> dict[str, list[str]]:
        """The cache's entries of low-bit matrices: entry name -> the Hugging Face names it holds, stacked by
        rows in that order (a layer's `_STACKS`, where the form stacks as views and their blocks are of one
        type and width), else one each."""
        entries = {name: [name] for name in infos}
        if not form.stacks_as_views or self.unstackable_blocks() is not None:
            return entries
        layer_parts = {}  # (layer, GGUF kind) -> Hugging Face name
        for gguf_name, hf_name in self.names.items():
            match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
            if match and hf_name in infos:
                layer_parts[match.group(1), match.group(2)] = hf_name
        for layer in sorted({layer for layer, _ in layer_parts}, key=int):
            for stack in _stacks(self.config):
                names = [layer_parts.get((layer, kind)) for kind in stack]
                if None in names or len({(infos[n].ggml_type, infos[n].shape[1]) for n in names}) > 1:
                    continue
                for name in names:
                    del entries[name]
                entries["+".join(names)] = names
        return entries


def _convert(model: GGUFModel, names: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    """Writes into `tensors` (by HF name) the tensors `names` names (GGUF name -> HF name) dequantized,
    llama.cpp's rotary layout undone, cast to the dtype of each."""
    gguf = model.gguf
    rotary_heads = _rotary_permuted_heads(gguf, model.config)
    gemma = _is_gemma(gguf)
    for gguf_name, hf_name in load_progress(names.items(), len(names), "converting weights"):
        weight = _dequantized(gguf, gguf.tensors[gguf_name])
        if gemma and hf_name.endswith("norm.weight"):
            weight = weight - 1.0  # stored as 1 + weight (see `_GEMMA_LAYER_TENSORS`); exact in float32
        tensors[hf_name].copy_(_in_hf_row_order(gguf_name, weight, rotary_heads))


def _pack(model: GGUFModel, entries: dict[str, list[str]], form: type[LowBitForm],
          tensors: dict[str, torch.Tensor]) -> None:
    """Writes into `tensors` the cache's `entries` (name -> Hugging Face names, stacked by rows) in `form`,
    llama.cpp's rotary layout undone (a permutation of whole rows, blocks and all), as the cache keeps them.
    The blocks are read from the file mapped, for the packer to take each byte once."""
    gguf_of = {hf_name: gguf_name for gguf_name, hf_name in model.names.items()}
    rotary_heads = _rotary_permuted_heads(model.gguf, model.config)
    parts_of: dict[str, dict[str, torch.Tensor]] = {}  # entry -> its tensors by their names in the form
    for name, tensor in tensors.items():
        entry, _, part = name.rpartition(".")
        parts_of.setdefault(entry, {})[part] = tensor
    with model.gguf.mapped_tensors() as stored:
        for entry, names in load_progress(entries.items(), len(entries), "packing 4/8-bit weights"):
            _pack_entry(model.gguf, stored, [gguf_of[name] for name in names], rotary_heads, form,
                        parts_of[entry])


def _pack_entry(gguf: GGUFFile, stored: Callable[[GGUFTensorInfo], np.ndarray], gguf_names: list[str],
                rotary_heads: dict[str, int], form: type[LowBitForm], tensors: dict[str, torch.Tensor]
                ) -> None:
    """One entry of `_pack`: the matrices `gguf_names` stacked. Its views of the file end with it, before the
    file is unmapped."""
    infos = [gguf.tensors[name] for name in gguf_names]
    with warnings.catch_warnings():  # read-only on purpose: nothing writes to the file's pages
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = [torch.from_numpy(stored(info)) for info in infos]
    parts = [_in_hf_row_order(name, rows, rotary_heads) for name, rows in zip(gguf_names, raw, strict=True)]
    form.pack_into(parts, infos[0].ggml_type, tensors)


def _stacks(config: ModelConfig) -> tuple[tuple[str, ...], ...]:
    return _STACKS + gguf_expert_stacks(config)


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
    parts = _GEMMA_LAYER_TENSORS if _is_gemma(gguf) else _LAYER_TENSORS
    part = None if m is None else parts.get(m.group(2)) or gguf_expert_part(m.group(2))
    if part is None:
        raise UnsupportedModelError(f"{gguf.path}: unexpected tensor {name} for a Llama-family model")
    return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"


def _is_gemma(gguf: GGUFFile) -> bool:
    return gguf.metadata.get("general.architecture") in GEMMA_GGUF_ARCHITECTURES


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
