"""Loads a model: a Hugging Face directory (config.json + safetensors) or a single GGUF file.

The module is built on the `meta` device and the checkpoint's tensors are assigned into it, so weights exist
once in memory (cast only when the requested dtype differs from the file's). On another device than the CPU
the built module is then moved there (`model/device.py` resolves which). A GGUF file's 4- and 8-bit
matrices are loaded in a low-bit kernel's form (`quantization`; CPU only): alone where the blocks kernel
serves every row (`dense_weights`), else beside a dense copy that serves long prompts (the default model's
dense bfloat16 weights take 270 MB beside 98 MB of blocks).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

import gracelm.cpu_features as cpu_features
from gracelm.config import QUANTIZATION_CHOICES, ModelConfig
from gracelm.memory_budget import available_memory, gib, require
from gracelm.model import prefaulted_memory
from gracelm.model.block_linear import BlockLinear
from gracelm.model.expert_weights import split_hf_experts
from gracelm.model.file_hash import content_hash
from gracelm.model.fused_weights import split_hf
from gracelm.model.gemma import causal_lm_class
from gracelm.model.gguf_tokenizer import builds_alone
from gracelm.model.llama import LlamaForCausalLM
from gracelm.model.load_progress import load_progress
from gracelm.model.model_files import ModelLoadError, read_hf_config, resolve_model_path
from gracelm.model.quantized_linear import LowBitForm, form_for, int4_serves
from gracelm.model.tokenizer import Tokenizer
from gracelm.model.tokenizer_cache import cached_tokenizer
from gracelm.startup_timeline import mark

if TYPE_CHECKING:  # imported when a GGUF file is loaded: gguf-py takes 0.1 s, of no use to a directory
    from gracelm.model.gguf_loader import GGUFModel
    from gracelm.model.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
INDEX_FILE = "model.safetensors.index.json"
# Beside the weights, what loading takes: torch's and the tokenizer's own allocations, the module's build.
_LOAD_MARGIN = 256 << 20
_EMBEDDING = "model.embed_tokens.weight"
# Checkpoint tensors the module recomputes or shares instead of loading.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    # The tokenizer, built or read from the cache once, at its first call: a GGUF file's only where a
    # request needs it (structured outputs), or a KV-cache snapshot's fingerprint (see `tokenizer_in_file`).
    tokenizer_of: Callable[[], Tokenizer]
    path: Path
    dtype: torch.dtype
    name: str
    device: torch.device
    # The 4-bit forms of some weights, by name, until `freeze` hands them to the model.
    int4: dict[str, LowBitForm] = field(default_factory=dict)
    # Whether `Tokenizer.from_gguf_without_transformers` builds the tokenizer from the model file: a
    # process without transformers builds it there itself, and the engine core sends none in Ready.
    tokenizer_in_file: bool = False

    @property
    def tokenizer(self) -> Tokenizer:
        return self.tokenizer_of()

    def freeze(self, int4_max_rows: int | None = None) -> None:
        """Readies the model for inference (`LlamaForCausalLM.freeze`), its linears of 4-bit forms using them
        for steps of at most `int4_max_rows` rows (0: never; `sys.maxsize`: always; None: the crossover of
        its dtype, `quantized_linear.int4_rows_for`); without a dense copy, the other rows take the forms
        too, in calls of their own (`FrozenLinear`)."""
        self.model.freeze(self.int4, int4_max_rows)
        self.int4 = {}


def load_model(path: str | os.PathLike[str] | None = None, dtype: str = "auto",
               quantization: str = "auto", device: torch.device | str = "cpu",
               dense_weights: str = "on", embedding: bool = False) -> LoadedModel:
    """Loads weights and config onto `device` (the tokenizer: `LoadedModel.tokenizer_of`); `path=None` is
    the default model (SmolLM2-135M-Instruct GGUF).

    `quantization` (`config.QUANTIZATION_CHOICES`): "auto", "blocks" and "int4" also load a GGUF file's 4-
    and 8-bit blocks in a low-bit kernel's form (`quantized_linear.form_for`) where the model runs on the
    CPU in bfloat16, or in float32 chosen by "auto" (`quantized_linear.int4_serves`); "none" loads dense
    weights only. `dense_weights` (`config.DENSE_WEIGHTS_CHOICES`; the engine's option, whose default is
    "auto"): whether the matrices of those forms also have a dense copy (`_dense_copy`). `embedding`: the
    decoder alone, for pooling (`build_model`)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    if quantization not in QUANTIZATION_CHOICES:
        choices = ", ".join(QUANTIZATION_CHOICES)
        raise ModelLoadError(f"unsupported quantization {quantization!r}; choose {choices}")
    path = resolve_model_path(path)
    device = torch.device(device)
    if path.is_dir():
        loaded = _load_hf_directory(path, dtype, device, embedding)
    else:
        loaded = _load_gguf_file(path, dtype, quantization, device, dense_weights, embedding)
    if device.type != "cpu":
        loaded.model.to(device)
    return loaded


