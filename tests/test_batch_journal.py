"""The batch journal alone (no server): its durability settings, one holder per directory (a second server
on the same `--state-dir` fails to start), checksums verified at read, a batch's end in one transaction
from the status the runner saw, and the checks of an input file."""

from __future__ import annotations

import io
import sqlite3
import subprocess

import pytest

from gracelm.batch.journal import (
    CRASHED_LINE,
    DB_NAME,
    SCHEMA_VERSION,
    SUSPECT_AFTER,
    CorruptFileError,
    Journal,
    JournalError,
)
from gracelm.batch.objects import CANCELLED_LINE, INPUT_PURPOSE, LineState, Status, answered_line
from gracelm.batch.validation import MAX_ERRORS, validate_input
from gracelm.lifecycle.exit_codes import ExitCode
from tests.batch_helpers import chat_lines, journal_rows, jsonl
from tests.server_process import GRACELM


@pytest.fixture
def journal(tmp_path):
    journal = Journal(tmp_path / "state")
    yield journal
    journal.close()


def test_the_journal_is_sqlite_in_wal_mode_with_full_sync(journal):
    assert journal_rows(journal.directory, "PRAGMA journal_mode")[0][0] == "wal"
    assert journal._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_one_process_holds_a_directory(journal, tmp_path):
    with pytest.raises(JournalError, match="another process holds the batch journal"):
        Journal(journal.directory)
    # A server started on a held directory fails at once, before loading a model, naming the lock, and
    # leaves the holder's records alone (its last stop's report, shown on its status page).
    record = journal.directory / "last-shutdown.json"
    record.write_text('{"the holder": "its own record"}')
    held = subprocess.run([str(GRACELM), "serve", "--port", "0", "--state-dir", str(journal.directory)],
                          capture_output=True, text=True, timeout=120)
    assert held.returncode == ExitCode.STARTUP_FAILURE, held.stderr
    assert "another process holds the batch journal" in held.stderr
    assert record.read_text() == '{"the holder": "its own record"}'


def test_a_files_bytes_are_checked_against_their_checksum(journal):
    record = journal.add_file("in.jsonl", INPUT_PURPOSE, io.BytesIO(b"hello\n"))
    assert journal.file_content(record.id) == b"hello\n"
    journal._db.execute("UPDATE files SET content = ? WHERE id = ?", (b"hellO\n", record.id))
    with pytest.raises(CorruptFileError):
        journal.file_content(record.id)


def test_a_batch_ends_once_from_the_status_the_runner_saw(journal):
    batch = journal.get_batch(_started_batch(journal, 3))
    [first] = journal.take_lines(batch.id, 0, 1)
    journal.record_results([(batch.id, first.line, LineState.COMPLETED,
                             answered_line("batch_req_1", first.custom_id, 200, {"ok": True}))])
    assert journal.request_cancel(batch.id).status is Status.CANCELLING
    journal.finalize(batch.id, Status.IN_PROGRESS, Status.EXPIRED, None)  # too late: cancelled meanwhile
    assert journal.get_batch(batch.id).status is Status.CANCELLING
    assert journal.take_lines(batch.id, 0, 3) == []  # no line of a batch no longer in progress
    journal.finalize(batch.id, Status.CANCELLING, Status.CANCELLED, CANCELLED_LINE)
    ended = journal.get_batch(batch.id)
    assert ended.status is Status.CANCELLED and ended.times["cancelled_at"]
    assert (ended.counts.total, ended.counts.completed, ended.counts.failed) == (3, 1, 2)
    assert journal.file_content(ended.output_file_id).count(b"\n") == 1
    assert journal.file_content(ended.error_file_id).count(b"batch_cancelled") == 2


def _started_batch(journal: Journal, count: int) -> str:
    file = journal.add_file("in.jsonl", INPUT_PURPOSE, io.BytesIO(jsonl(chat_lines(count))))
    batch = journal.create_batch(file.id, "/v1/chat/completions", "24h", 60, None)
    lines, errors = validate_input(journal.file_content(file.id), batch.endpoint)
    assert not errors and journal.start_batch(batch.id, lines)
    return batch.id


def test_a_line_in_flight_at_deaths_becomes_a_suspect_run_alone_then_failed(tmp_path):
    """The bookkeeping behind the poison line (test_batch_recovery.py), one death at a time: each open of
    the journal is a start after a death, since nothing released or answered the lines taken."""
    journal = Journal(tmp_path)
    batch_id = _started_batch(journal, 3)
    for _ in range(SUSPECT_AFTER):
        assert [line.line for line in journal.take_lines(batch_id, 0, 1)] == [1]
        journal.close()
        journal = Journal(tmp_path)
    assert [line.line for line in journal.take_lines(batch_id, 0, 3)] == [2, 3]  # the suspect left out
    assert journal.take_suspect(batch_id).line == 1
    journal.release_lines([(batch_id, 2)])  # a graceful stop: no crash counted for it
    journal.close()
    journal = Journal(tmp_path)
    try:
        assert journal.crash_culprits == 1
        rows = dict(journal_rows(tmp_path, "SELECT line, crashes || state FROM lines WHERE batch_id = ?",
                                 batch_id))
        assert rows == {1: f"{SUSPECT_AFTER}failed", 2: "0queued", 3: "1queued"}
        [output] = journal_rows(tmp_path, "SELECT output FROM results WHERE batch_id = ?", batch_id)
        assert CRASHED_LINE[0] in output[0]
    finally:
        journal.close()


def test_a_version_1_journal_gains_the_crash_bookkeeping(tmp_path):
    journal = Journal(tmp_path)
    batch_id = _started_batch(journal, 2)
    journal.close()
    with sqlite3.connect(tmp_path / DB_NAME) as db:  # the journal as version 1 wrote it
        for column in ("in_flight", "crashes", "alone"):
            db.execute(f"ALTER TABLE lines DROP COLUMN {column}")
        db.execute("PRAGMA user_version=1")
    journal = Journal(tmp_path)
    try:
        assert len(journal.take_lines(batch_id, 0, 2)) == 2
        assert journal_rows(tmp_path, "PRAGMA user_version")[0][0] == SCHEMA_VERSION
    finally:
        journal.close()


def test_a_file_with_many_bad_lines_lists_the_first_errors_only():
    lines, errors = validate_input(b"not json\n" * (MAX_ERRORS + 50), None)
    assert lines == [] and len(errors) == MAX_ERRORS and errors[-1]["line"] == MAX_ERRORS
