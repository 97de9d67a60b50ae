"""Where the model, its KV cache and the sampler run: the `--device` option (`EngineConfig.device`) resolved
against what this process can see. Only the engine core and the workers call this: the frontend never loads
torch, so a device it cannot have is refused when the core starts (a start-up failure naming the option)."""

from __future__ import annotations

import torch


def resolve_device(name: str, tensor_parallel_size: int = 1) -> torch.device:
    """`cpu`, `cuda` or `auto`: CUDA when torch sees a GPU and the model is not split over ranks (the
    ranks' collectives run over gloo on CPU tensors), else the CPU. `cuda` without a GPU is refused."""
    if name == "auto":
        use_cuda = torch.cuda.is_available() and tensor_parallel_size == 1
        return torch.device("cuda" if use_cuda else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else f"torch (CUDA {torch.version.cuda}) sees no GPU")
        raise ValueError(f"device 'cuda' (--device cuda) is not available here: {why}; use --device cpu "
                         "or auto")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of auto, cpu, cuda, got {name!r}")
    return torch.device(name)

