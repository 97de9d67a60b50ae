"""Accepted batch work survives what can happen to the server: `kill -9` of every process of it after some
lines finished, kills at random points (during uploads, validation, lines, finalizing; every journal
commit held open a little so that kills land inside transactions), and a graceful stop (SIGTERM) in the
middle of a batch. After each, a start on the same `--state-dir` completes every batch: each custom_id
exactly once, the lines finished before keep their committed results (never recomputed), nothing failed,
the journal passes `PRAGMA integrity_check`, and nothing of the servers is left behind."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest

from gracelm.lifecycle.runtime_dir import PREFIX, runtime_base
from tests.batch_helpers import (
    FINAL,
    SERVE_ARGS,
    chat_line,
    chat_lines,
    client,
    integrity,
    journal_rows,
    jsonl,
    outputs,
    submit,
    wait_for,
)
from tests.server_process import ServerProcess, metric_value, port_is_free
from tests.tiny_models import tiny_model

SLOW_STEPS = {"test_step_sleep_s": 0.05}


def serve(state_dir: Path, hooks: dict | None = None, *args: str, wait_ready: bool = True) -> ServerProcess:
    env = {"GRACELM_TEST_HOOKS": json.dumps(hooks)} if hooks else None
    return ServerProcess(tiny_model("llama"), *SERVE_ARGS, "--state-dir", str(state_dir),
                         "--max-num-seqs", "4", *args, env=env, wait_ready=wait_ready)


def kill_9(server: ServerProcess) -> None:
    """SIGKILL to the supervisor and to each of its children, by pid, as a crash would leave them."""
    for pid in [server.pid, *(child.pid for child in server.children)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.process.wait(30)


def committed(state_dir: Path) -> dict[tuple[str, int], str]:
    """Every result in the journal, by (batch, line): the committed output lines, as text."""
    rows = journal_rows(state_dir, "SELECT batch_id, line, output FROM results")
    return {(batch_id, number): output for batch_id, number, output in rows}


def assert_complete(api: openai.OpenAI, batch_id: str, custom_ids: list[str]) -> dict[str, dict]:
    done = wait_for(api, batch_id)
    assert done.status == "completed", done
    answers = outputs(api, done)
    assert sorted(answers) == sorted(custom_ids)
    assert all(a["response"]["status_code"] == 200 for a in answers.values())
    return answers


def killed_half_way(state_dir: Path, lines: list[dict], *args: str) -> tuple[ServerProcess, str]:
    """A server (steps slowed) given the batch of `lines`, killed with -9 once 4 lines finished; the server
    (to check what it left) and the batch's id."""
    server = serve(state_dir, SLOW_STEPS, *args)
    try:
        api = client(server.url)
        batch = submit(api, jsonl(lines))
        wait_for(api, batch.id, lambda b: b.request_counts.completed >= 4)
        kill_9(server)
    finally:
        server.close_log()
    return server, batch.id


def test_kill_9_of_the_whole_server_keeps_finished_lines_and_resumes_the_rest(tmp_path):
    lines = chat_lines(20, max_tokens=8, ignore_eos=True)
    server, batch_id = killed_half_way(tmp_path, lines)
    before = committed(tmp_path)
    assert 4 <= len(before) < len(lines) and integrity(tmp_path) == "ok"
    with serve(tmp_path) as restarted:
        api = client(restarted.url)
        answers = assert_complete(api, batch_id, [line["custom_id"] for line in lines])
        # The lines finished before the crash were not run again: their output is the one committed then.
        rows = journal_rows(tmp_path, "SELECT line, custom_id, attempt FROM lines WHERE batch_id = ?",
                            batch_id)
        by_line = {number: (custom_id, attempt) for number, custom_id, attempt in rows}
        for (_, number), output in before.items():
            assert answers[by_line[number][0]] == json.loads(output)
            assert by_line[number][1] == 1
    server.assert_nothing_left()  # the restart reclaimed what the killed server left
    assert integrity(tmp_path) == "ok"


