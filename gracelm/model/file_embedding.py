"""A token embedding read from the model file's own blocks: the rows a step looks up are gathered from the
file, memory-mapped read-only (its pages shared with the page cache; only the rows used are ever read), and
dequantized on the way in. So a model served without dense weights (`--dense-weights off`) holds no dense
copy of its largest matrix either: the vocabulary times the width, 1 GB in bfloat16 for Llama 3's 8B.
"""

from __future__ import annotations

import mmap
import warnings

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from gracelm.model.gguf_reader import GGUFFile, GGUFTensorInfo


class FileEmbedding(nn.Module):
    """`nn.Embedding`'s lookup over a GGUF tensor's stored rows. `weight` is a meta tensor of the dense
    shape and dtype: what the model reads of it (its dtype, its shape) without a dense copy."""

    # The file's rows are resident only once looked up, and stay so while the page cache keeps them: what the
    # memory report counts as workspace as they are read, not as weights (`memory_use.tensor_bytes`).
    read_on_demand = ("stored",)

    def __init__(self, gguf: GGUFFile, info: GGUFTensorInfo, dtype: torch.dtype) -> None:
        super().__init__()
        with gguf.path.open("rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # read-only on purpose: nothing writes to the file's pages
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            stored = torch.frombuffer(mapped, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        self.register_buffer("stored", stored.view(info.shape[0], -1), persistent=False)
        self.ggml_type: GGMLQuantizationType = info.ggml_type
        self.weight = torch.empty(info.shape, dtype=dtype, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.stored.index_select(0, ids.reshape(-1)).numpy()
        dense = torch.from_numpy(dequantize(rows, self.ggml_type))
        return dense.to(self.weight.dtype).view(*ids.shape, -1)
