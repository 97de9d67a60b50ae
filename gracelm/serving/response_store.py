"""The Responses API's stored responses: each response object (`store`) and the conversation it answered, in
the `responses` table of the state directory's journal (`batch/journal.py`, `DIR/batches.db`), so that
`GET /v1/responses/{id}` and `previous_response_id` find them after a restart.

What a response keeps is what `previous_response_id` needs to go on from it: its input items as given,
those of the responses before it included (a chain of responses stays whole when its first ones are pruned),
and the response object with its output items. Instructions are not carried over (OpenAI's rule): they are
in the object, not in the items.

Bounded in count (`--max-stored-responses`) and age (`--stored-response-max-age`; OpenAI keeps 30 days): the
oldest are pruned at each insert and when the store opens, and one past its age is not found even before
that. A background response is stored at each change of its status; one left unfinished by a stop is
failed when the store opens (`settle`). The methods block on SQLite's fsync: async callers run them in a
worker thread.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from typing import Any

from gracelm.batch.journal import Journal

# What a background response that a stop left unfinished says once settled.
STOPPED_ERROR = {"code": "server_error", "message": "the server stopped before this background response "
                                                    "finished"}


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was answered
    input_items: list[dict[str, Any]]  # the conversation it answered, without instructions


class ResponseStore:
    """The stored responses of `journal` (None: no `--state-dir`, nothing is stored)."""

    def __init__(self, journal: Journal | None, max_count: int, max_age_s: float) -> None:
        self.journal = journal
        self.max_count = max_count
        self.max_age_s = max_age_s

    @property
    def enabled(self) -> bool:
        return self.journal is not None

    def save(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Keeps `response` (its `id` and `created_at` say which and when), then prunes the oldest."""
        with self._journal.write_transaction() as db:
            db.execute("INSERT OR REPLACE INTO responses (id, created_at, response, input_items) "
                       "VALUES (?, ?, ?, ?)", (response["id"], int(response["created_at"]),
                                               json.dumps(response), json.dumps(input_items)))
            _prune(db, self.max_count, time.time() - self.max_age_s)

    def load(self, response_id: str) -> StoredResponse | None:
        """The stored response, unless unknown, deleted or past its age."""
        with self._journal.read_transaction() as db:
            row = db.execute("SELECT response, input_items FROM responses WHERE id = ? AND created_at >= ?",
                             (response_id, time.time() - self.max_age_s)).fetchone()
        return None if row is None else StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        with self._journal.write_transaction() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def prune(self) -> int:
        """Drops those past their age and the oldest beyond the count; returns how many."""
        with self._journal.write_transaction() as db:
            return _prune(db, self.max_count, time.time() - self.max_age_s)

    def settle(self) -> int:
        """At the start: a response stored queued or in progress was running in the background when the
        server stopped, and never will finish: failed, saying so. Returns how many."""
        with self._journal.write_transaction() as db:
            rows = db.execute("SELECT id, response FROM responses WHERE json_extract(response, '$.status') "
                              "IN ('queued', 'in_progress')").fetchall()
            for response_id, text in rows:
                response = {**json.loads(text), "status": "failed", "error": STOPPED_ERROR}
                db.execute("UPDATE responses SET response = ? WHERE id = ?",
                           (json.dumps(response), response_id))
        return len(rows)

    def count(self) -> int:
        with self._journal.read_transaction() as db:
            return db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    @property
    def _journal(self) -> Journal:
        assert self.journal is not None, "no state directory: nothing is stored"
        return self.journal


def _prune(db: sqlite3.Connection, max_count: int, oldest: float) -> int:
    aged = db.execute("DELETE FROM responses WHERE created_at < ?", (oldest,)).rowcount
    beyond = db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                        "ORDER BY created_at DESC, rowid DESC LIMIT -1 OFFSET ?)", (max_count,)).rowcount
    return aged + beyond