def test_kills_at_random_points_never_lose_duplicate_or_corrupt_a_line(tmp_path):
    rng = random.Random(1312)
    hooks = {"test_journal_commit_sleep_s": 0.03, "test_step_sleep_s": 0.02}
    uploaded: dict[str, bytes] = {}  # file id -> bytes, for each upload the server confirmed
    inputs: dict[bytes, list[str]] = {}  # input bytes -> custom_ids
    kept: dict[tuple[str, int], str] = {}  # results committed before some kill
    killed = []
    for round_ in range(3):
        server = serve(tmp_path, hooks)
        killed.append(server)
        try:
            api = client(server.url)
            content = jsonl(chat_lines(6 + round_))
            inputs[content] = [f"line-{i}" for i in range(6 + round_)]
            work = threading.Thread(target=_upload_and_submit, args=(api, content, uploaded), daemon=True)
            work.start()
            work.join(rng.uniform(0.0, 1.5))
            kill_9(server)
            work.join(30)
        finally:
            server.close_log()
        assert integrity(tmp_path) == "ok"
        now = committed(tmp_path)
        assert all(now.get(key) == output for key, output in kept.items()), "a committed result changed"
        kept = now
    with serve(tmp_path) as server:
        api = client(server.url)
        for file_id, content in uploaded.items():  # every confirmed upload is whole, its checksum verified
            assert api.files.content(file_id).content == content
        batches = journal_rows(tmp_path, "SELECT b.id, f.content FROM batches b JOIN files f ON "
                                         "f.id = b.input_file_id")
        assert batches, "no batch was ever created: the kills came too early to test anything"
        for batch_id, content in batches:
            answers = assert_complete(api, batch_id, inputs[bytes(content)])
            results = journal_rows(tmp_path, "SELECT line, output FROM results WHERE batch_id = ?", batch_id)
            for number, output in results:
                if (batch_id, number) in kept:
                    assert output == kept[batch_id, number]
                    assert answers[json.loads(output)["custom_id"]] == json.loads(output)
        assert [b.status for b in api.batches.list().data if b.status not in FINAL] == []
    for server in killed:  # the restarts reclaimed what each killed server left
        server.assert_nothing_left()
    assert integrity(tmp_path) == "ok"


def _upload_and_submit(api: openai.OpenAI, content: bytes, uploaded: dict[str, bytes]) -> None:
    """Uploads, creates a batch, waits for it; the kill ends this half-way, wherever it is."""
    with contextlib.suppress(openai.APIError):
        file = api.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
        uploaded[file.id] = content
        batch = api.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
        wait_for(api, batch.id, timeout=60)


@pytest.mark.parametrize("shutdown_timeout", ["0", "30"])
def test_a_graceful_stop_mid_batch_fails_nothing_and_a_restart_completes_it(tmp_path, shutdown_timeout):
    lines = chat_lines(16, max_tokens=8, ignore_eos=True)
    # --shutdown-timeout 0: the lines running at the stop are aborted, so they must go back to the queue;
    # 30: they finish within the drain, and their results are committed before the server exits.
    server = serve(tmp_path, SLOW_STEPS, "--shutdown-timeout", shutdown_timeout, "--shutdown-report",
                   str(tmp_path / "report.json"))
    with server:
        api = client(server.url)
        batch = submit(api, jsonl(lines))
        wait_for(api, batch.id, lambda b: b.request_counts.completed >= 2)
    assert server.exit_code == 0  # `with` stopped it with SIGTERM and checked that nothing is left
    report = json.loads((tmp_path / "report.json").read_text())
    released = {r["name"]: r["outcome"] for r in report["resources"]}
    assert released["asyncio task batch-runner"] == "released"
    assert [o for name, o in released.items() if name.startswith("batch journal")] == ["released"]
    states = dict(journal_rows(tmp_path, "SELECT state, COUNT(*) FROM lines GROUP BY state"))
    assert "failed" not in states and states["completed"] >= 2 and states.get("queued", 0) > 0
    # The drain took no new line: only the lines running at the stop were started and not finished, and
    # with time to finish, every one of them finished.
    started = journal_rows(tmp_path, "SELECT COUNT(*) FROM lines WHERE attempt > 0")[0][0]
    assert started - states["completed"] <= (4 if shutdown_timeout == "0" else 0)
    with serve(tmp_path) as restarted:
        assert_complete(client(restarted.url), batch.id, [line["custom_id"] for line in lines])
    assert integrity(tmp_path) == "ok"


