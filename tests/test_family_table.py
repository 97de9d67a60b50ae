"""The README's table of model families is the one `gracelm.model.family_table` writes from the registries:
a family added, refused or changed in the code fails here until the README is rewritten
(`python -m gracelm.model.family_table`)."""

from __future__ import annotations

from gracelm.config import SUPPORTED_ARCHITECTURES
from gracelm.model.family_table import README, family_table, with_family_table
from gracelm.model.gguf_config import GGUF_ARCHITECTURES


def test_the_readme_holds_the_table_the_registries_make() -> None:
    text = README.read_text()
    assert with_family_table(text) == text, "rewrite it: python -m gracelm.model.family_table"


def test_every_registered_family_has_a_row() -> None:
    table = family_table()
    for arch in SUPPORTED_ARCHITECTURES:
        assert f"| `{arch}` |" in table
    for gguf_arch in GGUF_ARCHITECTURES:
        assert f"`{gguf_arch}`" in table
