"""The README's table of the model families gracelm serves, written from the registries the loaders refuse
by (`config.SUPPORTED_ARCHITECTURES`, `gguf_config.GGUF_ARCHITECTURES`, `rope.SUPPORTED_ROPE_TYPES`), so
that it cannot say more or less than the code does: `python -m gracelm.model.family_table` rewrites it,
and `tests/test_family_table.py` fails while it differs.
"""

from __future__ import annotations

import re
from pathlib import Path

from gracelm.config import EMBEDDING_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from gracelm.model.gguf_config import GGUF_ARCHITECTURES, LLAMA_WITH_EXPERTS
from gracelm.model.rope import SUPPORTED_ROPE_TYPES

README = Path(__file__).resolve().parents[2] / "README.md"
START = "<!-- model families: written by `python -m gracelm.model.family_table` from the registries -->"
END = "<!-- end of model families -->"
# What each feature flag of `SUPPORTED_ARCHITECTURES` means to a reader.
_FEATURES = {"attention_bias": "q/k/v biases", "qk_norm": "q and k RMS norms",
             "fused_projections": "fused `qkv_proj` and `gate_up_proj` (GGUF: `attn_qkv`, gate+up `ffn_up`)",
             "experts": "mixture of experts, top-k routing (GGUF: `ffn_*_exps`)",
             "shared_expert": "a shared expert with its sigmoid gate (GGUF: `ffn_*_shexp`)",
             "qk_norm_per_projection": "the q and k norms over the whole projection",
             "gemma_layer": "Gemma's layer: (1 + weight) RMS norms before and after attention and MLP, "
                            "embeddings times sqrt(hidden), GeLU-tanh MLP, `query_pre_attn_scalar`, logits "
                            "soft-capped where set",
             "logit_softcapping": "attention scores soft-capped",
             "sliding_layers": "sliding-window layers between global ones, each applied (Gemma 3: their own "
                               "rope theta)"}


def family_table() -> str:
    """The markdown table, one row a Hugging Face architecture, and the lines that hold for every row."""
    embedding = {arch: name for name, arch in EMBEDDING_ARCHITECTURES.items()}
    rows = ["| architecture | GGUF `general.architecture` | its own features | tasks |", "|---|---|---|---|"]
    for arch, flags in SUPPORTED_ARCHITECTURES.items():
        gguf = ", ".join(f"`{name}`" for name, hf in GGUF_ARCHITECTURES.items() if hf == arch) or "none"
        if arch == LLAMA_WITH_EXPERTS:
            gguf = "`llama` with `llama.expert_count`"
        features = "; ".join(_FEATURES[flag] for flag, on in flags.items() if on) or "none"
        tasks = (f"generate; embed (`{embedding[arch]}` or sentence-transformers' files; a GGUF file's "
                 "`pooling_type`)")
        rows.append(f"| `{arch}` | {gguf} | {features} | {tasks} |")
    ropes = ", ".join(f"`{kind}`" for kind in SUPPORTED_ROPE_TYPES)
    rows += ["", f"Every family: rope scaling {ropes} (LongRoPE within its original context), "
                 "partial rotary; the context ends where a sliding window over every layer or LongRoPE's "
                 "original context does (a longer `--max-model-len` is refused at start). Any other "
                 "architecture, or feature, is refused at start (exit 3) naming it."]
    return "\n".join(rows)


def with_family_table(text: str) -> str:
    """`text` (the README) with the part between the markers replaced by `family_table()`."""
    pattern = re.compile(f"{re.escape(START)}\n.*?{re.escape(END)}", re.DOTALL)
    if pattern.search(text) is None:
        raise ValueError(f"the README has no {START!r} ... {END!r} markers")
    return pattern.sub(lambda _: f"{START}\n{family_table()}\n{END}", text)


if __name__ == "__main__":
    README.write_text(with_family_table(README.read_text()))
