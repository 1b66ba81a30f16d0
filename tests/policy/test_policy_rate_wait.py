"""Rate limits that wait (issue 42, part 3), in the engine on an injected clock, every rule on
both twins (``core``).

An org over its ``requests_per_minute`` whose ``on_limit`` is ``wait`` takes its token ahead
(the bucket goes into debt) and is *parked* until that token's refill when the refill comes
before the request's deadline (or queue age, or ``max_wait``): accepted, counted as waiting,
but in no flow and not in the core, so it holds no slot and delays no other org; at the refill
it joins its flow, in its flow's order. Otherwise it is refused (``rate_limited``) with a
``retry_after`` that is the real refill: checked here by moving the clock by it and by 90 % of
it. ``on_limit: refuse`` (the default) is today's refusal at once. Nothing here measures time:
the clock is the test's.
"""

from __future__ import annotations

import pytest
from policy_helpers import Clock, policy

from sfq.engine import PolicyEngine, Request
from sfq.engine.pool import RUNNING, WAITING
from sfq.errors import Refused
from sfq.policy import Flow
from sfq.policy.config import DEFAULT_ON_LIMIT

A, A2, B = Flow("a", "batch", "p"), Flow("a", "interactive", "p"), Flow("b", "batch", "p")
POOL = """
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 3}]
"""
CLASSES = """
  batch: {weight: 1}
  interactive: {weight: 1}
"""
#: org a: 2 requests a minute (a bucket of 2, a token every 30 s), waiting for its tokens
WAITING_ORGS = """
  a: {keys: [ka], classes: [batch, interactive], requests_per_minute: 2, on_limit: wait}
  b: {keys: [kb], classes: [batch]}
"""
REFILL = 30.0


def engine(core, clock: Clock, orgs: str = WAITING_ORGS, classes: str = CLASSES, pools: str = POOL,
           extra: str = "") -> PolicyEngine:
    return PolicyEngine(policy(pools=pools, classes=classes, orgs=orgs, extra=extra), clock=clock, scheduler=core)


def go(e: PolicyEngine, flow: Flow, deadline: float | None = None, **kw: object) -> Request:
    """Submit a request of ``flow`` and poll, as a driver does after every event."""
    r = e.submit(flow, cost=1.0, deadline=deadline, start=True, **kw)
    e.poll()
    return r


def spend_the_bucket(e: PolicyEngine, clock: Clock) -> list[Request]:
    """Org a's two tokens, taken by two requests that start at once."""
    rs = [go(e, A), go(e, A)]
    assert [r.state for r in rs] == [RUNNING, RUNNING]
    return rs


def test_over_the_rate_it_waits_out_of_the_competition_and_starts_at_the_refill(clock: Clock, core) -> None:
    e = engine(core, clock)
    t0 = clock.t
    running = spend_the_bucket(e, clock)
    r = go(e, A, deadline=t0 + 100)
    q = e.queues["p"]
    assert r.state == WAITING and r.outcome is None and r.ready_at == pytest.approx(t0 + REFILL)
    assert (q.n_parked, len(q), q.in_flight) == (1, 1, 2)  # counted as waiting, holding no slot
    assert e.wake_at() == pytest.approx(t0 + REFILL)
    # another org's request starts at once on the slot the parked one does not hold
    b = go(e, B)
    assert b.state == RUNNING
    e.complete(b)
    clock.advance(REFILL - 0.5)
    assert e.poll() == [] and r.state == WAITING
    b2 = go(e, B)  # still never delayed
    assert b2.state == RUNNING
    e.complete(b2)
    clock.advance(0.5)
    assert e.poll() == [r]
    assert r.started_at == pytest.approx(t0 + REFILL) and q.n_parked == 0
    assert e.stats()["pools"]["p"]["rate_waiting"] == 0
    for x in running + [r]:
        e.complete(x)
    assert e.live == {}


