"""Hypothesis: random arrivals, starts, completions, failures, cancellations, retries and clock
jumps through the PolicyEngine; after every step nothing is lost and every limit holds."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import sfq
from sfq.errors import BackendHTTPError, BackendUnavailable, Refused
from sfq.engine import PolicyEngine, Request
from sfq.policy import OUTCOMES, Flow, parse_policy
from sfq.engine import BACKOFF, RUNNING, WAITING

#: (tests/test_compiled_engine.py runs its random programs under this policy too)
POLICY_TEXT = """
pools:
  gpu:
    models: [m1]
    backends:
      - {url: "http://127.0.0.1:1", max_in_flight: 2}
      - {url: "http://127.0.0.1:2", max_in_flight: 3, max_context: 4000}
    limits: {max_in_flight: 4, requests_per_minute: 30, tokens_per_minute: 20000}
  api:
    models: [m2]
    backends:
      - {url: "http://127.0.0.1:3", max_in_flight: 2}
classes:
  system: {strict: true, max_in_flight: 1, max_queue_length: 3, max_queue_age_seconds: 20}
  interactive: {weight: 4, max_queue_length: 6, max_queue_age_seconds: 60, small_cost: 100, small_picks: 2}
  batch: {weight: 1, max_in_flight: 3, max_queue_length: 10}
orgs:
  a: {keys: [ka], classes: [batch, interactive], max_in_flight: 2, requests_per_minute: 4, on_limit: wait}
  b: {keys: [kb], classes: [interactive, system], weight: 2}
  c: {keys: [kc], classes: [batch, system], max_in_flight: 3, requests_per_minute: 20}
