"""What the batch tests share: input lines, the official client's calls to upload and wait, the output and
error files read back by custom_id, and the journal read directly (read-only) as a crash left it."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import openai

from gracelm.batch.journal import DB_NAME

FINAL = ("completed", "failed", "expired", "cancelled")
SERVE_ARGS = ("--kv-cache-memory", "4MiB", "--stats-interval", "0", "--max-model-len", "256",
              "--num-threads", "1", "--disable-log-requests")


def chat_line(custom_id: str, content: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def chat_lines(count: int, max_tokens: int = 4, **body: Any) -> list[dict[str, Any]]:
    return [chat_line(f"line-{i}", f"the cat {i} runs", max_tokens, **body) for i in range(count)]


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def client(url: str, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


def submit(api: openai.OpenAI, content: bytes, endpoint: str = "/v1/chat/completions") -> Any:
    """Uploads `content` and creates a batch of it; returns the batch."""
    file = api.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    return api.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")


def wait_for(api: openai.OpenAI, batch_id: str, done=lambda b: b.status in FINAL,
             timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = api.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch not there after {timeout} s: {batch}"
        time.sleep(0.1)


def outputs(api: openai.OpenAI, batch: Any) -> dict[str, dict[str, Any]]:
    """Every output line of the batch's output and error files, by custom_id; a custom_id seen twice fails."""
    found: dict[str, dict[str, Any]] = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is None:
            continue
        for text in api.files.content(file_id).text.splitlines():
            line = json.loads(text)
            assert line["custom_id"] not in found, f"{line['custom_id']} appears twice"
            found[line["custom_id"]] = line
    return found


def journal_rows(state_dir: Path, sql: str, *args: Any) -> list[tuple]:
    """Rows of the journal, read through a connection of the test's own (the server may be running or
    dead: SQLite serves both)."""
    with contextlib.closing(sqlite3.connect(state_dir / DB_NAME)) as db:
        return db.execute(sql, args).fetchall()


def integrity(state_dir: Path) -> str:
    return journal_rows(state_dir, "PRAGMA integrity_check")[0][0]
