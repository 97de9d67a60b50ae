"""Each model family beyond Llama through every eager kernel path this machine can run (docs/kernel_paths.md):
a tiny random model of the family in a GGUF file of 8-bit blocks, whose greedy answers on each path are held
to the family's own eager dense path as the path matrix holds the Llama model's (`assert_like_reference`).
The path matrix proves the paths on Llama; this proves that a family's own layout (fused projections split
into byte ranges of blocks, stacked experts split per expert, Gemma's norms and caps) reaches the same
kernels intact. A path a family refuses (two ranks for a mixture of experts) must refuse it by name. The
compiled decode graphs run the very layers the eager steps run; they are built and checked on the matrix's
model only (Gemma and mixtures of experts are served eagerly).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gracelm import Engine, SamplingParams
from tests.kernel_paths import PATHS, KernelPath
from tests.test_gemma import gguf_and_reference
from tests.test_gguf import PHI3_IDS, VOCAB, Q, gguf_layout, hf_model, write_gguf
from tests.test_kernel_paths import assert_like_reference, dtype_of, engine_kwargs
from tests.test_moe import moe_hf_model, write_moe_gguf


def _phi3(folder: Path) -> Path:
    model = hf_model("phi3", tie_word_embeddings=False, **PHI3_IDS)
    # transformers reads a phi3 file's pad id from it, else takes Phi3Config's, past this vocabulary.
    return write_gguf(folder / "phi3-q8_0.gguf", gguf_layout(model, "phi3"), Q.Q8_0, arch="phi3",
                      metadata={"pad_token_id": 0})


def _gemma(arch: str, layers: int) -> Callable[[Path], Path]:
    """Gemma 2 or 3 with a window of 8 tokens, which the longer prompts cross."""
    return lambda folder: gguf_and_reference(folder, arch, Q.Q8_0, layers)[0]


def _qwen2_moe(folder: Path) -> Path:
    """Qwen2-MoE: routed experts and the shared one, 2 of 8 experts a token."""
    return write_moe_gguf(folder / "qwen2moe-q8_0.gguf", moe_hf_model("qwen2_moe"), "qwen2_moe", Q.Q8_0)


# Family -> a writer of its tiny GGUF in 8-bit blocks.
FAMILIES: dict[str, Callable[[Path], Path]] = {"phi3": _phi3, "gemma2": _gemma("gemma2", 3),
                                               "gemma3": _gemma("gemma3", 6), "qwen2_moe": _qwen2_moe}
MOE_FAMILIES = ("qwen2_moe",)
# Every path of the matrix, eager: the kernels (blocks with AMX or VNNI, torch's int4, AVX2 and baseline
# float32, dense copy, unfused attention, deterministic, two ranks).
EAGER_PATHS = [dataclasses.replace(path, compiled=False) for path in PATHS]


class Families:
    """The families' files, written once, and their reference engines, started when first asked for."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[str, Path] = {}
        self._references: dict[tuple[str, str], Engine] = {}

    def file(self, family: str) -> Path:
        if family not in self._files:
            self._files[family] = FAMILIES[family](self.folder)
        return self._files[family]

    def reference(self, family: str, dtype: str) -> Engine:
        """The family's eager dense path in `dtype`."""
        if (family, dtype) not in self._references:
            mask = ["avx512"] if dtype == "float32" else []
            self._references[family, dtype] = Engine(
                str(self.file(family)), quantization="none", enforce_eager=True, decode_attention="unfused",
                max_model_len=256, num_threads=1, enable_prefix_caching=False, mask_cpu_features=mask)
        return self._references[family, dtype]

    def close(self) -> None:
        for engine in self._references.values():
            engine.shutdown()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def families() -> Iterator[Families]:
    made = Families(Path(tempfile.mkdtemp(prefix="gracelm-families-")))
    try:
        yield made
    finally:
        made.close()


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


@pytest.mark.parametrize("path", EAGER_PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_answers_on_each_path_as_its_dense_path_does(family: str, path: KernelPath,
                                                              families: Families) -> None:
    reason = path.why_not_here()
    if reason is not None:
        pytest.skip(f"path {path.name}: {reason}")
    # Prompts both sides of the short-prompt threshold (16 tokens), decoded together.
    prompts = [_prompt(length, seed) for seed, length in enumerate((3, 9, 17, 30, 5, 41))]
    kwargs = engine_kwargs(path)
    if family in MOE_FAMILIES and kwargs.get("tensor_parallel_size", 1) > 1:
        with pytest.raises(ValueError, match="mixture-of-experts model, which gracelm does not split"):
            Engine(str(families.file(family)), **kwargs)
        return
    with Engine(str(families.file(family)), **kwargs) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0,
                                                       logprobs=0), use_tqdm=False)
        linear = llm.stats()["kernel_paths"]["linear"]
    answers = [(p, out.outputs[0].token_ids, _logprobs(out.outputs[0])) for p, out in zip(prompts, outputs,
                                                                                          strict=True)]
    assert_like_reference(families.reference(family, dtype_of(path)), answers)
    if path.needs:  # a low-bit kernel's path: the file's 8-bit blocks served the decode steps
        assert linear.startswith(("blocks", "int4")), linear


def _logprobs(completion) -> list[float]:
    """The logprob of each token the completion generated."""
    tokens = completion.token_ids
    return [ranked[token].logprob for token, ranked in zip(tokens, completion.logprobs, strict=True)]
