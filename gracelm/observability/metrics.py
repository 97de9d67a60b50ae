"""Prometheus metrics of a server, multiprocess-safe, their files in a directory of the instance's own.

prometheus_client picks its multiprocess value store from `PROMETHEUS_MULTIPROC_DIR` when it is imported
and when each metric is built, so `ServerMetrics` sets the variable first and builds its metrics after
(only this process writes metrics: the engine core's figures are read from it at each scrape).
`close()` removes the directory: no file outlives the instance.

Names: every metric is `gracelm_*`. With `--metrics-names vllm` those vLLM also has are exported a second
time under vLLM's name (`vllm:*`) and labels (`model_name`, `engine`), so that dashboards made for vLLM
work unchanged; gracelm's own (lifecycle, faults, refusals, start-up, restored KV) keep their one name.

The status page's chart, output tokens per second over the last minutes (`ThroughputHistory`), is counted as
the tokens arrive (`add`, from each request's tracker) into buckets of a few seconds, so that nothing wakes up
to take samples while the server idles: a bucket no token fell into reads as 0.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Any

_ENV = "PROMETHEUS_MULTIPROC_DIR"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.4, 0.8, 2.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
N_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
FINISH_REASONS = ("stop", "length", "abort", "error")
# Where a request's own fault may end it (containment; the engine serves on): its stages in the engine core,
# then the frontend's.
FAULT_STAGES = ("sampling", "stop_check", "detokenize")
# A batch's statuses before its end, and its lines' states (`gracelm.batch.objects`, `BatchRunner.progress`).
BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
BATCH_LINE_STATES = ("queued", "running", "completed", "failed")
# Why a request was answered 429 (`serving/admission_control.py`): its admission would have passed
# --max-num-queued-reqs, or it waited --max-queue-wait without an output.
REJECTION_REASONS = ("queue_full", "queue_wait")
# The APIs a request can come through (`ServingBase.start`); a batch line counts as its endpoint's.
APIS = ("chat_completions", "completions", "responses", "messages", "embeddings")


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One metric: `ServerMetrics.<attr>` is `gracelm_<name>` (and `vllm:<name>` where `vllm`)."""

    attr: str
    kind: str  # Gauge, Counter or Histogram
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    vllm: bool = False
    buckets: tuple[float, ...] | None = None  # a histogram's; None: token counts up to the context


def _gauge(attr: str, name: str, doc: str, labels: tuple[str, ...] = (), vllm: bool = False) -> _Spec:
    return _Spec(attr, "Gauge", name, doc, labels, vllm)


def _counter(attr: str, name: str, doc: str, labels: tuple[str, ...] = (), vllm: bool = True) -> _Spec:
    return _Spec(attr, "Counter", name, doc, labels, vllm)


def _histogram(attr: str, name: str, doc: str, buckets: tuple[float, ...] | None) -> _Spec:
    return _Spec(attr, "Histogram", name, doc, (), True, buckets)


