"""The offline `Engine`'s lifecycle guarantees: context manager, double and concurrent `shutdown()` with its
report, atexit alone, garbage collection, Ctrl-C inside `generate()`, and a replaceable `on_fatal`. Each
test ends with no child process and no runtime directory left."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from gracelm import Engine, SamplingParams
from tests.process_checks import assert_nothing_left, core_stamps, wait_until
from tests.tiny_models import tiny_model

TINY = {"kv_cache_memory": "1MiB", "num_threads": 1}


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


def test_context_manager_and_double_concurrent_shutdown_give_one_report(model, tmp_path):
    path = tmp_path / "report.json"
    with Engine(model, shutdown_report=str(path), **TINY) as llm:
        out = llm.generate("the cat", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        core = psutil.Process(llm._client.process.pid)
    assert not core.is_running()
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(llm.shutdown())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert reports[0] is reports[1] and reports[0].ok
    written = json.loads(path.read_text())
    kinds = {r["kind"] for r in written["resources"]}
    assert {"process", "model", "socket", "zmq context", "directory", "shared memory", "thread"} <= kinds
    assert_nothing_left()


def test_garbage_collection_stops_the_engine(model):
    llm = Engine(model, **TINY)
    core = psutil.Process(llm._client.process.pid)
    del llm
    gc.collect()
    core.wait(10)
    assert_nothing_left()


def test_on_fatal_replaces_the_default_reaction(model):
    seen: list[str] = []
    llm = Engine(model, on_fatal=seen.append, **TINY)
    core = psutil.Process(llm._client.process.pid)
    core.kill()
    deadline = time.monotonic() + 2
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and "killed by SIGKILL" in seen[0].message
    llm.shutdown()
    assert_nothing_left()


def _script(model: str, body: str) -> str:
    return textwrap.dedent(f"""
        import os, signal, sys
        # Ctrl-C as in a user's interpreter, whatever disposition or mask the test runner's process passed on
        # (an ignored SIGINT is inherited, and Python then installs no KeyboardInterrupt handler).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
        os.environ["GRACELM_TEST_HOOKS"] = '{{"test_step_sleep_s": 0.05}}'
        from gracelm import Engine, SamplingParams
        llm = Engine({model!r}, kv_cache_memory="1MiB", num_threads=1)
        print("core", llm._client.process.pid, flush=True)
    """) + textwrap.dedent(body)


def _run_script(source: str, interrupt: bool) -> tuple[int, str, int]:
    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    # The core's log lines (the test hooks' warning) may come first.
    before = []
    while (line := proc.stdout.readline()) and not line.startswith("core "):
        before.append(line)
    assert line.startswith("core "), "".join(before) + proc.stdout.read()
    core_pid = int(line.split()[1])
    if interrupt:
        # Well inside generate(), which runs for 20 s: its core steps (idle, sent nothing, it never stamps).
        stamps = core_stamps(proc.pid)
        wait_until(lambda: core_stamps(proc.pid) >= stamps + 4, 60, "the core to step in generate()")
        proc.send_signal(signal.SIGINT)
    # Read through the text wrapper: `readline` above may have buffered what followed.
    output = proc.stdout.read()
    return proc.wait(60), output, core_pid


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_atexit_alone_stops_the_engine(model):
    code, output, core_pid = _run_script(_script(model, 'print("done", flush=True)'), interrupt=False)
    assert code == 0 and "done" in output, output
    # The stop at exit is a requested one, never taken for a failure of the core.
    assert "engine failed" not in output and "engine core ended (exited)" not in output, output
    assert _gone(core_pid)


def test_a_failure_after_the_core_is_ready_stops_it_and_the_interpreter_exits(model):
    """Something of the engine's own start failing once the core serves (here the tokenizer the core sent):
    the error reaches the caller, the core is stopped, and the interpreter's exit does not wait for it."""
    source = textwrap.dedent(f"""
        import psutil
        from gracelm import Engine
        from gracelm.model.tokenizer import Tokenizer

        def broken(data):
            cores = [c.pid for c in psutil.Process().children() if "engine-core" in " ".join(c.cmdline())]
            print("core", *cores, flush=True)
            raise RuntimeError("a tokenizer that cannot be rebuilt")

        Tokenizer.from_dict = broken
        try:
            Engine({model!r}, kv_cache_memory="1MiB", num_threads=1)
        except RuntimeError as e:
            print("raised:", e, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "raised: a tokenizer that cannot be rebuilt" in proc.stdout, proc.stdout + proc.stderr
    [core_pid] = [int(pid) for line in proc.stdout.splitlines() if line.startswith("core ")
                  for pid in line.split()[1:]]
    assert _gone(core_pid)
    assert_nothing_left()


def test_ctrl_c_inside_generate_raises_keyboard_interrupt_and_leaves_no_child(model):
    body = """
        try:
            llm.generate("the cat", SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
        except KeyboardInterrupt:
            print("KeyboardInterrupt reached the user", flush=True)
            raise
    """
    code, output, core_pid = _run_script(_script(model, body), interrupt=True)
    assert "KeyboardInterrupt reached the user" in output, (code, output)
    assert code != 0
    assert _gone(core_pid)
