"""The compiled decode step (`model/decode_graph.py`) and its background build
(`parallel/decode_graph_build.py`), on a tiny 4-bit GGUF model: the graph gives eager's logits and writes the
KV cache as eager does, over paged, shuffled blocks at every context length it serves (in the dtype
`--dtype auto` gives: bfloat16, or float32 where bfloat16 is emulated); a server compiles it
in the background while it serves eagerly, then serves compiled, answers the same, and stops with nothing
left (during the compile too); the next start loads it from the cache without compiling."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from openai import OpenAI

from gracelm.model.attention import allocate_kv_cache
from gracelm.model.block_linear import serves as blocks_serve
from gracelm.model.decode_graph import MAX_CONTEXT, DecodeGraph, compile_graph, graph_batches
from gracelm.model.forward_batch import ForwardBatch
from gracelm.model.loader import load_model
from tests.server_process import ServerProcess
from tests.test_gguf import Q
from tests.test_quantized_linear import tiny_gguf

BLOCK = 16
COMPILE_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("decode-graph") / "tiny-q4.gguf", Q.Q4_1)


# The low-bit forms a graph is traced through: the blocks' 8-bit-activation kernel where this CPU runs it,
# and torch's int4 kernel.
FORMS = ["blocks", "int4"] if blocks_serve() else ["int4"]


@pytest.fixture(scope="module", params=FORMS)
def compiled(gguf: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    # bfloat16, or float32 where bfloat16 is emulated
    loaded = load_model(gguf, quantization=request.param)
    loaded.freeze()
    folder = tmp_path_factory.mktemp("graph")
    graphs = []
    for rows in graph_batches(loaded.model):
        compile_graph(loaded.model, BLOCK, rows, folder / f"{rows.start}.pt2")
        graphs.append(DecodeGraph.load(folder / f"{rows.start}.pt2", rows, BLOCK))
    return loaded.model, graphs


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
    model, graphs = compiled
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
    # Inductor rounds where eager rounds (emulate_precision_casts); a fused reduction may still sum in
    # another order, so the bound is bfloat16's rounding of the logits, not bit equality: a relative
    # step, or one step (2^-7) of the largest logit, which a hidden state one step off moves a small one by.
    torch.testing.assert_close(ours, eager, rtol=1.6e-2, atol=max(1e-2, 2**-7 * float(eager.abs().max())))
    assert ours.abs().max() > 1.0  # far from zero, so a wrong path would show
    for old, eager_cache, graph_cache in zip(before, eager_caches, graph_caches, strict=True):
        torch.testing.assert_close(graph_cache, eager_cache, rtol=1.6e-2, atol=1e-2)
        written = (graph_cache != old).any(-1).view(2, graph_cache.shape[1], -1)  # by slot
        slots = batch.slot_mapping
        assert written[..., slots].all() and written.sum() == written[..., slots].sum()  # those slots only


def test_each_graph_serves_its_sequences_of_a_bounded_context_only(compiled) -> None:
    _, (one, few) = compiled
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
    with ServerProcess(gguf, *args, env=env) as again:
        assert re.search(r"decode graph loaded.*\n(.*\n)*.*engine core ready", again.log()), again.log()
        assert "compiling in the background" not in again.log() and not compiler_pids(again)
        assert [greedy(again, p) for p in ("the cat", "a river of light")] == before


def test_a_stop_during_the_compile_leaves_nothing(gguf: Path, tmp_path: Path) -> None:
    env = {"GRACELM_CACHE_DIR": str(tmp_path / "cache")}
    server = ServerProcess(gguf, "--num-threads", "1", env=env)
    try:
        pids = compiler_pids(server)
        assert pids, server.log()
        server.process.send_signal(signal.SIGTERM)
        assert server.wait_exit() == 0, server.log()[-5000:]
        server.assert_nothing_left()
        assert not compiler_pids(server)
        assert not list((tmp_path / "cache" / "graphs").glob("*.pt2"))  # nothing half written
    finally:
        if server.process.poll() is None:
            server.kill()
        server.close_log()


def test_enforce_eager_compiles_nothing(gguf: Path, tmp_path: Path) -> None:
    env = {"GRACELM_CACHE_DIR": str(tmp_path / "cache")}
    with ServerProcess(gguf, "--enforce-eager", "--num-threads", "1", env=env) as server:
        assert not compiler_pids(server)
        assert "decode graph" not in server.log()
