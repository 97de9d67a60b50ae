"""The Batch API of a real `gracelm serve --state-dir` through the official `openai` client: a batch of
dozens of lines answered as the online route answers, its progress on /status.json and /metrics, every
bad input refused as OpenAI refuses it (a failed batch with `errors`, a line's error in the error file, a
4xx at the route), a cancelled batch and an expired one, a file whose bytes no longer match their
checksum. The journal passes `PRAGMA integrity_check` afterwards and the servers stop cleanly."""

from __future__ import annotations

import io
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gracelm.batch.journal import DB_NAME
from tests.batch_helpers import (
    SERVE_ARGS,
    chat_line,
    chat_lines,
    client,
    integrity,
    jsonl,
    outputs,
    submit,
    wait_for,
)
from tests.process_checks import wait_until
from tests.server_process import ServerProcess, metric_value
from tests.tiny_models import tiny_model

API_KEY = "batch-key"
UPLOAD_LIMIT = 64 << 10
HOOKS = {"GRACELM_TEST_HOOKS": json.dumps({"test_step_sleep_s": 0.02})}


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-state") / "state"


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_model("llama"), *SERVE_ARGS, "--state-dir", str(state_dir), "--api-key", API_KEY,
                       "--max-num-seqs", "8", "--max-upload-bytes", str(UPLOAD_LIMIT), env=HOOKS) as server:
        yield server
    assert integrity(state_dir) == "ok"


@pytest.fixture(scope="module")
def api(server: ServerProcess) -> openai.OpenAI:
    return client(server.url, API_KEY)


def test_a_batch_of_dozens_of_lines_answers_each_once_as_the_online_route(api, server):
    lines = chat_lines(36)
    batch = submit(api, jsonl(lines))
    assert batch.status == "validating" and batch.endpoint == "/v1/chat/completions"
    assert batch.expires_at - batch.created_at == 24 * 3600
    assert batch.model is None and batch.usage is None  # given at the end
    done = wait_for(api, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 36 and done.request_counts.completed == 36
    assert done.error_file_id is None and done.in_progress_at and done.finalizing_at and done.completed_at
    answers = outputs(api, done)
    assert done.model == api.models.list().data[0].id
    _check_usage(done, answers)
    assert sorted(answers) == sorted(line["custom_id"] for line in lines)
    for line in lines[:4]:  # greedy: what the online route answers for the same body
        online = httpx.post(f"{server.url}/v1/chat/completions", json=line["body"], timeout=60,
                            headers={"Authorization": f"Bearer {API_KEY}"}).json()
        output = answers[line["custom_id"]]
        assert output["response"]["status_code"] == 200 and output["error"] is None
        body = output["response"]["body"]
        assert body["id"].startswith("chatcmpl-")
        assert {**body, "id": online["id"], "created": online["created"]} == online
    assert api.batches.list(limit=1).data[0].id == done.id  # newest first
    assert api.files.retrieve(done.output_file_id).purpose == "batch_output"


def _check_usage(batch, answers: dict[str, dict]) -> None:
    """The batch's usage: its 200 answers' tokens, summed; details 0."""
    usages = [a["response"]["body"]["usage"] for a in answers.values()
              if a["response"] and a["response"]["status_code"] == 200]
    prompt, completion = (sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens"))
    assert batch.usage.model_dump() == {
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}
    assert prompt > 0 and completion > 0


def test_completions_batch_and_the_files_routes(api):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"the dog {i}", "max_tokens": 3, "temperature": 0}} for i in range(3)]
    content = jsonl(lines)
    file = api.files.create(file=("completions.jsonl", io.BytesIO(content)), purpose="batch")
    assert file.bytes == len(content) and file.filename == "completions.jsonl"
    assert api.files.content(file.id).content == content
    batch = api.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h",
                               metadata={"job": "nightly"})
    done = wait_for(api, batch.id)
    assert done.status == "completed" and done.metadata == {"job": "nightly"}
    for line in outputs(api, done).values():
        assert line["response"]["body"]["object"] == "text_completion"
    assert file.id in [f.id for f in api.files.list(purpose="batch")]
    assert api.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(file.id)


