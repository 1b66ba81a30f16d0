"""The request engine: the policy as one synchronous state machine over every pool (no
asyncio, no sockets, an injected clock), in the style of h11: it is told what happened and
answers what to do next.

:class:`PolicyEngine` ties the pieces together: classification, org admission rate limits,
one :class:`~sfq.engine.PolicyQueue` per pool (with the limits shared between pools), the
estimator, the charge mode, the retry planner and outcome accounting. Its drivers
(``sfq.PolicyDispatcher`` under ``sfq serve``, ``sfq.Dispatcher``, the simulator's ``sfq``
discipline) call it like this::

    r = engine.submit(flow, estimate=est, streaming=True)  # accepted (or refused, recorded)
    for r in engine.poll(): ...                            # start these now, on r.backend
    engine.passed(r, event)                                # a stream's event passed to its client
    engine.complete(r, usage) / engine.fail(r, error) / engine.cancel(r)
    engine.backend_down(pool, name) / backend_up / backend_paused / backend_saturated
    engine.wake_at()                                       # poll() again at this time at the latest

Every accepted request ends as exactly one outcome (completed, failed,
cancelled_before_start, cancelled_during_execution, refused) and the engine refuses to end
one twice; ``live`` holds the ones not yet ended, so nothing accepted can be lost unseen.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from .._common import MAX_COST, check_cost
from ..cost import MAX_PROMPT_SURPRISE, PRIOR_CHARS, CostEstimator, Estimate, cached_tokens_of
from ..errors import (BackendHTTPError, BackendTimeout, DeadlineExceeded, DispatcherClosed, NoHealthyBackend, Refused,
                      RequestTooLarge)
from ..policy.charge import ChargeMode
from ..policy.classify import Classifier, Flow
from ..policy.config import ClassSpec, Policy
from ..policy.limits import TokenBucket
from ..policy.metrics import PolicyMetrics, service_levels
from ..policy.retry import RetryDecision, RetryPlanner, retry_after_of, retry_safe
from ..policy.spend import Hold, SpendBook, SpendCollector
from .pool import BACKOFF, ENDED, RUNNING, WAITING, Fits, PolicyQueue, Request, SharedLimits

_INF = math.inf
#: flows remembered as allowed, at most (then the memory starts again)
_ALLOWED_CACHE = 4096

__all__ = ["NO_METRICS", "NoMetrics", "OTHER", "PolicyEngine", "UNKNOWN"]

#: label value for what a refused request's flow did not get as far as (e.g. an unknown key)
UNKNOWN = ""
#: the org (and class, pool) label of refusals of flows the policy does not name
OTHER = "_other"
log = logging.getLogger("sfq.engine")


def _count(x: object) -> float | None:
    """A token count from a usage report as a float (``inf`` for one too large for a float),
    or ``None`` when it is not a number >= 0."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        v = float(x)
    except OverflowError:
        return math.inf
    return v if v >= 0 else None  # (NaN fails too)


class NoMetrics:
    """Metrics that count nothing: for a driver that keeps its own statistics and may see any
    number of flows (``sfq.Dispatcher``: flow ids are the caller's, unbounded), where a
    Prometheus series per flow would grow without end."""

    registry = None

    def _get(self, key: Any) -> None:
        return None

    def queued(self, key: Any, n: int = 1) -> None:
        pass

    def started(self, key: Any, wait: float, cost: float, retry: bool) -> None:
        pass

    def began(self, key: Any, cost: float) -> None:
        pass

    def completed(self, key: Any, served_cost: float | None, charged: float) -> None:
        pass

    def attempt_ended(self, key: Any, *, served_cost: float | None = None, upstream_429: bool = False,
                      timeout: bool = False, charged: float | None = None) -> None:
        pass

    def left_queue(self, key: Any) -> None:
        pass

    def timeout(self, key: Any) -> None:
        pass

    def cancelled_work_tokens(self, key: Any, tokens: float) -> None:
        pass

    def ended(self, key: Any, outcome: str, reason: str | None = None) -> None:
        pass

    def snapshot(self) -> dict[Any, dict[str, Any]]:
        return {}


#: the one :class:`NoMetrics` (``PolicyEngine(..., metrics=NO_METRICS)``)
NO_METRICS = NoMetrics()



def text_counts(choices: object, cpt: float = 0.0) -> tuple[int, float]:
    """What an OpenAI reply's (or stream event's) ``choices`` carry: the characters of text
    (each choice's ``text``, or the ``content`` of its ``delta`` or ``message``) and the output
    tokens that text counts for at ``cpt`` characters per token: ``max(1, chars / cpt)`` per
    choice with text, a choice's ``reasoning_content`` counted when it has no ``content``
    (tokens, not characters of the answer); no tokens when ``cpt`` is 0. The one walk over
    ``choices`` that the drivers, plain and streamed, all use."""
    if not choices or not isinstance(choices, list):
        return 0, 0.0
    chars = 0
    tokens = 0.0
    for ch in choices:
        if type(ch) is not dict and not isinstance(ch, Mapping):
            continue
        text = ch.get("text")
        counted = text
        if text is None:
            delta = ch.get("delta") or ch.get("message")
            if type(delta) is dict or isinstance(delta, Mapping):
                text = delta.get("content")
                counted = text or delta.get("reasoning_content")
        if type(text) is str:
            chars += len(text)
        if cpt and counted and type(counted) is str:
            t = len(counted) / cpt
            tokens += t if t > 1.0 else 1.0
    return chars, tokens