def _contents(answers: dict[str, dict]) -> dict[str, tuple[str, dict]]:
    """Each line's answer text and token counts: what a rerun must reproduce (ids and times differ)."""
    return {custom_id: (a["response"]["body"]["choices"][0]["message"]["content"],
                        a["response"]["body"]["usage"]) for custom_id, a in answers.items()}


def test_in_deterministic_mode_a_resumed_batch_answers_as_an_uninterrupted_one(tmp_path):
    """bfloat16, sampled lines (each with its own seed): the batch killed with -9 half-way and resumed gives,
    line for line, the answers of the same batch run without interruption on another state dir. The killed
    and resumed servers speculate (n-grams), the uninterrupted one does not: in deterministic mode
    speculation changes no bit either."""
    lines = chat_lines(16, max_tokens=8, ignore_eos=True, temperature=1.0)
    for i, line in enumerate(lines):
        line["body"]["seed"] = 100 + i
    mode = ("--deterministic", "--dtype", "bfloat16")
    speculating = (*mode, "--speculative", "ngram", "--prompt-lookup-min", "1",
                   "--speculative-max-batch", "64")
    custom_ids = [line["custom_id"] for line in lines]
    with serve(tmp_path / "whole", None, *mode) as server:
        api = client(server.url)
        whole = _contents(assert_complete(api, submit(api, jsonl(lines)).id, custom_ids))
    server, batch_id = killed_half_way(tmp_path / "killed", lines, *speculating)
    assert 4 <= len(committed(tmp_path / "killed")) < len(lines)
    with serve(tmp_path / "killed", None, *speculating) as restarted:
        resumed = _contents(assert_complete(client(restarted.url), batch_id, custom_ids))
        metrics = httpx.get(f"{restarted.url}/metrics", timeout=30).text
        assert metric_value(metrics, "gracelm_spec_decode_num_draft_tokens_total") > 0
    assert resumed == whole
    server.assert_nothing_left()
    assert integrity(tmp_path / "killed") == "ok"


POISON = {"test_exit_for_seed": 666}  # the engine core exits at a step with a request of seed 666


def test_a_line_that_kills_the_server_fails_alone_and_the_rest_completes(tmp_path):
    """A line that kills the engine whenever it runs (the poison) once killed the server again at every
    start on its --state-dir. In flight at two deaths it is a suspect, run alone; a third death while alone
    fails it, naming the crashes, and the batch and the server go on."""
    lines = [*chat_lines(5, max_tokens=4), chat_line("poison", "x", max_tokens=4, seed=666)]
    server = serve(tmp_path, POISON)
    try:
        batch_id = submit(client(server.url), jsonl(lines)).id
        assert server.wait_exit(60) == 1  # the engine died: a fatal stop
        server.assert_nothing_left()
    finally:
        server.close_log()
    for death in (2, 3):  # in flight at its second death (with others or not), then alone at its third
        server = serve(tmp_path, POISON, wait_ready=False)  # the batch resumes, and kills it, as it starts
        try:
            assert server.wait_exit(60) == 1, f"death {death}"
            assert port_is_free(server.port)
            assert not list(runtime_base().glob(f"{PREFIX}{server.pid}-*")), "runtime directory left"
        finally:
            server.close_log()
        rows = dict(journal_rows(tmp_path, "SELECT custom_id, crashes FROM lines WHERE batch_id = ?",
                                 batch_id))
        assert rows["poison"] == death - 1  # counted as the next start opens the journal
    with serve(tmp_path, POISON) as survivor:
        api = client(survivor.url)
        done = wait_for(api, batch_id)
        assert done.status == "completed" and done.request_counts.failed == 1, done
        answers = outputs(api, done)
        assert answers["poison"]["error"]["code"] == "line_crashed_the_server"
        assert all(answers[f"line-{i}"]["response"]["status_code"] == 200 for i in range(5))
        assert "failed as their cause" in survivor.log()
        metrics = httpx.get(f"{survivor.url}/metrics").text
        assert metric_value(metrics, "gracelm_batch_lines_crashed_total") == 1
    assert integrity(tmp_path) == "ok"
