"""The policy as one synchronous state machine over every pool (no asyncio, injected clock).

:class:`PolicyEngine` ties the pieces together: classification, org admission rate limits,
one :class:`~sfq.engine.PolicyQueue` per pool (with the limits shared between pools),
the retry planner and outcome accounting. An event loop (``sfq.policy.PolicyDispatcher``),
the simulator or a test drives it with four calls::

    r = engine.submit(flow, cost=..., tokens=...)   # accepted (or Refused, recorded)
    for r in engine.poll(): ...                     # start these now, on r.backend
    engine.complete(r, usage) / engine.fail(r, error) / engine.cancel(r)
    engine.wake_at()                                 # call poll() again at this time at the latest

Every accepted request ends as exactly one outcome (completed, failed,
cancelled_before_start, cancelled_during_execution, refused) and the engine refuses to end
one twice; ``live`` holds the ones not yet ended, so nothing accepted can be lost unseen.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from ..errors import BackendHTTPError, BackendTimeout, Refused
from ..policy.classify import Classifier, Flow
from ..policy.config import Policy
from ..policy.limits import TokenBucket
from ..policy.metrics import PolicyMetrics
from .pool import BACKOFF, ENDED, RUNNING, WAITING, PolicyQueue, Request, SharedLimits
from ..policy.retry import RetryDecision, RetryPlanner, retry_after_of, retry_safe

__all__ = ["PolicyEngine", "UNKNOWN"]

#: label value for what a refused request's flow did not get as far as (e.g. an unknown key)
UNKNOWN = ""


class PolicyEngine:
    """A policy in force. ``clock``: seconds (default ``time.monotonic``); ``scheduler``: the
    core factory (default ``sfq.Scheduler``); ``rng``: the retry jitter's random source;
    ``registry``: the Prometheus registry for the metrics (a new one by default)."""

    def __init__(self, policy: Policy, *, clock: Callable[[], float] = time.monotonic,
                 scheduler: Callable[[], Any] | None = None, rng: random.Random | None = None,
                 registry: CollectorRegistry | None = None, metrics: PolicyMetrics | None = None) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an sfq.policy.Policy, got {policy!r}")
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {clock!r}")
        self.policy = policy
        self.clock = clock
        self._scheduler = scheduler
        self.classifier = Classifier(policy)
        self.shared = SharedLimits(policy)
        self.queues: dict[str, PolicyQueue] = {
            p: PolicyQueue(policy, p, clock=clock, shared=self.shared, scheduler=scheduler) for p in policy.pools}
        now = clock()
        self.org_rate: dict[str, TokenBucket] = {
            o.name: TokenBucket(o.requests_per_minute, now) for o in policy.orgs.values()
            if o.requests_per_minute is not None}
        self.retry = RetryPlanner(policy.retry, rng)
        if metrics is None:
            metrics = PolicyMetrics(registry, policy.flows())
        else:  # a reload: the series go on; the new file's flows show from the start
            for k in policy.flows():
                metrics._get(k)
        self.metrics = metrics
        self.live: dict[int, Request] = {}
        self.submitted = 0
        #: requests the last poll() (or next_start() calls since) ended for their queue age or deadline
        self.dropped: list[Request] = []
        #: shared state (several gateways, ``sfq.state``): called when an attempt ends (with the
        #: usage report's tokens, or ``None``) and when a request ends; ``None`` in memory
        self.on_attempt_over: Callable[[Request, float | None], None] | None = None
        self.on_end: Callable[[Request], None] | None = None
        #: a start the engine decides is only a candidate until the shared state grants it
        #: (:meth:`granted`); until then the request counts as waiting
        self.defer_start = False

    # ------------------------------------------------------------ admission
    def classify(self, credential: str | None, stated_class: str | None, model: object) -> Flow:
        """The request's flow, or ``Refused`` (recorded as a refusal) with reason
        ``unauthenticated``, ``class_not_allowed`` or ``unknown_model``."""
        try:
            org = self.classifier.org_of(credential)
        except Refused as exc:
            self._refused_unclassified((UNKNOWN, UNKNOWN, UNKNOWN), exc)
            raise
        try:
            cls = self.classifier.class_for(org, stated_class)
        except Refused as exc:
            self._refused_unclassified((org.name, UNKNOWN, UNKNOWN), exc)
            raise
        try:
            pool = self.classifier.pool_for(model)
        except Refused as exc:
            self._refused_unclassified((org.name, cls, UNKNOWN), exc)
            raise
        return Flow(org.name, cls, pool)

    def _refused_unclassified(self, key: tuple[str, str, str], exc: Refused) -> None:
        self.submitted += 1
        self.metrics.ended(key, "refused", exc.reason)

    def refuse(self, flow: Flow | tuple[str, str, str], reason: str) -> None:
        """Record a refusal decided outside the engine (a malformed body, a request too large)."""
        self.submitted += 1
        self.metrics.ended(tuple(flow), "refused", reason)  # type: ignore[arg-type]

    def submit(self, flow: Flow, *, cost: float, tokens: float = 0.0, need: float = 0.0,
               deadline: float | None = None, item: Any = None, idempotency_key: str | None = None) -> Request:
        """Accept a request of ``flow`` (from :meth:`classify`) into its pool's queue.

        ``cost``: cost units (> 0); ``tokens``: the estimate debited from the pool's
        ``tokens_per_minute``; ``need``: prompt + max_tokens (backends' ``max_context``);
        ``deadline``: absolute clock time. Raises ``Refused`` (recorded) with reason
        ``rate_limited`` (the org's ``requests_per_minute``), ``queue_full``, ``deadline``
        (already past) or ``too_large`` (no backend's ``max_context`` fits ``need``), with
        ``retry_after`` where trying later can help;
        ``ValueError`` for a flow the policy does not allow or a bad number (nothing recorded).
        """
        if not isinstance(flow, Flow):
            flow = Flow(*flow)
        q = self.queues.get(flow.pool)
        if q is None or flow.org not in self.policy.orgs or flow.cls not in self.policy.orgs[flow.org].classes:
            raise ValueError(f"flow {tuple(flow)!r} is not allowed by the policy")
        for what, v in (("cost", cost), ("tokens", tokens), ("need", need)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                    what == "cost" and v == 0):
                raise ValueError(f"{what} must be a finite number {'> 0' if what == 'cost' else '>= 0'}, got {v!r}")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or math.isnan(deadline)):
            raise ValueError(f"deadline must be a clock time (a number) or None, got {deadline!r}")
        now = self.clock()
        key = tuple(flow)
        if need > q.largest_context:
            self.submitted += 1
            self.metrics.ended(key, "refused", "too_large")  # type: ignore[arg-type]
            raise Refused("too_large", f"the request needs about {need:.0f} tokens (prompt + max_tokens), more than "
                                       f"any backend of pool {flow.pool!r} takes (largest max_context "
                                       f"{q.largest_context:.0f})")
        if deadline is not None and deadline <= now:
            self.submitted += 1
            self.metrics.ended(key, "refused", "deadline")  # type: ignore[arg-type]
            raise Refused("deadline", "the request's deadline has already passed")
        try:
            q.check_room(flow.cls)
        except Refused as exc:
            self.submitted += 1
            self.metrics.ended(key, "refused", exc.reason)  # type: ignore[arg-type]
            raise
        bucket = self.org_rate.get(flow.org)
        if bucket is not None and not bucket.take(1, now):
            self.submitted += 1
            self.metrics.ended(key, "refused", "rate_limited")  # type: ignore[arg-type]
            raise Refused("rate_limited", f"org {flow.org!r} is over its requests_per_minute "
                                          f"({bucket.capacity:g})", retry_after=bucket.wait(1, now))
        r = Request(flow, float(cost), float(tokens), now, deadline=deadline, item=item, need=float(need),
                    idempotency_key=idempotency_key)
        q.push(r, check_length=False)
        self.submitted += 1
        self.live[r.id] = r
        self.metrics.queued(key)  # type: ignore[arg-type]
        self.retry.first_attempt(flow, now)
        return r

    # ------------------------------------------------------------ the loop
    def poll(self) -> list[Request]:
        """Start everything that may start now: returns the requests to send (each on
        ``r.backend``), after ending as refused those whose queue age or deadline ran out
        (:attr:`dropped` lists them until the next ``poll``)."""
        self.dropped = []
        starts: list[Request] = []
        for q in self.queues.values():
            while True:
                r = self._pop(q)
                if r is None:
                    break
                starts.append(r)
        return starts

    def next_start(self) -> Request | None:
        """Start one request, the next of the first pool (in file order) that has one; ``None``
        when none may start now. For a caller that places one request at a time (the
        simulator); drops are ended and added to :attr:`dropped` as in :meth:`poll`."""
        for q in self.queues.values():
            r = self._pop(q)
            if r is not None:
                return r
        return None

    def _pop(self, q: PolicyQueue) -> Request | None:
        r = q.pop()
        for d in q.expire():
            self._dropped(d)
            self.dropped.append(d)
        if r is not None:
            self._started(r)
        return r

    def _started(self, r: Request) -> None:
        assert r.started_at is not None
        if self.defer_start:  # counted when the shared state grants it (granted())
            return
        self.metrics.started(tuple(r.flow), r.started_at - r.queued_at, r.cost, r.retrying)  # type: ignore[arg-type]

    def granted(self, r: Request) -> None:
        """The shared state granted the start the engine decided for ``r`` (``defer_start``):
        it starts now, and the metrics count its wait up to now."""
        if r.state != RUNNING:
            raise ValueError(f"granted({r!r}): the request is not running")
        r.started_at = self.clock()
        self.metrics.started(tuple(r.flow), r.started_at - r.queued_at, r.cost, r.retrying)  # type: ignore[arg-type]

    def _dropped(self, r: Request) -> None:
        key = tuple(r.flow)
        self.metrics.left_queue(key)  # type: ignore[arg-type]
        self.metrics.timeout(key)  # type: ignore[arg-type]
        self._end(r, "refused" if r.tries == 0 else "failed", r.reason)

    def wake_at(self) -> float | None:
        """The clock time by which :meth:`poll` must run again even if nothing else happens."""
        ts = [t for t in (q.wake_at() for q in self.queues.values()) if t is not None]
        return min(ts) if ts else None

    # ------------------------------------------------------------ endings
    def _end(self, r: Request, outcome: str, reason: str | None = None) -> None:
        if r.outcome is not None:
            raise RuntimeError(f"{r!r} already ended as {r.outcome}")
        if r.retrying:
            r.retrying = False
            self.retry.retry_ended(r.flow)
        r.outcome = outcome
        r.reason = reason
        r.state = ENDED
        self.live.pop(r.id, None)
        self.metrics.ended(tuple(r.flow), outcome, reason)  # type: ignore[arg-type]
        if self.on_end is not None:
            self.on_end(r)

    def _attempt_over(self, r: Request, *, actual_tokens: float | None = None, served_cost: float | None = None,
                      retry_after: float | None = None, upstream_429: bool = False, timeout: bool = False) -> None:
        self.queues[r.flow.pool].finish(r, actual_tokens=actual_tokens, retry_after=retry_after)
        if self.on_attempt_over is not None:
            self.on_attempt_over(r, actual_tokens)
        self.metrics.attempt_ended(tuple(r.flow), served_cost=served_cost,  # type: ignore[arg-type]
                                   upstream_429=upstream_429, timeout=timeout)

    def complete(self, r: Request, usage: Mapping[str, Any] | None = None) -> None:
        """A running request completed; ``usage`` (OpenAI ``usage``) corrects the token bucket
        and measures the cost actually served."""
        if r.state != RUNNING:
            raise ValueError(f"complete({r!r}): the request is not running")
        tokens, served = self.usage_cost(usage)
        self._attempt_over(r, actual_tokens=tokens, served_cost=served)
        self._end(r, "completed")

    def usage_cost(self, usage: Mapping[str, Any] | None) -> tuple[float | None, float | None]:
        """``(tokens, cost units)`` of an OpenAI ``usage`` report (``None`` when absent or bad)."""
        if not isinstance(usage, Mapping):
            return None, None
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                   for x in (p, c)):
            return None, None
        cs = self.policy.cost
        return float(p) + float(c), cs.input_weight * float(p) + cs.output_weight * float(c)  # type: ignore[arg-type]

    def fail(self, r: Request, error: BaseException, *, deadline_hit: bool = False,
             retryable: bool = True) -> RetryDecision:
        """A running attempt failed with ``error``. Frees its slots, pauses its backend for an
        upstream 429's ``Retry-After``, then plans a retry by the policy's rules: on
        ``retry=True`` the request waits (state ``backoff``) and the caller calls
        :meth:`requeue` after ``delay`` seconds; otherwise it ends as failed.
        ``deadline_hit``: the attempt was aborted at the request's deadline (never retried);
        ``retryable=False``: the caller cannot repeat it (a stream that already passed events on)."""
        if r.state != RUNNING:
            raise ValueError(f"fail({r!r}): the request is not running")
        now = self.clock()
        is429 = isinstance(error, BackendHTTPError) and error.status == 429
        ra = retry_after_of(error)
        timeout = deadline_hit or isinstance(error, BackendTimeout)
        self._attempt_over(r, retry_after=ra if is429 else None, upstream_429=is429, timeout=timeout)
        if r.retrying:
            r.retrying = False
            self.retry.retry_ended(r.flow)
        if deadline_hit:
            decision = RetryDecision(False, 0.0, "deadline")
        else:
            decision = self.retry.plan(r.flow, r.tries, now,
                                       safe=retryable and retry_safe(error, r.idempotency_key),
                                       deadline=r.deadline, retry_after=ra)
        if decision.retry:
            r.state = BACKOFF
            r.retrying = True
        else:
            self._end(r, "failed", "deadline" if deadline_hit else None)
        return decision

    def requeue(self, r: Request) -> None:
        """Put a request waiting out its backoff back into its own flow's queue (its place is
        taken anew: a retry does not jump the queue). Ends it as failed (``deadline``) when
        its deadline has passed meanwhile (reason ``deadline``), or when a reload took its flow
        away (``unauthenticated``: its org is gone; ``class_not_allowed``)."""
        if r.state != BACKOFF:
            raise ValueError(f"requeue({r!r}): the request is not waiting for a retry")
        if r.deadline is not None and r.deadline <= self.clock():
            self._end(r, "failed", "deadline")
            return
        org = self.policy.orgs.get(r.flow.org)
        if org is None or r.flow.cls not in org.classes:  # a reload took its flow away meanwhile
            self._end(r, "failed", "unauthenticated" if org is None else "class_not_allowed")
            return
        self.queues[r.flow.pool].push(r, check_length=False)
        self.metrics.queued(tuple(r.flow))  # type: ignore[arg-type]

    def cancel(self, r: Request, *, work_tokens: float | None = None) -> None:
        """The caller gave up. Waiting (or between retries): removed, uncharged, outcome
        ``cancelled_before_start`` if it never started; running: its slots are freed, outcome
        ``cancelled_during_execution`` (``work_tokens``: tokens the backend produced for it,
        where measurable). A request that already ended is left as it is."""
        if r.outcome is not None:
            return
        if r.state == WAITING:
            self.queues[r.flow.pool].cancel(r)
            self.metrics.left_queue(tuple(r.flow))  # type: ignore[arg-type]
        elif r.state == RUNNING:
            self._attempt_over(r)
            if work_tokens:
                self.metrics.cancelled_work_tokens(tuple(r.flow), work_tokens)  # type: ignore[arg-type]
        self._end(r, "cancelled_before_start" if r.tries == 0 else "cancelled_during_execution")

    def end_retry(self, r: Request, reason: str) -> None:
        """End a request waiting to be retried as failed (``reason``): a shared state (several
        gateways, ``sfq.state``) refused the retry, e.g. over the flow's global retry budget."""
        if r.state != BACKOFF:
            raise ValueError(f"end_retry({r!r}): the request is not waiting for a retry")
        self._end(r, "failed", reason)

    def abandon(self, r: Request, outcome: str, reason: str | None = None) -> None:
        """End a request the engine started locally but that never reached a backend because
        the shared state (several gateways, ``sfq.state``) did not grant its start: its slots
        are freed and it ends as ``outcome`` (``refused``, ``failed`` or
        ``cancelled_before_start``) with ``reason``."""
        if r.state != RUNNING:
            raise ValueError(f"abandon({r!r}): the request is not running")
        if not self.defer_start:
            self._attempt_over(r)
        else:  # it never started: it leaves the queue
            self.queues[r.flow.pool].finish(r)
            if self.on_attempt_over is not None:
                self.on_attempt_over(r, None)
            r.tries -= 1
            key = tuple(r.flow)
            self.metrics.left_queue(key)  # type: ignore[arg-type]
            if reason in ("queue_timeout", "deadline"):
                self.metrics.timeout(key)  # type: ignore[arg-type]
        self._end(r, outcome, reason)

    def close(self) -> list[Request]:
        """End every waiting request (and every one between retries) as refused (``closed``);
        returns them. Running ones are left to end normally."""
        out = []
        for r in list(self.live.values()):
            if r.state == WAITING:
                self.queues[r.flow.pool].cancel(r)
                self.metrics.left_queue(tuple(r.flow))  # type: ignore[arg-type]
            elif r.state != BACKOFF:
                continue
            self._end(r, "refused" if r.tries == 0 else "failed", "closed")
            out.append(r)
        return out

    # ------------------------------------------------------------ reload
    def reloaded(self, policy: Policy) -> tuple[PolicyEngine, list[Request]]:
        """An engine for ``policy`` that takes over this one's requests (a policy reload: new
        keys, weights, classes, orgs and limits; the same pools and backends).

        Waiting requests join their flow's queue in the new engine in arrival order, keeping
        their queue age and deadline; running ones keep their slots there until they end;
        those waiting to be retried are requeued there. The metrics, the retry windows, the
        backends' health and pauses and every token bucket whose figure did not change carry
        over. Returns ``(engine, ended)``: ``ended`` are the waiting requests of a flow the new
        policy no longer allows, ended as refused (reason ``unauthenticated`` when their org is
        gone, else ``class_not_allowed``) so that their callers can be told. This engine must
        not be used afterwards. Raises ``PolicyError`` (changing nothing) when the new policy
        changes the pools' backends, ``cost`` or ``state``: those need a restart."""
        from ..errors import PolicyError

        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an sfq.policy.Policy, got {policy!r}")
        old = self.policy
        if list(policy.pools) != list(old.pools):
            raise PolicyError("pools", f"a reload cannot add, remove or rename pools (in force: "
                                       f"{', '.join(old.pools)}; new: {', '.join(policy.pools)}); restart for that")
        for name, p in policy.pools.items():
            if p.backends != old.pools[name].backends:
                raise PolicyError(f"pools.{name}.backends", "a reload cannot change backends; restart for that")
        for section in ("cost", "state"):
            if getattr(policy, section) != getattr(old, section):
                raise PolicyError(section, "a reload cannot change this section; restart for that")
        new = PolicyEngine(policy, clock=self.clock, scheduler=self._scheduler, metrics=self.metrics)
        new.retry = self.retry
        new.on_attempt_over, new.on_end = self.on_attempt_over, self.on_end
        new.defer_start = self.defer_start
        new.retry.spec = policy.retry
        new.submitted = self.submitted
        for org, b in self.org_rate.items():
            nb = new.org_rate.get(org)
            if nb is not None and nb.capacity == b.capacity:
                new.org_rate[org] = b
        for name, q in self.queues.items():
            nq = new.queues[name]
            for attr in ("rpm", "tpm"):
                b, nb = getattr(q, attr), getattr(nq, attr)
                if b is not None and nb is not None and b.capacity == nb.capacity:
                    setattr(nq, attr, b)
            for bname, be in q.backends.items():
                nq.backends[bname].healthy = be.healthy
                nq.backends[bname].paused_until = be.paused_until
            for cls, starts in q._starts.items():
                if cls in nq._starts:
                    nq._starts[cls] = starts
        ended: list[Request] = []
        for r in sorted(self.live.values(), key=lambda x: x.id):
            allowed = (r.flow.org in policy.orgs and r.flow.cls in policy.orgs[r.flow.org].classes)
            if r.state == RUNNING:
                new.queues[r.flow.pool].adopt_running(r)
            elif r.state == WAITING and not allowed:
                key = tuple(r.flow)
                r.state = ENDED
                new.metrics.left_queue(key)  # type: ignore[arg-type]
                new._end(r, "refused" if r.tries == 0 else "failed",
                         "unauthenticated" if r.flow.org not in policy.orgs else "class_not_allowed")
                ended.append(r)
                continue
            elif r.state == WAITING:
                new.queues[r.flow.pool].push(r, check_length=False, queued_at=r.queued_at)
            new.live[r.id] = r
        return new, ended

    # ------------------------------------------------------------ views
    def stats(self) -> dict[str, Any]:
        """A cheap snapshot: per flow (``"org/class/pool"``) counters, per pool and backend
        occupancy, limits in use. Time and memory grow with the number of flows and backends
        the policy file declares, never with the traffic."""
        now = self.clock()
        flows = {"/".join(k): v for k, v in self.metrics.snapshot().items() if all(k)}
        pools = {}
        for name, q in self.queues.items():
            pools[name] = {
                "waiting": len(q), "in_flight": q.in_flight, "max_in_flight": q.slots.limit,
                "virtual_time": float(q.sched.virtual_time),
                "requests_bucket": None if q.rpm is None else q.rpm.available(now),
                "tokens_bucket": None if q.tpm is None else q.tpm.available(now),
                "backends": {b.name: {"in_flight": b.in_flight, "max_in_flight": b.limit, "healthy": b.healthy,
                                      "paused_for": max(0.0, b.paused_until - now)} for b in q.backends.values()},
            }
        limits = {f"{kind}:{name}": {"used": s.used, "limit": s.limit} for (kind, name), s in self.shared.slots.items()}
        refused = {"/".join(k): v for k, v in self.metrics.snapshot().items() if not all(k)}
        return {"flows": flows, "pools": pools, "limits": limits, "unclassified": refused,
                "submitted": self.submitted, "live": len(self.live)}
