"""PolicyMetrics: the Prometheus series say what the plain counters say; they are made from
those counters at scrape time, exactly as prometheus_client's own labelled metrics would have
made them event by event."""

from __future__ import annotations

import random
import time
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sfq.policy.metrics import OUTCOMES, WAIT_BUCKETS, PolicyMetrics

K = ("acme", "interactive", "main")


def _request(m: PolicyMetrics, key: tuple[str, str, str] = K) -> None:
    m.queued(key)
    m.started(key, 0.003, 30.0, False)
    m.attempt_ended(key, served_cost=21.0, charged=30.0)
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
    m.attempt_ended(K, upstream_429=True, timeout=True, charged=30.0)
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
    per_class = {"class": K[1], "pool": K[2]}  # the wait histogram has no org label
    assert m.registry.get_sample_value("sfq_queue_wait_seconds_count", per_class) == 4
    assert m.registry.get_sample_value("sfq_queue_wait_seconds_bucket", {**per_class, "le": "0.005"}) == 3
    assert _value(m, "sfq_queue_length") == fc["waiting"] == 0
    assert _value(m, "sfq_in_flight") == fc["in_flight"] == 0


class _Children:
    """The series as ``prometheus_client``'s labelled metrics made them, event by event (what
    ``PolicyMetrics`` did before it read its counters at scrape time): the reference the
    collector's exposition must equal."""

    def __init__(self, flows: list[tuple[str, str, str]]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        lab = ("org", "class", "pool")
        self.wait = Histogram("sfq_queue_wait_seconds", "Wait before start (seconds), per class and pool",
                              ("class", "pool"), buckets=WAIT_BUCKETS, registry=r)
        self.ttft = Histogram("sfq_time_to_first_token_seconds", "Time to first token as the gateway saw it: from a "
                              "request's arrival to the first byte of its answer (the first event of a stream), per "
                              "class and pool; the buckets include the class's ttft_objective_seconds",
                              ("class", "pool"), buckets=WAIT_BUCKETS, registry=r)  # (no policy: no objective)
        self.requests = Counter("sfq_requests", "Requests by outcome", (*lab, "outcome"), registry=r)
        self.refusals = Counter("sfq_refusals", "Requests refused or dropped before start, by reason",
                                (*lab, "reason"), registry=r)
        self.failures = Counter("sfq_failures", "Requests that failed, by reason", (*lab, "reason"), registry=r)
        self.queue_length = Gauge("sfq_queue_length", "Requests waiting (not started)", lab, registry=r)
        self.in_flight = Gauge("sfq_in_flight", "Requests running on a backend", lab, registry=r)
        self.charged = Counter("sfq_charged_cost", "Cost the engine charged for attempts that ended, every correction "
                               "made (cost units)", lab, registry=r)
        self.served = Counter("sfq_served_cost", "Cost served: usage reports, or what passed to the client of a "
                              "request that ended early (cost units)", lab, registry=r)
        self.cancelled_work = Counter("sfq_cancelled_work_tokens",
                                      "Tokens produced for requests cancelled while running (streams)", lab,
                                      registry=r)
        self.upstream_429 = Counter("sfq_upstream_429", "Upstream 429 answers", lab, registry=r)
        self.timeouts = Counter("sfq_timeouts", "Queue-age or deadline expiries and backend timeouts", lab,
                                registry=r)
        self.missed = Counter("sfq_deadline_missed", "Requests ended because their deadline (X-SFQ-Timeout, "
                              "timeout=) or their class's max_queue_age_seconds ran out: in the queue, between "
                              "retries or while running", lab, registry=r)
        self.attempts = Counter("sfq_attempts", "Attempts started (first tries and retries)", lab, registry=r)
        self.retries = Counter("sfq_retries", "Retries started", lab, registry=r)
        self.known: set[tuple[str, str, str]] = set()
        for k in flows:
            self._flow(k)

    def _flow(self, k: tuple[str, str, str]) -> None:
        if k not in self.known:
            self.known.add(k)
            self.queue_length.labels(*k)
            self.in_flight.labels(*k)
            for o in OUTCOMES:
                self.requests.labels(*k, o)

    def queued(self, k: Any, n: int = 1) -> None:
        self._flow(k)
        self.queue_length.labels(*k).inc(n)

    def started(self, k: Any, wait: float, cost: float, retry: bool) -> None:
        self._flow(k)
        self.queue_length.labels(*k).dec()
        self.in_flight.labels(*k).inc()
        self.wait.labels(*k[1:]).observe(wait)
        self.charged.labels(*k)  # (counted when the attempt ends)
        self.attempts.labels(*k).inc()
        if retry:
            self.retries.labels(*k).inc()

    def attempt_ended(self, k: Any, *, served_cost: float | None = None, upstream_429: bool = False,
                      timeout: bool = False, charged: float | None = None) -> None:
        self._flow(k)
        self.in_flight.labels(*k).dec()
        if charged:
            self.charged.labels(*k).inc(charged)
        if served_cost:
            self.served.labels(*k).inc(served_cost)
        if upstream_429:
            self.upstream_429.labels(*k).inc()
        if timeout:
            self.timeout(k)

    def left_queue(self, k: Any) -> None:
        self._flow(k)
        self.queue_length.labels(*k).dec()

    def timeout(self, k: Any) -> None:
        self._flow(k)
        self.timeouts.labels(*k).inc()

    def cancelled_work_tokens(self, k: Any, tokens: float) -> None:
        if tokens > 0:
            self._flow(k)
            self.cancelled_work.labels(*k).inc(tokens)

    def ended(self, k: Any, outcome: str, reason: str | None = None) -> None:
        self._flow(k)
        self.requests.labels(*k, outcome).inc()
        if reason is not None:
            (self.refusals if outcome == "refused" else self.failures).labels(*k, reason).inc()
            if reason in ("deadline", "queue_timeout"):
                self.missed.labels(*k).inc()

    def joined(self, k: Any) -> None:
        self.requests.labels(*k, "joined").inc()

    def first_token(self, k: Any, seconds: float | None) -> None:
        if seconds is not None:
            self.ttft.labels(*k[1:]).observe(seconds)


#: the share window's families (tests/policy/test_metrics_window.py): not prometheus_client children
_WINDOW = ("sfq_share", "sfq_expected_share", "sfq_oldest_wait_seconds", "sfq_fairness_jain", "sfq_org_weight",
           "sfq_objective_attainment")


def _samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the registry's exposition (but the share window's), parsed back;
    ``_created`` ones valued 0 (they are clock readings)."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        if fam.name in _WINDOW:
            continue
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, key
            out[key] = 0.0 if s.name.endswith("_created") else round(s.value, 6)  # (sums over flows: any order)
    return out


