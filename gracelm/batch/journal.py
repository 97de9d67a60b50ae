"""The batch journal: uploaded files, batches, their lines and each line's result, kept in
`DIR/batches.db` (`--state-dir DIR`) so that accepted work survives a crash of any process, a `kill -9` or
a power cut, and the next start on DIR resumes it.

An embedded database made for this, the standard library's SQLite, not a log of our own: WAL mode with
`synchronous=FULL`, so each committed transaction is on disk (fsynced) when the commit returns, and a crash
at any point leaves the last committed state. Every change that must be seen whole is one transaction:
a file row with its content and checksum; a batch's validation with all its lines; a line's result with
its state; a batch's end with its output and error files. A line counts as completed only once its result
is committed; a line still `queued` after a crash simply runs again, and a result is unique per line
(primary key), as a custom_id is per batch (unique index), so no line can appear twice.

File contents are BLOBs in the same database rather than files beside it: the row, its bytes and its
SHA-256 then commit atomically (no temporary file, rename and directory fsync, no orphan to sweep after a
crash), and `PRAGMA integrity_check` covers them. The cost, each byte written twice (WAL, then the
checkpoint), is paid once per upload. The checksum is verified at every read.

The same database keeps the Responses API's stored responses (the `responses` table; its code is
`serving/response_store.py`), which a restart on DIR must find again.

One process at a time: the journal holds an exclusive `flock` on `DIR/batches.lock` while open (released by
the kernel when the process dies, even by SIGKILL); a second server on the same DIR fails to start.

Work that kills the server must not come back for ever. A line taken to run is marked in flight in the same
transaction that counts its attempt, and unmarked with its result, or by `release_lines` at a graceful stop.
A line found in flight when the journal opens was running when the server died: its `crashes` count grows.
A line in flight at two deaths is a suspect: `take_lines` leaves it, and the runner runs it alone
(`take_suspect`). A suspect found in flight after running alone is taken for the cause: failed, with an
error line that says so (`crash_culprits` counts them for /metrics); the batch and the server go on.

Thread-safe: one connection, used under a lock; the async callers run these methods in a worker thread so
that an fsync never holds the event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from gracelm.batch.objects import (
    ENDED,
    OUTPUT_PURPOSE,
    TIMESTAMPS,
    BatchRecord,
    BatchUsage,
    FileRecord,
    LineState,
    RequestCounts,
    Status,
    new_id,
    unanswered_line,
)
from gracelm.lifecycle.faults import faults

logger = logging.getLogger(__name__)

DB_NAME = "batches.db"
LOCK_NAME = "batches.lock"
SCHEMA_VERSION = 3
# Deaths of the server with a line in flight that make it a suspect, run alone.
SUSPECT_AFTER = 2
CRASHED_LINE = ("line_crashed_the_server", "This request was running, alone, when the server stopped "
                "abnormally, as it was at {crashes} earlier deaths: it is taken for their cause and not run "
                "again.")
# A file's bytes go into the journal this many at a time.
_CHUNK_BYTES = 1 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    endpoint TEXT,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    metadata TEXT
);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    in_flight INTEGER NOT NULL DEFAULT 0,  -- taken to run, its result not committed
    crashes INTEGER NOT NULL DEFAULT 0,  -- deaths of the server with it in flight
    alone INTEGER NOT NULL DEFAULT 0,  -- run alone, a suspect
    PRIMARY KEY (batch_id, line),
    UNIQUE (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state, line);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    output TEXT NOT NULL,
    PRIMARY KEY (batch_id, line),
    FOREIGN KEY (batch_id, line) REFERENCES lines (batch_id, line) ON DELETE CASCADE
);
-- The Responses API's stored responses (`serving/response_store.py`): the object, and the conversation
-- it answered (`previous_response_id` continues it).
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""
_FILE_COLUMNS = "id, purpose, filename, bytes, sha256, created_at"
_BATCH_COLUMNS = ("id, endpoint, input_file_id, completion_window, status, created_at, expires_at, "
                  + ", ".join(TIMESTAMPS) + ", output_file_id, error_file_id, errors, metadata")


class JournalError(RuntimeError):
    """The journal cannot be used: its directory is held by another process, or its format is unknown."""


class CorruptFileError(RuntimeError):
    """A stored file's bytes no longer match the checksum taken at upload."""


class NotCancellable(ValueError):
    """A batch already at its end (completed, failed, expired) or finalizing cannot be cancelled."""


