"""The last stop of a server, kept across restarts in its state directory (`--state-dir DIR`) as
`DIR/last-shutdown.json`: the shutdown report with when each resource was released, the exit code, and
when the server entered each lifecycle state, so that the next start can show how the last one ended (the
status page draws it as a timeline).

Written atomically at the end of every stop that has a report (a clean stop, a failure, an abandoned or
failed start-up); a failure to write is logged and never stops the stop. Read once at start; a file that
cannot be read or parsed is logged and treated as absent (the history is lost, nothing else is).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from gracelm.cache_dir import write_atomic
from gracelm.lifecycle.ledger import ShutdownReport

logger = logging.getLogger(__name__)

FILE_NAME = "last-shutdown.json"
FORMAT_VERSION = 1


def writable_dir_problem(path: str | None) -> str | None:
    """What keeps `path` from serving as a state directory (completing "--state-dir ..."), or None: it
    must be a writable directory, or creatable under the nearest existing one. Checks only; creates
    nothing."""
    if path is None:
        return None
    probe = Path(path).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"must be a directory, but {str(probe)!r} is not one"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"must be writable, but {str(probe)!r} is not"
    return None


def save_last_shutdown(state_dir: str | None, report: ShutdownReport, exit_code: int,
                       entered: dict[str, float]) -> None:
    """Keeps this stop's record in `state_dir` (nothing without one). `entered`: wall-clock time each
    lifecycle state began, by its name."""
    if state_dir is None:
        return
    record = {"version": FORMAT_VERSION, "pid": os.getpid(), "exit_code": int(exit_code),
              "saved_at": time.time(), "entered": entered, "report": report.to_dict()}
    path = Path(state_dir) / FILE_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps(record, indent=2) + "\n").encode())
    except OSError as exc:
        logger.error("could not keep the shutdown report in %s: %s", path, exc)


def load_last_shutdown(state_dir: str | None) -> dict[str, Any] | None:
    """The record the previous stop kept in `state_dir`, or None (no directory, no record, unreadable)."""
    if state_dir is None:
        return None
    path = Path(state_dir) / FILE_NAME
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the last shutdown record %s: %s", path, exc)
        return None
    if not isinstance(record, dict) or record.get("version") != FORMAT_VERSION:
        logger.warning("ignoring the last shutdown record %s: not format version %d", path, FORMAT_VERSION)
        return None
    return record