def _load_hf_directory(path: Path, dtype: str, device: torch.device, embedding: bool) -> LoadedModel:
    config = read_hf_config(path)
    with ExitStack() as stack:
        handles = {file: stack.enter_context(_open_safetensors(file)) for file in _safetensors_files(path)}
        target = DTYPES[dtype] if dtype != "auto" else _auto_dtype_of_safetensors(handles.values(), device)
        shapes = [handle.get_slice(name).get_shape() for handle in handles.values() for name in handle.keys()]
        _check_weights_fit(shapes, 0, target, device)
        state = dict(_read_tensors(handles, target))
    mark("read")
    model = build_model(config, state, target, source=path, head=not embedding)
    mark("model")
    tokenizer = cached_tokenizer(content_hash(path), lambda: Tokenizer.from_dir(path))
    mark("tokenizer")
    return LoadedModel(config, model, lambda: tokenizer, path, target, path.name, device)


def _load_gguf_file(path: Path, dtype: str, quantization: str, device: torch.device,
                    dense_weights: str, embedding: bool) -> LoadedModel:
    from gracelm.model.gguf_loader import open_gguf

    model_file = open_gguf(path)
    if embedding:  # the decoder alone: a logits matrix the file may hold is neither read nor kept
        model_file.names = {name: hf for name, hf in model_file.names.items() if hf != "lm_head.weight"}
    target = DTYPES[dtype] if dtype != "auto" else _auto_dtype_of_gguf(model_file.gguf, device)
    low_bit = _low_bit_form(model_file, target, dtype, quantization, device)
    blocks = model_file.int4_matrices() if low_bit is not None else {}
    dense_copy = _dense_copy(dense_weights, low_bit, model_file)
    without = frozenset() if dense_copy else frozenset(blocks.values())
    tensors = model_file.gguf.tensors
    dense = [info.shape for name, info in tensors.items() if model_file.names.get(name) not in without]
    _check_weights_fit(dense, sum(tensors[name].nbytes for name in blocks), target, device)
    tokenizer_of = functools.cache(model_file.tokenizer)
    in_file = builds_alone(model_file.gguf.metadata)
    if not in_file:  # sent in Ready: built now, through transformers (or read from the cache)
        tokenizer_of()
        mark("tokenizer")
    state = model_file.weights(target, without)
    state.update({name: torch.empty(tensors[gguf_name].shape, dtype=target, device="meta")
                  for gguf_name, name in blocks.items() if name in without})
    int4 = model_file.low_bit_weights(low_bit) if low_bit is not None else {}  # marks read or repack
    model = build_model(model_file.config, state, target, source=path, head=not embedding)
    if _EMBEDDING in without:
        model.model.embed_tokens = model_file.embedding(target)
    mark("model")
    return LoadedModel(model_file.config, model, tokenizer_of, path, target, path.stem, device, int4,
                       tokenizer_in_file=in_file)


def _dense_copy(dense_weights: str, form: type[LowBitForm] | None, model_file: GGUFModel) -> bool:
    """Whether the matrices of low-bit forms also get a dense copy: "on"; "off" (refused, naming why, where
    the blocks kernel would not serve them all); "auto": off where the blocks kernel serves every such
    matrix (torch's int4 kernel is slow at many rows, so its forms keep the copy for prompts)."""
    if dense_weights == "on" or form is None and dense_weights == "auto":
        return True
    if form is None:
        problem: str | None = ("no low-bit form serves it here (--quantization none, a --dtype the low-bit "
                               "kernels do not take, or not a CPU)")
    elif form is not BlockLinear:
        problem = "the low-bit kernel is torch's int4 one (the blocks kernel needs AVX-512 VNNI)"
    else:
        problem = model_file.unstackable_blocks()
    if problem is None:
        return False
    if dense_weights == "off":
        raise ModelLoadError(f"--dense-weights off cannot serve {model_file.gguf.path}: {problem}")
    logger.info("%s: dense weights beside the blocks: %s", model_file.gguf.path, problem)
    return True


def _low_bit_form(model_file: GGUFModel, dtype: torch.dtype, dtype_asked: str, quantization: str,
                  device: torch.device) -> type[LowBitForm] | None:
    """The low-bit form `quantization` asks for on this CPU (`quantized_linear.form_for`) for the file's 4-
    and 8-bit matrices, where a low-bit kernel serves them (both are CPU kernels); None where none does."""
    try:
        form = form_for(quantization)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    if form is None or not model_file.int4_matrices():
        return None
    if device.type != "cpu" or not int4_serves(dtype, dtype_asked):
        logger.info("%s: its 4-bit matrices are served dequantized, in %s (%s asked) on %s: the low-bit "
                    "kernels serve CPU models in bfloat16, or in float32 chosen by --dtype auto",
                    model_file.gguf.path, str(dtype).removeprefix("torch."), dtype_asked, device)
        return None
    return form


