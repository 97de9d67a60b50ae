"""The README's table of the model families gracelm serves, written from the registries the loaders refuse
by (`config.SUPPORTED_ARCHITECTURES`, `gguf_config.GGUF_ARCHITECTURES`, `rope.SUPPORTED_ROPE_TYPES`), so
that it cannot say more or less than the code does: `python -m gracelm.model.family_table` rewrites it,
and `tests/test_family_table.py` fails while it differs.
"""

from __future__ import annotations

import re
from pathlib import Path

from gracelm.config import EMBEDDING_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from gracelm.model.gguf_config import GGUF_ARCHITECTURES
from gracelm.model.rope import SUPPORTED_ROPE_TYPES

README = Path(__file__).resolve().parents[2] / "README.md"
START = "<!-- model families: written by `python -m gracelm.model.family_table` from the registries -->"
END = "<!-- end of model families -->"
# What each feature flag of `SUPPORTED_ARCHITECTURES` means to a reader.
_FEATURES = {"attention_bias": "q/k/v biases", "qk_norm": "q and k RMS norms",
             "fused_projections": "fused `qkv_proj` and `gate_up_proj` (GGUF: `attn_qkv`, gate+up `ffn_up`)"}


def family_table() -> str:
    """The markdown table, one row a Hugging Face architecture, and the lines that hold for every row."""
    embedding = {arch: name for name, arch in EMBEDDING_ARCHITECTURES.items()}
    rows = ["| architecture | GGUF `general.architecture` | its own features | tasks |", "|---|---|---|---|"]
    for arch, flags in SUPPORTED_ARCHITECTURES.items():
        gguf = ", ".join(f"`{name}`" for name, hf in GGUF_ARCHITECTURES.items() if hf == arch) or "none"
        features = "; ".join(_FEATURES[flag] for flag, on in flags.items() if on) or "none"
        tasks = f"generate; embed (`{embedding[arch]}` or sentence-transformers' files, safetensors)"
        rows.append(f"| `{arch}` | {gguf} | {features} | {tasks} |")
    ropes = ", ".join(f"`{kind}`" for kind in SUPPORTED_ROPE_TYPES)
    rows += ["", f"Every family: rope scaling {ropes} (LongRoPE within its original context), "
                 "partial rotary; the context ends where a sliding window or LongRoPE's original context "
                 "does (a longer `--max-model-len` is refused at start). Any other architecture, or feature, "
                 "is refused at start (exit 3) naming it."]
    return "\n".join(rows)


def with_family_table(text: str) -> str:
    """`text` (the README) with the part between the markers replaced by `family_table()`."""
    pattern = re.compile(f"{re.escape(START)}\n.*?{re.escape(END)}", re.DOTALL)
    if pattern.search(text) is None:
        raise ValueError(f"the README has no {START!r} ... {END!r} markers")
    return pattern.sub(lambda _: f"{START}\n{family_table()}\n{END}", text)


if __name__ == "__main__":
    README.write_text(with_family_table(README.read_text()))