def test_parked_requests_join_their_flow_in_order_each_at_its_own_refill(clock: Clock, core) -> None:
    e = engine(core, clock, pools=POOL.replace("max_in_flight: 3", "max_in_flight: 4"))
    t0 = clock.t
    spend_the_bucket(e, clock)  # (they keep two slots)
    r1, r2, r3 = (go(e, A, deadline=t0 + 1000) for _ in range(3))
    assert [x.ready_at - t0 for x in (r1, r2, r3)] == pytest.approx([REFILL, 2 * REFILL, 3 * REFILL])
    assert e.stats()["pools"]["p"]["rate_waiting"] == 3
    started: list[Request] = []
    for k in (1, 2, 3):
        clock.t = t0 + k * REFILL - 10
        b = e.submit(B, cost=1.0)  # org b between the refills: the parked requests hold no slot
        assert e.poll() == [b]
        e.complete(b)
        clock.t = t0 + k * REFILL
        b = e.submit(B, cost=1.0)  # and at a refill both go
        now = e.poll()
        assert set(now) == {b, (r1, r2, r3)[k - 1]}
        started += [x for x in now if x.flow == A]
        for x in now:
            e.complete(x)
    assert started == [r1, r2, r3]
    assert [x.started_at for x in started] == pytest.approx([t0 + k * REFILL for k in (1, 2, 3)])


def test_a_parked_request_starts_in_its_flows_order_behind_those_already_waiting(clock: Clock, core) -> None:
    one_slot = POOL.replace("max_in_flight: 3", "max_in_flight: 1")
    e = engine(core, clock, pools=one_slot)
    t0 = clock.t
    first = go(e, A)  # runs
    queued = go(e, A, deadline=t0 + 500)  # waits for the slot, with a token (due as the next: EDF ties by order)
    parked = go(e, A, deadline=t0 + 500)
    assert (first.state, queued.state, parked.ready_at) == (RUNNING, WAITING, pytest.approx(t0 + REFILL))
    clock.t = t0 + REFILL + 1  # the refill came while the slot was still held
    assert e.poll() == []
    e.complete(first)
    assert e.poll() == [queued]  # the one that waited in the flow first
    e.complete(queued)
    assert e.poll() == [parked]


def test_the_deadline_before_the_refill_is_refused_with_the_real_refill(clock: Clock, core) -> None:
    e = engine(core, clock)
    t0 = clock.t
    spend_the_bucket(e, clock)
    clock.advance(12.0)  # 18 s to the next token
    with pytest.raises(Refused) as info:
        go(e, A, deadline=clock.t + 17.9)
    exc = info.value
    assert exc.reason == "rate_limited" and exc.http_status == 429 and "deadline" in str(exc)
    assert exc.retry_after == pytest.approx(18.0)
    # the Retry-After is the refill: 90 % of it is too early, all of it is on time
    assert exc.retry_after is not None
    at = clock.t
    clock.t = at + 0.9 * exc.retry_after  # a request retried then still waits (for the rest)
    r = go(e, A, deadline=at + 100)
    assert r.state == WAITING and r.ready_at == pytest.approx(at + exc.retry_after)
    clock.t = at + exc.retry_after
    assert e.poll() == [r] and clock.t == pytest.approx(t0 + REFILL)


def test_a_refusal_behind_parked_requests_names_their_refills_too(clock: Clock, core) -> None:
    e = engine(core, clock)
    t0 = clock.t
    spend_the_bucket(e, clock)
    parked = go(e, A, deadline=t0 + 40)  # the token of t0 + 30
    with pytest.raises(Refused) as info:
        go(e, A, deadline=t0 + 40)  # the next one comes at t0 + 60
    ra = info.value.retry_after
    assert ra == pytest.approx(2 * REFILL)
    assert ra is not None
    clock.t = t0 + REFILL
    assert e.poll() == [parked]
    e.complete(parked)
    clock.t = t0 + 0.9 * ra
    with pytest.raises(Refused):
        go(e, A, deadline=clock.t + 0.05 * ra)
    clock.t = t0 + ra
    assert go(e, A).state == RUNNING


@pytest.mark.parametrize("bound", ["max_wait", "queue_age"])
def test_the_queue_age_and_max_wait_bound_the_wait_as_the_deadline_does(clock: Clock, core, bound: str) -> None:
    classes = CLASSES.replace("batch: {weight: 1}", "batch: {weight: 1, max_queue_age_seconds: 20}") \
        if bound == "queue_age" else CLASSES
    e = engine(core, clock, classes=classes)
    spend_the_bucket(e, clock)
    kw = {"max_wait": 20.0} if bound == "max_wait" else {}
    with pytest.raises(Refused) as info:
        go(e, A, **kw)
    assert info.value.reason == "rate_limited" and info.value.retry_after == pytest.approx(REFILL)
    if bound == "max_wait":
        assert go(e, A, max_wait=31.0).ready_at == pytest.approx(clock.t + REFILL)
    else:  # a request of another class of the org, with no bound: it waits
        assert go(e, A2).ready_at == pytest.approx(clock.t + REFILL)


