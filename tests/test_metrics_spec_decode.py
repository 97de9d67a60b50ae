"""Speculative decoding's counters on `/metrics`: the core's running totals (`stats()["spec_decode"]`) become
counter increments scrape after scrape, under gracelm's names and, with `--metrics-names vllm`, vLLM's
(`vllm:spec_decode_*`, accepted tokens by `position`); a core that reports no speculation leaves them at 0."""

from __future__ import annotations

import pytest
from prometheus_client import values
from prometheus_client.parser import text_string_to_metric_families

from gracelm.observability.metrics import ServerMetrics

NAME = "tiny"
ENGINE_STATS = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "kv_blocks_total": 8,
                "kv_blocks_free": 8, "kv_block_size": 16, "prefix_caching": True}
COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total")


def _spec(drafts: int, draft_tokens: int, accepted: int, per_position: list[int],
          method: str = "ngram") -> dict:
    return {**ENGINE_STATS, "spec_decode": {"method": method, "num_drafts": drafts,
                                            "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
                                            "accepted_per_position": per_position}}


@pytest.fixture(params=[("gracelm_",), ("gracelm_", "vllm:")], ids=["gracelm_names", "vllm_names"])
def prefixes(request) -> tuple[str, ...]:
    """The names exported: gracelm's, and vLLM's too with `--metrics-names vllm`."""
    return request.param


@pytest.fixture
def metrics(prefixes, tmp_path, monkeypatch):
    # The directory's variable and prometheus_client's value class are the process's: restored after.
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = ServerMetrics(tmp_path / "prometheus", NAME, ("running",), vllm_names="vllm:" in prefixes)
    yield metrics
    metrics.close()


def _samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset], float]:
    text = metrics.render()[0].decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples, prefix: str, name: str, **labels: str) -> float:
    labels = {"model_name": NAME, **({"engine": "0"} if prefix == "vllm:" else {}), **labels}
    return samples[(prefix + name, frozenset(labels.items()))]


def test_running_totals_become_counters_under_each_name(metrics, prefixes):
    metrics.set_engine_stats(_spec(3, 9, 5, [3, 2, 0]))
    first = _samples(metrics)
    metrics.set_engine_stats(_spec(10, 30, 17, [8, 6, 3]))
    metrics.set_engine_stats(_spec(10, 30, 17, [8, 6, 3]))  # a scrape with nothing new adds nothing
    second = _samples(metrics)
    for prefix in prefixes:
        assert [_value(first, prefix, name) for name in COUNTERS] == [3, 9, 5]
        assert [_value(second, prefix, name) for name in COUNTERS] == [10, 30, 17]
        per_position = "spec_decode_num_accepted_tokens_per_pos_total"
        # Position 2 had nothing accepted at the first scrape: its series is there, at 0.
        assert [_value(first, prefix, per_position, position=str(p)) for p in range(3)] == [3, 2, 0]
        assert [_value(second, prefix, per_position, position=str(p)) for p in range(3)] == [8, 6, 3]
    assert any(name.startswith("vllm:") for name, _ in second) == ("vllm:" in prefixes)


@pytest.mark.parametrize("stats", [ENGINE_STATS, _spec(0, 0, 0, [], method="off")], ids=["absent", "off"])
def test_no_speculation_leaves_the_counters_at_zero(metrics, prefixes, stats):
    metrics.set_engine_stats(stats)
    metrics.set_engine_stats(stats)
    samples = _samples(metrics)
    for prefix in prefixes:
        assert [_value(samples, prefix, name) for name in COUNTERS] == [0, 0, 0]
    assert not any("per_pos" in name for name, _ in samples)
