"""Sampling defaults from a model's `generation_config.json` (`--generation-config`), for the fields a
request leaves out.

`auto` reads the served model's file, `vllm` keeps gracelm's own defaults (`SamplingParams`'), and a folder
path reads that folder's file. A GGUF model has no generation_config.json (its header carries no sampling
settings), so `auto` there means gracelm's defaults, and the log says so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gracelm.sampling_params import SamplingParams

logger = logging.getLogger("gracelm.server")

FILE_NAME = "generation_config.json"
# generation_config.json's key -> the request field it defaults.
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_problem(setting: str) -> str | None:
    """What is wrong with a `--generation-config` value (completing "generation_config ..."), or None."""
    if setting in ("auto", "vllm") or (Path(setting).expanduser() / FILE_NAME).is_file():
        return None
    return f"must be auto, vllm or a folder holding a {FILE_NAME}, got {setting!r}"


def load_generation_defaults(setting: str, model_path: Path) -> dict[str, float | int]:
    """The request fields' defaults `setting` gives (empty: gracelm's own); raises `ValueError` naming the
    file when it cannot be read."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if not model_path.is_dir():
            logger.info("--generation-config auto: %s is a GGUF file, which has no %s; gracelm's sampling "
                        "defaults apply", model_path.name, FILE_NAME)
            return {}
        folder = model_path
    else:
        folder = Path(setting).expanduser()
    path = folder / FILE_NAME
    if not path.is_file():
        logger.info("--generation-config auto: the model has no %s; gracelm's sampling defaults apply",
                    FILE_NAME)
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    defaults = {field: config[key] for key, field in _FIELDS.items() if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"generation_config: {path}: {exc}") from None
    if defaults:
        logger.info("sampling defaults from %s, for requests that leave them out: %s (--generation-config "
                    "vllm keeps gracelm's own)", path, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