def _families(registry: CollectorRegistry) -> list[tuple[str, str, str]]:
    return [(f.name, f.type, f.documentation)
            for f in text_string_to_metric_families(generate_latest(registry).decode()) if f.name not in _WINDOW]


def _events(rng: random.Random, flows: list[tuple[str, str, str]], n: int) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """A random but consistent sequence of a policy's events (each request queued, started,
    perhaps retried, ended; refusals before and after a flow is known; joins)."""
    ev: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    reasons = ["rate_limited", "queue_full", "deadline", "unavailable"]
    for _ in range(n):
        k = rng.choice(flows)
        what = rng.random()
        if what < 0.1:
            ev.append(("ended", (k, "refused", rng.choice(reasons)), {}))
            continue
        if what < 0.13:
            ev.append(("joined", (k,), {}))
            continue
        ev.append(("queued", (k,), {}))
        if what < 0.2:
            ev.append(("left_queue", (k,), {}))
            ev.append(("timeout", (k,), {}))
            ev.append(("ended", (k, "refused", "queue_timeout"), {}))
            if k[1]:
                ev.append(("first_token", (k, None), {}))  # a miss: no time to first token
            continue
        if what < 0.25:
            ev.append(("left_queue", (k,), {}))
            ev.append(("ended", (k, "cancelled_before_start"), {}))
            continue
        tries = 1 + (rng.random() < 0.2)
        for t in range(tries):
            ev.append(("started", (k, rng.choice([0.0, 0.0005, 0.001, 0.02, 0.3, 4.0, 7200.0, 9000.0]),
                                   float(rng.randint(0, 300)), t > 0), {}))
            last = t == tries - 1
            ev.append(("attempt_ended", (k,), {"served_cost": rng.choice([None, 0.0, float(rng.randint(1, 300))]),
                                              "charged": rng.choice([None, 0.0, float(rng.randint(1, 300))]),
                                              "upstream_429": not last and rng.random() < 0.5,
                                              "timeout": not last and rng.random() < 0.3}))
            if not last:
                ev.append(("queued", (k,), {}))
        end = rng.random()
        if end < 0.7:
            if k[1]:
                ev.append(("first_token", (k, rng.choice([0.0, 0.0005, 0.02, 0.3, 4.0, 9000.0])), {}))
            ev.append(("ended", (k, "completed"), {}))
        elif end < 0.85:
            ev.append(("ended", (k, "failed", rng.choice(["deadline", "unavailable"])), {}))
        else:
            ev.append(("cancelled_work_tokens", (k, rng.choice([0.0, 12.0])), {}))
            ev.append(("ended", (k, "cancelled_during_execution"), {}))
    return ev


