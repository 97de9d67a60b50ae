"""The layers of `gracelm/` (docs/architecture.md, "Layers"): cli → deploy → server → serving →
observability → engine → parallel → model, with lifecycle and batch below the HTTP side and beside the
engine, and the top-level modules under all of them. Nothing
imports upward and no import cycle exists — lazy imports (inside functions) included, since a cycle through
a lazy import is still a knot in the design. The modules that must stay torch-free import no torch, even
lazily."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server_process import ServerProcess
from tests.tiny_models import tiny_model

PACKAGE = Path(__file__).resolve().parent.parent / "gracelm"
# What each layer may import, besides itself. The top-level modules (config, options, ...) are "base".
ALLOWED = {
    "cli": {"deploy", "server", "serving", "observability", "engine", "parallel", "model", "lifecycle",
            "batch", "base"},
    "deploy": {"serving", "engine", "lifecycle", "base"},
    "server": {"serving", "observability", "engine", "model", "lifecycle", "batch", "base"},
    "serving": {"observability", "engine", "model", "lifecycle", "batch", "base"},
    "observability": {"base"},
    "engine": {"parallel", "model", "lifecycle", "base"},
    "parallel": {"model", "lifecycle", "base"},
    "model": {"base"},
    "lifecycle": {"base"},
    "batch": {"lifecycle", "base"},
    "base": set(),
}
# The package's root re-exports the public API (`from gracelm import Engine`): it is above every layer.
FACADE = "gracelm"
# Modules that must run without torch: the scheduler's side, and all that the HTTP process loads.
TORCH_FREE = ("gracelm.engine.scheduler", "gracelm.engine.kv_cache_manager", "gracelm.engine.request")


def _modules() -> dict[str, Path]:
    modules = {}
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        modules[name] = file
    return modules


def _imports(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that `name` imports, at the top or inside a function."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in modules and module != name}


def _external_imports(file: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else "base"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, file, modules) for name, file in modules.items()}


def test_the_graph_sees_lazy_and_relative_imports(graph):
    # The checker itself: a lazy import inside a function counts (the CLI imports the server lazily).
    assert "gracelm.server.api_server" in graph["gracelm.cli.main"]
    assert "gracelm.engine.core_monitor" in graph["gracelm.engine.core_client"]
    assert layer("gracelm.config") == "base" and layer("gracelm.engine") == "engine"
    assert layer("gracelm.lifecycle.supervisor") == "lifecycle"


def test_no_module_imports_upward(graph):
    upward = [f"{module} ({layer(module)}) imports {target} ({layer(target)})"
              for module, targets in sorted(graph.items()) if module != FACADE
              for target in sorted(targets)
              if layer(target) != layer(module) and layer(target) not in ALLOWED[layer(module)]]
    assert upward == []


def test_no_import_cycle(graph):
    cycles = []
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_torch_free_modules_import_no_torch_even_lazily(graph):
    modules = _modules()
    heavy = {"torch", "transformers"}
    for name in TORCH_FREE:
        reachable, todo = set(), [name]
        while todo:  # everything the module pulls in from the package, transitively
            module = todo.pop()
            if module not in reachable:
                reachable.add(module)
                todo.extend(graph[module])
        offenders = {m: _external_imports(modules[m]) & heavy for m in reachable}
        assert {m: found for m, found in offenders.items() if found} == {}, name


def test_a_serving_supervisor_has_no_torch_mapped():
    """The HTTP process (the supervisor) never loads torch: its tokenizer comes from the engine core as
    data, rebuilt with `tokenizers`; only the core maps libtorch."""
    with ServerProcess(tiny_model("llama"), "--kv-cache-memory", "1MiB", "--num-threads", "1",
                       "--stats-interval", "0") as server:
        reply = httpx.post(f"{server.url}/v1/completions",
                           json={"prompt": "the cat", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200
        supervisor = Path(f"/proc/{server.pid}/maps").read_text()
        (core,) = [c for c in psutil.Process(server.pid).children() if "engine-core" in " ".join(c.cmdline())]
        core_maps = Path(f"/proc/{core.pid}/maps").read_text()
    assert "libtorch" in core_maps  # the check can see a mapped torch where there is one
    assert "libtorch" not in supervisor and "torch/lib" not in supervisor
