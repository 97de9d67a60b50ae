"""How long each sequence spent in each phase in the engine core, for the server's `/metrics`: queued
(arrival to first scheduled), prefill (first scheduled to first token), decode (first token to last) and
inference (first scheduled to last token), as vLLM defines them.

Only the core sees when a sequence is scheduled, so it keeps these records; the server reads the new ones
with the `request_timings` utility call at each scrape. Records are numbered: a reader passes how many it
has seen and gets those after, of the last `capacity` kept (a reader that falls further behind loses the
oldest, and is told how many). A sequence is one of a request's `n` completions; an aborted one leaves no
record. Torch-free, like the scheduler.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

CAPACITY = 10_000


class RequestTimings:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self._arrived: dict[str, float] = {}
        self._scheduled: dict[str, float] = {}
        self._first_token: dict[str, float] = {}
        self._records: deque[tuple[float, float, float, float]] = deque(maxlen=capacity)
        self._count = 0  # records made since the start

    def arrived(self, request_id: str) -> None:
        self._arrived[request_id] = time.monotonic()

    def scheduled(self, request_ids: Iterable[str]) -> None:
        """The sequences of a step; only a sequence's first scheduling counts (a preempted one resumes)."""
        now = time.monotonic()
        for request_id in request_ids:
            self._scheduled.setdefault(request_id, now)

    def sampled(self, request_id: str, finished: bool) -> None:
        """A step ended with a token (or a fault) for the sequence."""
        now = time.monotonic()
        first = self._first_token.setdefault(request_id, now)
        if not finished:
            return
        arrived = self._arrived.pop(request_id, now)
        scheduled = self._scheduled.pop(request_id, now)
        del self._first_token[request_id]
        self._records.append((scheduled - arrived, first - scheduled, now - first, now - scheduled))
        self._count += 1

    def forget(self, request_ids: Iterable[str]) -> None:
        """Aborted sequences: no record."""
        for request_id in request_ids:
            for times in (self._arrived, self._scheduled, self._first_token):
                times.pop(request_id, None)

    def since(self, seen: int) -> dict:
        """The records after the first `seen`: {"count": records made so far, "records": [[queue, prefill,
        decode, inference], ...], "lost": those after `seen` no longer kept}."""
        new = max(0, self._count - seen)
        kept = min(new, len(self._records))
        records = [list(r) for r in list(self._records)[len(self._records) - kept:]] if kept else []
        return {"count": self._count, "records": records, "lost": new - kept}