retry: {max_attempts: 3, budget_per_flow_percent: 20}
"""
POLICY = parse_policy(POLICY_TEXT)
FLOWS = [Flow(o, c, p) for o, c, p in POLICY.flows()]
TWINS = [sfq.ReferenceScheduler] + ([sfq.Scheduler] if sfq.CORE == "compiled" else [])


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def machine(make):  # one state machine per twin
    class PolicyMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.clock = Clock()
            self.e = PolicyEngine(POLICY, clock=self.clock, scheduler=make, rng=random.Random(0))
            self.all: list[Request] = []
            self.refused = 0

        # ---------------------------------------------------------- rules
        @rule(f=st.sampled_from(FLOWS), cost=st.sampled_from([1, 50, 99, 100, 101, 2000, 9000]),
              tokens=st.sampled_from([0, 10, 500, 25000]), need=st.sampled_from([0, 100, 3000, 6000]),
              deadline=st.one_of(st.none(), st.floats(0.0, 120.0)))
        def submit(self, f: Flow, cost: float, tokens: float, need: float, deadline: float | None) -> None:
            try:
                r = self.e.submit(f, cost=cost, tokens=tokens, need=need,
                                  deadline=None if deadline is None else self.clock.t + deadline)
            except Refused as exc:
                assert exc.reason in ("queue_full", "rate_limited", "deadline")
                if exc.reason in ("queue_full", "rate_limited"):
                    assert exc.retry_after is not None and exc.retry_after >= 0
                self.refused += 1
                return
            if r.ready_at > -math.inf:  # over org a's rate (on_limit: wait): parked until its token, in time
                assert f.org == "a" and r.state == WAITING and self.clock.t < r.ready_at < r.drop_at
            self.all.append(r)

        @rule()
        def poll(self) -> None:
            started = self.e.poll()
            now = self.clock.t
            for r in started:
                assert r.state == RUNNING and r.backend is not None and r.started_at == now
                assert r.drop_at > now  # never started past its queue age or deadline
            for r in self.e.dropped:  # ran out of time, or gave its place up to another org's (never started)
                assert (r.outcome in ("refused", "failed") and r.reason in ("queue_timeout", "deadline")
                        or r.reason == "queue_full" and r.outcome == ("refused" if r.tries == 0 else "failed"))
            # nothing waiting is past its time after a poll, nor parked past its token's refill
            for r in self.e.live.values():
                if r.state == WAITING:
                    assert r.drop_at > now and (r.ready_at == -math.inf or r.ready_at > now)

        def _pick(self, data: st.DataObject, state: str) -> Request | None:
            rs = [r for r in self.e.live.values() if r.state == state]
            return data.draw(st.sampled_from(rs)) if rs else None

        @rule(data=st.data(), usage=st.booleans())
        def complete(self, data: st.DataObject, usage: bool) -> None:
            r = self._pick(data, RUNNING)
            if r is not None:
                self.e.complete(r, {"prompt_tokens": 10, "completion_tokens": 20} if usage else None)
                assert r.outcome == "completed"

        @rule(data=st.data(), kind=st.sampled_from(["429", "503", "500", "refused"]))
        def fail(self, data: st.DataObject, kind: str) -> None:
            r = self._pick(data, RUNNING)
            if r is None:
                return
            if kind == "refused":
                err: Exception = BackendUnavailable("cannot connect", never_sent=True)
            else:
                err = BackendHTTPError(kind, status=int(kind), retry_after=1.0 if kind == "429" else None)
            d = self.e.fail(r, err)
            if d.retry:
                assert r.state == BACKOFF and r.tries < POLICY.retry.max_attempts and d.avoid == r.backend
                assert r.deadline is None or self.clock.t + d.delay < r.deadline
            else:
                assert r.outcome == "failed"

        @rule(data=st.data())
        def requeue(self, data: st.DataObject) -> None:
            r = self._pick(data, BACKOFF)
            if r is not None:
                self.e.requeue(r)
                assert r.state == WAITING or r.outcome == "failed"

        @rule(data=st.data(), state=st.sampled_from([WAITING, RUNNING, BACKOFF]))
        def cancel(self, data: st.DataObject, state: str) -> None:
            r = self._pick(data, state)
            if r is not None:
                self.e.cancel(r)
                assert r.outcome in ("cancelled_before_start", "cancelled_during_execution")

        @rule(dt=st.sampled_from([0.0, 0.01, 0.5, 2.0, 7.0, 30.0, 61.0, 3600.0]))
        def advance(self, dt: float) -> None:
            self.clock.t += dt

        # ---------------------------------------------------------- invariants
        @invariant()
        def nothing_lost(self) -> None:
            e = self.e
            ended = [r for r in self.all if r.outcome is not None]
            live = [r for r in self.all if r.outcome is None]
            assert {r.id for r in live} == set(e.live)
            for r in ended:
                assert r.outcome in OUTCOMES and r.state == "ended"
            for r in live:
                assert r.state in (WAITING, RUNNING, BACKOFF)
            counts = Counter()
            for fc in e.metrics.flows.values():
                counts.update(fc.outcomes)
            assert sum(counts.values()) + len(e.live) == e.submitted == len(self.all) + self.refused
            waiting = Counter(r.flow for r in live if r.state == WAITING)
            running = Counter(r.flow for r in live if r.state == RUNNING)
            for f in FLOWS:
                fc = e.metrics.flows.get(tuple(f))  # (a flow that has sent nothing has no counters)
                counted = (fc.waiting, fc.in_flight) if fc is not None else (0, 0)
                assert counted == (waiting[f], running[f])
                assert e.queues[f.pool].waiting(f) == waiting[f]

        @invariant()
        def limits_hold(self) -> None:
            e = self.e
            running = [r for r in e.live.values() if r.state == RUNNING]
            for name, q in e.queues.items():
                mine = [r for r in running if r.flow.pool == name]
                assert q.in_flight == len(mine)
                if q.slots.limit is not None:
                    assert q.in_flight <= q.slots.limit
                per_backend = Counter(r.backend for r in mine)
                for b in q.backends.values():
                    assert b.in_flight == per_backend[b.name] <= b.limit
                    if b.max_context is not None:
                        assert all(r.need <= b.max_context for r in mine if r.backend == b.name)
                assert q.sched.in_flight == q.in_flight
                if q.rpm is not None:
                    assert q.rpm.level >= -1e-9  # never more starts than the bucket allows
                # one entry per weighted flow with waiting requests
                assert len(q.sched) == sum(1 for fq in q.flows.values() if fq.n)
                for f, fq in q.flows.items():
                    if e.shared.room(f) is False:
                        assert q.sched.suspended(f)
            by_org = Counter(r.flow.org for r in running)
            by_cls = Counter(r.flow.cls for r in running)
            for o in POLICY.orgs.values():
                if o.max_in_flight is not None:
                    assert by_org[o.name] <= o.max_in_flight
            for c in POLICY.classes.values():
                if c.max_in_flight is not None:
                    assert by_cls[c.name] <= c.max_in_flight
            for (kind, name), s in e.shared.slots.items():
                assert s.used == (by_org if kind == "org" else by_cls)[name]
            # queue lengths: new requests never push a class past its limit (retries of accepted
            # requests go back to their flow even when it is full)
            for name, q in e.queues.items():
                for c in POLICY.classes.values():
                    first = sum(1 for r in e.live.values()
                                if r.state == WAITING and r.flow.pool == name and r.flow.cls == c.name and r.tries == 0)
                    if c.max_queue_length is not None:
                        assert first <= c.max_queue_length

    return PolicyMachine


@pytest.mark.parametrize("make", TWINS, ids=lambda m: m.__name__)
def test_random_operations_keep_every_promise(make) -> None:
    if not all(hasattr(make(), op) for op in ("suspend", "peek", "adjust", "work_started")):
        pytest.skip("this twin has no suspend/peek/adjust yet")
    m = machine(make)
    m.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
    m.TestCase().runTest()


def _event(e: PolicyEngine, clock: Clock, op: str, x: int, running: list[Request],
           accepted: list[Request]) -> None:
    """One event of a random sequence other than a submit or a poll: a running request
    completes or fails (retried when the engine says so), a waiting one is cancelled, or the
    clock moves."""
    if op == "complete" and running:
        r = running.pop(x % len(running))
        e.complete(r, {"prompt_tokens": x % 900, "completion_tokens": x % 1300} if x % 3 else None)
    elif op == "fail" and running:
        r = running.pop(x % len(running))
        if e.fail(r, BackendHTTPError("busy", status=503)).retry:
            e.requeue(r)
    elif op == "cancel":
        live = [r for r in accepted if r.outcome is None and r.state == WAITING]
        if live:
            e.cancel(live[x % len(live)])
    elif op == "advance":
        clock.t += [0.0, 0.5, 30.0, 7200.0][x % 4]


@pytest.mark.skipif(sfq.CORE != "compiled", reason="needs the compiled core next to the twin")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["submit", "poll", "complete", "fail", "cancel", "advance"]),
                              st.integers(0, 10_000)), max_size=120))
def test_both_twins_start_the_same_requests_in_the_same_order(ops: list[tuple[str, int]]) -> None:
    runs = []
    for make in (sfq.Scheduler, sfq.ReferenceScheduler):
        clock = Clock()
        e = PolicyEngine(POLICY, clock=clock, scheduler=make, rng=random.Random(0))
        index: dict[int, int] = {}  # request id -> submission number
        log: list[tuple[str, int]] = []
        running: list[Request] = []
        waiting: list[Request] = []
        n = 0
        for op, x in ops:
            if op == "submit":
                f = FLOWS[x % len(FLOWS)]
                try:
                    r = e.submit(f, cost=[1, 60, 150, 3000][x % 4], tokens=x % 700)
                except Refused as exc:
                    log.append(("refused:" + exc.reason, n))
                else:
                    index[r.id] = n
                    waiting.append(r)
                n += 1
            elif op == "poll":
                for r in e.poll():
                    log.append(("start:" + str(r.backend), index[r.id]))
                    running.append(r)
            else:
                _event(e, clock, op, x, running, waiting)
        runs.append(log)
    assert runs[0] == runs[1]


#: a policy where the uncontended path is taken most (no org or class max_in_flight), with
#: what still changes a start: weights, template orgs, a small-cost class, queue ages (one of
#: a quarter second), deadlines, the pool's request and token buckets, backends of unequal size and context
_OPEN = """
pools:
  gpu:
    models: [m1]
    backends:
      - {url: "http://127.0.0.1:1", max_in_flight: 1}
      - {url: "http://127.0.0.1:2", max_in_flight: 2, max_context: 4000}
    limits: {requests_per_minute: 40, tokens_per_minute: 30000}
  api:
    models: [m2]
    backends:
      - {url: "http://127.0.0.1:3", max_in_flight: 2}