# Every metric of the server, declared once.
METRICS = (
    _gauge("running", "num_requests_running", "Requests the engine is running.", vllm=True),
    _gauge("waiting", "num_requests_waiting", "Requests waiting in the engine's queue.", vllm=True),
    _gauge("running_background", "num_requests_running_background",
           "Requests of priority > 0 (background, such as batch lines) the engine is running."),
    _gauge("waiting_background", "num_requests_waiting_background",
           "Requests of priority > 0 waiting in the engine's queue."),
    _gauge("kv_usage", "kv_cache_usage_perc", "Share of KV-cache blocks in use (0..1).", vllm=True),
    _gauge("kv_total", "kv_cache_blocks_total", "KV-cache blocks in the pool."),
    _gauge("kv_free", "kv_cache_blocks_free", "KV-cache blocks free (cached ones included)."),
    _gauge("cache_config", "cache_config_info", "The KV cache's configuration, in the labels (value 1; "
           "cache_dtype auto: the model's dtype).",
           ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"), vllm=True),
    _gauge("prefix_hit_rate", "prefix_cache_hit_rate", "Prefix-cache hits over queries since start (0..1)."),
    _gauge("kv_restored", "kv_restored_blocks", "Prefix-cache blocks restored from --kv-cache-dir at start."),
    _gauge("kv_restored_hits", "kv_restored_block_hits",
           "Prefix-cache hits, in blocks, on blocks restored from --kv-cache-dir."),
    _gauge("batches", "batches", "Batches (/v1/batches) not at their end, by status.", ("status",)),
    _counter("batch_lines_crashed", "batch_lines_crashed",
             "Batch lines failed as the cause of the server's deaths (in flight at each, the last run "
             "alone).",
             vllm=False),
    _gauge("batch_lines", "batch_lines",
           "Lines of the batches not at their end, by state (queued, running, completed, failed).",
           ("state",)),
    _gauge("lifecycle", "lifecycle_state", "1 for the server's current lifecycle state.", ("state",)),
    _gauge("core_state", "engine_core_state",
           "1 for the engine core's shutdown state (running, requested, shutting_down).", ("state",)),
    _gauge("kernel_path", "kernel_path", "1 for the kernel path each part of a step takes now (part: linear, "
           "decode_attention, decode_graph, a draft model's draft_decode_graph; docs/kernel_paths.md).",
           ("part", "path")),
    _gauge("memory", "memory_bytes", "Bytes the engine core (rank 0) holds, by part: weights (every form "
           "loaded), kv_cache, and workspace (the rest of its resident memory).", ("part",)),
    _gauge("startup_phase", "startup_phase_seconds",
           "Seconds each phase of the start took (set once; phase total: all).", ("phase",)),
    _counter("prompt_tokens", "prompt_tokens", "Prompt tokens processed."),
    _counter("generation_tokens", "generation_tokens", "Tokens generated."),
    _counter("finished", "request_success", "Finished requests by finish reason.", ("finished_reason",)),
    _counter("prefix_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    _counter("prefix_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    _counter("compiled_steps", "decode_graph_steps",
             "Steps run by a compiled decode graph (docs/kernel_paths.md).", vllm=False),
    _counter("preemptions", "num_preemptions",
             "Sequences preempted (their KV cache freed, to be recomputed) for lack of KV-cache blocks."),
    _counter("spec_drafts", "spec_decode_num_drafts",
             "Speculative verifications: one per sequence per step that proposed at least one token."),
    _counter("spec_draft_tokens", "spec_decode_num_draft_tokens", "Tokens proposed by speculation."),
    _counter("spec_accepted_tokens", "spec_decode_num_accepted_tokens",
             "Proposed tokens the target model accepted."),
    _counter("spec_accepted_per_pos", "spec_decode_num_accepted_tokens_per_pos",
             "Proposed tokens accepted, by their position in the draft (0: the first).", ("position",)),
    _counter("request_faults", "request_faults", "Requests ended by a fault of their own (finish_reason "
             "error; the engine served on), by stage.", ("stage",), vllm=False),
    _counter("request_rejections", "request_rejections", "Requests answered 429 because the server had "
             "enough work, by reason: queue_full (--max-num-queued-reqs), queue_wait (--max-queue-wait).",
             ("reason",), vllm=False),
    _counter("api_requests", "api_requests", "Requests admitted to the engine, by the API they came "
             "through.", ("api",), vllm=False),
    _histogram("ttft", "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
    _histogram("itl", "inter_token_latency_seconds", "Time between two outputs of a request.", ITL_BUCKETS),
    _histogram("e2e", "e2e_request_latency_seconds", "Request latency, arrival to finish.", E2E_BUCKETS),
    _histogram("queue_time", "request_queue_time_seconds",
               "Time a sequence waited in the engine's queue before it was first scheduled.", E2E_BUCKETS),
    _histogram("prefill_time", "request_prefill_time_seconds",
               "Time from a sequence's first scheduling to its first token.", E2E_BUCKETS),
    _histogram("decode_time", "request_decode_time_seconds",
               "Time from a sequence's first token to its last.", E2E_BUCKETS),
    _histogram("inference_time", "request_inference_time_seconds",
               "Time from a sequence's first scheduling to its last token.", E2E_BUCKETS),
    _histogram("request_prompt_tokens", "request_prompt_tokens", "Prompt tokens of each request.", None),
    _histogram("request_generation_tokens", "request_generation_tokens",
               "Tokens generated for each request (all its n completions).", None),
    _histogram("request_n", "request_params_n", "The n of each request.", N_BUCKETS),
    _histogram("request_max_tokens", "request_params_max_tokens",
               "The max_tokens of each request that set it.", None),
)


def use_metrics_directory(directory: Path) -> None:
    """Points this process's prometheus_client at `directory` for its multiprocess files: the variable it
    reads, and its value class, picked at its import (which may have come first)."""
    os.environ[_ENV] = str(directory)
    from prometheus_client import values

    values.ValueClass = values.get_value_class()


class ServerMetrics:
    """The server's metrics (`METRICS`): request counters and latencies observed here, engine gauges read at
    scrape."""

    def __init__(self, directory: Path, model_name: str, lifecycle_states: tuple[str, ...],
                 core_states: tuple[str, ...] = (), *, vllm_names: bool = False,
                 max_model_len: int | None = None) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=False)
        use_metrics_directory(directory)
        self._label = {"model_name": model_name}
        self._vllm_names = vllm_names
        self._states = lifecycle_states
        self._core_states = core_states
        # Plain running totals of this process, for the periodic stats log line's throughput.
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0}
        self.api_totals = dict.fromkeys(APIS, 0)  # the status page's requests by API
        self.throughput = ThroughputHistory()  # the status page's chart
        self._engine_totals: dict[str, int] = {}  # the engine's running counts already added to counters
        self._kernel_paths: dict[str, str] = {}  # those last set to 1
        self.timings_seen = 0  # the core's phase-timing records observed (`RequestTimings`)
        token_buckets = _one_two_five(max_model_len or 1 << 20)
        for spec in METRICS:
            setattr(self, spec.attr, self._metric(spec, token_buckets))
        self._create_series()

    def _create_series(self) -> None:
        """Label sets exist from the start, so a scrape shows every series at 0 rather than omitting them."""
        for stage in FAULT_STAGES:
            self.request_faults.labels(**self._label, stage=stage)
        for reason in REJECTION_REASONS:
            self.request_rejections.labels(**self._label, reason=reason)
        for api in APIS:
            self.api_requests.labels(**self._label, api=api)
        for reason in FINISH_REASONS:
            self.finished.labels(**self._label, finished_reason=reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_queries, self.prefix_hits,
                       self.preemptions, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens):
            metric.labels(**self._label)

    def _metric(self, spec: _Spec, token_buckets: tuple[int, ...]) -> _Metric:
        """The metric `gracelm_<name>`, and `vllm:<name>` too when asked for and vLLM has it."""
        import prometheus_client

        cls = getattr(prometheus_client, spec.kind)
        labels = [*self._label, *spec.labels]
        kwargs: dict[str, Any] = {}
        if spec.kind == "Gauge":
            kwargs["multiprocess_mode"] = "mostrecent"
        elif spec.kind == "Histogram":
            kwargs["buckets"] = spec.buckets if spec.buckets is not None else token_buckets
        parts = [(cls(f"gracelm_{spec.name}", spec.doc, labels, registry=None, **kwargs), {})]
        if spec.vllm and self._vllm_names:
            parts.append((cls(f"vllm:{spec.name}", spec.doc, [*labels, "engine"], registry=None, **kwargs),
                          {"engine": "0"}))
        return _Metric(parts)

    def set_engine_stats(self, stats: dict) -> None:
        self.running.labels(**self._label).set(stats["num_running"])
        self.waiting.labels(**self._label).set(stats["num_waiting"])
        self.running_background.labels(**self._label).set(stats.get("num_running_background", 0))
        self.waiting_background.labels(**self._label).set(stats.get("num_waiting_background", 0))
        self.kv_usage.labels(**self._label).set(stats["kv_usage"])
        self.kv_total.labels(**self._label).set(stats["kv_blocks_total"])
        self.kv_free.labels(**self._label).set(stats["kv_blocks_free"])
        # vLLM writes its info gauges' label values with str(): True, False.
        self.cache_config.labels(**self._label, block_size=str(stats["kv_block_size"]), cache_dtype="auto",
                                 enable_prefix_caching=str(stats["prefix_caching"]),
                                 num_gpu_blocks=str(stats["kv_blocks_total"])).set(1)
        self.set_core_state(stats.get("state"))
        self.set_kernel_paths(stats.get("kernel_paths", {}))
        for part, size in stats.get("memory", {}).items():
            self.memory.labels(**self._label, part=part).set(size)
        queries = stats.get("prefix_cache_queries", 0)
        self.prefix_hit_rate.labels(**self._label).set(stats.get("prefix_cache_hits", 0) / queries
                                                       if queries else 0.0)
        self.kv_restored.labels(**self._label).set(stats.get("kv_restored_blocks", 0))
        self.kv_restored_hits.labels(**self._label).set(stats.get("kv_restored_block_hits", 0))
        for key, counter in (("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits), ("num_preemptions", self.preemptions),
                             ("compiled_steps", self.compiled_steps)):
            self._count_up(key, counter, stats.get(key, 0))
        self._count_spec_decode(stats.get("spec_decode"))

    def _count_spec_decode(self, spec: dict | None) -> None:
        """Brings the speculative-decoding counters up to the core's running totals. None (a core without
        speculation, an embedding model) counts nothing, as does method "off", whose totals stay 0."""
        if spec is None:
            return
        for key, counter in (("num_drafts", self.spec_drafts), ("num_draft_tokens", self.spec_draft_tokens),
                             ("num_accepted_tokens", self.spec_accepted_tokens)):
            self._count_up(f"spec_decode:{key}", counter, spec[key])
        for position, total in enumerate(spec["accepted_per_position"]):
            # Created at once: a position nothing was accepted at yet reads 0 rather than being absent.
            self.spec_accepted_per_pos.labels(**self._label, position=str(position))
            self._count_up(f"spec_decode:accepted:{position}", self.spec_accepted_per_pos, total,
                           position=str(position))

    def _count_up(self, key: str, counter: _Metric, total: int, **extra: str) -> None:
        """Brings a counter (its series with the `extra` labels) up to the engine's running total `total`
        of `key`."""
        new = total - self._engine_totals.get(key, 0)
        if new > 0:
            counter.labels(**self._label, **extra).inc(new)
            self._engine_totals[key] = total

    def observe_request_timings(self, timings: dict) -> None:
        """Observes the core's phase-timing records not seen yet (`engine.request_timings(timings_seen)`);
        those another scrape observed meanwhile are skipped."""
        records = timings["records"]
        first = timings["count"] - len(records)  # the number of the first record given
        for queue, prefill, decode, inference in records[max(0, self.timings_seen - first):]:
            self.queue_time.labels(**self._label).observe(queue)
            self.prefill_time.labels(**self._label).observe(prefill)
            self.decode_time.labels(**self._label).observe(decode)
            self.inference_time.labels(**self._label).observe(inference)
        self.timings_seen = max(self.timings_seen, timings["count"])

    def set_request_faults(self, counts: dict[str, int]) -> None:
        """Brings the fault counter up to the engine's running counts, by stage."""
        for stage, count in counts.items():
            self._count_up(f"request_faults:{stage}", self.request_faults, count, stage=stage)

    def count_rejection(self, reason: str) -> None:
        """One request answered 429, for one of `REJECTION_REASONS`."""
        self.request_rejections.labels(**self._label, reason=reason).inc()

    def count_api_request(self, api: str) -> None:
        """One request started through `api` (one of `APIS`)."""
        self.api_requests.labels(**self._label, api=api).inc()
        self.api_totals[api] += 1

    def set_crashed_lines(self, count: int) -> None:
        """The lines this start failed as the cause of crashes (`Journal.crash_culprits`)."""
        self._count_up("batch_lines_crashed", self.batch_lines_crashed, count)

    def set_batches(self, progress: list[dict[str, Any]]) -> None:
        """The batches' progress (`BatchRunner.progress`), as totals over the active batches: the labels stay
        few whatever the number of batches."""
        for status in BATCH_STATUSES:
            count = sum(b["status"] == status for b in progress)
            self.batches.labels(**self._label, status=status).set(count)
        for state in BATCH_LINE_STATES:
            self.batch_lines.labels(**self._label, state=state).set(sum(b[state] for b in progress))

    def set_lifecycle(self, state: str) -> None:
        for name in self._states:
            self.lifecycle.labels(**self._label, state=name).set(1.0 if name == state else 0.0)

    def set_core_state(self, state: str | None) -> None:
        """`None`: the core is gone; no state is 1."""
        for name in self._core_states:
            self.core_state.labels(**self._label, state=name).set(1.0 if name == state else 0.0)

    def set_kernel_paths(self, paths: dict[str, str]) -> None:
        """1 for each part's path now, 0 for the one it took before (a decode graph that fell back)."""
        for part, path in paths.items():
            before = self._kernel_paths.get(part)
            if before is not None and before != path:
                self.kernel_path.labels(**self._label, part=part, path=before).set(0.0)
            self.kernel_path.labels(**self._label, part=part, path=path).set(1.0)
            self._kernel_paths[part] = path

    def set_startup_phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.startup_phase.labels(**self._label, phase=phase).set(seconds)

    def request_tracker(self, num_prompt_tokens: int, n: int = 1,
                        max_tokens: int | None = None) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens, n, max_tokens)

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

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, n: int,
                 max_tokens: int | None) -> None:
        self._m = metrics
        self._label = metrics._label
        # The per-token metrics' children, looked up once: a lookup per token was a third of the cost of
        # counting it.
        self._itl = metrics.itl.labels(**self._label)
        self._generation_tokens = metrics.generation_tokens.labels(**self._label)
        self._arrival = time.monotonic()
        self._last: float | None = None
        self._num_prompt_tokens = num_prompt_tokens
        self._n = n
        self._max_tokens = max_tokens
        self._num_generated = 0

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
            self._itl.observe(now - self._last)
        self._generation_tokens.inc(num_new)
        self._num_generated += num_new
        self._m.totals["generation_tokens"] += num_new
        self._m.throughput.add(num_new)
        self._last = now

    def on_finish(self, finish_reasons: list[str | None]) -> None:
        m, label = self._m, self._label
        m.e2e.labels(**label).observe(time.monotonic() - self._arrival)
        m.request_prompt_tokens.labels(**label).observe(self._num_prompt_tokens)
        m.request_generation_tokens.labels(**label).observe(self._num_generated)
        m.request_n.labels(**label).observe(self._n)
        if self._max_tokens is not None:
            m.request_max_tokens.labels(**label).observe(self._max_tokens)
        for reason in finish_reasons:
            self._m.finished.labels(**self._label, finished_reason=reason or "abort").inc()


class _Metric:
    """One metric under one or two names (`ServerMetrics._metric`); `labels()` gives a child that updates
    each."""

    def __init__(self, parts: list[tuple[Any, dict[str, str]]]) -> None:
        self._parts = parts

    def labels(self, **labels: str) -> _Children:
        return _Children([metric.labels(**labels, **extra) for metric, extra in self._parts])


class _Children:
    def __init__(self, children: list[Any]) -> None:
        self._children = children

    def inc(self, amount: float = 1) -> None:
        for child in self._children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)


def _one_two_five(limit: int) -> tuple[int, ...]:
    """Buckets 1, 2, 5, 10, 20, 50, ... up to `limit` (token counts: a request's are at most the context)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


THROUGHPUT_BUCKET_S = 2.0
THROUGHPUT_WINDOW_S = 600.0


class ThroughputHistory:
    """Output tokens per second over the last `window_s`, in buckets of `bucket_s`."""

    def __init__(self, bucket_s: float = THROUGHPUT_BUCKET_S, window_s: float = THROUGHPUT_WINDOW_S) -> None:
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