class Line:
    """A line the runner is to run: where it is, what it asks, and how many times it was started."""

    __slots__ = ("batch_id", "line", "custom_id", "url", "body", "attempt")

    def __init__(self, batch_id: str, line: int, custom_id: str, url: str, body: str, attempt: int) -> None:
        self.batch_id, self.line, self.custom_id = batch_id, line, custom_id
        self.url, self.body, self.attempt = url, body, attempt

    @property
    def key(self) -> tuple[str, int]:
        return self.batch_id, self.line


class Journal:
    def __init__(self, directory: str | Path) -> None:
        """Opens (creating them if need be) the journal of `directory`; raises `JournalError` if another
        process holds it."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / DB_NAME
        self._lock_fd = _lock(self.directory / LOCK_NAME)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._check_version()
            self._db.executescript(_SCHEMA)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._mutex = threading.Lock()
        self._closed = False
        self.crash_culprits = self._settle_crashes()  # lines failed at this open as the cause of crashes

    def _check_version(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == 1:  # the lines' crash bookkeeping, added
            for column in ("in_flight", "crashes", "alone"):
                self._db.execute(f"ALTER TABLE lines ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")
            version = 2
        if version == 2:  # the responses table, created with the schema below
            version = 0
        if version == 0:
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        elif version != SCHEMA_VERSION:
            raise JournalError(f"{self.path} has format version {version}; this gracelm reads version "
                               f"{SCHEMA_VERSION}")

    def close(self) -> None:
        """Waits for the operation in progress, closes the database and releases the directory."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._db.close()
            os.close(self._lock_fd)

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed (and fsynced) when the block ends, rolled back if it raises."""
        with self._mutex:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            faults().before_journal_commit()
            self._db.execute("COMMIT")

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._mutex:
            yield self._db

    def write_transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One write transaction for another table's code (`serving/response_store.py`): committed when the
        block ends, rolled back if it raises."""
        return self._write()

    def read_transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """The connection, for reads only, held by this thread until the block ends."""
        return self._read()

    # -- files ---------------------------------------------------------------------------------------

    def add_file(self, filename: str, purpose: str, source: BinaryIO) -> FileRecord:
        """The file whose bytes `source` gives from where it stands to its end (an upload spooled to disk:
        streamed in, never whole in memory)."""
        with self._write() as db:
            return _insert_file(db, filename, purpose, source)

    def get_file(self, file_id: str) -> FileRecord | None:
        with self._read() as db:
            row = db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else FileRecord(*row)

    def list_files(self, purpose: str | None, after: str | None, limit: int,
                   newest_first: bool) -> tuple[list[FileRecord], bool]:
        """A page of files (oldest or newest first) after the file `after`, and whether more follow."""
        with self._read() as db:
            rows = _page(db, "files", _FILE_COLUMNS, "purpose = ?" if purpose else "",
                         [purpose] if purpose else [], after, limit, newest_first)
        return [FileRecord(*row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._write() as db:
            return db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    def file_content(self, file_id: str) -> bytes | None:
        """The file's bytes, checked against the checksum taken when they were stored."""
        with self._read() as db:
            row = db.execute("SELECT content, sha256 FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            return None
        content, checksum = row
        if hashlib.sha256(content).hexdigest() != checksum:
            raise CorruptFileError(f"the stored bytes of {file_id} do not match their checksum")
        return bytes(content)

    # -- batches -------------------------------------------------------------------------------------

    def create_batch(self, input_file_id: str, endpoint: str | None, completion_window: str,
                     window_s: float | None, metadata: dict[str, str] | None) -> BatchRecord:
        """A new batch, validating; it expires `window_s` s from now (None: never)."""
        now = int(time.time())
        batch_id = new_id("batch_")
        with self._write() as db:
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, "
                       "created_at, expires_at, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (batch_id, endpoint, input_file_id, completion_window, Status.VALIDATING, now,
                        None if window_s is None else int(now + window_s),
                        None if metadata is None else json.dumps(metadata)))
            return _batch(db, batch_id)

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        with self._read() as db:
            return _batch(db, batch_id)

    def list_batches(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """A page of batches, newest first, after the batch `after`, and whether more follow."""
        with self._read() as db:
            rows = _page(db, "batches", "id", "", [], after, limit, newest_first=True)
            return [_batch(db, row[0]) for row in rows[:limit]], len(rows) > limit

    def batches_in(self, statuses: tuple[Status, ...]) -> list[BatchRecord]:
        """The batches in these statuses, oldest first."""
        marks = ", ".join("?" * len(statuses))
        with self._read() as db:
            ids = db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY created_at, rowid",
                             statuses).fetchall()
            return [_batch(db, batch_id) for (batch_id,) in ids]

    def request_cancel(self, batch_id: str) -> BatchRecord | None:
        """Moves a validating or running batch to cancelling (the runner ends it); one cancelling or
        cancelled is returned as it is. None: no such batch; raises `NotCancellable` at its end."""
        with self._write() as db:
            batch = _batch(db, batch_id)
            if batch is None or batch.status in (Status.CANCELLING, Status.CANCELLED):
                return batch
            if batch.status not in (Status.VALIDATING, Status.IN_PROGRESS):
                raise NotCancellable(f"batch {batch_id} is {batch.status.value} and cannot be cancelled")
            _set_status(db, batch_id, Status.CANCELLING)
            return _batch(db, batch_id)

    # -- the runner's ---------------------------------------------------------------------------------

    def start_batch(self, batch_id: str, lines: list[tuple[int, str, str, str]]) -> bool:
        """A validated batch: its lines (number, custom_id, url, body) queued and the batch in progress,
        together. False if it is no longer validating (cancelled meanwhile): nothing is written."""
        with self._write() as db:
            if not _status_is(db, batch_id, Status.VALIDATING):
                return False
            db.executemany("INSERT INTO lines (batch_id, line, custom_id, url, body, state) "
                           "VALUES (?, ?, ?, ?, ?, ?)",
                           [(batch_id, n, cid, url, body, LineState.QUEUED) for n, cid, url, body in lines])
            _set_status(db, batch_id, Status.IN_PROGRESS)
            return True

    def fail_batch(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        """A batch whose input was refused: failed, with OpenAI's `errors.data`."""
        with self._write() as db:
            if _status_is(db, batch_id, Status.VALIDATING):
                db.execute("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(errors), batch_id))
                _set_status(db, batch_id, Status.FAILED)

    def take_lines(self, batch_id: str, after: int, limit: int) -> list[Line]:
        """Up to `limit` queued lines of the batch numbered above `after`, in order, suspects left out, each
        marked in flight with its attempt counted (committed before they run); none once the batch is no
        longer in progress."""
        return self._take(batch_id, "line > ? AND crashes < ?", (after, SUSPECT_AFTER), limit, alone=False)

    def take_suspect(self, batch_id: str) -> Line | None:
        """The batch's first queued suspect, marked in flight alone: the runner runs it with nothing else."""
        lines = self._take(batch_id, "crashes >= ?", (SUSPECT_AFTER,), 1, alone=True)
        return lines[0] if lines else None

    def _take(self, batch_id: str, where: str, args: tuple, limit: int, alone: bool) -> list[Line]:
        with self._write() as db:
            if not _status_is(db, batch_id, Status.IN_PROGRESS):  # cancelled meanwhile
                return []
            rows = db.execute(f"SELECT line, custom_id, url, body, attempt FROM lines WHERE batch_id = ? AND "
                              f"state = ? AND {where} ORDER BY line LIMIT ?",
                              (batch_id, LineState.QUEUED, *args, limit)).fetchall()
            db.executemany("UPDATE lines SET attempt = attempt + 1, in_flight = 1, alone = ? "
                           "WHERE batch_id = ? AND line = ?",
                           [(int(alone), batch_id, row[0]) for row in rows])
        return [Line(batch_id, n, cid, url, body, attempt + 1) for n, cid, url, body, attempt in rows]

    def release_lines(self, keys: list[tuple[str, int]]) -> None:
        """Lines stopped at a graceful stop, before their result: queued again, no crash of theirs."""
        with self._write() as db:
            db.executemany("UPDATE lines SET in_flight = 0, alone = 0 WHERE batch_id = ? AND line = ?", keys)

    def _settle_crashes(self) -> int:
        """The lines in flight when the last server died: each one's crash counted, and a suspect that
        ran alone failed as their cause. Returns how many were failed."""
        with self._write() as db:
            culprits = db.execute("SELECT batch_id, line, custom_id, crashes FROM lines WHERE in_flight = 1 "
                                  "AND alone = 1").fetchall()
            for batch_id, line, custom_id, crashes in culprits:
                code, message = CRASHED_LINE
                output = unanswered_line(custom_id, code, message.format(crashes=crashes))
                db.execute("INSERT OR REPLACE INTO results (batch_id, line, output) VALUES (?, ?, ?)",
                           (batch_id, line, json.dumps(output)))
                db.execute("UPDATE lines SET state = ? WHERE batch_id = ? AND line = ?",
                           (LineState.FAILED, batch_id, line))
                logger.error("batch %s line %d (custom_id %r) was running alone when the server died, after "
                             "%d deaths with it in flight: failed as their cause", batch_id, line, custom_id,
                             crashes)
            crashed = db.execute("UPDATE lines SET crashes = crashes + 1 WHERE in_flight = 1 AND alone = 0"
                                 ).rowcount
            if crashed:
                logger.warning("%d batch line(s) were running when the server died; each runs alone once in "
                               "flight at %d deaths", crashed, SUSPECT_AFTER)
            db.execute("UPDATE lines SET in_flight = 0, alone = 0 WHERE in_flight = 1")
        return len(culprits)

    def record_results(self, results: list[tuple[str, int, LineState, dict[str, Any]]]) -> None:
        """Lines' results (batch, line, final state, output line), committed together: each line counts as
        finished from the commit on."""
        with self._write() as db:
            db.executemany("INSERT INTO results (batch_id, line, output) VALUES (?, ?, ?)",
                           [(b, n, json.dumps(output)) for b, n, _, output in results])
            db.executemany("UPDATE lines SET state = ?, in_flight = 0, alone = 0 "
                           "WHERE batch_id = ? AND line = ?", [(state, b, n) for b, n, state, _ in results])

    def begin_finalizing(self, batch_id: str) -> None:
        with self._write() as db:
            if _status_is(db, batch_id, Status.IN_PROGRESS):
                _set_status(db, batch_id, Status.FINALIZING)

    def finalize(self, batch_id: str, current: Status, final: Status,
                 unfinished: tuple[str, str] | None) -> None:
        """Ends the batch if it is still `current`: the lines never run get an error line (`unfinished`: its
        code and message; only for a cancelled or expired batch), the output and error files are written
        from the results, and the batch takes its final status — in one transaction."""
        with self._write() as db:
            if not _status_is(db, batch_id, current):  # cancelled meanwhile: that end comes next
                return
            if unfinished is not None:
                queued = db.execute("SELECT line, custom_id FROM lines WHERE batch_id = ? AND state = ?",
                                    (batch_id, LineState.QUEUED)).fetchall()
                db.executemany("INSERT INTO results (batch_id, line, output) VALUES (?, ?, ?)",
                               [(batch_id, n, json.dumps(unanswered_line(cid, *unfinished)))
                                for n, cid in queued])
                db.execute("UPDATE lines SET state = ? WHERE batch_id = ? AND state = ?",
                           (LineState.FAILED, batch_id, LineState.QUEUED))
            files = {}
            for state, column, suffix in ((LineState.COMPLETED, "output_file_id", "output"),
                                          (LineState.FAILED, "error_file_id", "error")):
                outputs = db.execute("SELECT r.output FROM results r JOIN lines l USING (batch_id, line) "
                                     "WHERE r.batch_id = ? AND l.state = ? ORDER BY r.line",
                                     (batch_id, state)).fetchall()
                if outputs:
                    content = io.BytesIO("".join(output + "\n" for (output,) in outputs).encode())
                    files[column] = _insert_file(db, f"{batch_id}_{suffix}.jsonl", OUTPUT_PURPOSE, content).id
            for column, file_id in files.items():
                db.execute(f"UPDATE batches SET {column} = ? WHERE id = ?", (file_id, batch_id))
            _set_status(db, batch_id, final)

    def results(self, batch_id: str) -> list[dict[str, Any]]:
        """The batch's output lines committed so far, in line order."""
        with self._read() as db:
            rows = db.execute("SELECT output FROM results WHERE batch_id = ? ORDER BY line",
                              (batch_id,)).fetchall()
        return [json.loads(output) for (output,) in rows]

    def find_batch_of_file(self, input_file_id: str) -> BatchRecord | None:
        """The newest batch made from this input file (`gracelm run-batch` resumes it)."""
        with self._read() as db:
            row = db.execute("SELECT id FROM batches WHERE input_file_id = ? ORDER BY created_at DESC, "
                             "rowid DESC LIMIT 1", (input_file_id,)).fetchone()
            return None if row is None else _batch(db, row[0])

    def find_file(self, sha256: str, purpose: str) -> FileRecord | None:
        """The oldest stored file with these bytes (by checksum) and purpose."""
        with self._read() as db:
            row = db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE sha256 = ? AND purpose = ? "
                             "ORDER BY created_at, rowid LIMIT 1", (sha256, purpose)).fetchone()
        return None if row is None else FileRecord(*row)


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JournalError(f"another process holds the batch journal in {path.parent} (the lock "
                           f"{path.name}); one server per state directory") from None
    return fd


def _insert_file(db: sqlite3.Connection, filename: str, purpose: str, source: BinaryIO) -> FileRecord:
    """A new file of `source`'s bytes from where it stands, a chunk at a time: read once for its size and
    checksum, then again into SQLite's incremental blob I/O. (Its row is written whole once: updating it
    after would read the whole blob back into memory.)"""
    start = source.tell()
    digest = hashlib.sha256()
    while chunk := source.read(_CHUNK_BYTES):
        digest.update(chunk)
    size = source.tell() - start
    source.seek(start)
    record = FileRecord(new_id("file-"), purpose, filename, size, digest.hexdigest(), int(time.time()))
    columns = (getattr(record, f) for f in ("id", "purpose", "filename", "bytes", "sha256", "created_at"))
    cursor = db.execute(f"INSERT INTO files ({_FILE_COLUMNS}, content) "
                        f"VALUES (?, ?, ?, ?, ?, ?, zeroblob(?))", (*columns, size))
    with db.blobopen("files", "content", cursor.lastrowid) as blob:
        while chunk := source.read(_CHUNK_BYTES):
            blob.write(chunk)
    return record


def _page(db: sqlite3.Connection, table: str, columns: str, where: str, args: list[Any], after: str | None,
          limit: int, newest_first: bool) -> list[tuple]:
    """Up to `limit` + 1 rows (the extra says whether more follow) in creation order, after the row whose id
    is `after` (none: from the start; unknown: nothing)."""
    conditions, values = ([where], list(args)) if where else ([], [])
    if after is not None:
        anchor = db.execute(f"SELECT created_at, rowid FROM {table} WHERE id = ?", (after,)).fetchone()
        if anchor is None:
            return []
        conditions.append(f"(created_at, rowid) {'<' if newest_first else '>'} (?, ?)")
        values += list(anchor)
    order = "DESC" if newest_first else "ASC"
    clause = f"WHERE {' AND '.join(conditions)}" if conditions else ""
    return db.execute(f"SELECT {columns} FROM {table} {clause} ORDER BY created_at {order}, rowid {order} "
                      f"LIMIT ?", (*values, limit + 1)).fetchall()


def _status_is(db: sqlite3.Connection, batch_id: str, status: Status) -> bool:
    row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
    return row is not None and row[0] == status


def _set_status(db: sqlite3.Connection, batch_id: str, status: Status) -> None:
    column = f"{status.value}_at"
    stamp = f", {column} = ?" if column in TIMESTAMPS else ""
    values = (status, int(time.time())) if stamp else (status,)
    db.execute(f"UPDATE batches SET status = ?{stamp} WHERE id = ?", (*values, batch_id))


def _batch(db: sqlite3.Connection, batch_id: str) -> BatchRecord | None:
    row = db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)).fetchone()
    if row is None:
        return None
    (batch_id, endpoint, input_file_id, window, status, created_at, expires_at, *rest) = row
    times = dict(zip(TIMESTAMPS, rest[:len(TIMESTAMPS)], strict=True))
    output_file_id, error_file_id, errors, metadata = rest[len(TIMESTAMPS):]
    counts = dict(db.execute("SELECT state, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY state",
                             (batch_id,)).fetchall())
    request_counts = RequestCounts(sum(counts.values()), counts.get(LineState.COMPLETED, 0),
                                   counts.get(LineState.FAILED, 0))
    model, usage = _answered(db, batch_id) if status in ENDED else (None, None)
    return BatchRecord(batch_id, endpoint, input_file_id, window, Status(status), created_at, expires_at,
                       times, output_file_id, error_file_id, None if errors is None else json.loads(errors),
                       None if metadata is None else json.loads(metadata), request_counts, model, usage)


def _answered(db: sqlite3.Connection, batch_id: str) -> tuple[str | None, BatchUsage]:
    """The model a batch's 200 answers name and their tokens, summed from its stored results. Asked only of
    a batch at its end, as OpenAI gives usage: the sum reads every result, which the polls of a batch in
    progress would redo again and again."""
    model, prompt, completion, reasoning = db.execute(
        "SELECT MIN(json_extract(output, '$.response.body.model')), "
        "COALESCE(SUM(json_extract(output, '$.response.body.usage.prompt_tokens')), 0), "
        "COALESCE(SUM(json_extract(output, '$.response.body.usage.completion_tokens')), 0), "
        "COALESCE(SUM(json_extract(output, "
        "'$.response.body.usage.completion_tokens_details.reasoning_tokens')), 0) "
        "FROM results WHERE batch_id = ? AND json_extract(output, '$.response.status_code') = 200",
        (batch_id,)).fetchone()
    return model, BatchUsage(prompt, completion, reasoning)