classes:
  interactive: {weight: 4, max_queue_length: 6, max_queue_age_seconds: 60, small_cost: 100, small_picks: 2}
  batch: {weight: 1, max_queue_length: 10}
  instant: {weight: 2, max_queue_age_seconds: 0.25}
org_template: {classes: [batch, interactive]}
orgs:
  a: {keys: [ka], classes: [batch, interactive, instant], weight: 3}
  b: {keys: [kb], classes: [interactive, batch]}
retry: {max_attempts: 3, budget_per_flow_percent: 20}
"""
OPEN_POLICY = parse_policy(_OPEN)
OPEN_SEED_POLICY = parse_policy(_OPEN + "cost: {charge: seed}\n")
OPEN_FLOWS = [Flow(o, c, p) for o, c, p in OPEN_POLICY.flows()] + [
    Flow(o, c, p) for o in ("t1", "t2") for c in ("batch", "interactive") for p in ("gpu", "api")]
#: few flows of one pool, so that one flow's requests meet (its small-pick run, its refund floor)
NARROW_FLOWS = [Flow("a", "interactive", "gpu"), Flow("b", "interactive", "gpu"), Flow("t1", "interactive", "gpu")]
_BODIES = [{"model": "m", "prompt": "x" * n, "max_tokens": m} for n in (10, 400, 3000) for m in (5, 60, 900)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["submit", "submit", "complete", "fail", "cancel", "advance"]),
                              st.integers(0, 10_000)), max_size=120),
       which=st.sampled_from(["limits", "open", "open-seed", "narrow"]))
def test_starting_at_submit_decides_what_the_next_poll_would(ops: list[tuple[str, int]], which: str) -> None:
    """``submit(start=True)`` (the drivers' fast path: an uncontended request starts without a
    poll, ``PolicyQueue.start_alone``) and no poll after a request joins a full pool
    (``may_start``), against ``submit`` then ``poll`` after every event: the same requests
    start, in the same order, on the same backends, at the same meters and virtual times, and
    the same are dropped; every meter agrees at the end. Fixed costs and estimates (plain and
    streamed, corrected from usage reports), under both a policy of limits and one without."""
    policy = {"limits": POLICY, "open": OPEN_POLICY, "open-seed": OPEN_SEED_POLICY, "narrow": OPEN_POLICY}[which]
    flows = FLOWS if which == "limits" else NARROW_FLOWS if which == "narrow" else OPEN_FLOWS
    runs = []
    for at_once in (False, True):
        clock = Clock()
        e = PolicyEngine(policy, clock=clock, rng=random.Random(0))
        index: dict[int, int] = {}  # request id -> submission number
        log: list[tuple[str, int, float]] = []
        running: list[Request] = []
        accepted: list[Request] = []
        n = 0

        def started(r: Request) -> None:
            q = e.queues[r.flow.pool]
            log.append(("start:" + str(r.backend), index[r.id], q.meter(r.flow) if r.in_core else -1.0))
            log.append(("v", index[r.id], q.sched.virtual_time))
            running.append(r)

        for op, x in ops:
            pump = True
            if op == "submit":
                f = flows[x % len(flows)]
                try:
                    if x % 5 < 2:  # an estimate from a body (plain or streamed), corrected as it completes
                        body = _BODIES[x % len(_BODIES)]
                        r = e.submit(f, estimate=e.estimator.estimate(body, f), streaming=x % 5 == 1, start=at_once)
                    else:
                        r = e.submit(f, cost=[1, 60, 150, 3000][x % 4], tokens=x % 700,
                                     need=[0, 3000, 6000][x % 3], start=at_once)
                except Refused as exc:
                    log.append(("refused:" + exc.reason, n, 0.0))
                else:
                    index[r.id] = n
                    accepted.append(r)
                    if r.state == RUNNING:
                        assert at_once
                        started(r)
                    # the driver skips the poll while the pool is full (a freed slot polls again)
                    pump = not at_once or r.state == RUNNING or e.may_start(f.pool)
                n += 1
            else:
                _event(e, clock, op, x, running, accepted)
            if not pump:
                continue
            for r in e.poll():  # the driver's pump after every event
                started(r)
            log.extend(("dropped:" + str(d.reason), index[d.id], 0.0) for d in e.dropped)
        for name, q in e.queues.items():
            log.extend(("meter:" + name + str(tuple(f)), 0, q.meter(f)) for f in flows if f.pool == name)
            log.append(("v:" + name, 0, q.sched.virtual_time))
        runs.append(log)
    assert runs[0] == runs[1]
    assert any(s.startswith("start") for s, _, _ in runs[0]) or not any(op == "submit" for op, _ in ops)


def _twins_of_start(steps: Any) -> list[list[tuple[str, int, float]]]:
    """``steps(e, submit, complete)`` run on two engines of ``OPEN_POLICY``: one submits with
    ``start=True`` (``PolicyQueue.start_alone``), the other queues and polls after each event.
    Returns each one's log of starts (backend, submission, meter) and final meters."""
    logs = []
    for at_once in (False, True):
        e = PolicyEngine(OPEN_POLICY, clock=Clock(), rng=random.Random(0))
        log: list[tuple[str, int, float]] = []
        reqs: list[Request] = []

        def note(started: list[Request]) -> None:
            for r in started:
                log.append(("start:" + str(r.backend), reqs.index(r), e.queues[r.flow.pool].meter(r.flow)))

        def submit(f: Flow, **kw: Any) -> Request:
            r = e.submit(f, start=at_once, **kw)
            reqs.append(r)
            note([r] if r.state == RUNNING else [])
            note(e.poll())
            return r

        def complete(i: int, usage: dict[str, int] | None = None) -> None:
            e.complete(reqs[i], usage)
            note(e.poll())

        steps(e, submit, complete)
        log.extend(("meter" + str(tuple(f)), 0, e.queues[f.pool].meter(f)) for f in OPEN_FLOWS)
        logs.append(log)
    return logs


