"""The kernel paths of the path matrix (tests/test_kernel_paths.py; docs/kernel_paths.md): what each asks the
engine for (CPU features masked, quantization, attention, eager, deterministic, tensor parallel), why one
cannot run on this machine, and the tiny 4-bit model whose compiled decode graphs the suite builds once,
each compiled path's in a child process of its own (its masked features reach torch there, as in a server's
core), two at a time.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gracelm.cpu_features as cpu_features
from gracelm.model.block_linear import amx_rows
from gracelm.model.kernel_library import LOADED
from tests.test_gguf import Q
from tests.test_quantized_linear import tiny_gguf

COMPILE_TIMEOUT_S = 300


@dataclass(frozen=True)
class KernelPath:
    name: str
    mask: tuple[str, ...] = ()  # --mask-cpu-features
    options: dict[str, Any] = field(default_factory=dict)  # other engine options (EngineConfig's fields)
    needs: tuple[str, ...] = ()  # CPU features the path runs on
    compiled: bool = False  # its decode steps run compiled graphs, built first

    def engine_options(self) -> dict[str, Any]:
        eager = {} if self.compiled else {"enforce_eager": True}
        return {"mask_cpu_features": list(self.mask), **eager, **self.options}

    def server_args(self) -> list[str]:
        args = ["--mask-cpu-features", *self.mask] if self.mask else []
        for name, value in self.engine_options().items():
            flag = "--" + name.replace("_", "-")
            if name == "mask_cpu_features":
                continue
            args += [flag] if value is True else [flag, str(value)]
        return args

    def why_not_here(self) -> str | None:
        """Why this machine cannot run the path; None where it can."""
        missing = [feature for feature in self.needs if feature not in cpu_features.detected()]
        if missing:
            return f"this CPU lacks {', '.join(missing)}"
        if self.needs and not LOADED:
            return "gracelm._kernels is not built"
        if "amx" in self.needs and not amx_rows():
            return "the OS refuses the AMX tile registers"
        return None


PATHS = [
    KernelPath("blocks-amx", needs=("amx", "avx512_vnni"), compiled=True),
    KernelPath("blocks-vnni", mask=("amx",), needs=("avx512_vnni",), compiled=True),
    KernelPath("int4-bfloat16", mask=("avx512_vnni",), needs=("avx512",), compiled=True),
    KernelPath("avx2-float32", mask=("avx512",), needs=("avx2",), compiled=True),
    KernelPath("blocks-vnni-eager", mask=("amx",), needs=("avx512_vnni",)),
    KernelPath("blocks-dense-copy", options={"dense_weights": "on"}, needs=("avx512_vnni",)),
    KernelPath("baseline-float32", mask=("avx2",)),
    KernelPath("dense", options={"quantization": "none"}),
    KernelPath("unfused-attention", options={"decode_attention": "unfused"}),
    KernelPath("deterministic", options={"deterministic": True}),
    KernelPath("tensor-parallel-2", options={"tensor_parallel_size": 2}),
]
BY_NAME = {path.name: path for path in PATHS}


@functools.cache
def matrix_gguf() -> Path:
    """The matrix's model: a tiny Llama in Q4_1 blocks, tied (its logits head 4-bit too), once a process;
    the same bytes every time, so the graphs built for it are found by every module's servers."""
    folder = Path(tempfile.mkdtemp(prefix="gracelm-matrix-"))
    atexit.register(shutil.rmtree, folder, True)
    return tiny_gguf(folder / "tiny-q4_1.gguf", Q.Q4_1)


def build_graphs(paths: list[KernelPath], cache: Path) -> None:
    """Compiles the decode graphs of `paths` for `matrix_gguf()` into the cache folder `cache`, each path in
    a child process started as a server's core would be (its masked features in torch's environment), two
    at a time; those the cache holds already are skipped by the compiler itself."""
    pending = list(paths)
    running: list[tuple[KernelPath, subprocess.Popen]] = []
    try:
        while pending or running:
            while pending and len(running) < 2:
                path = pending.pop(0)
                running.append((path, _start_compiler(path, cache)))
            path, process = running[0]
            out, _ = process.communicate(timeout=COMPILE_TIMEOUT_S)
            running.pop(0)
            assert process.returncode == 0, f"compiling {path.name}'s graphs failed:\n{out[-5000:]}"
    finally:
        for _, process in running:  # a failure or a timeout leaves no compiler behind
            process.kill()
            process.wait()


def _start_compiler(path: KernelPath, cache: Path) -> subprocess.Popen:
    """The server's compiler, at normal priority: it runs at idle priority beside serving, but here it is
    the suite's own work, which the tests of another pytest-xdist worker must not starve."""
    code = ("from gracelm.config import EngineConfig\n"
            "import gracelm.parallel.decode_graph_compiler as compiler\n"
            "compiler._serving_first = lambda: None\n"
            f"config = EngineConfig(model={str(matrix_gguf())!r}, **{path.engine_options()!r})\n"
            "compiler.compile_in_child(config)\n")
    env = {**os.environ, "GRACELM_CACHE_DIR": str(cache), **cpu_features.environment(path.mask)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
