"""The compiled decode step (`model/decode_graph.py`), its check (`model/decode_graph_check.py`) and its
background build (`parallel/decode_graph_build.py`), on the path matrix's tiny 4-bit GGUF model: the graph
of each path this process can run gives eager's logits and writes the KV cache as eager does, over paged,
shuffled blocks at every context length it serves; it passes its check, and a graph that computes otherwise
or raises does not serve; a server compiles it in the background while it serves eagerly, then serves
compiled, answers the same, and stops with nothing left (during the compile too); the next start loads it
from the cache without compiling, and nothing of the packages is left in TMPDIR."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from openai import OpenAI

import gracelm.cpu_features as cpu_features
from gracelm.config import EngineConfig
from gracelm.lifecycle.ledger import Ledger
from gracelm.model import decode_graph, decode_graph_proof
from gracelm.model.attention import allocate_kv_cache
from gracelm.model.block_linear import serves as blocks_serve
from gracelm.model.decode_graph import MAX_CONTEXT, DecodeGraph, damaged
from gracelm.model.decode_graph_check import check, close
from gracelm.model.decode_graph_proof import keep_proof, proof_path, proven
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.loader import LoadedModel, load_model
from gracelm.parallel import decode_graph_build
from gracelm.parallel.decode_graph_build import DecodeGraphBuild, graph_files
from gracelm.parallel.worker import dense_weights_for
from tests.faults.helpers import small_filesystem
from tests.kernel_paths import BY_NAME, KernelPath, matrix_gguf
from tests.server_process import ServerProcess

BLOCK = 16
COMPILE_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def gguf() -> Path:
    return matrix_gguf()


# The paths whose graphs this process can run as they were built (`tests/kernel_paths.py`): those whose
# masked features leave torch's own kernels as they are here (an AVX2 path packs torch's int4 weights for
# AVX2, which this process's int4 kernel would read as its own). The others run in the path matrix.
IN_PROCESS = [BY_NAME[name] for name in ("blocks-amx", "blocks-vnni", "int4-bfloat16")
              if BY_NAME[name].why_not_here() is None]


@contextlib.contextmanager
def path_model(gguf: Path, path: KernelPath) -> Iterator[tuple[EngineConfig, LoadedModel, dict[range, Path]]]:
    """The engine options of a path, its model in bfloat16 (or float32 where bfloat16 is emulated) and the
    packages of the graphs the suite built for it (`conftest.graph_cache`); the path's CPU features masked
    meanwhile."""
    with cpu_features.masking(path.mask):
        config = EngineConfig(model=str(gguf), **path.engine_options())
        loaded = load_model(gguf, dense_weights=dense_weights_for(config))  # the model a server's core has
        loaded.freeze()
        yield config, loaded, graph_files(config, loaded)


@pytest.fixture(scope="module", params=IN_PROCESS, ids=lambda path: path.name)
def compiled(gguf: Path, graph_cache: Path, request: pytest.FixtureRequest) -> Iterator[tuple]:
    """A path's model with its graphs loaded (not serving) and their packages."""
    with path_model(gguf, request.param) as (_, loaded, files):
        graphs = [DecodeGraph.load(file, rows, BLOCK, loaded.model.model) for rows, file in files.items()]
        yield loaded.model, graphs, list(files.values())


