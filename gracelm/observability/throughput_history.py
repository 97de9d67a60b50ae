"""Output tokens per second over the last minutes, for the status page's chart.

Counted as the tokens arrive (`add`, from each request's tracker) into buckets of a few seconds, so that
nothing wakes up to take samples while the server idles: a bucket no token fell into reads as 0.
"""

from __future__ import annotations

import collections
import time

BUCKET_S = 2.0
WINDOW_S = 600.0


class ThroughputHistory:
    def __init__(self, bucket_s: float = BUCKET_S, window_s: float = WINDOW_S) -> None:
        self.bucket_s = bucket_s
        self.num_buckets = int(window_s / bucket_s)
        self._started = self._bucket(time.monotonic())
        self._counts: collections.deque[list[int]] = collections.deque()  # [bucket index, tokens]

    def _bucket(self, now: float) -> int:
        return int(now // self.bucket_s)

    def add(self, num_tokens: int) -> None:
        bucket = self._bucket(time.monotonic())
        if self._counts and self._counts[-1][0] == bucket:
            self._counts[-1][1] += num_tokens
        else:
            self._counts.append([bucket, num_tokens])
        while self._counts[0][0] <= bucket - self.num_buckets:
            self._counts.popleft()

    def tokens_per_s(self) -> list[float]:
        """One rate per bucket, oldest first, up to the last complete bucket (the current one would read
        low): the window's worth, or fewer since the start."""
        last = self._bucket(time.monotonic()) - 1
        first = max(last - self.num_buckets + 1, self._started)
        counts = {bucket: tokens for bucket, tokens in self._counts}
        return [counts.get(bucket, 0) / self.bucket_s for bucket in range(first, last + 1)]
