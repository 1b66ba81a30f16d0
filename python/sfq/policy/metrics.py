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
        for k in flows:
            self._get(k)

    def _get(self, key: Key) -> FlowCounters:
        fc = self.flows.get(key)
        if fc is None:
            fc = self.flows[key] = FlowCounters()
            # create the labelled series so they show (as 0) before the first event
            self.queue_length.labels(*key)
            self.in_flight.labels(*key)
            for o in OUTCOMES:
                self.requests.labels(*key, o)
        return fc

    # ------------------------------------------------------------ events
    def queued(self, key: Key, n: int = 1) -> None:
        self._get(key).waiting += n
        self.queue_length.labels(*key).inc(n)

    def started(self, key: Key, wait: float, cost: float, retry: bool) -> None:
        fc = self._get(key)
        fc.waiting -= 1
        fc.in_flight += 1
        fc.attempts += 1
        fc.charged_cost += cost
        fc.waits += wait
        self.queue_length.labels(*key).dec()
        self.in_flight.labels(*key).inc()
        self.wait.labels(*key).observe(wait)
        self.charged.labels(*key).inc(cost)
        self.attempts.labels(*key).inc()
        if retry:
            fc.retries += 1
            self.retries.labels(*key).inc()

    def attempt_ended(self, key: Key, *, served_cost: float | None = None, upstream_429: bool = False,
                      timeout: bool = False) -> None:
        fc = self._get(key)
        fc.in_flight -= 1
        self.in_flight.labels(*key).dec()
        if served_cost:
            fc.served_cost += served_cost
            self.served.labels(*key).inc(served_cost)
        if upstream_429:
            fc.upstream_429 += 1
            self.upstream_429.labels(*key).inc()
        if timeout:
            self.timeout(key)

    def left_queue(self, key: Key) -> None:
        fc = self._get(key)
        fc.waiting -= 1
        self.queue_length.labels(*key).dec()

    def timeout(self, key: Key) -> None:
        self._get(key).timeouts += 1
        self.timeouts.labels(*key).inc()

    def cancelled_work_tokens(self, key: Key, tokens: float) -> None:
        if tokens > 0:
            self._get(key).cancelled_work += tokens
            self.cancelled_work.labels(*key).inc(tokens)

    def ended(self, key: Key, outcome: str, reason: str | None = None) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        fc = self._get(key)
        fc.outcomes[outcome] += 1
        self.requests.labels(*key, outcome).inc()
        if reason is not None:
            fc.reasons[reason] = fc.reasons.get(reason, 0) + 1
            (self.refusals if outcome == "refused" else self.failures).labels(*key, reason).inc()

    def snapshot(self) -> dict[Key, dict[str, Any]]:
        return {k: fc.as_dict() for k, fc in self.flows.items()}