def test_the_exposition_equals_what_prometheus_children_made() -> None:
    """The same events on ``PolicyMetrics`` and on prometheus_client's own labelled metrics:
    the same families (names, types, help) and the same samples (names, labels, values), the
    flows declared up front showing 0 before their first event, the others from theirs."""
    declared = [K, ("acme", "batch", "main"), ("beta", "interactive", "main")]
    extra = [("", "", ""), ("gamma", "interactive", "other")]  # refused before known; seen only at run time
    rng = random.Random(7)
    m = PolicyMetrics(flows=declared)
    ref = _Children(declared)
    assert _samples(m.registry) == _samples(ref.registry)
    for step, (name, args, kw) in enumerate(_events(rng, declared + extra, 600)):
        getattr(m, name)(*args, **kw)
        getattr(ref, name)(*args, **kw)
        if step % 150 == 0:
            assert _samples(m.registry) == _samples(ref.registry), step
    quiet = ("delta", "interactive", "main")  # started, never served, retried or timed out: those series absent
    for target in (m, ref):
        target.queued(quiet)
        target.started(quiet, 0.0, 0.0, False)
        target.attempt_ended(quiet, served_cost=0.0)
        target.ended(quiet, "completed")
    got, want = _samples(m.registry), _samples(ref.registry)
    assert got == want
    assert _families(m.registry) == _families(ref.registry)
    # the sequence reached every kind of series (the comparison covers them all)
    names = {n for n, _ in got}
    for series in ("sfq_failures_total", "sfq_refusals_total", "sfq_retries_total", "sfq_upstream_429_total",
                   "sfq_timeouts_total", "sfq_cancelled_work_tokens_total", "sfq_served_cost_total",
                   "sfq_queue_wait_seconds_bucket", "sfq_time_to_first_token_seconds_bucket"):
        assert series in names, series
    assert any(dict(labels).get("outcome") == "joined" for n, labels in got if n == "sfq_requests_total")
    assert ("sfq_queue_wait_seconds_bucket", frozenset({*zip(("class", "pool"), K[1:]), ("le", "+Inf")})) in got
    quiet_series = {n for n, labels in got if ("org", "delta") in labels}
    assert "sfq_charged_cost_total" in quiet_series and "sfq_served_cost_total" not in quiet_series


def test_created_series_follow_prometheus_client_setting() -> None:
    m = PolicyMetrics(flows=[K])
    m.queued(K)
    m.started(K, 0.1, 1.0, False)
    before = time.time()
    assert 0 < _value(m, "sfq_attempts_created") <= before  # type: ignore[operator]
    prometheus_client.disable_created_metrics()
    try:
        assert not [n for n, _ in _samples(m.registry) if n.endswith("_created")]
    finally:
        prometheus_client.enable_created_metrics()


def test_two_policies_cannot_share_series_in_one_registry() -> None:
    r = CollectorRegistry()
    PolicyMetrics(r, flows=[K])
    with pytest.raises(ValueError, match="sfq_"):
        PolicyMetrics(r)


def test_events_touch_no_prometheus_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request's path adds to plain counters only: no labelled child, no locked value."""
    from prometheus_client import metrics, values

    def forbidden(*a: Any, **kw: Any) -> Any:
        raise AssertionError("a Prometheus object was touched on the request's path")

    m = PolicyMetrics(flows=[K])
    monkeypatch.setattr(metrics.MetricWrapperBase, "labels", forbidden)
    monkeypatch.setattr(values.MutexValue, "inc", forbidden)
    monkeypatch.setattr(values.MutexValue, "set", forbidden)
    for _ in range(3):
        _request(m)
    m.ended(K, "refused", "rate_limited")
    m.joined(K)
    monkeypatch.undo()
    assert _value(m, "sfq_requests_total", outcome="completed") == 3
    assert _value(m, "sfq_requests_total", outcome="joined") == 1
