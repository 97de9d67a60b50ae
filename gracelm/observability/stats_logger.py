"""The periodic stats log line: running and waiting requests, KV-cache use, prefix-cache hits, preemptions
since the start, throughput."""

from __future__ import annotations

import asyncio
import logging
import time

from gracelm.observability.metrics import ServerMetrics

logger = logging.getLogger("gracelm.stats")


async def log_stats_forever(engine, metrics: ServerMetrics, interval: float) -> None:
    """Logs one line every `interval` seconds until cancelled; a dead engine ends the loop quietly."""
    last_time = time.monotonic()
    last_totals = dict(metrics.totals)
    while engine.is_running:
        await asyncio.sleep(interval)
        try:
            stats = await engine.stats()
        except Exception as exc:  # the engine died meanwhile: its death is reported elsewhere
            logger.debug("stats unavailable: %s", exc)
            return
        now = time.monotonic()
        elapsed = max(now - last_time, 1e-9)
        prompt_tps = (metrics.totals["prompt_tokens"] - last_totals["prompt_tokens"]) / elapsed
        gen_tps = (metrics.totals["generation_tokens"] - last_totals["generation_tokens"]) / elapsed
        last_time, last_totals = now, dict(metrics.totals)
        queries = stats.get("prefix_cache_queries", 0)
        hit_rate = stats.get("prefix_cache_hits", 0) / queries if queries else 0.0
        logger.info("running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: "
                    "%.1f%%, preemptions: %d, prompt throughput: %.1f tok/s, generation throughput: "
                    "%.1f tok/s",
                    stats["num_running"], stats["num_waiting"], 100 * stats["kv_usage"], 100 * hit_rate,
                    stats.get("num_preemptions", 0), prompt_tps, gen_tps)
