"""PolicyMetrics: the Prometheus series say what the plain counters say, and a flow's label
children are bound once, not looked up on every event."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from sfq.policy.metrics import PolicyMetrics

K = ("acme", "interactive", "main")


def _request(m: PolicyMetrics, key: tuple[str, str, str] = K) -> None:
    m.queued(key)
    m.started(key, 0.003, 30.0, False)
    m.attempt_ended(key, served_cost=21.0)
    m.ended(key, "completed")


def _value(m: PolicyMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {"org": K[0], "class": K[1], "pool": K[2], **labels})


def test_series_match_the_counters() -> None:
    m = PolicyMetrics(flows=[K])
    text = generate_latest(m.registry).decode()
    assert 'sfq_queue_length{class="interactive",org="acme",pool="main"} 0.0' in text
    assert "sfq_queue_wait_seconds_count{" not in text  # shows when first counted, not before
    for _ in range(3):
        _request(m)
    m.queued(K)
    m.started(K, 0.2, 30.0, True)
    m.attempt_ended(K, upstream_429=True, timeout=True)
    m.ended(K, "failed", "unavailable")
    m.ended(K, "refused", "rate_limited")
    m.ended(K, "refused", "rate_limited")
    fc = m.snapshot()[K]
    assert _value(m, "sfq_requests_total", outcome="completed") == fc["completed"] == 3
    assert _value(m, "sfq_requests_total", outcome="refused") == fc["refused"] == 2
    assert _value(m, "sfq_refusals_total", reason="rate_limited") == 2
    assert _value(m, "sfq_failures_total", reason="unavailable") == 1
    assert _value(m, "sfq_refusals_total", reason="unavailable") is None
    assert _value(m, "sfq_attempts_total") == fc["attempts"] == 4
    assert _value(m, "sfq_retries_total") == fc["retries"] == 1
    assert _value(m, "sfq_charged_cost_total") == fc["charged_cost"] == 120.0
    assert _value(m, "sfq_served_cost_total") == fc["served_cost"] == 63.0
    assert _value(m, "sfq_upstream_429_total") == fc["upstream_429"] == 1
    assert _value(m, "sfq_timeouts_total") == fc["timeouts"] == 1
    assert _value(m, "sfq_queue_wait_seconds_count") == 4
    assert _value(m, "sfq_queue_wait_seconds_bucket", le="0.005") == 3
    assert _value(m, "sfq_queue_length") == fc["waiting"] == 0
    assert _value(m, "sfq_in_flight") == fc["in_flight"] == 0


def test_label_children_are_bound_once_per_flow() -> None:
    m = PolicyMetrics(flows=[K])
    calls: list[str] = []
    for name in ("wait", "requests", "refusals", "failures", "queue_length", "in_flight", "charged", "served",
                 "attempts", "retries"):
        metric = getattr(m, name)

        def counted(*values: Any, _labels: Any = metric.labels, _name: str = name) -> Any:
            calls.append(_name)
            return _labels(*values)

        metric.labels = counted
    _request(m)
    first = len(calls)
    assert first > 0  # the children counted for the first time are bound now
    for _ in range(50):
        _request(m)
        m.ended(K, "refused", "rate_limited")
    assert len(calls) == first + 1  # ... and only the one new (refusals, rate_limited) child since
    assert _value(m, "sfq_requests_total", outcome="completed") == 51
