"""`gracelm run-batch` as a user runs it: interrupted with Ctrl-C (SIGINT) half-way, it keeps its finished
lines and exits 130 without writing the output; the same command resumes, runs only the lines left (none
redone), and writes every line once, in input order, in vLLM's run-batch format. A bad input file is
refused before any engine starts. Nothing of either run is left behind (process, runtime directory)."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import psutil

from gracelm.batch.journal import DB_NAME
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base
from tests.batch_helpers import chat_line, chat_lines, integrity, journal_rows, jsonl
from tests.server_process import GRACELM
from tests.tiny_models import tiny_model


def start(input_file: Path, output_file: Path, hooks: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "GRACELM_TEST_HOOKS": json.dumps(hooks or {})}
    return subprocess.Popen([str(GRACELM), "run-batch", "-i", str(input_file), "-o", str(output_file),
                             "--model", str(tiny_model("llama")), "--kv-cache-memory", "4MiB",
                             "--max-model-len", "256", "--num-threads", "1", "--max-num-seqs", "4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def finish(process: subprocess.Popen, children: list[psutil.Process]) -> str:
    """Waits for the run's end; asserts that nothing of it is left; returns its stderr."""
    _, stderr = process.communicate(timeout=120)
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"processes left behind: {alive}"
    assert not list(runtime_base().glob(f"{PREFIX}{process.pid}-*")), "runtime directory left behind"
    return stderr


def results(state_dir: Path) -> int:
    """The results committed so far (0 while the journal is being made)."""
    if not (state_dir / DB_NAME).exists():
        return 0
    try:
        return journal_rows(state_dir, "SELECT COUNT(*) FROM results")[0][0]
    except sqlite3.OperationalError:  # no table yet
        return 0


def lines_run_now(stderr: str) -> int:
    return int(re.search(r"(\d+) (?:lines )?run now", stderr).group(1))


def test_run_batch_interrupted_by_ctrl_c_resumes_without_redoing_a_line(tmp_path):
    lines = chat_lines(16, max_tokens=8, ignore_eos=True) + [chat_line("refused", "x", max_tokens=100_000)]
    input_file, output_file = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_file.write_bytes(jsonl(lines))
    state_dir = Path(f"{output_file}.state")  # the default, beside the output

    first = start(input_file, output_file, hooks={"test_step_sleep_s": 0.05})
    deadline = time.monotonic() + 120
    while results(state_dir) < 4:
        assert first.poll() is None, first.communicate()[1]
        assert time.monotonic() < deadline, "no line finished in time"
        time.sleep(0.1)
    children = psutil.Process(first.pid).children(recursive=True)
    first.send_signal(signal.SIGINT)
    stderr = finish(first, children)
    assert first.returncode == ExitCode.INTERRUPTED, stderr
    assert not output_file.exists()
    done_before = results(state_dir)
    assert 4 <= done_before < len(lines) and lines_run_now(stderr) == done_before
    assert journal_rows(state_dir, "SELECT COUNT(*) FROM lines WHERE state = 'failed'")[0][0] <= 1

    second = start(input_file, output_file)
    stderr = finish(second, [])
    assert second.returncode == 0, stderr
    assert lines_run_now(stderr) == len(lines) - done_before  # the finished lines were not run again
    outputs = [json.loads(text) for text in output_file.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [line["custom_id"] for line in lines]  # once each, in order
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in outputs[:-1])
    refused = outputs[-1]  # vLLM's format: the error body in `error`, no response body
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"] is None
    assert refused["error"]["error"]["code"] == "context_length_exceeded"
    assert journal_rows(state_dir, "SELECT MAX(attempt) FROM lines")[0][0] <= 2
    assert integrity(state_dir) == "ok"


def test_run_batch_refuses_a_bad_input_file_before_starting(tmp_path):
    input_file = tmp_path / "in.jsonl"
    input_file.write_bytes(jsonl([chat_line("a", "x"), chat_line("a", "y")]) + b"not json\n")
    process = start(input_file, tmp_path / "out.jsonl")
    stderr = finish(process, [])
    assert process.returncode == ExitCode.USAGE
    assert "in.jsonl:2: duplicate_custom_id" in stderr and "in.jsonl:3: invalid_json_line" in stderr
