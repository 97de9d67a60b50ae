"""OpenAI's Batch API objects as the journal keeps them: a file, a batch with its statuses and request
counts, one line's output (the line format of the output and error files), and their ids.

A batch goes validating → in_progress → finalizing → completed; validating → failed (its input refused,
`errors`); in_progress → cancelling → cancelled (`POST /v1/batches/{id}/cancel`), or → expired when its
completion window passes. A cancelled or expired batch's lines that never ran get an output line with an
`error` (`batch_cancelled`, `batch_expired`) in the error file, as OpenAI's do. A batch at its end names
the model of its answers and their usage, summed (`journal.py` reads them from its results).
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from typing import Any


class Status(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# Batches the runner still has work for.
ACTIVE = (Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)
# Batches at their end: nothing of theirs changes any more.
ENDED = (Status.COMPLETED, Status.FAILED, Status.EXPIRED, Status.CANCELLED)


class LineState(enum.StrEnum):
    QUEUED = "queued"  # not run yet, or run and not committed (a crash, a stop): it runs (again)
    COMPLETED = "completed"  # its result, a 200 answer, is committed
    FAILED = "failed"  # its result, an error, is committed


ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOW = "24h"  # the only window OpenAI accepts
COMPLETION_WINDOW_S = 24 * 3600
# The engine priority of a batch line (lower runs first; interactive requests default to 0): batch work fills
# the engine's batches without holding interactive requests back.
LINE_PRIORITY = 1
INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(frozen=True)
class FileRecord:
    id: str
    purpose: str
    filename: str
    bytes: int
    sha256: str
    created_at: int

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}


@dataclasses.dataclass(frozen=True)
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclasses.dataclass(frozen=True)
class BatchUsage:
    """A batch's tokens, summed over its lines' 200 answers (OpenAI's batch `usage`)."""

    input_tokens: int
    output_tokens: int
    reasoning_tokens: int = 0  # of the output tokens, those a reasoning parser read as thinking

    def to_openai(self) -> dict[str, Any]:
        # cached_tokens is 0: the prefix cache's hits are not counted per request.
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.input_tokens + self.output_tokens}


# The batch's timestamps, one per status it has entered (OpenAI's `<status>_at`).
TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at")


@dataclasses.dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str | None  # None: any of ENDPOINTS, line by line (`gracelm run-batch`)
    input_file_id: str
    completion_window: str
    status: Status
    created_at: int
    expires_at: int | None  # None: never (`gracelm run-batch`)
    times: dict[str, int | None]  # TIMESTAMPS
    output_file_id: str | None
    error_file_id: str | None
    errors: list[dict[str, Any]] | None
    metadata: dict[str, str] | None
    counts: RequestCounts
    # At the batch's end (None before): the model its answers name (None: no line was answered) and
    # their usage.
    model: str | None
    usage: BatchUsage | None

    def to_openai(self) -> dict[str, Any]:
        errors = None if self.errors is None else {"object": "list", "data": self.errors}
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint or "", "errors": errors,
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status.value, "output_file_id": self.output_file_id,
                "error_file_id": self.error_file_id, "created_at": self.created_at,
                "expires_at": self.expires_at, **self.times,
                "request_counts": dataclasses.asdict(self.counts), "metadata": self.metadata,
                "model": self.model, "usage": None if self.usage is None else self.usage.to_openai()}


def batch_error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """One entry of a failed batch's `errors.data`."""
    return {"code": code, "message": message, "param": param, "line": line}


def answered_line(line_id: str, custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """The output line of a line that got an HTTP answer (its run named `line_id`): 200 goes to the output
    file, any other status (its body an error body) to the error file."""
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": line_id, "body": body}, "error": None}


def unanswered_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """The output line of a line that never ran (its batch cancelled or expired)."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


CANCELLED_LINE = ("batch_cancelled", "This request was not executed because the batch was cancelled.")
EXPIRED_LINE = ("batch_expired", "This request could not be executed before the completion window expired.")
