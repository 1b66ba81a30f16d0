"""Outcome accounting and metrics per (org, class, pool).

Every request the policy sees ends as exactly one outcome (``OUTCOMES``); a refusal carries
its reason (``REASONS``). The numbers live twice: as plain counters (``stats()`` reads them
without touching Prometheus, in time proportional to the number of flows, which the policy
file bounds) and in a ``prometheus_client.CollectorRegistry`` an embedder can mount
(``generate_latest(metrics.registry)``) under the names below.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
           "state_unavailable", "budget")
#: seconds: the buckets of the wait-before-start histogram
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                900.0, 3600.0, 7200.0)
_LABELS = ("org", "class", "pool")


class FlowCounters:
    """Plain counters of one (org, class, pool)."""

    __slots__ = ("waiting", "in_flight", "outcomes", "reasons", "charged_cost", "served_cost", "cancelled_work",
                 "upstream_429", "timeouts", "attempts", "retries", "waits")

    def __init__(self) -> None:
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

    def as_dict(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "in_flight": self.in_flight, **self.outcomes,
                "reasons": dict(self.reasons), "charged_cost": self.charged_cost, "served_cost": self.served_cost,
                "cancelled_work_tokens": self.cancelled_work, "upstream_429": self.upstream_429,
                "timeouts": self.timeouts, "attempts": self.attempts, "retries": self.retries,
                "retry_share": self.retries / self.attempts if self.attempts else 0.0,
                "mean_wait": self.waits / self.attempts if self.attempts else None}


Key = tuple[str, str, str]


class _Bound:
    """One flow's counters and its Prometheus children, each bound on first use and kept
    (``labels()`` checks, joins and looks up its label values under a lock on every call).
    The series a flow shows before its first event (queue length, in flight, requests by
    outcome) are bound when the flow is made; the others appear when first counted, as before."""

    __slots__ = ("fc", "key", "queue_length", "in_flight", "wait", "charged", "served", "cancelled_work",
                 "upstream_429", "timeouts", "attempts", "retries", "outcomes", "reasons")

    def __init__(self, m: PolicyMetrics, key: Key) -> None:
        self.fc = FlowCounters()
        self.key = key
        self.queue_length = m.queue_length.labels(*key)
        self.in_flight = m.in_flight.labels(*key)
        self.outcomes = {o: m.requests.labels(*key, o) for o in OUTCOMES}
        self.wait: Any = None
        self.charged: Any = None
        self.served: Any = None
        self.cancelled_work: Any = None
        self.upstream_429: Any = None
        self.timeouts: Any = None
        self.attempts: Any = None
        self.retries: Any = None
        self.reasons: dict[tuple[bool, str], Any] = {}  # (refused?, reason) -> child


def _child(m: PolicyMetrics, b: _Bound, name: str) -> Any:
    """``b``'s child of the metric ``name`` (an attribute of both), bound on first use."""
    c = getattr(b, name)
    if c is None:
        c = getattr(m, name).labels(*b.key)
        setattr(b, name, c)
    return c


