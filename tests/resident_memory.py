"""How much of a tensor's memory is mapped in: `mincore` over exactly its range, page by page. (A mapping's
Rss in /proc/self/smaps is not the tensor's: the kernel merges adjacent anonymous mappings, so it may count
a neighbour's pages.)"""

from __future__ import annotations

import ctypes
import mmap

import torch


def resident_kb(tensor: torch.Tensor) -> int:
    page, start, length = mmap.PAGESIZE, tensor.data_ptr(), tensor.numel() * tensor.element_size()
    assert start % page == 0 and length % page == 0, "a tensor of whole pages of its own"
    residency = (ctypes.c_ubyte * (length // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), residency) == 0, ctypes.get_errno()
    return sum(1 for flags in bytes(residency) if flags & 1) * page // 1024