@pytest.mark.parametrize("content,code,line,param", [
    (b'{"custom_id": "a", "method": "POST"\n', "invalid_json_line", 1, None),
    (jsonl([chat_line("a", "x"), {**chat_line("b", "y"), "url": "/v1/embeddings"}]), "invalid_url", 2, "url"),
    (jsonl([{**chat_line("a", "x"), "url": "/v1/completions"}]), "invalid_url", 1, "url"),
    (jsonl([{**chat_line("a", "x"), "method": "GET"}]), "invalid_value", 1, "method"),
    (jsonl([chat_line("a", "x"), chat_line("a", "y")]), "duplicate_custom_id", 2, "custom_id"),
    (jsonl([{k: v for k, v in chat_line("a", "x").items() if k != "custom_id"}]),
     "missing_required_parameter", 1, "custom_id"),
    (jsonl([{**chat_line("a", "x"), "body": "hello"}]), "invalid_type", 1, "body"),
    (jsonl([{**chat_line("a", "x"), "priority": 1}]), "invalid_request", 1, "priority"),
    (b"\n\n", "empty_file", None, None),
])
def test_a_bad_input_file_fails_the_batch_with_openai_errors(api, content, code, line, param):
    failed = wait_for(api, submit(api, content).id)
    assert failed.status == "failed" and failed.failed_at and failed.request_counts.total == 0
    assert failed.model is None and failed.usage.total_tokens == 0
    first = failed.errors.data[0]
    assert (first.code, first.line, first.param) == (code, line, param), failed.errors
    assert failed.output_file_id is None and failed.error_file_id is None


def test_a_body_the_api_would_refuse_is_that_lines_error_as_the_online_route_gives_it(api, server):
    bodies = {"unknown-field": {"messages": [{"role": "user", "content": "x"}], "colour": "red"},
              "wrong-type": {"messages": [{"role": "user", "content": "x"}], "max_tokens": "4"},
              "no-messages": {"messages": []},
              "other-model": {"model": "not-served", "messages": [{"role": "user", "content": "x"}]},
              "too-long": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100_000},
              "hidden-states": {"messages": [{"role": "user", "content": "x"}], "return_hidden_states": True}}
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
             for cid, body in bodies.items()]
    # SGLang's fields at their defaults, as the field's routers send them, are accepted here too.
    sglang_defaults = {"no_stop_trim": False, "separate_reasoning": True, "return_hidden_states": False}
    lines += [chat_line("streamed", "x", stream=True), chat_line("fine", "x"),
              chat_line("sglang-defaults", "x", **sglang_defaults)]
    done = wait_for(api, submit(api, jsonl(lines)).id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 7)
    answers = outputs(api, done)
    _check_usage(done, answers)  # the two answered lines only
    for cid, body in bodies.items():
        online = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60,
                            headers={"Authorization": f"Bearer {API_KEY}"})
        response = answers[cid]["response"]
        assert online.status_code in (400, 404), online.text
        assert (response["status_code"], response["body"]) == (online.status_code, online.json()), cid
    assert answers["streamed"]["response"]["body"]["error"]["param"] == "stream"
    error_file = api.files.content(done.error_file_id).text
    failed = [json.loads(line)["custom_id"] for line in error_file.splitlines()]
    assert "fine" not in failed and "sglang-defaults" not in failed