class PolicyMetrics:
    """Counters and Prometheus series per (org, class, pool); ``registry`` is created when not
    given (pass one to expose the policy's series next to the embedder's own)."""

    def __init__(self, registry: CollectorRegistry | None = None, flows: Iterable[Key] = ()) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.wait = Histogram("sfq_queue_wait_seconds", "Wait before start (seconds)", _LABELS,
                              buckets=WAIT_BUCKETS, registry=r)
        self.requests = Counter("sfq_requests", "Requests by outcome", (*_LABELS, "outcome"), registry=r)
        self.refusals = Counter("sfq_refusals", "Requests refused or dropped before start, by reason",
                                (*_LABELS, "reason"), registry=r)
        self.failures = Counter("sfq_failures", "Requests that failed, by reason", (*_LABELS, "reason"), registry=r)
        self.queue_length = Gauge("sfq_queue_length", "Requests waiting (not started)", _LABELS, registry=r)
        self.in_flight = Gauge("sfq_in_flight", "Requests running on a backend", _LABELS, registry=r)
        self.charged = Counter("sfq_charged_cost", "Estimated cost charged at start (cost units)", _LABELS,
                               registry=r)
        self.served = Counter("sfq_served_cost", "Actual cost served, from usage reports (cost units)", _LABELS,
                              registry=r)
        self.cancelled_work = Counter("sfq_cancelled_work_tokens",
                                      "Tokens produced for requests cancelled while running (streams)", _LABELS,
                                      registry=r)
        self.upstream_429 = Counter("sfq_upstream_429", "Upstream 429 answers", _LABELS, registry=r)
        self.timeouts = Counter("sfq_timeouts", "Queue-age or deadline expiries and backend timeouts", _LABELS,
                                registry=r)
        self.attempts = Counter("sfq_attempts", "Attempts started (first tries and retries)", _LABELS, registry=r)
        self.retries = Counter("sfq_retries", "Retries started", _LABELS, registry=r)
        self.flows: dict[Key, FlowCounters] = {}
        self._bound: dict[Key, _Bound] = {}
        for k in flows:
            self._get(k)

    def _flow(self, key: Key) -> _Bound:
        b = self._bound.get(key)
        if b is None:
            # binds (and so creates) the flow's labelled series: they show, as 0, before the first event
            b = self._bound[key] = _Bound(self, key)
            self.flows[key] = b.fc
        return b

    def _get(self, key: Key) -> FlowCounters:
        return self._flow(key).fc

    # ------------------------------------------------------------ events
    def queued(self, key: Key, n: int = 1) -> None:
        b = self._flow(key)
        b.fc.waiting += n
        b.queue_length.inc(n)

    def started(self, key: Key, wait: float, cost: float, retry: bool) -> None:
        b = self._flow(key)
        fc = b.fc
        fc.waiting -= 1
        fc.in_flight += 1
        fc.attempts += 1
        fc.charged_cost += cost
        fc.waits += wait
        b.queue_length.dec()
        b.in_flight.inc()
        _child(self, b, "wait").observe(wait)
        _child(self, b, "charged").inc(cost)
        _child(self, b, "attempts").inc()
        if retry:
            fc.retries += 1
            _child(self, b, "retries").inc()

    def attempt_ended(self, key: Key, *, served_cost: float | None = None, upstream_429: bool = False,
                      timeout: bool = False) -> None:
        b = self._flow(key)
        fc = b.fc
        fc.in_flight -= 1
        b.in_flight.dec()
        if served_cost:
            fc.served_cost += served_cost
            _child(self, b, "served").inc(served_cost)
        if upstream_429:
            fc.upstream_429 += 1
            _child(self, b, "upstream_429").inc()
        if timeout:
            self.timeout(key)

    def left_queue(self, key: Key) -> None:
        b = self._flow(key)
        b.fc.waiting -= 1
        b.queue_length.dec()

    def timeout(self, key: Key) -> None:
        b = self._flow(key)
        b.fc.timeouts += 1
        _child(self, b, "timeouts").inc()

    def cancelled_work_tokens(self, key: Key, tokens: float) -> None:
        if tokens > 0:
            b = self._flow(key)
            b.fc.cancelled_work += tokens
            _child(self, b, "cancelled_work").inc(tokens)

    def ended(self, key: Key, outcome: str, reason: str | None = None) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        b = self._flow(key)
        fc = b.fc
        fc.outcomes[outcome] += 1
        b.outcomes[outcome].inc()
        if reason is not None:
            fc.reasons[reason] = fc.reasons.get(reason, 0) + 1
            refused = outcome == "refused"
            child = b.reasons.get((refused, reason))
            if child is None:
                metric = self.refusals if refused else self.failures
                child = b.reasons[(refused, reason)] = metric.labels(*key, reason)
            child.inc()

    def snapshot(self) -> dict[Key, dict[str, Any]]:
        return {k: fc.as_dict() for k, fc in self.flows.items()}