def test_on_limit_refuse_is_todays_429_at_once(clock: Clock, core) -> None:
    assert DEFAULT_ON_LIMIT == "refuse"
    for orgs in (WAITING_ORGS.replace("on_limit: wait", "on_limit: refuse"),
                 WAITING_ORGS.replace(", on_limit: wait", "")):  # the default
        e = engine(core, clock, orgs=orgs)
        spend_the_bucket(e, clock)
        with pytest.raises(Refused) as info:
            go(e, A, deadline=clock.t + 3600)
        assert info.value.reason == "rate_limited" and info.value.retry_after == pytest.approx(REFILL)
        assert "deadline" not in str(info.value)
        assert e.queues["p"].n_parked == 0 and len(e.queues["p"]) == 0


def test_the_orgs_on_limit_wins_over_the_class_and_the_template_has_its_own(clock: Clock, core) -> None:
    classes = """
      batch: {weight: 1, on_limit: wait}
      interactive: {weight: 1, on_limit: refuse}
    """
    orgs = """
      a: {keys: [ka], classes: [batch, interactive], requests_per_minute: 2, on_limit: refuse}
      c: {keys: [kc], classes: [batch, interactive], requests_per_minute: 2}
    """
    extra = "org_template: {classes: [batch, interactive], requests_per_minute: 2, on_limit: wait}\n"
    pol = policy(pools=POOL, classes=classes, orgs=orgs, extra=extra)
    assert not pol.waits_for_rate("a", "batch")  # the org's refuse, over the class's wait
    assert pol.waits_for_rate("c", "batch") and not pol.waits_for_rate("c", "interactive")  # the class's
    assert pol.waits_for_rate("t", "interactive")  # the template's wait, over the class's refuse
    e = PolicyEngine(pol, clock=clock, scheduler=core)
    for org, cls, waits in (("a", "batch", False), ("c", "batch", True), ("c", "interactive", False),
                            ("t", "interactive", True)):
        f = Flow(org, cls, "p")
        if org != "c" or cls == "batch":
            for _ in range(2):
                go(e, f)
        if waits:
            assert go(e, f).ready_at > clock.t
        else:
            with pytest.raises(Refused):
                go(e, f)


def test_a_parked_request_cancelled_or_dropped_ends_once_and_starts_nothing(clock: Clock, core) -> None:
    e = engine(core, clock)
    t0 = clock.t
    spend_the_bucket(e, clock)
    r1 = go(e, A, deadline=t0 + 500)
    r2 = go(e, A, deadline=t0 + 500)
    e.cancel(r1)
    assert r1.outcome == "cancelled_before_start" and e.queues["p"].n_parked == 1
    e.backend_down("p", "http://127.0.0.1:9")  # the pool's last backend: waiting ones end at the next poll
    assert e.poll() == [] and e.dropped == [r2] and r2.reason == "unavailable"
    assert e.queues["p"].n_parked == 0 and len(e.queues["p"]) == 0 and e.live.keys() == {x.id for x in e.live.values()}
    assert e.wake_at() is None


def test_parked_requests_hold_their_class_places_and_give_them_up_fairly(clock: Clock, core) -> None:
    classes = CLASSES.replace("batch: {weight: 1}", "batch: {weight: 1, max_queue_length: 2}")
    e = engine(core, clock, classes=classes, pools=POOL.replace("max_in_flight: 3", "max_in_flight: 2"))
    t0 = clock.t
    spend_the_bucket(e, clock)  # the two slots
    p1, p2 = go(e, A, deadline=t0 + 500), go(e, A, deadline=t0 + 500)
    assert e.queues["p"].waiting_by_class["batch"] == 2
    b = e.submit(B, cost=1.0)  # the class is full: org a holds both places, so its newest gives one up
    assert b.state == WAITING and e.poll() == [] and e.dropped == [p2] and p2.reason == "queue_full"
    assert p1.state == WAITING and e.queues["p"].n_parked == 1


