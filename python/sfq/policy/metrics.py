"""Outcome accounting and metrics per (org, class, pool).

Every request the policy sees ends as exactly one outcome (``OUTCOMES``); a refusal carries
its reason (``REASONS``). The numbers are plain counters per flow (:class:`FlowCounters`):
an event adds to a few attributes and takes no lock. ``stats()`` reads them, and so does a
Prometheus scrape: :class:`PolicyMetrics` registers a collector in a
``prometheus_client.CollectorRegistry`` an embedder can mount
(``generate_latest(metrics.registry)``) that turns them into the series below when it is
collected, in time proportional to the number of flows (which the policy file bounds).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as _prom_metrics
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["OUTCOMES", "REASONS", "PolicyMetrics", "FlowCounters", "WAIT_BUCKETS"]

OUTCOMES = ("completed", "failed", "cancelled_before_start", "cancelled_during_execution", "refused")
#: why a request was refused (before start) or why it failed (``failed`` outcomes carry one too)
REASONS = ("unauthenticated", "class_not_allowed", "unknown_model", "bad_request", "too_large", "rate_limited",
           "queue_full",
           # a flow an embedder classified names an org the policy has no entry (and no template) for
           "unknown_org",
           "queue_timeout", "deadline", "closed",
           # no backend of the pool was in rotation for unavailable_timeout
           "unavailable",
           # several gateways sharing one queue (sfq.state): Redis cannot be reached; a retry over
           # the flow's budget counted over every gateway
           "state_unavailable", "budget",
           # the org's spending budget (orgs.NAME.budget) cannot cover the request ("budget" above
           # is the retry budget)
           "budget_exhausted")
#: seconds: the buckets of the wait-before-start histogram
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                900.0, 3600.0, 7200.0)
_LABELS = ("org", "class", "pool")
#: the histogram's ``le`` labels, +Inf last
_go_float: Callable[[float], str] = floatToGoString  # (prometheus_client's own spelling of a bound)
_LE = tuple(_go_float(b) for b in WAIT_BUCKETS) + ("+Inf",)


class FlowCounters:
    """Plain counters of one (org, class, pool). ``refused_by``: the refusals among ``reasons``
    (the rest are failures); ``wait_buckets``: waits before start per bucket of
    ``WAIT_BUCKETS`` (not cumulative; the last one is over the largest bound); ``created``: when
    the flow was first seen (``time.time()``)."""

    __slots__ = ("waiting", "in_flight", "outcomes", "reasons", "charged_cost", "served_cost", "cancelled_work",
                 "upstream_429", "timeouts", "attempts", "retries", "waits", "refused_by", "wait_buckets", "created")

    def __init__(self) -> None:
        self.created = time.time()
        self.waiting = 0
        self.in_flight = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.reasons: dict[str, int] = {}
        self.charged_cost = 0.0  # estimated cost at start (what the scheduler charged)
        self.served_cost = 0.0  # actual cost from usage reports
        self.cancelled_work = 0.0  # tokens produced for requests cancelled while running
        self.upstream_429 = 0
        self.timeouts = 0
        self.attempts = 0
        self.retries = 0
        self.waits = 0.0  # sum of waits before start, seconds
        self.refused_by: dict[str, int] = {}
        self.wait_buckets = [0] * (len(WAIT_BUCKETS) + 1)

    def as_dict(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "in_flight": self.in_flight, **self.outcomes,
                "reasons": dict(self.reasons), "charged_cost": self.charged_cost, "served_cost": self.served_cost,
                "cancelled_work_tokens": self.cancelled_work, "upstream_429": self.upstream_429,
                "timeouts": self.timeouts, "attempts": self.attempts, "retries": self.retries,
                "retry_share": self.retries / self.attempts if self.attempts else 0.0,
                "mean_wait": self.waits / self.attempts if self.attempts else None}


Key = tuple[str, str, str]


class PolicyMetrics:
    """Counters per (org, class, pool), and their Prometheus series in ``registry`` (created
    when not given: pass one to expose the policy's series next to the embedder's own). A
    flow's queue length, in-flight count and requests by outcome show, as 0, from the moment
    the flow is known (``flows``, or its first event); its other series from their first
    count."""

    def __init__(self, registry: CollectorRegistry | None = None, flows: Iterable[Key] = ()) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.flows: dict[Key, FlowCounters] = {}
        #: requests that joined a running one of the same ``Idempotency-Key`` (the gateway's count)
        self.joins: dict[Key, int] = {}
        self._joins_created: dict[Key, float] = {}
        for k in flows:
            self._get(k)
        self.collector = _Collector(self)
        self.registry.register(self.collector)

    def _get(self, key: Key) -> FlowCounters:
        fc = self.flows.get(key)
        if fc is None:
            fc = self.flows[key] = FlowCounters()
        return fc

    # ------------------------------------------------------------ events
    def queued(self, key: Key, n: int = 1) -> None:
        fc = self.flows.get(key) or self._get(key)
        fc.waiting += n

    def started(self, key: Key, wait: float, cost: float, retry: bool) -> None:
        fc = self.flows.get(key) or self._get(key)
        fc.waiting -= 1
        fc.in_flight += 1
        fc.attempts += 1
        fc.charged_cost += cost
        fc.waits += wait
        fc.wait_buckets[bisect_left(WAIT_BUCKETS, wait)] += 1
        if retry:
            fc.retries += 1

    def attempt_ended(self, key: Key, *, served_cost: float | None = None, upstream_429: bool = False,
                      timeout: bool = False) -> None:
        fc = self.flows.get(key) or self._get(key)
        fc.in_flight -= 1
        if served_cost:
            fc.served_cost += served_cost
        if upstream_429:
            fc.upstream_429 += 1
        if timeout:
            fc.timeouts += 1

    def left_queue(self, key: Key) -> None:
        fc = self.flows.get(key) or self._get(key)
        fc.waiting -= 1

    def timeout(self, key: Key) -> None:
        fc = self.flows.get(key) or self._get(key)
        fc.timeouts += 1

    def cancelled_work_tokens(self, key: Key, tokens: float) -> None:
        if tokens > 0:
            fc = self.flows.get(key) or self._get(key)
            fc.cancelled_work += tokens

    def ended(self, key: Key, outcome: str, reason: str | None = None) -> None:
        fc = self.flows.get(key) or self._get(key)
        outcomes = fc.outcomes
        if outcome not in outcomes:
            raise ValueError(f"unknown outcome {outcome!r}")
        outcomes[outcome] += 1
        if reason is not None:
            fc.reasons[reason] = fc.reasons.get(reason, 0) + 1
            if outcome == "refused":
                fc.refused_by[reason] = fc.refused_by.get(reason, 0) + 1

    def joined(self, key: Key) -> None:
        """A request joined a running one with the same ``Idempotency-Key``: counted in
        ``sfq_requests_total{outcome="joined"}`` (not an outcome of the policy's: the request
        it joined has that)."""
        n = self.joins.get(key)
        if n is None:
            self._joins_created[key] = time.time()
            n = 0
        self.joins[key] = n + 1

    def snapshot(self) -> dict[Key, dict[str, Any]]:
        return {k: fc.as_dict() for k, fc in self.flows.items()}


#: (name, help, type, label names beyond org/class/pool); the order the series are exposed in
_FAMILIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("sfq_queue_wait_seconds", "Wait before start (seconds)", "histogram", ()),
    ("sfq_requests", "Requests by outcome", "counter", ("outcome",)),
    ("sfq_refusals", "Requests refused or dropped before start, by reason", "counter", ("reason",)),
    ("sfq_failures", "Requests that failed, by reason", "counter", ("reason",)),
    ("sfq_queue_length", "Requests waiting (not started)", "gauge", ()),
    ("sfq_in_flight", "Requests running on a backend", "gauge", ()),
    ("sfq_charged_cost", "Estimated cost charged at start (cost units)", "counter", ()),
    ("sfq_served_cost", "Actual cost served, from usage reports (cost units)", "counter", ()),
    ("sfq_cancelled_work_tokens", "Tokens produced for requests cancelled while running (streams)", "counter", ()),
    ("sfq_upstream_429", "Upstream 429 answers", "counter", ()),
    ("sfq_timeouts", "Queue-age or deadline expiries and backend timeouts", "counter", ()),
    ("sfq_attempts", "Attempts started (first tries and retries)", "counter", ()),
    ("sfq_retries", "Retries started", "counter", ()),
)
_FAMILY = {"histogram": HistogramMetricFamily, "counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class _Collector(Collector):
    """The policy's series, made from the plain counters when the registry is collected (a
    scrape): what ``prometheus_client``'s own labelled metrics would say had every event
    incremented them. A series' ``_created`` is when its flow was first seen (it counted 0
    from then)."""

    def __init__(self, m: PolicyMetrics) -> None:
        self.m = m

    def describe(self) -> Iterator[Metric]:
        for name, doc, typ, extra in _FAMILIES:
            yield _FAMILY[typ](name, doc, labels=(*_LABELS, *extra))

    def collect(self) -> Iterator[Metric]:
        m = self.m
        fam = {name: _FAMILY[typ](name, doc, labels=(*_LABELS, *extra)) for name, doc, typ, extra in _FAMILIES}
        created = _prom_metrics._use_created  # (prometheus_client.disable_created_metrics() turns it off)
        wait, requests, refusals, failures = (fam["sfq_queue_wait_seconds"].samples, fam["sfq_requests"].samples,
                                              fam["sfq_refusals"].samples, fam["sfq_failures"].samples)
        for key, fc in list(m.flows.items()):
            org, cls, pool = key
            lab = {"org": org, "class": cls, "pool": pool}
            ts = fc.created
            for o, n in fc.outcomes.items():
                _counter(requests, "sfq_requests", {**lab, "outcome": o}, n, ts if created else None)
            for reason, n in list(fc.reasons.items()):
                refused = fc.refused_by.get(reason, 0)
                if refused:
                    _counter(refusals, "sfq_refusals", {**lab, "reason": reason}, refused, ts if created else None)
                if n - refused:
                    _counter(failures, "sfq_failures", {**lab, "reason": reason}, n - refused,
                             ts if created else None)
            fam["sfq_queue_length"].samples.append(Sample("sfq_queue_length", lab, float(fc.waiting)))
            fam["sfq_in_flight"].samples.append(Sample("sfq_in_flight", lab, float(fc.in_flight)))
            if fc.attempts:
                acc = 0.0
                for le, n in zip(_LE, fc.wait_buckets):
                    acc += n
                    wait.append(Sample("sfq_queue_wait_seconds_bucket", {**lab, "le": le}, acc))
                wait.append(Sample("sfq_queue_wait_seconds_count", lab, acc))
                wait.append(Sample("sfq_queue_wait_seconds_sum", lab, float(fc.waits)))
                if created:
                    wait.append(Sample("sfq_queue_wait_seconds_created", lab, ts))
            for name, value, shown in (("sfq_charged_cost", fc.charged_cost, fc.attempts),
                                       ("sfq_served_cost", fc.served_cost, fc.served_cost),
                                       ("sfq_cancelled_work_tokens", fc.cancelled_work, fc.cancelled_work),
                                       ("sfq_upstream_429", fc.upstream_429, fc.upstream_429),
                                       ("sfq_timeouts", fc.timeouts, fc.timeouts),
                                       ("sfq_attempts", fc.attempts, fc.attempts),
                                       ("sfq_retries", fc.retries, fc.retries)):
                if shown:
                    _counter(fam[name].samples, name, lab, value, ts if created else None)
        for key, n in list(m.joins.items()):
            org, cls, pool = key
            _counter(requests, "sfq_requests", {"org": org, "class": cls, "pool": pool, "outcome": "joined"}, n,
                     m._joins_created.get(key, 0.0) if created else None)
        yield from fam.values()


def _counter(samples: list[Sample], name: str, labels: dict[str, str], value: float, created: float | None) -> None:
    samples.append(Sample(name + "_total", labels, float(value)))
    if created is not None:
        samples.append(Sample(name + "_created", labels, created))
