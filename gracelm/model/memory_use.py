"""What a loaded model holds in memory, counted from its tensors, for `/metrics` and the start log."""

from __future__ import annotations

import torch
from torch import nn


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of the distinct tensors below `module`: parameters, buffers and the tensors modules keep as
    plain attributes (a frozen linear's weight in oneDNN's opaque layout). A tensor shared by several
    modules (tied embeddings, views of one stacked matrix) counts once. A module's tensors that it names in
    `read_on_demand` (a file mapped and read a row at a time, resident only where read: `FileEmbedding`) are
    not counted: what they hold is not known from their size."""
    seen: set[int] = set()
    total = 0
    for child in module.modules():
        on_demand = {id(getattr(child, name)) for name in getattr(child, "read_on_demand", ())}
        for value in (*child._parameters.values(), *child._buffers.values(), *vars(child).values()):
            if not isinstance(value, torch.Tensor) or value.is_meta or id(value) in on_demand:
                continue
            if value.is_mkldnn:  # no storage to share: each is its own
                key, size = id(value), value.numel() * value.element_size()
            else:
                storage = value.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            if key not in seen:
                seen.add(key)
                total += size
    return total