def test_an_uncontended_start_keeps_the_flows_small_pick_run() -> None:
    """Three small requests of a named org's flow start at once, one by one; the run of small
    picks they make outlives the flow's queue, so when a large and a small request of the flow
    then wait, the large one goes first (``small_picks: 2``), as the queue-and-poll path says."""
    f = Flow("a", "interactive", "gpu")

    def steps(e: PolicyEngine, submit: Any, complete: Any) -> None:
        for _ in range(3):
            assert submit(f, cost=60).state == RUNNING  # (three slots: each starts at once)
        submit(f, cost=3000)
        submit(f, cost=60)
        complete(0)

    plain, at_once = _twins_of_start(steps)
    assert plain == at_once
    assert [i for s, i, _ in plain if s.startswith("start")] == [0, 1, 2, 3]  # the large one (3) first


def test_an_uncontended_start_keeps_the_refund_floor_of_its_flow() -> None:
    """A flow alone dispatched on a guessed estimate while its earlier work runs sets a refund
    floor; a fixed-cost request of the flow that starts at once joins that floor rather than
    setting its own, so the guessed request's refund is not held back (pop's rule)."""
    f = Flow("a", "batch", "gpu")
    body = {"model": "m1", "prompt": "x" * 400, "max_tokens": 900}

    def steps(e: PolicyEngine, submit: Any, complete: Any) -> None:
        submit(f, estimate=e.estimator.estimate(body, f))
        submit(f, estimate=e.estimator.estimate(body, f))  # alone, above v, on the prior: a floor
        submit(f, cost=60)
        complete(0, {"prompt_tokens": 100, "completion_tokens": 3})
        complete(1, {"prompt_tokens": 100, "completion_tokens": 3})

    plain, at_once = _twins_of_start(steps)
    assert plain == at_once