def decode_batch(contexts: list[int], tables: torch.Tensor) -> ForwardBatch:
    """Each sequence's decode token at position `contexts[i]` (after that many cached tokens)."""
    width = max(contexts) // BLOCK + 1
    slots = [int(tables[i, c // BLOCK]) * BLOCK + c % BLOCK for i, c in enumerate(contexts)]
    return ForwardBatch(input_ids=torch.arange(7, 7 + len(contexts)), positions=torch.tensor(contexts),
                        slot_mapping=torch.tensor(slots), query_lens=[1] * len(contexts),
                        seq_lens=[c + 1 for c in contexts], block_tables=tables[:, :width].contiguous(),
                        logits_indices=torch.arange(len(contexts)))


@pytest.mark.parametrize(("contexts"), [[0], [1], [15], [16], [17], [100], [MAX_CONTEXT - 1], [3, 40],
                                        [16, 0, 200, 33, 31], [MAX_CONTEXT - 1, 5, 17, 64, 1, 0, 300, 48],
                                        [BLOCK, 3, 9], [3, 0, 14], [BLOCK - 1] * 5,
                                        [17 * i % 300 + 16 for i in range(12)],
                                        [29 * i % 700 + 16 for i in range(33)]], ids=lambda c: str(c)[:40])
def test_the_graph_gives_eagers_logits_and_cache_over_shuffled_blocks(compiled, contexts: list[int]) -> None:
    """Mixed lengths, blocks in no order and none contiguous, of one sequence and of several (more than 8
    where the blocks' kernel serves the graph: torch's int4 kernel's graph stops at 8)."""
    model, graphs, _ = compiled
    if not any(g.rows.stop > len(contexts) for g in graphs):
        assert model.model.int4_gate.max_rows == 8 and len(contexts) > 8  # eager's, as the gate says
        return
    per_seq = MAX_CONTEXT // BLOCK + 1
    generator = torch.Generator().manual_seed(len(contexts) * 1000 + contexts[0])
    tables = torch.randperm(len(contexts) * per_seq + 4, generator=generator)[:len(contexts) * per_seq]
    tables = tables.view(len(contexts), per_seq)
    before = allocate_kv_cache(model.config, len(contexts) * per_seq + 4, BLOCK,
                               model.model.embed_tokens.weight.dtype)
    for cache in before:
        cache.normal_(generator=generator)
    eager_caches, graph_caches = [c.clone() for c in before], [c.clone() for c in before]
    batch = decode_batch(contexts, tables)
    [graph] = [g for g in graphs if g.serves(batch)]
    with torch.inference_mode():
        model.model.decode_graphs = []
        eager = model(batch, eager_caches)
        model.model.decode_graphs = [graph]
        ours = model(batch, graph_caches)
    model.model.decode_graphs = []
    # Within bfloat16's rounding, not bit equal: a fused reduction may sum in another order.
    assert close(ours, eager), float((ours - eager).abs().max())
    assert ours.abs().max() > 1.0  # far from zero, so a wrong path would show
    for old, eager_cache, graph_cache in zip(before, eager_caches, graph_caches, strict=True):
        torch.testing.assert_close(graph_cache, eager_cache, rtol=1.6e-2, atol=1e-2)
        written = (graph_cache != old).any(-1).view(2, graph_cache.shape[1], -1)  # by slot
        slots = batch.slot_mapping
        assert written[..., slots].all() and written.sum() == written[..., slots].sum()  # those slots only


def test_each_graph_serves_its_sequences_of_a_bounded_context_only(compiled) -> None:
    _, (one, few), _ = compiled
    most = few.rows.stop - 1  # the low-bit forms' rows: 8 for torch's int4 kernel, more for the blocks'
    assert most == 8 or most > 8 and blocks_serve()
    tables = torch.arange((most + 1) * (MAX_CONTEXT // BLOCK + 2)).view(most + 1, -1)
    alone = decode_batch([MAX_CONTEXT - 1], tables[:1])
    assert one.serves(alone) and not few.serves(alone)
    assert few.serves(decode_batch([BLOCK] * most, tables[:most]))
    assert not one.serves(decode_batch([BLOCK, 4], tables[:2]))
    assert not few.serves(decode_batch([BLOCK] * (most + 1), tables))  # above the forms' rows
    # Several sequences all within one block: compiled too (given a second, masked block).
    assert few.serves(decode_batch([3, BLOCK - 2], tables[:2]))
    assert few.serves(decode_batch([3, BLOCK], tables[:2]))
    assert not one.serves(decode_batch([MAX_CONTEXT], tables[:1]))  # longer: eager is faster there
    prompt = ForwardBatch(input_ids=torch.tensor([1, 2]), positions=torch.tensor([0, 1]),
                          slot_mapping=torch.tensor([0, 1]), query_lens=[2], seq_lens=[2],
                          block_tables=torch.tensor([[0]]), logits_indices=torch.tensor([1]))
    mixed = ForwardBatch(input_ids=torch.tensor([1, 2, 3]), positions=torch.tensor([0, 1, 9]),
                         slot_mapping=torch.tensor([0, 1, 25]), query_lens=[2, 1], seq_lens=[2, 10],
                         block_tables=torch.tensor([[0], [1]]), logits_indices=torch.tensor([1, 2]))
    assert not any(g.serves(b) for g in (one, few) for b in (prompt, mixed))


def test_each_graph_passes_its_check(compiled) -> None:
    model, graphs, _ = compiled
    assert check(model, graphs, BLOCK) == [None] * len(graphs)
    for graph in graphs:
        assert check(model, [graph], BLOCK) == [None]


class Wrong(DecodeGraph):
    """A graph that computes otherwise: its hidden states one bfloat16 step and more off."""

    def __call__(self, *args) -> torch.Tensor:
        out = super().__call__(*args)
        return out + 0.05 * out.abs().max()


class Raising(DecodeGraph):
    def __call__(self, *args) -> torch.Tensor:
        raise RuntimeError("a defect of the compiled code")


def as_graph(graph: DecodeGraph, kind: type[DecodeGraph]) -> DecodeGraph:
    broken = copy.copy(graph)
    broken.__class__ = kind
    return broken


def test_a_graph_that_computes_otherwise_or_raises_fails_its_check(compiled) -> None:
    model, graphs, _ = compiled
    for graph in graphs:
        [wrong] = check(model, [as_graph(graph, Wrong)], BLOCK)
        assert "logits differ from eager's by up to" in wrong
        assert check(model, [as_graph(graph, Raising)], BLOCK) == [
            "a compiled step raised RuntimeError: a defect of the compiled code"]
    # Checked together, a failing graph fails alone.
    assert check(model, [as_graph(graphs[0], Raising), *graphs[1:]], BLOCK) == [
        "a compiled step raised RuntimeError: a defect of the compiled code", *[None] * (len(graphs) - 1)]
    assert model.model.decode_graphs == [] and model.model.decode_graph_failure is None


class ServesNothing(DecodeGraph):
    def serves(self, batch: ForwardBatch) -> bool:
        return False


class ServesMixedSteps(DecodeGraph):
    """Takes every step, a prompt's rows too: its own decode steps as the graph computes them."""

    def serves(self, batch: ForwardBatch) -> bool:
        return True

    def __call__(self, x: torch.Tensor, *args) -> torch.Tensor:
        return super().__call__(x, *args) if x.shape[0] <= 3 else torch.zeros_like(x)


def test_a_graph_that_skips_its_own_steps_or_takes_mixed_ones_fails_its_check(compiled) -> None:
    model, graphs, _ = compiled
    for graph in graphs:
        assert check(model, [as_graph(graph, ServesNothing)], BLOCK) == [
            "it does not serve a step of its own sequences"]
        # Served, a mixed step's rows meet a head that expects its own: it raises there, or is caught after.
        [problem] = check(model, [as_graph(graph, ServesMixedSteps)], BLOCK)
        assert problem == "a graph served a mixed step" or problem.startswith("a check step raised"), problem
    # The mixed step is shared: a graph that takes it fails the graphs checked with it, and a graph already
    # serving beside them takes part in it.
    mixed = [as_graph(graphs[0], ServesMixedSteps), *graphs[1:]]
    assert all(problem is not None for problem in check(model, mixed, BLOCK))
    assert all(problem is not None for problem in check(model, graphs[1:] or graphs, BLOCK,
                                                        serving=(mixed[0],)))
    assert model.model.decode_graphs == [] and model.model.decode_graph_failure is None


@pytest.fixture()
def own_graph_cache(gguf: Path, graph_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                    ) -> Iterator[tuple[EngineConfig, LoadedModel, list[Path]]]:
    """The first in-process path's model, and a cache of its own holding copies of its packages (the proofs
    written here stay out of the suite's cache, whose servers would otherwise skip their checks)."""
    monkeypatch.setenv("GRACELM_CACHE_DIR", str(tmp_path))
    with path_model(gguf, IN_PROCESS[0]) as (config, loaded, files):
        for package in files.values():
            shutil.copy(graph_cache / "graphs" / package.name, package)
        yield config, loaded, list(files.values())


def built(config: EngineConfig, loaded: LoadedModel, checked: list[int], monkeypatch: pytest.MonkeyPatch,
          verdict: str | None = None) -> list[DecodeGraph]:
    """The graphs a start's build of `loaded` serves (its packages all written), each check's count of graphs
    appended to `checked`; `verdict`: every check's answer instead of the real one."""
    def spied(model, graphs, *args, **kwargs) -> list[str | None]:
        checked.append(len(graphs))
        return [verdict] * len(graphs) if verdict else check(model, graphs, *args, **kwargs)

    monkeypatch.setattr(decode_graph_build, "check", spied)
    loaded.model.model.decode_graphs = []
    try:
        build = DecodeGraphBuild(config, loaded, 0, Ledger())
        assert build.status() in ("compiled", "eager-fallback")  # nothing compiling: every package was there
        return loaded.model.model.decode_graphs
    finally:
        loaded.model.model.decode_graphs = []


def test_a_graph_that_passed_its_check_is_not_checked_again_with_the_same_code(
        own_graph_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    config, loaded, packages = own_graph_cache
    checked: list[int] = []
    assert len(built(config, loaded, checked, monkeypatch, verdict="a defect")) == 0
    assert checked == [len(packages)] and not any(proof_path(p).exists() for p in packages)  # failed: none
    assert len(built(config, loaded, checked, monkeypatch)) == len(packages)
    assert checked[1:] == [len(packages)] and all(proven(p) for p in packages)
    assert len(built(config, loaded, checked, monkeypatch)) == len(packages)
    assert checked[2:] == [0]  # proven, loaded unchecked
    # Another thread count, or other code: the check runs again.
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert not any(proven(p) for p in packages)
    finally:
        torch.set_num_threads(threads)
    with monkeypatch.context() as patch:
        patch.setattr(decode_graph_proof, "code_digest", lambda: "other code")
        assert not any(proven(p) for p in packages)
        assert len(built(config, loaded, checked, monkeypatch)) == len(packages)
        assert checked[3:] == [len(packages)] and all(proven(p) for p in packages)
    assert not any(proven(p) for p in packages)  # the proofs now state the other code


def test_a_proof_holds_for_its_packages_bytes_only_and_goes_with_its_package(own_graph_cache) -> None:
    _, _, packages = own_graph_cache
    package = packages[0]
    keep_proof(package)
    assert proven(package) and set(json.loads(proof_path(package).read_bytes())) == {"package", "code",
                                                                                     "threads"}
    with package.open("ab") as file:
        file.write(b"\0")  # other bytes under the same key
    assert not proven(package)
    proof_path(package).write_bytes(b"not json")
    assert not proven(package)
    package.unlink()
    decode_graph._prune(package.parent)
    assert not proof_path(package).exists()
    assert all(p.exists() for p in packages[1:])


def test_a_compiled_step_that_raises_is_run_eagerly_and_the_graphs_are_dropped(compiled) -> None:
    model, graphs, _ = compiled
    caches = allocate_kv_cache(model.config, 8, BLOCK, model.model.embed_tokens.weight.dtype)
    batch = decode_batch([17, 3], torch.arange(8).view(2, 4))
    with torch.inference_mode():
        eager = model(batch, [cache.clone() for cache in caches])
        model.model.decode_graphs = [as_graph(graph, Raising) for graph in graphs]
        try:
            ours = model(batch, caches)
        finally:
            dropped, model.model.decode_graphs = model.model.decode_graphs, []
            failure, model.model.decode_graph_failure = model.model.decode_graph_failure, None
    assert torch.equal(ours, eager) and dropped == []
    assert failure == "a compiled step raised RuntimeError: a defect of the compiled code"


def test_a_step_of_a_prompt_beside_decode_tokens_runs_eagerly_with_graphs_loaded(compiled) -> None:
    """The crash of every compiled path on a CPU without AMX (and with it): a long prompt's rows, which take
    the dense weights, beside decode rows, with the graphs loaded."""
    model, graphs, _ = compiled
    caches = allocate_kv_cache(model.config, 12, BLOCK, model.model.embed_tokens.weight.dtype)
    prompt = 40  # in blocks 1-3; then decode tokens at positions 20 (blocks 5, 6) and 9 (block 8)
    batch = ForwardBatch(input_ids=torch.arange(3, 5 + prompt),
                         positions=torch.tensor([*range(prompt), 20, 9]),
                         slot_mapping=torch.tensor([*range(16, 16 + prompt), 6 * 16 + 4, 8 * 16 + 9]),
                         query_lens=[prompt, 1, 1], seq_lens=[prompt, 21, 10],
                         block_tables=torch.tensor([[1, 2, 3], [5, 6, 0], [8, 0, 0]]),
                         logits_indices=torch.tensor([prompt - 1, prompt, prompt + 1]),
                         prompt_lens=[prompt, 3, 2])
    with torch.inference_mode():
        eager = model(batch, [cache.clone() for cache in caches])
        model.model.decode_graphs = graphs
        try:
            ours = model(batch, caches)
        finally:
            model.model.decode_graphs = []
    assert torch.equal(ours, eager)


def test_loading_leaves_nothing_in_the_temporary_directory_and_a_full_one_costs_only_the_graph(
        compiled, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's loader unpacks a package into $TMPDIR: removed at once, also when the filesystem is full (the
    package is then kept: it is whole)."""
    model, graphs, packages = compiled
    package = packages[0]
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    DecodeGraph.load(package, graphs[0].rows, BLOCK, model.model)
    assert list(tmp_path.iterdir()) == []
    with small_filesystem("256k") as full:
        monkeypatch.setenv("TMPDIR", str(full))
        monkeypatch.setattr(tempfile, "tempdir", None)
        with pytest.raises(Exception):  # noqa: B017 - whatever torch raises for a full disk
            DecodeGraph.load(package, graphs[0].rows, BLOCK, model.model)
        assert list(full.iterdir()) == []
    assert package.exists() and not damaged(package)


def wait_for_log(server: ServerProcess, text: str, count: int, timeout: float) -> None:
    """Until `text` is in the server's log `count` times."""
    deadline = time.monotonic() + timeout
    while server.log().count(text) < count:
        assert server.process.poll() is None, server.log()[-5000:]
        assert time.monotonic() < deadline, f"{text!r} not logged in {timeout} s:\n{server.log()[-5000:]}"
        time.sleep(0.2)


def greedy(server: ServerProcess, prompt: str) -> str:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    return answer.choices[0].text


def compiler_pids(server: ServerProcess) -> list[int]:
    """The compilers the core said it started that are still running."""
    pids = [int(pid) for pid in re.findall(r"compiling in the background \(pid (\d+)\)", server.log())]
    return [pid for pid in pids
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_a_server_compiles_in_the_background_then_serves_compiled_and_the_next_start_loads_it(
        gguf: Path, tmp_path: Path) -> None:
    env = {"GRACELM_CACHE_DIR": str(tmp_path / "cache")}
    args = ("--served-model-name", "tiny", "--num-threads", "1", "--kv-cache-memory", "8MiB")
    with ServerProcess(gguf, *args, env=env) as server:
        assert compiler_pids(server), server.log()  # started at once, the server already ready
        log = server.log()
        assert log.index("warm-up: ") < log.index("compiling in the background"), log  # not beside its steps
        before = [greedy(server, p) for p in ("the cat", "a river of light")]  # eager meanwhile
        wait_for_log(server, "decode graph written to", 2, COMPILE_TIMEOUT_S)
        psutil.wait_procs([psutil.Process(pid) for pid in compiler_pids(server)], timeout=30)
        after = [greedy(server, p) for p in ("the cat", "a river of light")]  # the first step loads it
        assert "decode graph loaded" in server.log()
        assert after == before  # same greedy answers compiled as eager
        server.stop()
        assert re.search(r"decode graph compiler \(pid \d+\).*released", server.log()), server.log()[-3000:]
    packages = list((tmp_path / "cache" / "graphs").glob("*.pt2"))
    assert len(packages) == 2 and not any(p.name.startswith(".") for p in packages)
    assert all(proof_path(p).exists() for p in packages)  # checked as they loaded
    with ServerProcess(gguf, *args, env=env) as again:
        assert re.search(r"decode graph loaded.*\n(.*\n)*.*engine core ready", again.log()), again.log()
        assert again.log().count("run compiled (its check passed at an earlier start)") == 2, again.log()
        assert "compiling in the background" not in again.log() and not compiler_pids(again)
        assert [greedy(again, p) for p in ("the cat", "a river of light")] == before


def test_a_stop_during_the_compile_leaves_nothing_and_keeps_each_graph_written(gguf: Path,
                                                                              tmp_path: Path) -> None:
    """A stop kills the compiler: nothing half written is left, the graph written before it is kept, and
    the next start compiles only the other one."""
    env = {"GRACELM_CACHE_DIR": str(tmp_path / "cache")}
    packages = tmp_path / "cache" / "graphs"
    server = ServerProcess(gguf, "--num-threads", "1", env=env)  # stopped at once
    stop_during_the_compile(server)
    assert not list(packages.glob("*.pt2")) and not list(packages.glob(".*"))  # nothing half written
    server = ServerProcess(gguf, "--num-threads", "1", env=env)  # stopped once one graph is written
    wait_for_log(server, "decode graph written to", 1, COMPILE_TIMEOUT_S)
    stop_during_the_compile(server)
    assert len(list(packages.glob("*.pt2"))) == 1 and not list(packages.glob(".*"))
    with ServerProcess(gguf, "--num-threads", "1", env=env) as again:
        assert re.search(r"decode graph loaded from .*: decode steps of 1 to 1 sequences", again.log())
        assert "compiling in the background (pid" in again.log() and "1 graph(s)" in again.log()


def stop_during_the_compile(server: ServerProcess) -> None:
    """SIGTERM while the compiler runs: a clean stop that leaves nothing, the compiler included."""
    try:
        assert compiler_pids(server), server.log()
        server.process.send_signal(signal.SIGTERM)
        assert server.wait_exit() == 0, server.log()[-5000:]
        server.assert_nothing_left()
        assert not compiler_pids(server)
    finally:
        if server.process.poll() is None:
            server.kill()
        server.close_log()


def test_enforce_eager_compiles_nothing(gguf: Path, tmp_path: Path) -> None:
    env = {"GRACELM_CACHE_DIR": str(tmp_path / "cache")}
    with ServerProcess(gguf, "--enforce-eager", "--num-threads", "1", env=env) as server:
        assert not compiler_pids(server)
        assert "decode graph" not in server.log()