def test_a_reload_keeps_a_parked_request_parked_until_its_token(clock: Clock, core) -> None:
    e = engine(core, clock)
    t0 = clock.t
    running = spend_the_bucket(e, clock)
    r = go(e, A, deadline=t0 + 500)
    heavier_b = WAITING_ORGS.replace("[batch]}", "[batch], weight: 2}")
    new, ended = e.reloaded(policy(pools=POOL, classes=CLASSES, orgs=heavier_b))
    assert ended == [] and new.queues["p"].n_parked == 1 and new.wake_at() == pytest.approx(t0 + REFILL)
    for x in running:
        new.complete(x)
    clock.t = t0 + REFILL - 1
    assert new.poll() == []
    clock.t = t0 + REFILL
    assert new.poll() == [r]


def test_ready_at_parks_a_request_a_shared_state_admitted_ahead(clock: Clock, core) -> None:
    e = engine(core, clock, orgs=WAITING_ORGS.replace(", requests_per_minute: 2, on_limit: wait", ""))
    t0 = clock.t
    r = e.submit(A, cost=1.0, start=True, ready_at=t0 + 5)
    assert r.state == WAITING and e.wake_at() == pytest.approx(t0 + 5)
    assert go(e, B).state == RUNNING
    clock.t = t0 + 5
    assert e.poll() == [r]
    assert go(e, A, ready_at=t0).state == RUNNING  # a time already past parks nothing
    for bad in (float("nan"), "soon", True):
        with pytest.raises(ValueError, match="ready_at"):
            e.submit(A, cost=1.0, ready_at=bad)


def test_budgets_keep_refusing_whatever_on_limit_says(clock: Clock, core) -> None:
    pools = POOL + "    prices: {input: 0, output: 1000000}\n"
    orgs = WAITING_ORGS.replace("on_limit: wait}", "on_limit: wait, budget: {amount: 0, per: day}}")
    e = engine(core, clock, orgs=orgs, pools=pools)
    body = {"model": "m", "prompt": "hi", "max_tokens": 5}
    with pytest.raises(Refused) as info:
        e.submit(A, estimate=e.estimator.estimate(body, A), deadline=clock.t + 3600)
    assert info.value.reason == "budget_exhausted"


def test_nested_orgs_wait_too(clock: Clock, core) -> None:
    orgs = """
      a:
        classes: [batch]
        requests_per_minute: 2
        on_limit: wait
        teams: {x: {keys: [kx]}, y: {keys: [ky]}}
      b: {keys: [kb], classes: [batch]}
    """
    e = PolicyEngine(policy(pools=POOL, classes="\n  batch: {weight: 1}\n", orgs=orgs), clock=clock, scheduler=core)
    t0 = clock.t
    x, y = Flow("a", "batch", "p", "x", None), Flow("a", "batch", "p", "y", None)
    assert [go(e, f).state for f in (x, y)] == [RUNNING, RUNNING]
    r = go(e, y, deadline=t0 + 100)
    assert r.ready_at == pytest.approx(t0 + REFILL)
    clock.t = t0 + REFILL
    assert e.poll() == [r]


def test_a_strict_class_waits_in_its_fifo_order(clock: Clock, core) -> None:
    classes = CLASSES + "  urgent: {strict: true, max_in_flight: 2, max_queue_length: 5, on_limit: wait}\n"
    orgs = """
      a: {keys: [ka], classes: [urgent, batch], requests_per_minute: 2}
      b: {keys: [kb], classes: [urgent]}
    """
    e = engine(core, clock, classes=classes, orgs=orgs)
    t0 = clock.t
    u, ub = Flow("a", "urgent", "p"), Flow("b", "urgent", "p")
    first = [go(e, u) for _ in range(2)]  # the tokens and the class's two slots
    parked = go(e, u, deadline=t0 + 100)
    assert parked.ready_at == pytest.approx(t0 + REFILL)
    queued_b = go(e, ub)  # org b's urgent request waits for a class slot, first in the FIFO
    for x in first:
        e.complete(x)
    assert e.poll() == [queued_b] and parked.state == WAITING  # the parked one holds no place in the FIFO
    clock.t = t0 + REFILL
    assert e.poll() == [parked]
    with pytest.raises(Refused):
        go(e, Flow("a", "batch", "p"))  # the batch class does not wait (no on_limit: refuse)
