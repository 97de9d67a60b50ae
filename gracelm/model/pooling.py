"""How an embedding model turns a prompt's hidden states into one vector, read from its files, and the last
touches of that vector. Imports no torch: the frontend resolves the task and finishes the vectors.

An embedding model is a decoder whose final-norm hidden states are pooled: the last token's
(Qwen3-Embedding), their mean, or the first token's ("cls"), as sentence-transformers' files say
(`modules.json` names the Pooling module's directory, whose `config.json` sets one `pooling_mode_*` flag; a
Normalize module makes the vector unit-length). A GGUF file says it in its metadata: llama.cpp's converter
writes `<arch>.pooling_type` from those same files, and its server normalises the vectors, as gracelm then
does. A decoder without either is pooled at its last token and normalised, as vLLM does for `--task embed`.

In a step, the rows of each request's pooled positions are summed (`pooled_sums`: tensor methods only, so
this module imports no torch) and the scheduler adds the chunks' sums up; the engine returns the pooled
vector as it is (for "mean" the rows' mean). `finished` applies what the request and the model ask on top:
Matryoshka truncation to `dimensions` (only where config.json declares `is_matryoshka` or
`matryoshka_dimensions`: other models' leading dimensions mean nothing alone), then normalisation.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import msgspec

from gracelm.config import TASK_CHOICES
from gracelm.model.model_files import ModelLoadError, resolve_model_path
from gracelm.model_step import PooledSum, PoolRows

# sentence-transformers' flags, in the order they are looked for, and the pooling each names.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_cls_token": "cls"}
# llama.cpp's pooling types (gguf-py's `PoolingType`) that an embedding takes; NONE (0, a vector per token)
# and RANK (4, a reranker's score) are not embeddings.
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
_GGUF_POOLING_NAMES = {0: "NONE (a vector per token)", 4: "RANK (a reranker's score)"}
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


class Pooling(msgspec.Struct, frozen=True):
    """An embedding model's pooling: `method` ("last", "mean" or "cls"), whether the vector is normalised,
    and the `dimensions` it may be truncated to (None: not a Matryoshka model; empty: any)."""

    method: str = "last"
    normalize: bool = True
    dimensions: tuple[int, ...] | None = None

    def check_dimensions(self, dimensions: int, hidden_size: int) -> str | None:
        """What is wrong with truncating to `dimensions` (completing "dimensions ..."), or None."""
        if self.dimensions is None:
            return ("is not supported by this model: it declares no Matryoshka representation "
                    "(is_matryoshka or matryoshka_dimensions in its config.json)")
        if not 1 <= dimensions <= hidden_size:
            return f"must be between 1 and {hidden_size}, got {dimensions}"
        if self.dimensions and dimensions not in self.dimensions:
            return f"must be one of {', '.join(map(str, self.dimensions))}, got {dimensions}"
        return None

    def finished(self, vector: list[float], dimensions: int | None = None,
                 normalize: bool | None = None) -> list[float]:
        """`vector` truncated to `dimensions` (if given) and normalised as the model defines, or as
        `normalize` says where given."""
        if dimensions is not None:
            vector = vector[:dimensions]
        if not (self.normalize if normalize is None else normalize):
            return list(vector)
        norm = math.sqrt(math.fsum(x * x for x in vector))
        return [x / norm for x in vector] if norm > 0 else list(vector)


def pooled_sums(hidden: Any, rows: list[PoolRows]) -> dict[str, PooledSum]:
    """Each request's rows of `hidden` (a tensor of the step's pooled rows, in the order of `rows`) summed
    in float32."""
    if not rows:
        return {}
    parts = hidden.float().split([r.num_rows for r in rows])
    return {r.request_id: PooledSum(part.sum(0).tolist(), r.num_rows)
            for r, part in zip(rows, parts, strict=True)}


def task_pooling(task: str, model: str | os.PathLike[str] | None) -> Pooling | None:
    """The pooling `model` is served with for `task`, or None where it generates text: "generate"; "embed";
    "auto", an embedding model where its files name a pooling (sentence-transformers' Pooling module, a GGUF
    file's `pooling_type`). The model's files are read once for both."""
    if task not in TASK_CHOICES:
        raise ValueError(f"task must be one of {', '.join(TASK_CHOICES)}, got {task!r}")
    if task == "generate":
        return None
    path = resolve_model_path(model)
    if not path.is_dir():
        kind = _gguf_pooling_type(path)
        return None if task == "auto" and kind is None else _gguf_pooling(path, kind)
    pooling_dir = _pooling_dir(path)
    if task == "auto" and pooling_dir is None:
        return None
    hf = _json(path / "config.json") or {}
    method = "last" if pooling_dir is None else _method(pooling_dir)
    normalize = pooling_dir is None or any(m.get("type") == _NORMALIZE_MODULE for m in _modules(path))
    return Pooling(method, normalize, _matryoshka(hf))


def _gguf_pooling(path: Path, kind: int | None) -> Pooling:
    """A GGUF file's pooling, from its `<arch>.pooling_type` `kind` (last token where it has none),
    normalised as llama.cpp's server normalises; no Matryoshka dimensions, which the file cannot declare."""
    if kind is None:
        return Pooling()
    if kind not in _GGUF_POOLING:
        named = _GGUF_POOLING_NAMES.get(kind, f"{kind}, unknown")
        raise ModelLoadError(f"{path}: its pooling_type is {named}; embeddings are pooled by "
                             f"{', '.join(f'{k} ({m})' for k, m in _GGUF_POOLING.items())}")
    return Pooling(_GGUF_POOLING[kind])


def _gguf_pooling_type(path: Path) -> int | None:
    """The `<arch>.pooling_type` of a GGUF file's metadata, or None where it has none."""
    from gracelm.model.gguf_reader import read_gguf  # gguf-py's import is of no use to a directory

    metadata = read_gguf(path, string_arrays=False).metadata
    kind = metadata.get(f"{metadata.get('general.architecture')}.pooling_type")
    return None if kind is None else int(kind)


def _modules(path: Path) -> list[dict[str, Any]]:
    """The sentence-transformers modules that `modules.json` lists (none without the file)."""
    return [module for module in _json(path / "modules.json") or [] if isinstance(module, dict)]


def _pooling_dir(path: Path) -> Path | None:
    """The directory of the Pooling module, if any."""
    for module in _modules(path):
        if module.get("type") == _POOLING_MODULE:
            return path / str(module.get("path", ""))
    return None


def _method(pooling_dir: Path) -> str:
    config = _json(pooling_dir / "config.json") or {}
    methods = [method for flag, method in _MODES.items() if config.get(flag)]
    others = sorted(flag for flag, value in config.items()
                    if flag.startswith("pooling_mode_") and value and flag not in _MODES)
    if len(methods) != 1 or others:
        named = ", ".join(others or [f for f in _MODES if config.get(f)]) or "none"
        raise ModelLoadError(f"{pooling_dir}: one of {', '.join(_MODES)} must be set, and only it; this "
                             f"model sets {named}")
    return methods[0]


def _matryoshka(hf: dict[str, Any]) -> tuple[int, ...] | None:
    listed = hf.get("matryoshka_dimensions")
    if isinstance(listed, list) and listed:
        return tuple(int(d) for d in listed)
    return () if hf.get("is_matryoshka") else None


def _json(file: Path) -> Any:
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from e