@pytest.mark.parametrize("make", TWINS)
def test_a_retry_keeps_its_class_queue_bound(make) -> None:
    """A retry put back after its backoff is bound by its class's ``max_queue_length`` as an
    arrival is (found by the state machine above): its own org holding the most places, it
    ends as failed (``queue_full``); a retry that waits and gives its place up to another
    org's arrival ends as failed too (it started once), never as refused."""
    api = lambda org: Flow(org, "system", "api")  # noqa: E731  (strict: max_queue_length 3)

    def retry_behind(others: int) -> tuple[PolicyEngine, Request]:
        """Org b's request fails with a 429 (a retry), then ``others`` more of b's arrive."""
        e = PolicyEngine(POLICY, clock=Clock(), scheduler=make, rng=random.Random(0))
        r = e.submit(api("b"), cost=1)
        e.poll()
        assert e.fail(r, BackendHTTPError("429", status=429, retry_after=1.0)).retry
        for _ in range(others):
            e.submit(api("b"), cost=1)
        return e, r

    e, r = retry_behind(3)
    e.requeue(r)
    assert (r.outcome, r.reason) == ("failed", "queue_full")
    assert e.queues["api"].waiting_by_class["system"] == 3

    e, r = retry_behind(2)
    e.requeue(r)  # room: it waits again, the newest of org b
    assert r.state == WAITING
    e.submit(api("c"), cost=1)  # the class is full and b holds the most: b's newest gives way
    assert (r.outcome, r.reason) == ("failed", "queue_full")
    assert e.queues["api"].waiting_by_class["system"] == 3
    e.poll()
    assert r in e.dropped  # handed to the driver as any eviction is