def _check_weights_fit(shapes: list, low_bit_bytes: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuses (`MemoryBudgetError`) a CPU model whose weights would not fit in the memory available: the
    dense tensors in `dtype`, the low-bit copy, and while converting, one tensor in float32 twice over
    (dequantized, then cast) beside a margin for the loader's own work."""
    if device.type != "cpu":
        return
    sizes = [math.prod(shape) for shape in shapes]
    dense = sum(sizes) * dtype.itemsize
    need = dense + low_bit_bytes + max(sizes, default=0) * 8 + _LOAD_MARGIN
    available = available_memory()
    # The memory written ahead for the conversion is counted used, and is the weights' own.
    available = dataclasses.replace(available, bytes=available.bytes + prefaulted_memory.held())
    require(need, f"the model's weights ({gib(dense)} dense in {str(dtype).removeprefix('torch.')}, "
                  f"{gib(low_bit_bytes)} in a low-bit form) and their loading",
            "free memory, raise the limit, or serve a smaller file or one of fewer bits", available)


def build_model(
    config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, source: Path, head: bool = True
) -> LlamaForCausalLM:
    """Assigns `state` (HF names, already in `dtype`) into a module built without allocating weights;
    without `head`, the decoder alone (an embedding model's checkpoint may name its tensors without the
    `model.` prefix, as its `<Family>Model` saves them, and has no logits head)."""
    with torch.device("meta"):
        model = causal_lm_class(config)(config, head=head)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected = set(shapes)
    state = {name: t for name, t in split_hf_experts(config, split_hf(config, state)).items()
             if not name.endswith(_IGNORED_SUFFIXES)}
    if not head:
        state = {name if name.startswith(("model.", "lm_head.")) else f"model.{name}": t
                 for name, t in state.items() if not name.startswith("lm_head.")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
    missing = sorted(expected - state.keys())
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"{source}: missing tensors: {shown}")
    unexpected = sorted(state.keys() - expected)
    if unexpected:
        logger.warning("%s: ignoring %d tensors this model does not use: %s", source, len(unexpected),
                       ", ".join(unexpected[:8]))
    misfits = [f"{name} is {list(state[name].shape)}, the config needs {list(shapes[name])}"
               for name in sorted(expected) if tuple(state[name].shape) != shapes[name]]
    if misfits:
        raise ModelLoadError(f"{source}: tensors do not fit the config: {'; '.join(misfits[:4])}")
    model.load_state_dict({name: state[name] for name in expected}, strict=True, assign=True)
    del state
    model.eval().requires_grad_(False)
    logger.info("loaded %s (%s, %s)", source, config.architecture, dtype)
    return model


def _safetensors_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [file.name for file in files if not file.is_file()]
        if absent:
            raise ModelLoadError(f"{path}: shards named in {INDEX_FILE} are missing: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {', '.join(other)}: only safetensors weights are supported)" if other else ""
        raise ModelLoadError(f"{path} has no *.safetensors weights{hint}")
    return files


def _open_safetensors(file: Path) -> Any:
    try:
        # Opened here first: safetensors words every failure to open as "No such file or directory", a
        # file the process may not read (permissions) included.
        with file.open("rb"):
            pass
    except OSError as e:
        raise ModelLoadError(f"cannot read the weights file {file}: {e.strerror}") from e
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{file} is not a readable safetensors file (corrupt or truncated?): {e}") from e


def _read_tensors(handles: dict[Path, Any], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    names = [(file, handle, name) for file, handle in handles.items() for name in handle.keys()]
    for file, handle, name in load_progress(names, len(names), "loading weights"):
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file}: cannot read tensor {name}: {e}") from e
        yield name, _cast(tensor, dtype)


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


def _half_precision(device: torch.device) -> torch.dtype:
    """bfloat16 where the device computes it natively: a GPU from Ampere on, a CPU with oneDNN's bf16 kernels
    (AVX-512 BF16/VNNI or AMX). Elsewhere float16 on a GPU, and float32 on a CPU, where bfloat16 is emulated
    and a decode step several times slower (float16 too is slow on CPU), as where its bfloat16 is masked
    (`cpu_features.py`)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_features.native_bfloat16() else torch.float32


def _auto_dtype_of_safetensors(handles: Any, device: torch.device) -> torch.dtype:
    """Half precision (`_half_precision`) for a half-precision checkpoint, float32 for a float32 one."""
    for handle in handles:
        for name in handle.keys():
            if handle.get_slice(name).get_dtype() in ("BF16", "F16"):
                return _half_precision(device)
    return torch.float32


def _auto_dtype_of_gguf(gguf: GGUFFile, device: torch.device) -> torch.dtype:
    """float32 for an all-F32 file; quantized and half-precision files in half precision
    (`_half_precision`)."""
    from gguf import GGMLQuantizationType

    all_f32 = all(t.ggml_type == GGMLQuantizationType.F32 for t in gguf.tensors.values())
    return torch.float32 if all_f32 else _half_precision(device)
