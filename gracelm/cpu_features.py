"""The CPU features that choose gracelm's kernel paths, less those the operator masks (`--mask-cpu-features`).

Which kernels serve a step depends on the CPU: AVX-512 VNNI for the file's blocks
(`model/block_linear.py`), AMX for their tile kernel, AVX-512 BF16 for native bfloat16 (`--dtype auto`) and
the decode attention's bfloat16 dot products, AVX-512 or AVX2 for the vector width of the attention kernel,
torch's int4 kernel and the compiled graphs. Masking a feature makes every one of those choices as on a CPU
without it, so that one host can run (and test) the paths of the others: a Sapphire Rapids those of a Zen 4
(`amx`), of a CPU without VNNI (`avx512_vnni`), or of an AVX2-only Zen 3 (`avx512`). A feature masked masks
those built on it (`_BUILT_ON`).

Two halves. gracelm's own choices read `active()` in the process that computes (the engine core, a worker,
the graph compiler), after `mask()`. torch's own kernels (oneDNN's matmuls, ATen's vector code, inductor's
generated loops) choose at their first use from environment variables, so a process that will import torch
is started with `environment()` (`lifecycle/processes.py:start_process`); an operator's own setting of one of
those variables is kept.

This module imports torch only when asked for the features detected: the configuration validates names
without it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterable, Iterator

# The features that may be masked, in the order they build on one another.
MASKABLE = ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
# What masking a feature masks besides: the paths that need it too.
_BUILT_ON = {"avx2": ("avx512",), "avx512": ("avx512_vnni", "avx512_bf16"), "avx512_bf16": ("amx",)}
# oneDNN's and ATen's own caps for a process whose mask holds the key (the first key found, in this order).
_ONEDNN_CAP = (("avx2", "SSE41"), ("avx512", "AVX2"), ("avx512_vnni", "AVX512_CORE"),
               ("avx512_bf16", "AVX512_CORE_VNNI"), ("amx", "AVX512_CORE_FP16"))
_ATEN_CAP = (("avx2", "default"), ("avx512", "avx2"))

_masked: frozenset[str] = frozenset()


def unknown(names: Iterable[str]) -> list[str]:
    """The names that are not maskable features."""
    return [name for name in names if name not in MASKABLE]


def closure(names: Iterable[str]) -> frozenset[str]:
    """`names` and every feature built on them."""
    found: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        if name not in found:
            found.add(name)
            pending.extend(_BUILT_ON.get(name, ()))
    return frozenset(found)


def environment(names: Iterable[str]) -> dict[str, str]:
    """The variables that make torch's own kernels in a new process choose as without the features `names`,
    but for those this process's environment sets already (the operator's)."""
    masked = closure(names)
    env = {}
    for variable, caps in (("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAP), ("ATEN_CPU_CAPABILITY", _ATEN_CAP)):
        cap = next((value for feature, value in caps if feature in masked), None)
        if cap is not None and variable not in os.environ:
            env[variable] = cap
    return env


def mask(names: Iterable[str]) -> None:
    """From now on in this process, `active()` leaves out `names` and what is built on them."""
    global _masked
    bad = unknown(names)
    if bad:
        raise ValueError(f"unknown CPU feature(s) {', '.join(bad)}; maskable: {', '.join(MASKABLE)}")
    _masked = closure(names)
    active.cache_clear()


@contextlib.contextmanager
def masking(names: Iterable[str]) -> Iterator[None]:
    """`mask(names)` for the duration of a block (benchmarks, tests), then the mask there was before."""
    global _masked
    before = _masked
    mask(names)
    try:
        yield
    finally:
        _masked = before
        active.cache_clear()


def masked() -> frozenset[str]:
    return _masked


@functools.cache
def detected() -> frozenset[str]:
    """The maskable features this CPU has, as torch reads them (cpuinfo)."""
    import torch

    cpu = torch.cpu
    found = {"avx2": cpu._is_avx2_supported(), "avx512": cpu._is_avx512_supported(),
             "avx512_vnni": cpu._is_vnni_supported(), "avx512_bf16": cpu._is_avx512_bf16_supported(),
             "amx": cpu._is_amx_tile_supported()}
    return frozenset(name for name, present in found.items() if present)


@functools.cache
def active() -> frozenset[str]:
    """The features gracelm's kernel choices may use: those detected, less those masked."""
    return detected() - _masked


def has(feature: str) -> bool:
    return feature in active()


def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 natively for oneDNN's matmuls (AVX-512 with BF16, or AMX), where
    `--dtype auto` takes it: elsewhere it is emulated, several times slower than float32."""
    import torch

    return torch.ops.mkldnn._is_mkldnn_bf16_supported() and "avx512_bf16" not in _masked


@functools.cache
def fingerprint() -> str:
    """The host CPU's own flags, hashed: what code compiled for this CPU (`-march=native`) may use."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:12]


def compiler_arch() -> str | None:
    """The `-march` for code compiled here (inductor's): the vector level the features leave where one is
    masked (so that a graph compiled on a masked CPU runs that level's code), else None (the CPU's own)."""
    if "avx2" in _masked:
        return "x86-64-v2"
    return "x86-64-v3" if "avx512" in _masked else None


def describe() -> str:
    """For the log and the graphs' key: the features in use, and those masked."""
    used = ",".join(name for name in MASKABLE if name in active()) or "none"
    return f"{used}" + (f" (masked: {','.join(n for n in MASKABLE if n in _masked)})" if _masked else "")
