"""Builds gracelm's one compiled library, `gracelm._kernels` (fused paged decode attention, the GGUF blocks'
matmul and torch's 4-bit one as an op of its own, on the CPU, `gracelm/csrc/`), against the installed torch:
install with `pip install --no-build-isolation`, torch first (`scripts/bootstrap.sh` does). Everything else
about the package is in pyproject.toml."""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "gracelm._kernels",
            ["gracelm/csrc/paged_decode_attention.cpp", "gracelm/csrc/block_matmul.cpp",
             "gracelm/csrc/block_matmul_amx.cpp", "gracelm/csrc/block_pack.cpp",
             "gracelm/csrc/int4_matmul.cpp"],
            # -fopenmp: at::parallel_for shares torch's OpenMP threads. No -march: the kernel's hot function
            # is compiled for AVX-512, AVX2 and the baseline, chosen by the CPU at load time.
            extra_compile_args=["-O3", "-fopenmp", "-mprefer-vector-width=512"],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
