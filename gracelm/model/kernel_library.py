"""gracelm's compiled CPU kernels, `gracelm._kernels`, built from `gracelm/csrc/` when the package is
installed (`setup.py`): fused paged decode attention (`decode_attention.py`), the 8-bit-activation
matmul of a GGUF file's blocks (`block_linear.py`). Loaded once, here, for both."""

from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)


def _load() -> bool:
    """Loads the compiled library once; False (and a warning naming what is missing) where the package was
    installed without it: the engine then attends unfused and multiplies 4-bit weights with torch's kernel."""
    spec = importlib.util.find_spec("gracelm._kernels")
    if spec is None or spec.origin is None:
        logger.warning("gracelm._kernels is not built (install with `pip install --no-build-isolation -e .`, "
                       "as scripts/bootstrap.sh does): decode attention runs unfused and 4-bit weights take "
                       "torch's int4 kernel")
        return False
    torch.ops.load_library(spec.origin)
    return True


LOADED = _load()
