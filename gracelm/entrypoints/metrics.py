"""Prometheus metrics of a server, multiprocess-safe, their files in a directory of the instance's own.

prometheus_client picks its multiprocess value store from `PROMETHEUS_MULTIPROC_DIR` when it is imported
and when each metric is built, so `ServerMetrics` sets the variable first and builds its metrics after
(only this process writes metrics: the engine core's figures are read from it at each scrape).
`close()` removes the directory: no file outlives the instance.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from gracelm.entrypoints.throughput_history import ThroughputHistory

_ENV = "PROMETHEUS_MULTIPROC_DIR"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.4, 0.8, 2.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
# Where a request's own fault may end it (containment; the engine serves on): its stages in the engine core,
# then the frontend's.
FAULT_STAGES = ("sampling", "stop_check", "detokenize")


class ServerMetrics:
    """The server's metrics: request counters and latencies observed here, engine gauges read at scrape."""

    def __init__(self, directory: Path, model_name: str, lifecycle_states: tuple[str, ...],
                 core_states: tuple[str, ...] = ()) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=False)
        os.environ[_ENV] = str(directory)
        from prometheus_client import Counter, Gauge, Histogram, values

        # Re-read the variable in case prometheus_client was imported before it was set.
        values.ValueClass = values.get_value_class()
        label = {"model_name": model_name}
        self._label = label
        self._states = lifecycle_states
        self._core_states = core_states
        # Plain running totals of this process, for the periodic stats log line's throughput.
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0}
        self.throughput = ThroughputHistory()  # the status page's chart

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*label, *extra], registry=None, multiprocess_mode="mostrecent")

        self.running = gauge("gracelm_num_requests_running", "Requests the engine is running.")
        self.waiting = gauge("gracelm_num_requests_waiting", "Requests waiting in the engine's queue.")
        self.kv_usage = gauge("gracelm_kv_cache_usage_perc", "Share of KV-cache blocks in use (0..1).")
        self.kv_total = gauge("gracelm_kv_cache_blocks_total", "KV-cache blocks in the pool.")
        self.kv_free = gauge("gracelm_kv_cache_blocks_free", "KV-cache blocks free (cached ones included).")
        self.prefix_hit_rate = gauge("gracelm_prefix_cache_hit_rate",
                                     "Prefix-cache hits over queries since start (0..1).")
        self.kv_restored = gauge("gracelm_kv_restored_blocks",
                                 "Prefix-cache blocks restored from --kv-cache-dir at start.")
        self.kv_restored_hits = gauge("gracelm_kv_restored_block_hits",
                                      "Prefix-cache hits, in blocks, on blocks restored from --kv-cache-dir.")
        self.lifecycle = gauge("gracelm_lifecycle_state", "1 for the server's current lifecycle state.",
                               ("state",))
        self.core_state = gauge("gracelm_engine_core_state",
                                "1 for the engine core's shutdown state (running, requested, shutting_down).",
                                ("state",))
        self.startup_phase = gauge("gracelm_startup_phase_seconds",
                                   "Seconds each phase of the start took (set once; phase total: all).",
                                   ("phase",))
        self.prompt_tokens = Counter("gracelm_prompt_tokens", "Prompt tokens processed.", [*label],
                                     registry=None)
        self.generation_tokens = Counter("gracelm_generation_tokens", "Tokens generated.", [*label],
                                         registry=None)
        self.finished = Counter("gracelm_request_success", "Finished requests by finish reason.",
                                [*label, "finished_reason"], registry=None)
        self.ttft = Histogram("gracelm_time_to_first_token_seconds", "Time to first token.", [*label],
                              buckets=TTFT_BUCKETS, registry=None)
        self.itl = Histogram("gracelm_inter_token_latency_seconds", "Time between two outputs of a request.",
                             [*label], buckets=ITL_BUCKETS, registry=None)
        self.e2e = Histogram("gracelm_e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             [*label], buckets=E2E_BUCKETS, registry=None)
        self.request_faults = Counter("gracelm_request_faults", "Requests ended by a fault of their own "
                                      "(finish_reason error; the engine served on), by stage.",
                                      [*label, "stage"], registry=None)
        self._faults_seen: dict[str, int] = {}
        # Label sets exist from the start, so a scrape shows every series at 0 rather than omitting them.
        for stage in FAULT_STAGES:
            self.request_faults.labels(**label, stage=stage)
        for reason in FINISH_REASONS:
            self.finished.labels(**label, finished_reason=reason)
        for metric in (self.prompt_tokens, self.generation_tokens):
            metric.labels(**label)

    def set_engine_stats(self, stats: dict) -> None:
        self.running.labels(**self._label).set(stats["num_running"])
        self.waiting.labels(**self._label).set(stats["num_waiting"])
        self.kv_usage.labels(**self._label).set(stats["kv_usage"])
        self.kv_total.labels(**self._label).set(stats["kv_blocks_total"])
        self.kv_free.labels(**self._label).set(stats["kv_blocks_free"])
        self.set_core_state(stats.get("state"))
        queries = stats.get("prefix_cache_queries", 0)
        self.prefix_hit_rate.labels(**self._label).set(stats.get("prefix_cache_hits", 0) / queries
                                                       if queries else 0.0)
        self.kv_restored.labels(**self._label).set(stats.get("kv_restored_blocks", 0))
        self.kv_restored_hits.labels(**self._label).set(stats.get("kv_restored_block_hits", 0))

    def set_request_faults(self, counts: dict[str, int]) -> None:
        """Brings the fault counter up to the engine's running counts, by stage."""
        for stage, count in counts.items():
            new = count - self._faults_seen.get(stage, 0)
            if new > 0:
                self.request_faults.labels(**self._label, stage=stage).inc(new)
                self._faults_seen[stage] = count

    def set_lifecycle(self, state: str) -> None:
        for name in self._states:
            self.lifecycle.labels(**self._label, state=name).set(1.0 if name == state else 0.0)

    def set_core_state(self, state: str | None) -> None:
        """`None`: the core is gone; no state is 1."""
        for name in self._core_states:
            self.core_state.labels(**self._label, state=name).set(1.0 if name == state else 0.0)

    def set_startup_phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.startup_phase.labels(**self._label, phase=phase).set(seconds)

    def request_tracker(self, num_prompt_tokens: int) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text of every process's metrics, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(self.directory))
        return generate_latest(registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        from prometheus_client import values

        values.close_all_multiprocess_files()
        shutil.rmtree(self.directory, ignore_errors=True)
        if os.environ.get(_ENV) == str(self.directory):
            del os.environ[_ENV]


class RequestTracker:
    """Observes one request's latencies and token counts as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self._m = metrics
        self._label = metrics._label
        self._arrival = time.monotonic()
        self._last: float | None = None
        self._num_prompt_tokens = num_prompt_tokens

    def on_output(self, num_new: int) -> None:
        """Called with each output's new tokens (all `n` completions together)."""
        if num_new <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.labels(**self._label).observe(now - self._arrival)
            self._m.prompt_tokens.labels(**self._label).inc(self._num_prompt_tokens)
            self._m.totals["prompt_tokens"] += self._num_prompt_tokens
        else:
            self._m.itl.labels(**self._label).observe(now - self._last)
        self._m.generation_tokens.labels(**self._label).inc(num_new)
        self._m.totals["generation_tokens"] += num_new
        self._m.throughput.add(num_new)
        self._last = now

    def on_finish(self, finish_reasons: list[str | None]) -> None:
        self._m.e2e.labels(**self._label).observe(time.monotonic() - self._arrival)
        for reason in finish_reasons:
            self._m.finished.labels(**self._label, finished_reason=reason or "abort").inc()
