"""Suite-wide settings. The suite runs the pytest process and engine-core processes side by side on few
cores: OpenMP threads that spin while waiting then steal the cores the other process needs (measured: a
default-model forward 10x slower under load), so test processes wait passively. Set before torch loads."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gracelm.cache_dir import ENV

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite's cache directory (`GRACELM_CACHE_DIR`, inherited by the servers it starts): a temporary one
    per session, so that tests never write to ~/.cache and every session starts with a cold cache."""
    path = tmp_path_factory.mktemp("gracelm-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, str(path))
        yield path


@pytest.fixture(scope="session")
def graph_cache(private_cache_dir: Path) -> Path:
    """The suite's cache with the decode graphs of every compiled path this machine runs
    (`tests/kernel_paths.py`), built once, two at a time, when a test first needs them."""
    from tests.kernel_paths import PATHS, build_graphs

    build_graphs([path for path in PATHS if path.compiled and path.why_not_here() is None], private_cache_dir)
    return private_cache_dir
