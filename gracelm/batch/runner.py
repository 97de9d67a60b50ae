"""The batch runner: one asyncio task that takes every batch of the journal from validation to its end, and
runs their lines through a `LineExecutor` (the online routes' own handling, `server/batch_lines.py`).

- **Validation**: a validating batch's input file is read (its checksum verified) and checked
  (`validation.py`); it fails with `errors`, or its lines are queued and it is in progress, in one commit.
- **Lines**: queued lines of the batches in progress, oldest batch first and in line order, run
  concurrently, at most `concurrency` at once (the engine's `max_num_seqs`, so that they fill its batches).
  Each line holds a background admission of the server (`ServerState.admit(background=True)`) from its start
  until its result is committed, so a drain waits for that commit. A line's result (its answer, 200 or an
  error) is committed before the line counts as done; results that arrive while a commit runs are
  committed together in the next one (a group commit: one fsync for many lines).
- **Stops**: a line stopped before its answer (a drain's deadline, the engine's end) leaves no result: it
  stays queued in the journal and runs again at the next start. A drain stops new lines at once, since a
  background admission is refused once the server is not RUNNING; the runner then only waits.
- **Ends**: a batch with no line left goes finalizing, then completed, its output and error files written
  from the results. A cancelling batch, once its running lines are done, and a batch past its
  `expires_at`, likewise, become cancelled or expired, their unrun lines in the error file.

After a crash nothing needs repair: the journal's committed state is the runner's whole state, and the next
start takes it from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from gracelm.batch.journal import CorruptFileError, Journal, Line
from gracelm.batch.objects import (
    ACTIVE,
    CANCELLED_LINE,
    EXPIRED_LINE,
    BatchRecord,
    LineState,
    Status,
    answered_line,
    batch_error,
    new_id,
)
from gracelm.batch.validation import validate_input
from gracelm.lifecycle.server_state import AdmissionRefused, ServerState

logger = logging.getLogger(__name__)

_RETRY_S = 5.0  # after a step that failed, the runner tries again this much later (or when woken)


class LineAnswer(NamedTuple):
    status_code: int
    body: dict[str, Any]


class LineExecutor(Protocol):
    async def __call__(self, line: Line, line_id: str) -> LineAnswer | None:
        """The answer to the line's request (its run named `line_id`), or None when the request was stopped
        before its end (a drain, the engine's end): the line then stays queued."""
        ...


class BatchRunner:
    def __init__(self, journal: Journal, execute: LineExecutor, state: ServerState, concurrency: int,
                 on_committed: Callable[[int], None] | None = None) -> None:
        """`on_committed(n)`: told each time `n` lines' results have been committed (a progress bar)."""
        self._journal = journal
        self._execute = execute
        self._state = state
        self._concurrency = concurrency
        self._wake = asyncio.Event()
        self._in_flight: dict[tuple[str, int], asyncio.Task] = {}
        self._cursor: dict[str, int] = {}  # per batch, the last line started by this process
        self._commits = _GroupCommit(journal, on_committed)
        self._alone: tuple[str, int] | None = None  # a suspect line running with nothing beside it
        self.lines_answered = 0  # lines this process ran to an answer

    def wake(self) -> None:
        """Something changed in the journal (a batch created or cancelled): look again."""
        self._wake.set()

    async def progress(self) -> list[dict[str, Any]]:
        """Each batch not at its end, oldest first: its status and its lines by state (for /status.json and
        /metrics)."""
        batches = await asyncio.to_thread(self._journal.batches_in, ACTIVE)
        return [{"id": b.id, "status": b.status.value, "endpoint": b.endpoint, "created_at": b.created_at,
                 "expires_at": b.expires_at, "total": b.counts.total, "completed": b.counts.completed,
                 "failed": b.counts.failed, "running": self.running(b.id),
                 "queued": _queued(b) - self.running(b.id)} for b in batches]

    def running(self, batch_id: str) -> int:
        """The batch's lines running now."""
        return sum(key[0] == batch_id for key in self._in_flight)

    async def run(self) -> None:
        """Runs until cancelled; the lines still running are then cancelled (they stay queued)."""
        try:
            while True:
                self._wake.clear()
                try:
                    timeout = await self._step()
                except Exception:  # the journal failed (a full disk, say): the batches wait, never lost
                    logger.exception("the batch runner's step failed; trying again in %g s", _RETRY_S)
                    timeout = _RETRY_S
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
        finally:
            stopped, tasks = list(self._in_flight), list(self._in_flight.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if stopped and self._state.alive:
                # A graceful stop: no crash of theirs (after a death they stay in flight: the next start
                # counts it).
                await asyncio.to_thread(self._journal.release_lines, stopped)

    async def _step(self) -> float | None:
        """Moves every active batch on as far as it can go now; returns how long until the next expiry."""
        batches = await asyncio.to_thread(self._journal.batches_in, ACTIVE)
        now = time.time()
        runnable = []
        for batch in batches:
            if batch.status is Status.VALIDATING:
                await self._validate(batch)
            elif batch.status is Status.CANCELLING and not self.running(batch.id):
                await self._end(batch, Status.CANCELLING, Status.CANCELLED, CANCELLED_LINE)
            elif batch.status is Status.FINALIZING:
                await self._end(batch, Status.FINALIZING, Status.COMPLETED, None)
            elif batch.status is Status.IN_PROGRESS:
                if batch.expires_at is not None and batch.expires_at <= now:
                    if not self.running(batch.id):
                        await self._end(batch, Status.IN_PROGRESS, Status.EXPIRED, EXPIRED_LINE)
                elif _queued(batch):
                    runnable.append(batch)
                elif not self.running(batch.id):
                    await asyncio.to_thread(self._journal.begin_finalizing, batch.id)
                    await self._end(batch, Status.FINALIZING, Status.COMPLETED, None)
        for batch in runnable:
            if not await self._dispatch(batch):
                break
        if any(b.status is Status.VALIDATING for b in batches):
            return 0.0  # validated batches are in progress now: look again at once
        expiries = [b.expires_at for b in batches  # those expired already wait for their running lines
                    if b.status is Status.IN_PROGRESS and b.expires_at is not None and b.expires_at > now]
        return max(0.0, min(expiries) - now) if expiries else None

    async def _validate(self, batch: BatchRecord) -> None:
        try:
            content = await asyncio.to_thread(self._journal.file_content, batch.input_file_id)
        except CorruptFileError as exc:
            logger.error("batch %s: %s", batch.id, exc)
            content, errors = None, [batch_error("file_corrupted", str(exc), param="input_file_id")]
        else:
            gone = f"The input file {batch.input_file_id} no longer exists."
            errors = [batch_error("invalid_request", gone, param="input_file_id")] if content is None else []
        if content is not None:
            lines, errors = await asyncio.to_thread(validate_input, content, batch.endpoint)
        if errors:
            await asyncio.to_thread(self._journal.fail_batch, batch.id, errors)
            logger.info("batch %s failed validation: %d errors, the first: %s", batch.id, len(errors),
                        errors[0]["message"])
        elif await asyncio.to_thread(self._journal.start_batch, batch.id, lines):
            logger.info("batch %s in progress: %d lines", batch.id, len(lines))

    async def _end(self, batch: BatchRecord, current: Status, final: Status,
                   unfinished: tuple[str, str] | None) -> None:
        await asyncio.to_thread(self._journal.finalize, batch.id, current, final, unfinished)
        self._cursor.pop(batch.id, None)
        logger.info("batch %s %s", batch.id, final.value)

    async def _dispatch(self, batch: BatchRecord) -> bool:
        """Starts as many of the batch's queued lines as there is room for, suspects last and each alone
        (`journal.py`); False once there is no room left (or the server starts no background work)."""
        room = self._concurrency - len(self._in_flight)
        if room <= 0 or self._alone is not None:
            return False
        admissions = []
        try:
            for _ in range(room):
                admissions.append(self._state.admit(background=True))
        except AdmissionRefused:
            for admission in admissions:
                admission.release()
            return False
        lines = await asyncio.to_thread(self._journal.take_lines, batch.id, self._cursor.get(batch.id, 0),
                                        len(admissions))
        if not lines and not self._in_flight:
            suspect = await asyncio.to_thread(self._journal.take_suspect, batch.id)
            if suspect is not None:
                logger.warning("batch %s line %d was in flight at earlier deaths of the server: run alone",
                               batch.id, suspect.line)
                self._alone = suspect.key
                lines = [suspect]
        for line, admission in zip(lines, admissions, strict=False):
            self._cursor[batch.id] = line.line
            self._in_flight[line.key] = asyncio.create_task(self._run_line(line, admission),
                                                            name=f"batch-line {batch.id}:{line.line}")
        for admission in admissions[len(lines):]:
            admission.release()
        return len(lines) < room

    async def _run_line(self, line: Line, admission) -> None:
        line_id = new_id("batch_req_")
        try:
            answer = await self._execute(line, line_id)
            if answer is None:  # stopped before its end: it stays queued, and runs again
                self._cursor[line.batch_id] = min(self._cursor.get(line.batch_id, 0), line.line - 1)
                return
            state = LineState.COMPLETED if answer.status_code == 200 else LineState.FAILED
            output = answered_line(line_id, line.custom_id, answer.status_code, answer.body)
            await self._commits.commit((line.batch_id, line.line, state, output))
            self.lines_answered += 1
        except Exception:
            # Not committed: the line stays queued in the journal and runs again at the next start.
            logger.exception("batch %s line %d: its result could not be kept", line.batch_id, line.line)
        finally:
            admission.release()
            self._in_flight.pop(line.key, None)
            if self._alone == line.key:
                self._alone = None
            self.wake()


def _queued(batch: BatchRecord) -> int:
    counts = batch.counts
    return counts.total - counts.completed - counts.failed


class _GroupCommit:
    """Commits lines' results; those that come while a commit runs go together into the next one."""

    def __init__(self, journal: Journal, on_committed: Callable[[int], None] | None) -> None:
        self._journal = journal
        self._on_committed = on_committed
        self._pending: list[tuple[tuple, asyncio.Future]] = []
        self._writer: asyncio.Task | None = None

    async def commit(self, result: tuple[str, int, LineState, dict[str, Any]]) -> None:
        """Returns once `result` is committed (raises if the commit failed)."""
        done = asyncio.get_running_loop().create_future()
        self._pending.append((result, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="batch-group-commit")
        await done

    async def _write(self) -> None:
        while self._pending:
            group, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self._journal.record_results, [result for result, _ in group])
            except Exception as exc:  # each line's task logs it; their lines stay queued
                for _, done in group:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for _, done in group:
                if not done.done():
                    done.set_result(None)
            if self._on_committed is not None:
                self._on_committed(len(group))
