"""Suite-wide settings. The suite runs the pytest process and engine-core processes side by side on few
cores: OpenMP threads that spin while waiting then steal the cores the other process needs (measured: a
default-model forward 10x slower under load), so test processes wait passively. Set before torch loads.

Under pytest-xdist (`-n 2`, in pyproject.toml's addopts) each worker has a TMPDIR of its own, and each
test module runs whole on one worker (`pytest_xdist_make_scheduler`)."""

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gracelm.cache_dir import ENV

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The modules that use the session's compiled decode graphs (`graph_cache`): on one worker, which builds them
# once for both.
GRAPH_MODULES = ("test_decode_graph.py", "test_kernel_paths.py")
GRAPH_BUILD_TIMEOUT_S = 900


def _own_temp_dir_per_worker() -> None:
    """A test checks that its server left nothing in TMPDIR: a server of the other worker is not its own. The
    folder is short (socket paths in it must stay within 107 characters), and removed at exit, after what the
    tests made in it (atexit runs last what registered first)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    path = Path(tempfile.gettempdir()) / f"gracelm-tests-{os.getppid()}-{worker}"
    path.mkdir(exist_ok=True)
    atexit.register(shutil.rmtree, path, True)
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None


_own_temp_dir_per_worker()


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist's scheduler here: each module whole on one worker, in its order (some tests follow each
    other, a restart reading what the test before it left), its module-scoped servers started once; the two
    modules of the compiled graphs together. Called in the controller only; the largest groups go first."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "compiled-graphs" if Path(module).name in GRAPH_MODULES else module

    return ByModule(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first test that needs the suite's graphs builds them: its time includes the build."""
    for item in items:
        if "graph_cache" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(GRAPH_BUILD_TIMEOUT_S))


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite's cache directory (`GRACELM_CACHE_DIR`, inherited by the servers it starts): a temporary one
    per session, so that tests never write to ~/.cache and every session starts with a cold cache.

    Inductor's cache of compiled kernels (`TORCHINDUCTOR_CACHE_DIR`, which the graph compiler takes where it
    is set) is one for the session too: a test that compiles a model's graphs into a cache of its own finds
    the kernels of the same graphs compiled before, and compiles only what is new."""
    path = tmp_path_factory.mktemp("gracelm-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, str(path))
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor-cache")))
        yield path


@pytest.fixture(scope="session")
def graph_cache(private_cache_dir: Path) -> Path:
    """The suite's cache with the decode graphs of every compiled path this machine runs
    (`tests/kernel_paths.py`), built once, two at a time, when a test first needs them."""
    from tests.kernel_paths import PATHS, build_graphs

    build_graphs([path for path in PATHS if path.compiled and path.why_not_here() is None], private_cache_dir)
    return private_cache_dir