def test_bad_requests_to_the_routes_are_refused(api, server):
    file = api.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat_lines(1)))), purpose="batch")
    for kwargs, status in (({"endpoint": "/v1/embeddings"}, 400), ({"completion_window": "1h"}, 400),
                           ({"input_file_id": "file-missing"}, 404),
                           ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400)):
        request = {"input_file_id": file.id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                   **kwargs}
        with pytest.raises(openai.APIStatusError) as refused:
            api.batches.create(**request)
        assert refused.value.status_code == status, (kwargs, refused.value)
    with pytest.raises(openai.BadRequestError):
        api.files.create(file=("in.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as too_big:  # refused at upload, like any oversized body
        api.files.create(file=("big.jsonl", io.BytesIO(b"x" * (UPLOAD_LIMIT + 1))), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        api.batches.retrieve("batch_missing")
    done = wait_for(api, api.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                            completion_window="24h").id)
    with pytest.raises(openai.ConflictError):
        api.batches.cancel(done.id)
    for path in ("/v1/files", "/v1/batches"):
        assert httpx.get(f"{server.url}{path}").status_code == 401
    # A page at a time, newest first: the next page starts after the last one seen.
    first = api.batches.list(limit=2)
    assert first.data[0].id == done.id and first.has_more
    second = api.batches.list(limit=2, after=first.data[-1].id)
    assert second.data and not {b.id for b in second.data} & {b.id for b in first.data}
    assert second.data[0].created_at <= first.data[-1].created_at


def test_cancel_mid_batch_keeps_what_finished_and_reports_the_rest_cancelled(api, server):
    lines = chat_lines(48, max_tokens=16, ignore_eos=True)
    batch = submit(api, jsonl(lines))
    running = wait_for(api, batch.id, lambda b: b.request_counts.completed >= 1)
    assert running.usage is None  # given at the end, as OpenAI gives it
    # Progress while it runs, on the status page and in the metrics.
    status = httpx.get(f"{server.url}/status.json", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    shown = {b["id"]: b for b in status["batches"]}[batch.id]
    assert shown["total"] == 48 and shown["completed"] >= 1
    assert shown["queued"] + shown["running"] + shown["completed"] + shown["failed"] == 48
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric_value(metrics, "gracelm_batch_lines", state="queued") >= 1
    assert metric_value(metrics, "gracelm_batches", status="in_progress") >= 1

    cancelling = api.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    cancelled = wait_for(api, batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    answers = outputs(api, cancelled)
    assert sorted(answers) == sorted(line["custom_id"] for line in lines)
    unrun = [a for a in answers.values() if a["error"] is not None]
    assert unrun and all(a["error"]["code"] == "batch_cancelled" and a["response"] is None for a in unrun)
    counts = cancelled.request_counts
    assert counts.completed == len(answers) - len(unrun) >= 1 and counts.failed == len(unrun)
    _check_usage(cancelled, answers)
    assert cancelled.usage.output_tokens == 16 * counts.completed


def test_a_file_whose_bytes_no_longer_match_their_checksum_is_refused(api, state_dir):
    file = api.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat_lines(2)))), purpose="batch")
    with sqlite3.connect(state_dir / DB_NAME) as db:  # a bit flipped on the disk, as it were
        db.execute("UPDATE files SET content = ? WHERE id = ?", (b"[" + jsonl(chat_lines(2))[1:], file.id))
    with pytest.raises(openai.InternalServerError) as refused:
        api.files.content(file.id)
    assert refused.value.code == "file_corrupted"
    failed = wait_for(api, api.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                              completion_window="24h").id)
    assert failed.status == "failed" and failed.errors.data[0].code == "file_corrupted"


def test_a_batch_past_its_completion_window_expires_with_its_unrun_lines(tmp_path):
    # A 2 s window (a test hook; OpenAI's is 24 h) and at least 0.05 s a step: 24 lines of 8 tokens, 4 at a
    # time, take more than 2 s, so some never start.
    hooks = {"test_batch_completion_window_s": 2, "test_step_sleep_s": 0.05}
    with ServerProcess(tiny_model("llama"), *SERVE_ARGS, "--state-dir", str(tmp_path), "--max-num-seqs", "4",
                       env={"GRACELM_TEST_HOOKS": json.dumps(hooks)}) as server:
        api = client(server.url)
        lines = chat_lines(24, max_tokens=8, ignore_eos=True)
        expired = wait_for(api, submit(api, jsonl(lines)).id)
        assert expired.status == "expired" and expired.expired_at >= expired.expires_at
        answers = outputs(api, expired)
        assert sorted(answers) == sorted(line["custom_id"] for line in lines)
        unrun = [a for a in answers.values() if a["error"] is not None]
        assert unrun and all(a["error"]["code"] == "batch_expired" for a in unrun)
        assert expired.request_counts.failed == len(unrun)
        assert expired.request_counts.completed == len(lines) - len(unrun)
    assert integrity(tmp_path) == "ok"


