"""The engine-core process as a process: start-up failures, stop, death, the default model, the CLI.

Every test ends by checking that no child process and no runtime directory of the test remains.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from gracelm import AsyncEngine, Engine, SamplingParams
from gracelm.engine.errors import EngineDeadError
from tests.process_checks import assert_nothing_left
from tests.tiny_models import tiny_model

TINY = {"kv_cache_memory": "1MiB", "num_threads": 1}


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


def test_bad_model_path_names_it_and_leaves_nothing(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(Exception, match=str(missing)):
        Engine(str(missing))
    assert_nothing_left()


def test_too_little_kv_memory_is_a_clear_start_up_error(model):
    with pytest.raises(Exception, match="not enough KV-cache memory"):
        Engine(model, kv_cache_memory="4KiB", max_model_len=512)
    assert_nothing_left()


def test_core_is_named_ignores_sigint_and_stops_fast(model):
    llm = Engine(model, **TINY)
    try:
        core = psutil.Process(llm._client.process.pid)
        runtime_dir = llm.runtime_dir
        assert "gracelm::engine-core" in " ".join(core.cmdline())
        assert runtime_dir.is_dir()
        assert {p.name for p in runtime_dir.iterdir()} == {
            "input.sock", "output.sock", "heartbeat", "tmp", "owner.lock"}
        core.send_signal(signal.SIGINT)  # Ctrl-C reaches the whole group; only the frontend may act on it
        # The core answers a call after the signal: a signal is handled before the core runs on, so had
        # SIGINT stopped it (its default action, or a KeyboardInterrupt), no answer would come.
        assert llm.stats()["num_running"] == 0 and core.is_running()
    finally:
        started = time.monotonic()
        llm.shutdown()
    assert time.monotonic() - started < 2.0
    assert not core.is_running() and not runtime_dir.exists()
    assert llm._client.process.outcome == "exited"
    assert_nothing_left()


def test_the_core_is_named_whatever_tmpdir_the_parent_has(model, tmp_path, monkeypatch):
    """The core's TMPDIR is its runtime directory's; a parent with its own TMPDIR once left the core
    unnamed (its title set after its environment changed)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    llm = Engine(model, **TINY)
    try:
        assert "gracelm::engine-core" in " ".join(psutil.Process(llm._client.process.pid).cmdline())
    finally:
        llm.shutdown()
    assert_nothing_left()


def test_killed_core_fails_in_flight_and_later_requests(model):
    engine = AsyncEngine(model, **TINY)
    long_run = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def scenario():
        stream = engine.generate("the cat", long_run, "victim")
        await anext(stream)  # in flight for sure
        os.kill(engine._client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await anext(engine.generate("a dog", long_run, "later"))
        with pytest.raises(EngineDeadError):
            await engine.stats()

    try:
        asyncio.run(scenario())
        assert engine.errored and not engine.is_running
    finally:
        engine.shutdown()
    assert_nothing_left()


def test_core_dies_with_its_parent_even_on_sigkill(model):
    script = textwrap.dedent(f"""
        import os, signal
        from gracelm import Engine
        llm = Engine({model!r}, kv_cache_memory="1MiB")
        print(llm._client.process.pid, llm.runtime_dir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    core_pid, runtime_dir = int(result.stdout.split()[0]), result.stdout.split()[1]
    # A SIGKILLed owner cannot remove its runtime directory: the next start reclaims such leftovers.
    shutil.rmtree(runtime_dir)
    deadline = time.monotonic() + 1.0
    while psutil.pid_exists(core_pid) and psutil.Process(core_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the engine core outlived its parent by more than a second"
        time.sleep(0.02)


QUESTION = "What is the capital of France? Answer in one sentence."


def test_default_model_chats_in_english_and_a_second_engine_works(model):
    # Not the bare question: its first token is a near tie ("The" or "L'Étoile...", 0.13 apart) that the
    # 8-bit activations of the blocks kernel flip where no AMX unit serves prompts, as llama.cpp's do.
    with Engine() as llm:
        core_pid = llm._client.process.pid
        runtime_dir = llm.runtime_dir
        [out] = llm.chat([{"role": "user", "content": QUESTION}],
                         SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert not psutil.pid_exists(core_pid) or psutil.Process(core_pid).status() == psutil.STATUS_ZOMBIE
    assert not runtime_dir.exists()
    with Engine(model, **TINY) as again:
        [second] = again.generate("a dog", SamplingParams(max_tokens=4), use_tqdm=False)
        assert second.finished and second.outputs[0].token_ids
    assert_nothing_left()


def test_cli_generate_streams_the_greedy_completion(model):
    with Engine(model, **TINY) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        expected = llm.generate("the cat runs", params, use_tqdm=False)[0].outputs[0].text
    cli = subprocess.Popen([sys.executable, "-m", "gracelm.cli.main", "generate", "--model", model,
                            "--prompt", "the cat runs", "--max-tokens", "16", "--kv-cache-memory", "1MiB"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = cli.communicate(timeout=120)
    assert cli.returncode == 0, stderr.decode()
    # ignore_eos is not a CLI option: the model may stop early, never differently.
    assert expected.startswith(stdout.decode().rstrip("\n"))
    assert stdout.decode().strip()
    assert_nothing_left()


def test_script_without_main_guard_or_shutdown_exits_cleanly(model, tmp_path):
    # No `if __name__ == "__main__"` (spawn must not re-run the script in the child) and no shutdown():
    # the atexit hook stops the core, before multiprocessing's own hook would wait for it for ever.
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        from gracelm import Engine, SamplingParams
        llm = Engine({model!r}, kv_cache_memory="1MiB")
        out = llm.generate("a dog", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        print(llm._client.process.pid, llm.runtime_dir, len(out[0].outputs[0].token_ids))
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    pid, runtime_dir, num_tokens = result.stdout.split()
    assert num_tokens == "3" and not psutil.pid_exists(int(pid)) and not os.path.exists(runtime_dir)