class PolicyEngine:
    """A policy in force. ``clock``: seconds (default ``time.monotonic``); ``scheduler``: the
    core factory (default ``sfq.Scheduler``); ``rng``: the retry jitter's random source;
    ``registry``: the Prometheus registry for the metrics (a new one by default);
    ``wall_clock``: epoch seconds, for the budgets' UTC periods (default ``time.time``);
    ``spend``: the spend rule and ledger (default: made from the policy; a reload hands its own on)."""

    def __init__(self, policy: Policy, *, clock: Callable[[], float] = time.monotonic,
                 scheduler: Callable[[], Any] | None = None, rng: random.Random | None = None,
                 registry: CollectorRegistry | None = None, metrics: PolicyMetrics | NoMetrics | None = None,
                 estimator: CostEstimator | None = None, max_pause: float = 60.0,
                 wall_clock: Callable[[], float] = time.time, spend: SpendBook | None = None) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an sfq.policy.Policy, got {policy!r}")
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {clock!r}")
        if estimator is not None and not isinstance(estimator, CostEstimator):
            raise TypeError(f"estimator must be an sfq.CostEstimator, got {estimator!r}")
        if isinstance(max_pause, bool) or not isinstance(max_pause, (int, float)) or not max_pause >= 0:
            raise ValueError(f"max_pause must be a number of seconds >= 0, got {max_pause!r}")
        self.policy = policy
        self.clock = clock
        self._scheduler = scheduler
        cs = policy.cost
        #: prices requests, re-prices them at dispatch, learns from their usage
        self.estimator = estimator if estimator is not None else CostEstimator(
            cs.input_weight, cs.output_weight, default_max_tokens=cs.default_max_tokens, prior_ratio=cs.prior_ratio,
            cached_input_weight=cs.cached_input_weight)
        #: the charge mode (the policy file's ``cost.charge``)
        self.charge = ChargeMode(cs.charge)
        #: seconds: the longest an upstream's ``Retry-After`` may pause one of its backends
        self.max_pause = float(max_pause)
        self.classifier = Classifier(policy)
        self.shared = SharedLimits(policy)
        self.queues: dict[str, PolicyQueue] = {
            p: PolicyQueue(policy, p, clock=clock, shared=self.shared, scheduler=scheduler, estimator=self.estimator)
            for p in policy.pools}
        now = clock()
        self.org_rate: dict[str, TokenBucket] = {
            o.name: TokenBucket(o.requests_per_minute, now) for o in policy.orgs.values()
            if o.requests_per_minute is not None}
        #: whether some org may have a requests_per_minute: one the file names, or any through
        #: the template (an org the file does not name is the template's, ``Policy.org``)
        self._org_rates = bool(self.org_rate) or (
            policy.org_template is not None and policy.org_template.requests_per_minute is not None)
        self.retry = RetryPlanner(policy.retry, rng)
        ms = policy.metrics
        if metrics is None:  # an org shows from its first request (10,000 orgs idle: no series)
            metrics = PolicyMetrics(registry, clock=clock, window_seconds=ms.window_seconds,
                                    max_org_series=ms.max_org_series)
        elif isinstance(metrics, PolicyMetrics):  # a reload: the series go on, under the new file's settings
            metrics.configure(ms.window_seconds, ms.max_org_series)
        if isinstance(metrics, PolicyMetrics):
            metrics.policy = policy
            metrics.oldest = self.oldest_waiting
            metrics.predicted = self.predicted_wait
        self.metrics = metrics
        #: ``metrics.began(key, cost)``: a request queued and started at once (0 s waited, its
        #: first attempt), in one call; ``None`` for metrics without it (``queued`` + ``started``)
        self._began: Callable[[Any, float], None] | None = getattr(metrics, "began", None)
        #: ``metrics.completed(key, served_cost, charged)``: an attempt ended and its request
        #: completed (``attempt_ended`` + ``ended``), in one call; ``None`` for metrics without it
        self._completed: Callable[[Any, float | None, float], None] | None = getattr(metrics, "completed", None)
        #: spend (currency) against the orgs' budgets: reserved at admission, settled at the end
        self.spend = spend if spend is not None else SpendBook(policy, wall_clock=wall_clock)
        if spend is None and metrics.registry is not None:
            metrics.registry.register(SpendCollector(self.spend))
        self.live: dict[int, Request] = {}
        #: nested shares: the live users (a request of theirs accepted and not ended) of each
        #: (org, team), with how many requests each has live; bounded by ``max_users``
        self.users: dict[tuple[str, str | None], dict[str, int]] = {}
        self._allowed: set[Flow] = set()  # flows the policy allows, as submit() met them
        self.submitted = 0
        #: requests the last poll() (or next_start() calls since) ended before they started: their
        #: queue age or deadline ran out, or (reason ``queue_full``) another org's request took
        #: their place in a full class
        self.dropped: list[Request] = []
        self._evicted: list[Request] = []  # given their place up in submit(), for the next poll()
        #: shared state (several gateways, ``sfq.state``): called when an attempt ends (with the
        #: usage report's tokens, or ``None``) and when a request ends; ``None`` in memory
        self.on_attempt_over: Callable[[Request, float | None], None] | None = None
        self.on_end: Callable[[Request], None] | None = None
        #: a start the engine decides is only a candidate until the shared state grants it
        #: (:meth:`granted`); until then the request counts as waiting
        self.defer_start = False
        #: several gateways sharing a ledger: ``decider(pool)`` is the fleet's decider's queue
        #: of ``pool`` when this gateway decides (it holds every gateway's waiting requests),
        #: else ``None`` (this engine sees only its own: no prediction here)
        self.decider: Callable[[str], PolicyQueue | None] | None = None
        #: seconds a refusal for a pool with no backend in rotation tells the client to wait
        self.unavailable_retry_after = 1.0
        #: some class has a default deadline or refuses unmeetable ones (``_class_deadline``)
        self._class_deadlines = any(c.deadline_seconds is not None or c.refuse_unmeetable
                                    for c in policy.classes.values())

    # ------------------------------------------------------------ admission
    def classify(self, credential: str | None, stated_class: str | None, model: object,
                 user: str | None = None) -> Flow:
        """The request's flow, or ``Refused`` (recorded as a refusal) with reason
        ``unauthenticated``, ``class_not_allowed`` or ``unknown_model``. ``user``: the
        ``X-SFQ-User`` the request states (checked by the caller), for an org with users."""
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
        if org.nested:
            assert credential is not None  # (org_of accepted it)
            return Flow(org.name, cls, pool, *self.classifier.member(org, credential, user))
        return Flow(org.name, cls, pool)

    def _refused_unclassified(self, key: tuple[str, str, str], exc: Refused) -> None:
        self.submitted += 1
        self.metrics.ended(self._refusal_key(key), "refused", exc.reason)

    def refuse(self, flow: Flow | tuple[str, str, str], reason: str) -> None:
        """Record a refusal decided outside the engine (a malformed body, a request too large)."""
        self.submitted += 1
        self.metrics.ended(self._refusal_key(tuple(flow[:3])), "refused", reason)

    def _refusal_key(self, key: tuple[Any, ...]) -> tuple[str, str, str]:
        """Where a refusal is counted: under its own flow when the policy names its org (or the
        flow has counted before), else under ``OTHER`` (the names a client makes up never grow
        the counters, the stats or the metric series: refused flows leave no state)."""
        flows = getattr(self.metrics, "flows", None)
        if flows is None or key in flows:
            return key
        org, cls, pool = key
        p = self.policy
        if org in p.orgs or org == UNKNOWN:
            return key
        return (OTHER, cls if cls in p.classes or cls == UNKNOWN else OTHER,
                pool if pool in p.pools or pool == UNKNOWN else OTHER)

    # (cost, tokens, need and deadline are annotated ``object``, not ``float | None``: the engine
    # checks them itself, with the twin's messages, where the compiled engine would refuse a
    # string with mypyc's own TypeError before the check; docs/library.md "The engine, compiled")
    def submit(self, flow: Flow, *, cost: object = None, tokens: object = None,
               need: object = None, deadline: object = None, item: Any = None,
               idempotency_key: str | None = None, estimate: Estimate | None = None,
               streaming: bool = False, start: bool = False, hold: Hold | None = None,
               max_wait: object = None, ready_at: object = None) -> Request:
        """Accept a request of ``flow`` (from :meth:`classify`) into its pool's queue.

        ``estimate``: the request's estimate (``CostEstimator.estimate``); with it the request
        is re-estimated at dispatch and its charge corrected from what it delivered, as the
        charge mode says, and ``cost``, ``tokens`` and ``need`` default to its figures.
        Without it, or given with it, ``cost`` (cost units, > 0) is a fixed charge, never
        re-estimated or corrected (the estimate then only bounds the usage it learns from).
        ``tokens``: the estimate debited from the pool's ``tokens_per_minute``; ``need``:
        prompt + max_tokens of one sequence (backends' ``max_context``); ``deadline``: absolute
        clock time (it bounds the whole request); ``max_wait``: seconds the request may wait
        for each start (its own queue age bound: the smaller of it and its class's
        ``max_queue_age_seconds`` applies; it ends as refused, ``queue_timeout``, when it runs
        out; a running request is never cut by it); ``streaming``: the reply is a stream
        (``served`` charges its output as it is delivered, :meth:`delivered`). ``start``: when
        nothing else waits in its pool, start
        it now if it may (returned RUNNING on ``r.backend``), the decision the next
        :meth:`poll` would make, for a driver that polls after every event and checks no
        ``fits`` of its own (an uncontended request then costs no poll).

        Over its org's ``requests_per_minute``, a request whose ``on_limit`` is ``wait``
        (:meth:`~sfq.policy.Policy.waits_for_rate`) takes its token ahead (the bucket goes into
        debt) and is *parked* until that token's refill: accepted, counted as waiting, but in no
        flow and not in the core (no slot, no place in the order, nobody delayed), it joins its
        flow then (:meth:`wake_at` names the time); when its deadline, queue age or ``max_wait``
        would run out first it is refused, as with ``on_limit: refuse``. ``ready_at``: a clock
        time before which the request may not join its flow (a shared state reserved its org's
        token for then, ``sfq.state``); it is parked until then.

        Raises ``Refused`` (recorded) with reason ``rate_limited`` (the org's
        ``requests_per_minute``; ``retry_after``: when its next token comes), ``queue_full``,
        ``deadline`` (already past) or ``too_large`` (no backend's ``max_context`` fits
        ``need``), with ``retry_after`` where trying later can help; ``NoHealthyBackend``
        (recorded as refused, ``unavailable``) when no backend of the pool is in rotation;
        ``ValueError`` for a flow the policy does not allow or a bad number (nothing recorded).
        ``Refused`` with reason ``budget_exhausted`` (429, retry at the period's end) when the
        org's budget cannot cover the request's reservation (:class:`~sfq.policy.spend.SpendBook`);
        ``hold``: a reservation the caller already made in a shared ledger (``sfq.state``), the
        request's from now on (given back if refused).
        """
        return self._submit(flow, cost, tokens, need, deadline, item, idempotency_key, estimate, streaming, start,
                            hold, max_wait, ready_at)

    def _submit(self, flow: Flow, cost: object, tokens: object, need: object,
                deadline: object, item: Any, idempotency_key: str | None, estimate: Estimate | None,
                streaming: bool, start: bool, hold: Hold | None, max_wait: object = None,
                ready_at: object = None) -> Request:
        """:meth:`submit` with its arguments in order (the driver's call, without keywords)."""
        if type(flow) is not Flow:
            flow = Flow(*flow)
        q = self.queues.get(flow.pool)
        if q is None or (flow not in self._allowed and not self._allow(flow)):
            raise ValueError(f"flow {tuple(flow)!r} is not allowed by the policy")
        fixed = cost is not None
        if estimate is None and type(cost) is float and tokens is None and need is None and 0.0 < cost <= MAX_COST:
            tokens = need = 0.0  # a permit's fixed cost, checked (the common case in one test: NaN, inf fail it)
        else:
            cost, tokens, need = self._figures(cost, tokens, need, estimate)
        if deadline is not None and (type(deadline) is not float and (
                isinstance(deadline, bool) or not isinstance(deadline, (int, float))) or deadline != deadline):
            raise ValueError(f"deadline must be a clock time (a number) or None, got {deadline!r}")
        wait = _INF
        if max_wait is not None:
            if not isinstance(max_wait, bool) and isinstance(max_wait, (int, float)) and max_wait > 0:
                wait = float(max_wait)
            else:
                raise ValueError(f"max_wait must be a number of seconds > 0 or None, got {max_wait!r}")
        park = -_INF  # parked until then (its org's rate: ready_at, or its token's refill below)
        if ready_at is not None:
            if isinstance(ready_at, bool) or not isinstance(ready_at, (int, float)) or ready_at != ready_at:
                raise ValueError(f"ready_at must be a clock time (a number) or None, got {ready_at!r}")
            park = float(ready_at)
        now = self.clock()
        # counters and metrics are kept per (org, class, pool): teams and users add no series
        key = flow if len(flow) == 3 else flow[:3]
        if need > q.largest_context:
            self.submitted += 1
            self.metrics.ended(self._refusal_key(key), "refused", "too_large")
            raise RequestTooLarge(f"the request needs about {need:.0f} tokens (prompt + max_tokens), more than "
                                       f"any backend of pool {flow.pool!r} takes (largest max_context "
                                       f"{q.largest_context:.0f})")
        if deadline is not None and deadline <= now:
            self.submitted += 1
            self.metrics.ended(self._refusal_key(key), "refused", "deadline")
            raise Refused("deadline", "the request's deadline has already passed")
        spec = self.policy.classes[flow.cls]
        if self._class_deadlines:  # (some class has a default deadline or refuses early)
            deadline = self._class_deadline(q, flow, spec, key, float(cost), deadline, now)
        victim = None
        if spec.max_queue_length is not None and q.waiting_by_class[flow.cls] >= spec.max_queue_length:
            try:
                victim = q.make_room(flow)  # a full class: the org holding the most gives a place up
            except Refused as exc:
                self.submitted += 1
                self.metrics.ended(self._refusal_key(key), "refused", exc.reason)
                raise
        if q.down_since is not None and q.unavailable_timeout <= 0:  # (no backend in rotation)
            self.submitted += 1
            self.metrics.ended(self._refusal_key(key), "refused", "unavailable")
            down = NoHealthyBackend(f"no backend of pool {flow.pool!r} is in rotation")
            down.retry_after = self.unavailable_retry_after
            raise down
        if hold is None and q.spec.prices is not None:  # (a pool without prices spends nothing)
            try:
                hold = self.spend.admit(flow, estimate)
            except Refused as exc:
                self.submitted += 1
                self.metrics.ended(self._refusal_key(key), "refused", exc.reason)
                raise
        bucket = self._org_bucket(flow.org, now) if self._org_rates else None
        if bucket is not None and not bucket.take(1, now):
            refill = bucket.wait(1, now)  # (0 < refill: take() refused)
            waits = self.policy.waits_for_rate(flow.org, flow.cls)
            if not waits or now + refill >= self._bound(spec, now, wait, deadline):
                self.spend.release(hold)
                self.submitted += 1
                self.metrics.ended(self._refusal_key(key), "refused", "rate_limited")
                raise Refused("rate_limited", f"org {flow.org!r} is over its requests_per_minute "
                                              f"({bucket.capacity:g})" + (
                                                  "; its next token comes after the request's deadline, queue age "
                                                  "or max_wait" if waits else ""), retry_after=refill)
            bucket.debit(1, now)  # on_limit: wait: the token is the request's, taken ahead (a debt)
            if now + refill > park:
                park = now + refill
        user = flow.user if len(flow) > 3 else None  # nested shares: a user counts towards max_users
        if user is not None and not self._user_room(flow):
            if bucket is not None:  # (its token, taken last: given back exactly)
                bucket.credit(1, now)
            self.submitted += 1
            self.metrics.ended(self._refusal_key(key), "refused", "too_many_users")
            where = f"team {flow.team!r} of org {flow.org!r}" if flow.team is not None else f"org {flow.org!r}"
            raise Refused("too_many_users", f"{where} already has {self._max_users(flow)} users with requests "
                                            "waiting or running (max_users); this user's request is refused until "
                                            "one of them is done", retry_after=q.place_frees_in(flow.cls))
        r = Request(flow, float(cost), float(tokens), now, deadline, item, float(need), idempotency_key, estimate,
                    self.estimator.epoch if estimate is not None else -1, bool(streaming))  # (in order: no keywords)
        r.fixed = fixed
        r.hold = hold
        r.max_wait = wait
        if park > now:  # parked until its token comes (queue_new)
            r.ready_at = park
            start = False
        if start and victim is None and q.start_alone(r, now, spec):
            # nothing waited in its pool and nothing bound: it started at once, as the pair
            # queue_new + pop would have started it (PolicyQueue.start_alone)
            self._accepted(r, user)
            self.retry.first_attempt(key, now)
            if self._began is not None and not self.defer_start:
                self._began(key, r.cost)
            else:
                self.metrics.queued(key)
                self._started(r)
            return r
        alone = not q.n_waiting  # (a victim waited: never alone)
        if victim is not None:
            self.evict(victim)
        q.queue_new(r, now)  # (checked above: the flow, its need, its cost, its class's room)
        self._accepted(r, user)
        self.metrics.queued(key)
        self.retry.first_attempt(key, now)  # (the retry budget is the (org, class, pool)'s: invented users add none)
        if start and alone:
            # the only request waiting in its pool: what poll() would do next (nothing else in
            # the pool can start or be dropped: its other requests are running), without the poll
            if q.pop() is not None:  # (r: nothing else waits)
                self._started(r)
        return r

    def _class_deadline(self, q: PolicyQueue, flow: Flow, spec: ClassSpec, key: tuple[str, str, str],
                        cost: float, deadline: float | None, now: float) -> float | None:
        """The deadline of a new request of ``flow`` (``deadline``: its own, or ``None``): its
        class's ``deadline_seconds`` from now when it has none; and, in a class that refuses
        early (``refuse_unmeetable``), ``Refused("deadline_unmeetable")`` (recorded, nothing
        else changed) when it cannot start before it (``PolicyQueue.unmeetable``)."""
        if deadline is None and spec.deadline_seconds is not None:
            deadline = now + spec.deadline_seconds
        if spec.refuse_unmeetable and deadline is not None:
            age = spec.max_queue_age_seconds
            drop_at = deadline if age is None or deadline <= now + age else now + age
            late = q.unmeetable(flow, cost, drop_at, now)
            if late is not None:
                self.submitted += 1
                self.metrics.ended(self._refusal_key(key), "refused", "deadline_unmeetable")
                raise Refused("deadline_unmeetable", f"the request cannot start within its deadline "
                                                     f"({drop_at - now:.3g} s): its flow's requests due before "
                                                     f"it take longer at its fair part of the measured service "
                                                     f"of pool {flow.pool!r}", retry_after=late)
        return deadline

    def _accepted(self, r: Request, user: str | None) -> None:
        """``r`` is accepted: counted, live, and its user (nested shares) live in its team."""
        self.submitted += 1
        self.live[r.id] = r
        if user is not None:
            f = r.flow
            live = self.users.setdefault((f.org, f.team), {})
            live[user] = live.get(user, 0) + 1

    @staticmethod
    def _figures(cost: object, tokens: object, need: object,
                 estimate: Estimate | None) -> tuple[float, float, float]:
        """``submit``'s ``(cost, tokens, need)``: defaulted from ``estimate``, and checked."""
        if estimate is not None:
            if not isinstance(estimate, Estimate):
                raise TypeError(f"estimate must be an sfq.cost.Estimate, got {estimate!r}")
            if cost is None:
                cost = estimate.cost
            if tokens is None:
                tokens = estimate.charged_prompt + estimate.max_tokens
            if need is None:
                need = estimate.prompt_tokens + estimate.max_tokens // max(1, estimate.copies)
        if cost is None:
            raise TypeError("submit() needs cost= or estimate=")
        tokens = 0.0 if tokens is None else tokens
        need = 0.0 if need is None else need
        checked: float = check_cost(cost)  # the core's own check and message (TypeError, ValueError, OverflowError)
        if not ((type(tokens) is float or type(tokens) is int) and 0 <= tokens < _INF):  # (bool is neither)
            raise ValueError(f"tokens must be a finite number >= 0, got {tokens!r}")
        if not ((type(need) is float or type(need) is int) and 0 <= need < _INF):
            raise ValueError(f"need must be a finite number >= 0, got {need!r}")
        return checked, tokens, need

    # ------------------------------------------------------------ nested shares: live users
    def _max_users(self, flow: Flow) -> int:
        org = self.policy.org(flow.org)
        assert org is not None
        return org.teams[flow.team].max_users if flow.team is not None else org.max_users

    def _user_room(self, flow: Flow) -> bool:
        """Whether a request of ``flow``'s user may be accepted: the user is live already, or
        its team (or org) has fewer than ``max_users`` live users."""
        live = self.users.get((flow.org, flow.team))
        return live is None or flow.user in live or len(live) < self._max_users(flow)

    def _user_ended(self, flow: Flow) -> None:
        g = (flow.org, flow.team)
        live = self.users.get(g)
        if live is None or flow.user not in live:
            return
        n = live[flow.user] - 1
        if n:
            live[flow.user] = n
        else:
            del live[flow.user]
            if not live:
                del self.users[g]

    def _allow(self, flow: Flow) -> bool:
        """Whether the policy allows ``flow``, remembered when it does (the policy of an
        engine never changes; a reload makes a new engine)."""
        if not self.policy.allows(flow):
            return False
        allowed = self._allowed
        if len(allowed) >= _ALLOWED_CACHE:  # flows of template orgs: bounded, never a leak
            allowed.clear()
        allowed.add(flow)
        return True

    @staticmethod
    def _bound(spec: ClassSpec, now: float, max_wait: float, deadline: object) -> float:
        """When a request arriving ``now`` would be dropped unstarted: its class's queue age,
        its ``max_wait`` or its deadline, the soonest (``PolicyQueue.queue_new``'s ``drop_at``)."""
        age = spec.max_queue_age_seconds
        bound = now + age if age is not None else _INF
        if now + max_wait < bound:
            bound = now + max_wait
        if deadline is not None and float(deadline) < bound:  # type: ignore[arg-type]
            bound = float(deadline)  # type: ignore[arg-type]
        return bound

    def _org_bucket(self, org: str, now: float) -> TokenBucket | None:
        b = self.org_rate.get(org)
        if b is None and org not in self.policy.orgs:  # an org of the template: its own bucket, on first use
            o = self.policy.org(org)
            if o is not None and o.requests_per_minute is not None:
                b = self.org_rate[org] = TokenBucket(o.requests_per_minute, now)
        return b

    # ------------------------------------------------------------ the loop
    def has_waiting(self) -> bool:
        """Whether :meth:`poll` may have anything to do: a request waits in some pool (or gave
        its place up in :meth:`submit` and is still to be handed out as dropped)."""
        if self._evicted:
            return True
        for q in self.queues.values():
            if q.n_waiting:
                return True
        return False

    def may_start(self, pool: str) -> bool:
        """Whether a :meth:`poll` after a request joined ``pool``'s queue may start or drop
        anything that :meth:`wake_at` does not already name: ``False`` while the pool is full
        (every slot taken: what frees one polls again) and no request gave its place up."""
        return bool(self._evicted) or not self.queues[pool].full()

    def poll(self, fits: Fits | None = None) -> list[Request]:
        """Start everything that may start now: returns the requests to send (each on
        ``r.backend``), after ending as refused those whose queue age or deadline ran out
        (:attr:`dropped` lists them until the next ``poll``). ``fits(request, backend)``:
        the driver's own check that a backend can take a request now (see
        :meth:`PolicyQueue.pop`)."""
        self.dropped, self._evicted = self._evicted, []
        starts: list[Request] = []
        for q in self.queues.values():
            if not q.n_waiting:  # nothing to start or to drop (pop's own first test, without the call)
                q.stalled = None
                q.blocked_until = -math.inf
                continue
            while True:
                r = self._pop(q, fits)
                if r is None:
                    break
                starts.append(r)
                if not q.n_waiting:
                    q.stalled = None
                    break
                if q.full():  # every slot taken: another pop would start nothing, and it dropped
                    break     # what had run out of time as it started this one (what frees a slot polls)
        return starts

    def next_start(self, fits: Fits | None = None) -> Request | None:
        """Start one request, the next of the first pool (in file order) that has one; ``None``
        when none may start now. For a caller that places one request at a time (the
        simulator); drops are ended and added to :attr:`dropped` as in :meth:`poll`."""
        if self._evicted:
            self.dropped.extend(self._evicted)
            self._evicted = []
        for q in self.queues.values():
            r = self._pop(q, fits)
            if r is not None:
                return r
        return None

    def _pop(self, q: PolicyQueue, fits: Fits | None = None) -> Request | None:
        r = q.pop(fits)
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
        self.metrics.started(r.flow[:3], r.started_at - r.queued_at, r.cost, r.retrying)

    def granted(self, r: Request) -> None:
        """The shared state granted the start the engine decided for ``r`` (``defer_start``):
        it starts now, and the metrics count its wait up to now."""
        if r.state != RUNNING:
            raise ValueError(f"granted({r!r}): the request is not running")
        r.started_at = self.clock()
        self.metrics.started(r.flow[:3], r.started_at - r.queued_at, r.cost, r.retrying)

    def _dropped(self, r: Request) -> None:
        key = r.flow[:3]
        self.metrics.left_queue(key)
        self.metrics.timeout(key)
        self._end(r, "refused" if r.tries == 0 else "failed", r.reason)

    def forget_idle(self) -> int:
        """Forget what the engine keeps of flows with nothing waiting or running and no
        activity for a retry window (60 s): their retry budgets (a fresh flow's: nothing a
        decision needs is lost). The queues forget a flow's queue when it empties, and the
        core its meter once ``v`` passes it. Of the orgs made from the policy's
        ``org_template`` (names an embedder made up, unbounded), with nothing live: their specs
        (``Policy.forget_orgs``), their ``requests_per_minute`` buckets once full again, their
        ``max_in_flight`` slots once free, and their metrics once idle for the share window
        (``PolicyMetrics.forget_idle``): what a fresh org starts with, so nothing a decision
        needs is lost. Returns how many flows (and template orgs) were forgotten. A driver
        calls it on a timer, so that an idle process holds nothing for flows seen once."""
        now = self.clock()
        self._allowed.clear()  # (a cache of the flows the policy allows)
        for q in self.queues.values():
            q.forget_starts(now)
        n = self.retry.sweep(now)
        p = self.policy
        if p.org_template is not None:
            live = {r.flow.org for r in self.live.values()}
            n += p.forget_orgs(live)
            named = p.orgs
            full = [o for o, b in self.org_rate.items() if o not in named and o not in live
                    and b.available(now) >= b.capacity]
            for o in full:
                del self.org_rate[o]
            if full:
                self.org_rate = dict(self.org_rate)
            slots = self.shared.slots
            free = [g for g, sl in slots.items() if g[0] == "org" and g[1] not in named and g[1] not in live
                    and not sl.used and not sl.full]
            for g in free:
                del slots[g]
            if free:
                self.shared.slots = dict(slots)
        if isinstance(self.metrics, PolicyMetrics):
            n += self.metrics.forget_idle()
        return n

    def wake_at(self) -> float | None:
        """The clock time by which :meth:`poll` must run again even if nothing else happens."""
        best = None
        for q in self.queues.values():
            t = q.wake_at()
            if t is not None and (best is None or t < best):
                best = t
        return best

    # ------------------------------------------------------------ endings
    def _end(self, r: Request, outcome: str, reason: str | None = None, counted: bool = False) -> None:
        """``r`` ends as ``outcome`` (``counted``: the metrics have counted its end already)."""
        if r.outcome is not None:
            raise RuntimeError(f"{r!r} already ended as {r.outcome}")
        if r.retrying:
            r.retrying = False
            self.retry.retry_ended(r.flow[:3])
        r.outcome = outcome
        r.reason = reason
        r.state = ENDED
        if self.live.pop(r.id, None) is not None and len(r.flow) > 3 and r.flow.user is not None:
            self._user_ended(r.flow)
        if not counted:
            self.metrics.ended(r.flow[:3], outcome, reason)
        if r.hold is not None:
            self.spend.settle(r.hold)
        if self.on_end is not None:
            self.on_end(r)

    def _passed_cost(self, r: Request) -> float | None:
        """What a running attempt that ends early (cancelled, failed) served: its prompt and the
        output tokens that passed to its client (:meth:`delivered`), priced as a usage report
        would be; ``None`` when nothing passed."""
        return self._actual(r, None, None)[1] if r.delivered > 0 else None

    def _attempt_over(self, r: Request, *, actual_tokens: float | None = None, served_cost: float | None = None,
                      retry_after: float | None = None, upstream_429: bool = False, timeout: bool = False) -> None:
        self.queues[r.flow.pool].finish(r, actual_tokens=actual_tokens, retry_after=retry_after)
        r.charged_total += r.charged  # (the attempt's charge, every correction made)
        if self.on_attempt_over is not None:
            self.on_attempt_over(r, actual_tokens)
        self.metrics.attempt_ended(r.flow[:3], served_cost=served_cost,
                                   upstream_429=upstream_429, timeout=timeout, charged=r.charged)

    # ------------------------------------------------------------ delivered service
    def delivered(self, r: Request, tokens: object) -> float:
        """The running request ``r`` passed ``tokens`` more output tokens to its client (a
        stream's events as they go through). In ``served`` mode the flow is charged them now.
        Capped at the request's ``max_tokens``; returns the tokens counted. ``ValueError`` for
        a request that is not running or a count that is not a finite number >= 0."""
        return self.queues[r.flow.pool].delivered(r, tokens)

    def event_tokens(self, r: Request, event: Mapping[str, Any]) -> float:
        """The output tokens one parsed SSE event of ``r`` carries beyond those already
        :meth:`delivered`: a usage report in the event (``completion_tokens`` so far) is
        taken as the running count; otherwise each choice's text counts
        ``max(1, chars / chars_per_token)`` tokens (:func:`text_counts`, at the estimator's
        calibration when the stream's first text came)."""
        tokens = self._counts(r, event)[1]
        return tokens if tokens > 0 else 0.0

    def passed(self, r: Request, event: Mapping[str, Any]) -> int:
        """One parsed SSE event of the stream ``r`` reached its client: while ``r`` runs, its
        tokens (:meth:`event_tokens`) are :meth:`delivered`. Returns the characters of text it
        carried (``choices[].text`` or ``delta.content``: the ``output_text_chars`` that
        :meth:`complete` takes when no usage comes). One pass over the event, for a driver
        that calls it for every event of every stream."""
        chars, tokens = self._counts(r, event)
        if tokens > 0 and r.state == RUNNING:
            self.queues[r.flow.pool].add_delivered(r, tokens)
        return chars

    def _counts(self, r: Request, event: Mapping[str, Any]) -> tuple[int, float]:
        """``(characters of text, tokens beyond those delivered)`` of one event of ``r``: the
        text's (:func:`text_counts`), unless the event reports usage, whose running
        ``completion_tokens`` then says what was delivered (the tokens may be <= 0)."""
        chars, tokens = text_counts(event.get("choices"), r.cpt or self._cpt(r))
        u = event.get("usage")
        if u:
            ct = u.get("completion_tokens") if type(u) is dict or isinstance(u, Mapping) else None
            tokens = ct - r.delivered if type(ct) is int and ct >= 0 else 0.0
        return chars, tokens

    def _cpt(self, r: Request) -> float:
        """Characters per output token the text of ``r`` counts at: the estimator's ratio for
        its model, read once (when its first text comes) and held for the request."""
        cpt = r.cpt = self.estimator.chars_per_token_of(r.est.model if r.est is not None else "")
        return cpt

    def _actual(self, r: Request, usage: Mapping[str, Any] | None, text_chars: int | None,
                spend: bool = False) -> tuple[float | None, float | None]:
        """:meth:`_used` as ``(tokens, cost units)``; ``spend``: the attempt's spend is these
        tokens (its budget's hold is told; once per attempt, by the call that settles it)."""
        used = self._used(r, usage, text_chars)
        if used is None:
            return None, None
        p, cached, c = used
        if spend and r.hold is not None:
            self.spend.used(r.hold, p, cached, c)
        est = self.estimator
        if cached:  # cached prompt tokens count cached_input_weight each, in the charge and the bucket
            p = est.charged_prompt(p, cached)
        cost = est.input_weight * p + est.output_weight * c
        cost = est.min_cost if cost < est.min_cost else MAX_COST if cost > MAX_COST else cost
        return p + c, cost

    def _used(self, r: Request, usage: Mapping[str, Any] | None,
              text_chars: int | None) -> tuple[float, float, float] | None:
        """``(tokens, cost units)`` the attempt of ``r`` really used, clamped to what it could
        have cost: output within ``[0, max_tokens]``, the prompt within a factor 4 of its
        estimate (plus 64 for a chat template's tokens), so one absurd report moves no meter
        or bucket by more than the request was worth. From ``usage``; without a usable one,
        from the tokens :meth:`delivered` or the returned text's length; ``(None, None)`` when
        nothing is known (the charge at dispatch stands). :meth:`_used` gives the tokens:
        ``(prompt, of which cached, output)`` or ``None``; the cached ones keep their share of
        a clamped prompt."""
        p: float | None = None
        c: float | None = None
        cached = 0.0
        if usage is not None and (type(usage) is dict or isinstance(usage, Mapping)):
            c = _count(usage.get("completion_tokens"))
            p = _count(usage.get("prompt_tokens"))
            if p:
                cached = min(float(cached_tokens_of(usage)), p) / p  # (a fraction until p is clamped)
        e = r.est
        if c is None:
            if r.delivered > 0:
                c = r.delivered
            elif text_chars is not None and e is not None:
                c = text_chars / self.estimator.chars_per_token_of(e.model)
            else:
                return None
        if e is not None:
            if c > e.max_tokens:
                c = float(e.max_tokens)
            lo = e.prompt_tokens / MAX_PROMPT_SURPRISE
            hi = e.prompt_tokens * MAX_PROMPT_SURPRISE + PRIOR_CHARS
            p = e.prompt_tokens if p is None else lo if p < lo else hi if p > hi else p
        else:  # a fixed cost: the tokens are bounded by the request's own token estimate
            limit = max(r.tokens, 1.0) * MAX_PROMPT_SURPRISE + PRIOR_CHARS
            p = 0.0 if p is None else min(p, limit)
            c = min(c, limit)
            if p + c > limit:
                scale = limit / (p + c)
                p, c = p * scale, c * scale
        return p, (p * cached if cached else 0.0), c

    def _spent_delivered(self, r: Request) -> None:
        """An attempt of ``r`` ended without a usage report (failed, cancelled): its spend is
        the prompt and the output it delivered, if it delivered any (else nothing)."""
        if r.hold is not None and r.delivered > 0:
            used = self._used(r, None, None)
            if used is not None:
                self.spend.used(r.hold, *used)

    def complete(self, r: Request, usage: Mapping[str, Any] | None = None,
                 output_text_chars: object = None) -> None:  # (object: checked below, with the twin's message)
        """A running request completed. Its charge is settled as the charge mode says (not in
        ``seed``, not for a fixed cost) to what it really cost: from ``usage`` (OpenAI
        ``usage``), or without one from the tokens it :meth:`delivered` or from
        ``output_text_chars`` (the length of the text it returned), clamped (:meth:`_actual`);
        the token bucket is corrected by the same figure and the estimator learns from the
        usage report."""
        if r.state != RUNNING:
            raise ValueError(f"complete({r!r}): the request is not running")
        if output_text_chars is not None and (isinstance(output_text_chars, bool) or not isinstance(
                output_text_chars, int) or output_text_chars < 0):
            raise ValueError(f"output_text_chars must be an integer >= 0, got {output_text_chars!r}")
        if usage is None and output_text_chars is None and r.delivered <= 0:
            tokens = served = None  # nothing known of what it used: the charge at dispatch stands
        else:
            tokens, served = self._actual(r, usage, output_text_chars, True)  # (spend: this attempt's)
        if served is not None:
            self.queues[r.flow.pool].settle(r, served)
        if r.est is not None and usage is not None and (type(usage) is dict or isinstance(usage, Mapping)):
            try:
                self.estimator.observe(r.est, usage, r.flow)
            except Exception:  # a bad usage report must not fail a served request
                log.exception("sfq: calibrating from the usage of a request of flow %r failed; ignored", r.flow)
        done = self._completed
        if done is None:
            self._attempt_over(r, actual_tokens=tokens, served_cost=served)
            self._end(r, "completed")
            return
        # _attempt_over then _end, with the metrics' two calls in one (metrics.completed)
        self.queues[r.flow.pool].finish(r, tokens)
        r.charged_total += r.charged
        if self.on_attempt_over is not None:
            self.on_attempt_over(r, tokens)
        flow = r.flow
        done(flow if len(flow) == 3 else flow[:3], served, r.charged)
        self._end(r, "completed", None, True)  # (counted)

    def usage_cost(self, usage: Mapping[str, Any] | None) -> tuple[float | None, float | None]:
        """``(tokens, cost units)`` of an OpenAI ``usage`` report as it stands (``None`` when
        absent or bad), unclamped: for reports; the engine charges :meth:`_actual`."""
        if not isinstance(usage, Mapping):
            return None, None
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                   for x in (p, c)):
            return None, None
        cs = self.policy.cost
        pc = float(p)  # type: ignore[arg-type]
        if cs.cached_input_weight != 1.0:
            pc = self.estimator.charged_prompt(pc, min(float(cached_tokens_of(usage)), pc))
        return pc + float(c), cs.input_weight * pc + cs.output_weight * float(c)  # type: ignore[arg-type]

    def ended_error(self, r: Request) -> Exception:
        """The error a driver raises for ``r``, which the engine ended before (or between) its
        attempts: one table for every driver (``NoHealthyBackend`` for ``unavailable``,
        ``DeadlineExceeded`` for a deadline that ran out between retries, else ``Refused``)."""
        reason = r.reason or "closed"
        if reason == "unavailable":
            t = self.queues[r.flow.pool].unavailable_timeout
            down = NoHealthyBackend(f"no backend of pool {r.flow.pool!r} was healthy for {t:g} s while this request "
                                    "waited" if 0 < t < math.inf else f"no backend of pool {r.flow.pool!r} is in rotation")
            down.retry_after = self.unavailable_retry_after
            return down
        if reason == "deadline" and r.tries:
            return DeadlineExceeded("the request's deadline ran out while it waited to be retried")
        if reason in ("queue_timeout", "deadline"):
            what = "deadline" if reason == "deadline" else "queue age"
            if reason == "queue_timeout" and r.max_wait < math.inf:
                c = self.policy.classes.get(r.flow.cls)
                age = None if c is None else c.max_queue_age_seconds
                if age is None or r.max_wait <= age:
                    what = f"max_wait ({r.max_wait:g} s)"
            return Refused(reason, f"the request's {what} ran out before it started")
        if reason == "queue_full":
            q = self.queues[r.flow.pool]
            return Refused("queue_full", f"the request's waiting place went to another org's request: class "
                                         f"{r.flow.cls!r} was full in pool {r.flow.pool!r} (max_queue_length) and "
                                         f"org {r.flow.org!r} held the most places",
                           retry_after=q.place_frees_in(r.flow.cls))
        if reason in ("unauthenticated", "class_not_allowed"):
            return Refused(reason, f"the policy was reloaded and no longer allows flow "
                                   f"{r.flow.org}/{r.flow.cls}/{r.flow.pool}")
        if reason == "closed":
            return DispatcherClosed("the dispatcher closed while this request waited to be retried" if r.tries
                                    else "the dispatcher closed before this request started")
        return Refused(reason, f"the request ended ({reason}) before it started")

    # ------------------------------------------------------------ backends
    def _queue(self, pool: str) -> PolicyQueue:
        q = self.queues.get(pool)
        if q is None:
            raise ValueError(f"unknown pool {pool!r}; pools: {', '.join(self.queues)}")
        return q

    def _backend(self, pool: str, name: str) -> PolicyQueue:
        q = self._queue(pool)
        if name not in q.backends:
            raise ValueError(f"unknown backend {name!r} of pool {pool!r}; its backends: {', '.join(q.backends)}")
        return q

    def backend_up(self, pool: str, name: str) -> None:
        """Backend ``name`` of ``pool`` is in rotation (its health check passed)."""
        self._backend(pool, name).set_healthy(name, True)

    def backend_down(self, pool: str, name: str, reason: str | None = None) -> None:
        """Backend ``name`` of ``pool`` left the rotation (``reason``: for the log). When it was
        the pool's last, the pool is unavailable: new requests are refused at once
        (``NoHealthyBackend``) and waiting ones end at the next :meth:`poll` (``unavailable``)."""
        q = self._backend(pool, name)
        if q.backends[name].healthy:
            log.warning("sfq: backend %r of pool %r left the rotation%s", name, pool, f" ({reason})" if reason else "")
        q.set_healthy(name, False)

    def backend_saturated(self, pool: str, name: str, saturated: bool = True) -> None:
        """Backend ``name`` is in rotation but full by its own report (a saturation probe): it
        takes nothing new until it says otherwise; the pool stays available."""
        self._backend(pool, name).set_saturated(name, saturated)

    def backend_paused(self, pool: str, name: str, seconds: float) -> float:
        """An upstream 429: send nothing to backend ``name`` for ``seconds`` (its
        ``Retry-After``), capped at :attr:`max_pause`; returns the pause applied."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        s = min(float(seconds), self.max_pause)
        self._backend(pool, name).pause_backend(name, s)
        return s

    def candidates(self, r: Request) -> list[str]:
        """The backends of ``r``'s pool that could take ``r`` now (in rotation, not saturated,
        not paused, big enough), the one its last attempt failed on (``r.avoid``) last; slots
        are not looked at (a shared state counts them over every gateway)."""
        q = self._queue(r.flow.pool)
        now = self.clock()
        names = [b.name for b in q.backends.values()
                 if b.healthy and not b.saturated and b.paused_until <= now
                 and (b.max_context is None or r.need <= b.max_context)]
        if r.avoid in names and len(names) > 1:
            names.remove(r.avoid)
            names.append(r.avoid)
        return names

    def pool_available(self, pool: str) -> bool:
        """Whether some backend of ``pool`` is in rotation."""
        return self._queue(pool).available

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
        self._spent_delivered(r)
        now = self.clock()
        is429 = isinstance(error, BackendHTTPError) and error.status == 429
        ra = retry_after_of(error)
        if ra is not None and ra > self.max_pause:
            ra = self.max_pause
        timeout = deadline_hit or isinstance(error, BackendTimeout)
        self._attempt_over(r, retry_after=ra if is429 else None, upstream_429=is429, timeout=timeout,
                           served_cost=self._passed_cost(r))
        if r.retrying:
            r.retrying = False
            self.retry.retry_ended(r.flow[:3])
        if deadline_hit:
            decision = RetryDecision(False, 0.0, "deadline")
        else:
            decision = self.retry.plan(r.flow[:3], r.tries, now,
                                       safe=retryable and retry_safe(error, r.idempotency_key),
                                       deadline=r.deadline, retry_after=ra)
        if decision.retry:
            r.state = BACKOFF
            r.retrying = True
            r.avoid = r.backend
            decision = decision._replace(avoid=r.backend)
        else:
            self._end(r, "failed", "deadline" if deadline_hit else None)
        return decision

    def requeue(self, r: Request) -> None:
        """Put a request waiting out its backoff back into its own flow's queue (its place is
        taken anew: a retry does not jump the queue). Ends it as failed (``deadline``) when
        its deadline has passed meanwhile (reason ``deadline``), when a reload took its flow
        away (``unauthenticated``: its org is gone; ``class_not_allowed``), or when its class
        is at its ``max_queue_length`` and its org holds the most places (``queue_full``; when
        another org holds the most, that org's newest request gives its place up, as for an
        arrival)."""
        if r.state != BACKOFF:
            raise ValueError(f"requeue({r!r}): the request is not waiting for a retry")
        if r.deadline is not None and r.deadline <= self.clock():
            self._end(r, "failed", "deadline")
            return
        org = self.policy.org(r.flow.org)
        if org is None or r.flow.cls not in org.classes:  # a reload took its flow away meanwhile
            self._end(r, "failed", "unauthenticated" if org is None else "class_not_allowed")
            return
        q = self.queues[r.flow.pool]
        if not q.available and q.unavailable_timeout <= 0:
            self._end(r, "failed", "unavailable")
            return
        try:  # its class's max_queue_length binds a retry as it binds an arrival (make_room)
            victim = q.make_room(r.flow)
        except Refused:  # the class is full and its own org holds the most places
            self._end(r, "failed", "queue_full")
            return
        if victim is not None:
            self.evict(victim)
        q.push(r)
        self.metrics.queued(r.flow[:3])

    def cancel(self, r: Request, *, work_tokens: float | None = None) -> None:
        """The caller gave up. Waiting (or between retries): removed, uncharged, outcome
        ``cancelled_before_start`` if it never started; running: its slots are freed, outcome
        ``cancelled_during_execution`` (``work_tokens``: tokens the backend produced for it,
        where measurable). A request that already ended is left as it is."""
        if r.outcome is not None:
            return
        if r.state == WAITING:
            self.queues[r.flow.pool].cancel(r)
            self.metrics.left_queue(r.flow[:3])
        elif r.state == RUNNING:
            self._spent_delivered(r)
            self._attempt_over(r, served_cost=self._passed_cost(r))
            if work_tokens:
                self.metrics.cancelled_work_tokens(r.flow[:3], work_tokens)
        self._end(r, "cancelled_before_start" if r.tries == 0 else "cancelled_during_execution")

    def evict(self, r: Request) -> None:
        """The waiting request ``r`` gives its place up to another org's request (its class was
        full and its org held the most places, here or, with a shared state, over every
        gateway): it ends as refused (``queue_full``; failed when it is a retry, as a drop
        does), uncharged, and is handed to the driver with the next :meth:`poll`'s
        :attr:`dropped`."""
        self.queues[r.flow.pool].evict(r)
        self.metrics.left_queue(r.flow[:3])
        self._end(r, "refused" if r.tries == 0 else "failed", "queue_full")
        self._evicted.append(r)

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
            key = r.flow[:3]
            self.metrics.left_queue(key)
            if reason in ("queue_timeout", "deadline"):
                self.metrics.timeout(key)
        self._end(r, outcome, reason)

    def close(self) -> list[Request]:
        """End every waiting request (and every one between retries) as refused (``closed``);
        returns them. Running ones are left to end normally."""
        out = []
        for r in list(self.live.values()):
            if r.state == WAITING:
                self.queues[r.flow.pool].cancel(r)
                self.metrics.left_queue(r.flow[:3])
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
        self.spend.policy = policy  # (budgets may change; the spend so far carries over)
        new = PolicyEngine(policy, clock=self.clock, scheduler=self._scheduler, metrics=self.metrics,
                           estimator=self.estimator, max_pause=self.max_pause, spend=self.spend)
        new.unavailable_retry_after = self.unavailable_retry_after
        new.retry = self.retry
        new.on_attempt_over, new.on_end = self.on_attempt_over, self.on_end
        new.defer_start = self.defer_start
        new.decider = self.decider
        new.retry.spec = policy.retry
        new.submitted = self.submitted
        for org, b in self.org_rate.items():
            nb = new.org_rate.get(org)
            if nb is not None and nb.capacity == b.capacity:
                new.org_rate[org] = b
        for name, q in self.queues.items():
            nq = new.queues[name]
            for attr in ("rpm", "tpm"):  # (a bucket or None: not ``b``, the org buckets' TokenBucket above)
                ob, nqb = getattr(q, attr), getattr(nq, attr)
                if ob is not None and nqb is not None and ob.capacity == nqb.capacity:
                    setattr(nq, attr, ob)
            for bname, be in q.backends.items():
                nbe = nq.backends[bname]
                nbe.healthy, nbe.saturated, nbe.paused_until = be.healthy, be.saturated, be.paused_until
            nq.down_since = q.down_since  # a pool with no backend in rotation stays so
            nq.on_charge = q.on_charge
            nq.refund_floors = not nq.nested and (q.refund_floors or q.nested)
            for cls, starts in q._starts.items():
                if cls in nq._starts:
                    nq._starts[cls] = starts
        ended: list[Request] = []
        for r in sorted(self.live.values(), key=lambda x: x.id):
            allowed = policy.allows(r.flow)
            if not allowed and len(r.flow) > 3 and policy.allows(r.flow.flat):
                r.flow, allowed = r.flow.flat, True  # its org no longer nests: the request is the org's
            if r.state == RUNNING:
                new.queues[r.flow.pool].adopt_running(r)
            elif r.state == WAITING and not allowed:
                key = r.flow[:3]
                r.state = ENDED
                new.metrics.left_queue(key)
                new._end(r, "refused" if r.tries == 0 else "failed",
                         "unauthenticated" if policy.org(r.flow.org) is None else "class_not_allowed")
                ended.append(r)
                continue
            elif r.state == WAITING:
                new.queues[r.flow.pool].push(r, queued_at=r.queued_at)
            new.live[r.id] = r
            if len(r.flow) > 3 and r.flow.user is not None:
                live = new.users.setdefault((r.flow.org, r.flow.team), {})
                live[r.flow.user] = live.get(r.flow.user, 0) + 1
        return new, ended

    # ------------------------------------------------------------ views
    def oldest_waiting(self) -> dict[tuple[str, str], float]:
        """``{(pool, org): clock time its oldest waiting request was queued}`` for every org with
        a request waiting (time proportional to the flows with a queue)."""
        out: dict[tuple[str, str], float] = {}
        for name, q in self.queues.items():
            for d in q.strict.values():
                for r in d:
                    if r.state == WAITING:
                        k = (name, r.flow.org)
                        if r.queued_at < out.get(k, _INF):
                            out[k] = r.queued_at
            for f, fq in q.flows.items():
                if fq.n:
                    t = fq.oldest_arrival()
                    k = (name, f.org)
                    if t < out.get(k, _INF):
                        out[k] = t
        return out

    def predicted_wait(self, org: str, cls: str, pool: str) -> float | None:
        """Seconds a new request of ``(org, cls, pool)`` arriving now is predicted to wait
        before it starts (:meth:`PolicyQueue.predicted_wait`: the model of
        ``deadline_unmeetable``), with its class's default deadline when it has one; ``None``
        when the pool has measured nothing yet, for a strict class, under nested shares, for a
        pool or class the policy does not have, and at a gateway of a fleet that is not the
        fleet's decider (:attr:`decider`: the decider's queue holds every gateway's requests)."""
        q = self.queues.get(pool) if self.decider is None else self.decider(pool)
        spec = self.policy.classes.get(cls)
        if q is None or spec is None:
            return None
        now = self.clock()
        drop_at = _INF
        if spec.deadline_seconds is not None:  # (as _class_deadline makes it)
            age = spec.max_queue_age_seconds
            deadline = now + spec.deadline_seconds
            drop_at = deadline if age is None or deadline <= now + age else now + age
        return q.predicted_wait(Flow(org, cls, pool), now, drop_at)

    def stats(self) -> dict[str, Any]:
        """A cheap snapshot: per flow (``"org/class/pool"``) counters, per pool and backend
        occupancy, limits in use, per class its service levels (``classes``). Time and memory
        grow with the number of flows and backends the policy file declares, never with the
        traffic."""
        now = self.clock()
        flows = {"/".join(k): v for k, v in self.metrics.snapshot().items() if all(k)}
        pools = {}
        for name, q in self.queues.items():
            pools[name] = {
                "waiting": len(q), "rate_waiting": q.n_parked, "in_flight": q.in_flight,
                "max_in_flight": q.slots.limit,
                "virtual_time": float(q.sched.virtual_time),
                "requests_bucket": None if q.rpm is None else q.rpm.available(now),
                "tokens_bucket": None if q.tpm is None else q.tpm.available(now),
                "backends": {b.name: {"in_flight": b.in_flight, "max_in_flight": b.limit, "healthy": b.healthy,
                                      "paused_for": max(0.0, b.paused_until - now)} for b in q.backends.values()},
            }
        limits = {f"{kind}:{name}": {"used": s.used, "limit": s.limit} for (kind, name), s in self.shared.slots.items()}
        refused = {"/".join(k): v for k, v in self.metrics.snapshot().items() if not all(k)}
        return {"flows": flows, "pools": pools, "limits": limits, "unclassified": refused,
                "submitted": self.submitted, "live": len(self.live), "classes": service_levels(self.policy)}