def test_batch_lines_run_behind_interactive_requests(api, server):
    # Eight long lines hold every seat (--max-num-seqs 8) at the batch priority; each needs at least 200
    # slowed steps (4 s), so an interactive request that had to wait for a seat would end after one of them.
    batch = submit(api, jsonl(chat_lines(8, max_tokens=200, ignore_eos=True)))
    deadline = time.monotonic() + 120
    while _metric(server, "gracelm_num_requests_running_background") < 8:
        assert time.monotonic() < deadline, "the batch's lines never held every seat"
        time.sleep(0.05)
    online = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert online.status_code == 200, online.text
    assert api.batches.retrieve(batch.id).request_counts.completed == 0  # it overtook every line
    done = wait_for(api, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 8


def _metric(server: ServerProcess, name: str) -> float:
    return metric_value(httpx.get(f"{server.url}/metrics", timeout=30).text, name)


def test_uploads_stream_to_the_journal_and_at_most_two_run_at_once(tmp_path):
    """A 100 MB upload once cost the server about 5x its size (614 MB at its peak), four at once 1.74 GB,
    with no cap on how many ran: now its bytes pass through to the form parser's spool file and into the
    journal a chunk at a time, and a third upload while two are in progress is a 429 before its body."""
    size = 100 << 20
    with ServerProcess(tiny_model("llama"), *SERVE_ARGS, "--state-dir", str(tmp_path / "state"),
                       "--max-upload-bytes", str(size + (1 << 20))) as server:
        api = client(server.url)
        api.files.create(file=("warm.jsonl", io.BytesIO(b"{}\n")), purpose="batch")  # first-use imports
        before = _peak_rss(server)
        content = b"x" * (size - 1) + b"\n"
        uploaded = api.files.create(file=("big.jsonl", io.BytesIO(content)), purpose="batch")
        grown = _peak_rss(server) - before
        assert grown < size // 4, f"the upload raised the server's peak memory by {grown >> 20} MiB"
        assert uploaded.bytes == size and api.files.content(uploaded.id).content == content
        slow = [_slow_upload(server, b"y" * 1000) for _ in range(2)]
        try:
            # Nothing says when the server has taken both in: until then a third upload is served (as it
            # should be); once they are, it is refused.
            third = wait_until(lambda: _refused_upload(server), 30, "a third upload refused")
            assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_uploads"
        finally:
            for sock in slow:
                sock.close()
        deadline = time.monotonic() + 30  # the server notices the two closed connections
        while httpx.post(f"{server.url}/v1/files", timeout=60, data={"purpose": "batch"},
                         files={"file": ("d.jsonl", b"{}\n")}).status_code != 200:
            assert time.monotonic() < deadline, "uploads are still refused"
            time.sleep(0.2)


def _peak_rss(server: ServerProcess) -> int:
    """The server process's peak resident memory so far (VmHWM), in bytes."""
    status = Path(f"/proc/{server.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) << 10


def _slow_upload(server: ServerProcess, first_bytes: bytes):
    """An upload whose body has begun and stops: it holds its place among those in progress."""
    import socket

    body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"s.jsonl\"\r\n\r\n" + first_bytes
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                 b"boundary=b\r\nContent-Length: 10000000\r\n\r\n" + body)
    return sock


def _refused_upload(server: ServerProcess) -> httpx.Response | None:
    """A small upload's answer if it was refused; None if it was served."""
    answer = httpx.post(f"{server.url}/v1/files", timeout=60, files={"file": ("c.jsonl", b"{}\n")},
                        data={"purpose": "batch"})
    return None if answer.status_code == 200 else answer
