"""Ordering and limits per pool, each rule on an injected clock (no sleeps)."""

from __future__ import annotations

import math
import types
from typing import Any
from collections import Counter

import pytest
from policy_helpers import Clock, policy

from sfq.errors import BackendHTTPError, Refused
from sfq.engine import PolicyEngine, Request
from sfq.engine.pool import PolicyQueue
from sfq.policy import Flow, Policy

ONE_SLOT = """
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 1}]
"""


def engine(pol: Policy, clock: Clock, core) -> PolicyEngine:
    return PolicyEngine(pol, clock=clock, scheduler=core)


def drain(e: PolicyEngine, n: int, clock: Clock | None = None, dt: float = 0.0) -> list[Request]:
    """Start and complete one request at a time, ``n`` times; returns them in start order."""
    out = []
    running: list[Request] = []
    while len(out) < n:
        started = e.poll()
        running += started
        out += started
        if not running:
            break
        if clock is not None:
            clock.advance(dt)
        e.complete(running.pop(0))
    return out[:n]


# ------------------------------------------------------------------ strict classes
STRICT = """
  system: {strict: true, max_in_flight: 2, max_queue_length: 10}
  interactive: {weight: 1}
"""


def test_strict_first_but_capped(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 6}]
    """, classes=STRICT, orgs="""
      a: {keys: [ka], classes: [interactive, system]}
    """)
    e = engine(pol, clock, core)
    inter = [e.submit(Flow("a", "interactive", "p"), cost=1) for _ in range(10)]
    sys_ = [e.submit(Flow("a", "system", "p"), cost=1) for _ in range(5)]
    started = e.poll()
    assert len(started) == 6
    assert sum(r.flow.cls == "system" for r in started) == 2  # never more than its max_in_flight
    assert started[:2] == sys_[:2]  # strict goes first
    assert [r for r in started if r.flow.cls == "interactive"] == inter[:4]
    e.complete(started[0])  # a system request ends: the next system one takes its place
    assert e.poll() == [sys_[2]]
    e.complete(started[3])  # an interactive one ends: strict still first, but at its cap
    assert e.poll() == [inter[4]]


def test_strict_org_at_its_limit_does_not_block_other_orgs(clock: Clock, core) -> None:
    pol = policy(classes=STRICT, orgs="""
      a: {keys: [ka], classes: [system], max_in_flight: 1}
      b: {keys: [kb], classes: [system]}
    """)
    e = engine(pol, clock, core)
    a1, a2 = (e.submit(Flow("a", "system", "p"), cost=1) for _ in range(2))
    b1 = e.submit(Flow("b", "system", "p"), cost=1)
    assert e.poll() == [a1, b1]  # a2 waits for a's slot; b1 passes it
    e.complete(b1)
    assert e.poll() == []
    e.complete(a1)
    assert e.poll() == [a2]


# ------------------------------------------------------------------ weighted sharing
def test_weighted_classes_share_by_cost(clock: Clock, core) -> None:
    pol = policy(pools=ONE_SLOT, classes="""
      interactive: {weight: 3}
      batch: {weight: 1}
    """, orgs="""
      a: {keys: [ka], classes: [batch]}
      b: {keys: [kb], classes: [interactive]}
    """)
    e = engine(pol, clock, core)
    for _ in range(400):
        e.submit(Flow("a", "batch", "p"), cost=10)
        e.submit(Flow("b", "interactive", "p"), cost=10)
    got = Counter(r.flow.org for r in drain(e, 400))
    assert abs(got["b"] - 300) <= 1 and abs(got["a"] - 100) <= 1
    # and by cost, not by count: b's requests cost 3x as much, so they now share 1:1
    e2 = engine(pol, clock, core)
    for _ in range(400):
        e2.submit(Flow("a", "batch", "p"), cost=10)
        e2.submit(Flow("b", "interactive", "p"), cost=30)
    got = Counter(r.flow.org for r in drain(e2, 400))
    assert abs(got["a"] - got["b"]) <= 2


def test_org_weight_multiplies_class_weight(clock: Clock, core) -> None:
    pol = policy(pools=ONE_SLOT, classes="""
      batch: {weight: 2}
    """, orgs="""
      a: {keys: [ka], classes: [batch], weight: 3}
      b: {keys: [kb], classes: [batch]}
    """)
    e = engine(pol, clock, core)
    for _ in range(200):
        e.submit(Flow("a", "batch", "p"), cost=1)
        e.submit(Flow("b", "batch", "p"), cost=1)
    got = Counter(r.flow.org for r in drain(e, 200))
    assert abs(got["a"] - 150) <= 1


# ------------------------------------------------------------------ concurrency limits
def test_org_limit_holds_the_org_not_the_others_and_banks_no_credit(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 3}]
    """, orgs="""
      a: {keys: [ka], classes: [batch], max_in_flight: 1}
      b: {keys: [kb], classes: [batch]}
    """)
    e = engine(pol, clock, core)
    fa, fb = Flow("a", "batch", "p"), Flow("b", "batch", "p")
    for _ in range(50):
        e.submit(fa, cost=1)
        e.submit(fb, cost=1)
    first = e.poll()
    assert Counter(r.flow.org for r in first) == {"a": 1, "b": 2}  # a at its limit does not block b
    q = e.queues["p"]
    a_run = next(r for r in first if r.flow.org == "a")
    b_runs = [r for r in first if r.flow.org == "b"]
    # a stays held while b is served 30 times
    for _ in range(30):
        e.complete(b_runs.pop(0))
        b_runs += e.poll()
        assert all(r.flow.org == "b" for r in b_runs)
        assert e.shared.slots[("org", "a")].used == 1
    assert q.sched.suspended(fa)
    e.complete(a_run)
    assert not q.sched.suspended(fa)
    # it rejoins at max(S, v): no credit for the time it was held
    assert q.sched.meter(fa) >= q.sched.virtual_time
    # so it gets its fair turn, not a burst of 30: the next starts alternate a, b at most 1:1 (a's limit 1)
    nxt = e.poll()
    assert [r.flow.org for r in nxt] == ["a"]


def test_weighted_class_limit(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 8}]
    """, classes="""
      batch: {weight: 1, max_in_flight: 3}
      interactive: {weight: 1}
    """, orgs="""
      a: {keys: [ka], classes: [batch]}
      b: {keys: [kb], classes: [batch, interactive]}
    """)
    e = engine(pol, clock, core)
    for _ in range(10):
        e.submit(Flow("a", "batch", "p"), cost=1)
        e.submit(Flow("b", "batch", "p"), cost=1)
        e.submit(Flow("b", "interactive", "p"), cost=1)
    started = e.poll()
    assert len(started) == 8
    assert sum(r.flow.cls == "batch" for r in started) == 3


def test_pool_and_backend_limits_and_placement(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends:
          - {url: "http://127.0.0.1:1", max_in_flight: 4}
          - {url: "http://127.0.0.1:2", max_in_flight: 2}
        limits: {max_in_flight: 5}
    """)
    e = engine(pol, clock, core)
    for _ in range(20):
        e.submit(Flow("a", "batch", "p"), cost=1)
    started = e.poll()
    assert len(started) == 5  # the pool's limit, below the backends' 6
    per = Counter(r.backend for r in started)
    assert per["http://127.0.0.1:1"] <= 4 and per["http://127.0.0.1:2"] <= 2
    assert set(per) == {"http://127.0.0.1:1", "http://127.0.0.1:2"}  # least loaded first


def test_max_context_placement(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends:
          - {url: "http://127.0.0.1:1", max_in_flight: 4, max_context: 1000}
          - {url: "http://127.0.0.1:2", max_in_flight: 4, max_context: 8000}
    """)
    e = engine(pol, clock, core)
    big = e.submit(Flow("a", "batch", "p"), cost=1, need=5000)
    assert e.poll()[0].backend == "http://127.0.0.1:2" and big.backend == "http://127.0.0.1:2"
    with pytest.raises(Refused, match="more than any backend") as info:
        e.submit(Flow("a", "batch", "p"), cost=1, need=9000)
    assert info.value.reason == "too_large"
    assert e.stats()["flows"]["a/batch/p"]["reasons"] == {"too_large": 1}


# ------------------------------------------------------------------ rate limits
def test_requests_per_minute_bucket(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 10}]
        limits: {requests_per_minute: 2}
    """)
    e = engine(pol, clock, core)
    rs = [e.submit(Flow("a", "batch", "p"), cost=1) for _ in range(4)]
    assert e.poll() == rs[:2]  # the bucket starts full
    assert e.poll() == []
    assert e.wake_at() == pytest.approx(clock.t + 30.0)  # one token per 30 s
    clock.advance(29.9)
    assert e.poll() == []
    clock.advance(0.1)
    assert e.poll() == [rs[2]]


def test_tokens_per_minute_bucket_corrected_from_usage(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 10}]
        limits: {tokens_per_minute: 1000}
    """)
    e = engine(pol, clock, core)
    rs = [e.submit(Flow("a", "batch", "p"), cost=1, tokens=600) for _ in range(3)]
    assert e.poll() == [rs[0]]  # 600 of 1000; the next needs 600
    e.complete(rs[0], {"prompt_tokens": 50, "completion_tokens": 50})  # used 100: 500 come back
    assert e.poll() == [rs[1]]
    assert e.poll() == []
    q = e.queues["p"]
    assert q.tpm is not None and q.tpm.available(clock.t) == pytest.approx(300)
    assert e.wake_at() == pytest.approx(clock.t + 300 / (1000 / 60))


def test_upstream_429_pauses_that_backend_only(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends:
          - {url: "http://127.0.0.1:1", max_in_flight: 1}
          - {url: "http://127.0.0.1:2", max_in_flight: 1}
    """, extra="retry: {max_attempts: 1}\n")
    e = engine(pol, clock, core)
    for _ in range(5):
        e.submit(Flow("a", "batch", "p"), cost=1)
    r1, r2 = e.poll()
    err = BackendHTTPError("slow down", backend=r1.backend, status=429)
    err.retry_after = 10.0  # type: ignore[attr-defined]
    e.fail(r1, err)
    assert r1.outcome == "failed"
    e.complete(r2)
    started = e.poll()
    assert [r.backend for r in started] == [r2.backend]  # r1's backend is paused
    assert e.stats()["pools"]["p"]["backends"][r1.backend]["paused_for"] == pytest.approx(10.0)
    e.complete(started[0])
    clock.advance(10.0)
    assert len(e.poll()) == 2
    assert e.stats()["flows"]["a/batch/p"]["upstream_429"] == 1


def test_org_requests_per_minute_at_admission(clock: Clock, core) -> None:
    pol = policy(orgs="""
      a: {keys: [ka], classes: [batch], requests_per_minute: 3}
      b: {keys: [kb], classes: [batch]}
    """)
    e = engine(pol, clock, core)
    for _ in range(3):
        e.submit(Flow("a", "batch", "p"), cost=1)
    with pytest.raises(Refused) as info:
        e.submit(Flow("a", "batch", "p"), cost=1)
    assert info.value.reason == "rate_limited"
    assert info.value.retry_after == pytest.approx(20.0)  # the honest time to the next token
    e.submit(Flow("b", "batch", "p"), cost=1)  # another org is not affected
    clock.advance(20.0)
    e.submit(Flow("a", "batch", "p"), cost=1)
    assert e.stats()["flows"]["a/batch/p"]["reasons"] == {"rate_limited": 1}


# ------------------------------------------------------------------ admission and deadlines
@pytest.mark.parametrize("strict", [False, True])
def test_a_full_queue_is_shared_fairly_the_org_holding_the_most_gives_a_place_up(clock: Clock, core, strict) -> None:
    cls = "\n  system: {strict: true, max_in_flight: 1, max_queue_length: 3}" if strict else \
        "\n  batch: {weight: 1, max_queue_length: 3}"
    name = "system" if strict else "batch"
    pol = policy(pools=ONE_SLOT, classes=cls, orgs=f"""
      a: {{keys: [ka], classes: [{name}]}}
      b: {{keys: [kb], classes: [{name}]}}
      c: {{keys: [kc], classes: [{name}]}}
    """)
    e = engine(pol, clock, core)
    a, b, c = (Flow(o, name, "p") for o in "abc")
    first = e.submit(a, cost=1)
    assert e.poll() == [first]  # running: not in the queue
    flood = [e.submit(a, cost=1) for _ in range(3)]  # a fills the class's queue
    assert e.stats()["flows"][f"a/{name}/p"]["waiting"] == 3
    # b has nothing waiting: it is not refused because of a's requests; a's newest gives way
    rb = e.submit(b, cost=1)
    assert flood[2].outcome == "refused" and flood[2].reason == "queue_full"
    assert rb.state == "waiting" and flood[0].state == flood[1].state == "waiting"
    err = e.ended_error(flood[2])
    assert isinstance(err, Refused) and err.reason == "queue_full" and err.retry_after is not None
    assert "'a' held the most places" in str(err)
    assert e.poll() == [] and e.dropped == [flood[2]]  # handed to the driver once, with the next poll
    rc = e.submit(c, cost=1)  # a still holds the most (2): it gives way again
    assert flood[1].outcome == "refused" and rc.state == "waiting"
    # now a, b and c hold one place each: a newcomer of a (or b, or c) holds the most: refused,
    # nobody else loses a place
    for f in (a, b, c):
        with pytest.raises(Refused) as info:
            e.submit(f, cost=1)
        assert info.value.reason == "queue_full" and f"{f.org!r} holds the most" in str(info.value)
    assert [r.state for r in (flood[0], rb, rc)] == ["waiting"] * 3
    stats = e.stats()["flows"]
    assert stats[f"a/{name}/p"]["reasons"] == {"queue_full": 3}
    # every accepted request ends once: the evicted ones are counted refused, never started
    e.complete(first)
    started = drain(e, 3)
    assert sorted(r.flow.org for r in started) == ["a", "b", "c"]


def test_max_queue_length_counts_waiting_only_with_an_honest_retry_after(clock: Clock, core) -> None:
    pol = policy(pools=ONE_SLOT, classes="""
      batch: {weight: 1, max_queue_length: 3, max_queue_age_seconds: 100}
    """)
    e = engine(pol, clock, core)
    rs = [e.submit(Flow("a", "batch", "p"), cost=1)]
    assert e.poll() == [rs[0]]
    rs += [e.submit(Flow("a", "batch", "p"), cost=1) for _ in range(3)]  # three wait: the running one is not counted
    clock.advance(10)
    with pytest.raises(Refused) as info:
        e.submit(Flow("a", "batch", "p"), cost=1)
    assert info.value.reason == "queue_full"
    # one start in the last minute: about 60 s per start; the oldest waiting one runs out of
    # queue age in 90 s (by then it has started or been dropped): the sooner is the answer
    assert info.value.retry_after == pytest.approx(60.0)
    e.complete(rs[0])
    assert e.poll() == [rs[1]]
    e.submit(Flow("a", "batch", "p"), cost=1)  # a place freed
    with pytest.raises(Refused) as info:
        e.submit(Flow("a", "batch", "p"), cost=1)
    # two starts within the last 10 s: one every 30 s; the oldest waiting (rs[2]) ages out in 90 s
    assert info.value.retry_after == pytest.approx(30.0)
    clock.advance(75)  # the two starts leave the window; rs[2] has 15 s of queue age left
    with pytest.raises(Refused) as info:
        e.submit(Flow("a", "batch", "p"), cost=1)
    assert info.value.retry_after == pytest.approx(15.0)


def test_queue_age_and_deadline_drop_before_start(clock: Clock, core) -> None:
    pol = policy(pools=ONE_SLOT, classes="""
      batch: {weight: 1, max_queue_age_seconds: 5}
    """)
    e = engine(pol, clock, core)
    f = Flow("a", "batch", "p")
    r0 = e.submit(f, cost=1)
    assert e.poll() == [r0]  # (before the others come: dl, with a deadline, would go first: EDF)
    aged = e.submit(f, cost=1)
    dl = e.submit(f, cost=1, deadline=clock.t + 2)
    assert e.poll() == []
    assert e.wake_at() == pytest.approx(clock.t + 2)
    clock.advance(2)
    assert e.poll() == [] and e.dropped == [dl]
    assert dl.outcome == "refused" and dl.reason == "deadline"
    clock.advance(3)
    e.poll()
    assert aged.outcome == "refused" and aged.reason == "queue_timeout"
    assert not e.queues["p"].sched.pending(f)  # gone from the core too
    e.complete(r0)
    assert e.poll() == [] and not e.live
    with pytest.raises(Refused) as info:
        e.submit(f, cost=1, deadline=clock.t)
    assert info.value.reason == "deadline"


def test_max_wait_bounds_only_the_wait_for_a_start(clock: Clock, core) -> None:
    """A request's own ``max_wait`` is a queue age bound of its own, by the class's machinery:
    the waiting one ends once, refused ``queue_timeout``, naming it; a running one with the
    same ``max_wait`` is never cut; the smaller of it, the class's age and the deadline wins,
    and a retry waits anew (as the class's age)."""
    pol = policy(pools=ONE_SLOT, classes="""
      batch: {weight: 1, max_queue_age_seconds: 8}
    """, orgs="""
      a: {keys: [ka], classes: [batch]}
      b: {keys: [kb], classes: [batch]}
    """)
    e = engine(pol, clock, core)
    f = Flow("a", "batch", "p")
    running = e.submit(f, cost=1, max_wait=5.0, start=True)
    assert running.state == "running" and running.max_wait == 5.0
    waiting = e.submit(f, cost=1, max_wait=5)  # behind the full pool
    by_age = e.submit(f, cost=1, max_wait=30.0)  # the class's 8 s is the smaller
    by_deadline = e.submit(f, cost=1, max_wait=5.0, deadline=clock.t + 3)  # the deadline is the smaller
    assert e.wake_at() == pytest.approx(clock.t + 3)
    clock.advance(3)
    assert e.poll() == [] and e.dropped == [by_deadline] and by_deadline.reason == "deadline"
    clock.advance(2)
    assert e.poll() == [] and e.dropped == [waiting]
    assert waiting.outcome == "refused" and waiting.reason == "queue_timeout"
    err = e.ended_error(waiting)
    assert isinstance(err, Refused) and err.reason == "queue_timeout" and err.http_status == 504
    assert str(err) == "the request's max_wait (5 s) ran out before it started"
    assert running.state == "running" and running.outcome is None  # its wait was over: never cut
    clock.advance(3)
    e.poll()
    assert by_age.outcome == "refused" and by_age.reason == "queue_timeout"
    assert str(e.ended_error(by_age)) == "the request's queue age ran out before it started"
    e.complete(running)
    assert running.outcome == "completed" and not e.live and not e.has_waiting()
    # a retry waits for its start anew, bounded by its max_wait again
    r = e.submit(f, cost=1, max_wait=5.0, start=True)
    other = e.submit(Flow("b", "batch", "p"), cost=1)
    assert e.fail(r, BackendHTTPError("boom", status=500, unhealthy=True)).retry
    assert e.poll() == [other]
    e.requeue(r)
    clock.advance(5)
    e.poll()
    assert r.outcome == "failed" and r.reason == "queue_timeout" and r.tries == 1
    e.complete(other)
    assert not e.live


@pytest.mark.parametrize("bad", [0, -1, float("nan"), True, "5"])
def test_a_bad_max_wait_is_refused_by_the_engine_and_changes_nothing(clock: Clock, core, bad: Any) -> None:
    e = engine(policy(pools=ONE_SLOT), clock, core)
    with pytest.raises(ValueError, match=r"^max_wait must be a number of seconds > 0 or None, got "):
        e.submit(Flow("a", "batch", "p"), cost=1, max_wait=bad)
    assert e.submitted == 0 and not e.live and not e.has_waiting()


def test_cancel_before_start_is_uncharged(clock: Clock, core) -> None:
    pol = policy(pools=ONE_SLOT, orgs="""
      a: {keys: [ka], classes: [batch]}
      b: {keys: [kb], classes: [batch]}
    """)
    e = engine(pol, clock, core)
    ra = e.submit(Flow("a", "batch", "p"), cost=5)
    rb = e.submit(Flow("b", "batch", "p"), cost=5)
    assert e.poll() == [ra]
    before = e.queues["p"].sched.meter(Flow("b", "batch", "p"))
    e.cancel(rb)
    assert rb.outcome == "cancelled_before_start"
    assert e.queues["p"].sched.meter(Flow("b", "batch", "p")) == before
    e.cancel(ra, work_tokens=12)
    assert ra.outcome == "cancelled_during_execution"
    assert e.stats()["flows"]["a/batch/p"]["cancelled_work_tokens"] == 12
    e.cancel(ra)  # already ended: nothing changes
    assert ra.outcome == "cancelled_during_execution"


# ------------------------------------------------------------------ short work inside a flow
BUCKETS = """
  interactive: {weight: 1, small_cost: 100, small_picks: 3}
"""


def test_small_first_but_the_large_one_goes_after_a_bounded_run(clock: Clock, core) -> None:
    pol = policy(pools=ONE_SLOT, classes=BUCKETS, orgs="""
      a: {keys: [ka], classes: [interactive]}
    """)
    e = engine(pol, clock, core)
    f = Flow("a", "interactive", "p")
    big = e.submit(f, cost=5000)
    small = [e.submit(f, cost=10) for _ in range(10)]
    order = drain(e, 11)
    assert order[:4] == [big] + small[:3] or order[:4] == small[:3] + [big]
    pos = order.index(big)
    assert pos <= 3  # at most small_picks short ones pass the large one
    # and the ten short ones are not all held behind the huge one
    assert sum(1 for r in order[:4] if r in small) >= 3


def test_size_buckets_do_not_change_the_flows_share(clock: Clock, core) -> None:
    orgs = """
      a: {keys: [ka], classes: [interactive]}
      b: {keys: [kb], classes: [interactive]}
    """
    served = {}
    for small_cost in ("100", "null"):
        pol = policy(pools=ONE_SLOT, classes=f"""
          interactive: {{weight: 1, small_cost: {small_cost}, small_picks: 3}}
        """, orgs=orgs)
        e = engine(pol, clock, core)
        fa, fb = Flow("a", "interactive", "p"), Flow("b", "interactive", "p")
        for i in range(300):
            e.submit(fa, cost=1000 if i % 5 == 0 else 10)  # a mixes sizes
            e.submit(fb, cost=200)
        order = drain(e, 300)
        cost = Counter()
        for r in order:
            cost[r.flow.org] += r.cost
        served[small_cost] = cost
        # every flow is charged exactly what it was served (the core's entry is corrected to the
        # cost of the request that went), and two backlogged flows of equal weight are served
        # equal cost within one request of each (SFQ's bound), whatever the order inside a flow
        q = e.queues["p"]
        assert q.sched.meter(fa) == pytest.approx(cost["a"])
        assert q.sched.meter(fb) == pytest.approx(cost["b"])
        assert abs(cost["a"] - cost["b"]) <= 1000 + 200
    # the buckets did change the order inside a: short ones went first
    assert served["100"] != served["null"]


# ------------------------------------------------------------------ memory follows the work
FORGET_CLASSES = """
  interactive: {weight: 4, max_in_flight: 3, small_cost: 100, small_picks: 2}
  batch: {weight: 1, small_cost: 100, small_picks: 2, max_queue_length: 6}
"""
FORGET_ORGS = """
  a: {keys: [ka], classes: [interactive, batch], max_in_flight: 2}
  b: {keys: [kb], classes: [interactive, batch], weight: 2}
  c: {keys: [kc], classes: [batch, interactive], max_in_flight: 1}
  d: {keys: [kd], classes: [batch]}
"""


def _keep_every_flow(q: Any) -> None:
    """The queue as it was before flows were forgotten: every flow's queue kept once made (a
    method of the queue's replaced: only the engine's source allows it, not a build of it
    compiled by mypyc, ``benchmarks/mypyc_tree.sh``, where the test is skipped)."""
    def emptied(fq: Any) -> None:
        if fq.aside:
            q._unaside(fq)
    q._emptied = emptied


@pytest.mark.skipif(not isinstance(PolicyQueue._emptied, types.FunctionType),
                    reason="the queue is compiled (mypyc): its methods cannot be replaced")
def test_forgetting_empty_flows_changes_no_decision(clock: Clock, core) -> None:
    """A flow's queue is forgotten when it empties (``PolicyQueue._emptied``): a random run of
    arrivals (small and large requests, four orgs, org and class ``max_in_flight``, a class's
    ``max_queue_length``: refusals and evictions), starts, completions and cancellations makes
    the same decisions, step by step, as the same run on a queue that keeps every flow, and
    leaves no flow queue behind once nothing waits."""
    import random

    pol = policy(pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 4}]
    """, classes=FORGET_CLASSES, orgs=FORGET_ORGS)
    flows = [Flow(o, c, "p") for o in "abcd" for c in pol.orgs[o].classes]
    for seed in range(3):
        rng = random.Random(seed)
        lean, kept = engine(pol, clock, core), engine(pol, clock, core)
        _keep_every_flow(kept.queues["p"])
        reqs: dict[PolicyEngine, list[Request]] = {lean: [], kept: []}
        running: dict[PolicyEngine, list[Request]] = {lean: [], kept: []}
        forgot = 0
        for _ in range(600):
            op = rng.random()
            if op < 0.45:
                f, cost = rng.choice(flows), rng.choice((5, 40, 90, 150, 400))
                refused = set()
                for e in (lean, kept):
                    try:
                        reqs[e].append(e.submit(f, cost=cost))
                    except Refused:
                        refused.add(e)
                assert refused in (set(), {lean, kept})
            elif op < 0.55:
                waiting = [n for n, r in enumerate(reqs[lean]) if r.outcome is None and r not in running[lean]]
                if waiting:
                    i = rng.choice(waiting)
                    for e in (lean, kept):
                        e.cancel(reqs[e][i])
            elif running[lean] and op < 0.8:
                i = rng.randrange(len(running[lean]))
                for e in (lean, kept):
                    e.complete(running[e].pop(i))
            assert [r.outcome for r in reqs[lean]] == [r.outcome for r in reqs[kept]]  # evictions too
            started = {e: e.poll() for e in (lean, kept)}
            index = {e: {r.id: n for n, r in enumerate(reqs[e])} for e in (lean, kept)}
            assert [index[lean][r.id] for r in started[lean]] == [index[kept][r.id] for r in started[kept]]
            for e in (lean, kept):
                running[e] += started[e]
            forgot = max(forgot, len(kept.queues["p"].flows) - len(lean.queues["p"].flows))
        q = lean.queues["p"]
        assert forgot > 0  # flows were forgotten along the way (else this run tested nothing)
        assert sum(r.reason == "queue_full" for r in reqs[lean]) > 0  # and places were given up
        assert all(fq.n for fq in q.flows.values())  # what is left has requests waiting
        for e in (lean, kept):
            while running[e] or e.queues["p"].n_waiting:
                running[e] += e.poll()
                e.complete(running[e].pop(0))
        assert q.flows == {} and not q._group_members.get(("org", "a"))
        assert [r.outcome for r in reqs[lean]] == [r.outcome for r in reqs[kept]]


def test_a_flow_forgotten_while_its_org_is_full_is_served_when_it_frees(clock: Clock, core) -> None:
    """A flow whose org is at its ``max_in_flight`` is suspended in the core; when its last
    waiting request is cancelled its queue is forgotten, and a request that comes later, once
    the org has a free slot, starts (the flow is not left suspended)."""
    pol = policy(classes=FORGET_CLASSES, orgs=FORGET_ORGS)
    e = engine(pol, clock, core)
    fc = Flow("c", "batch", "p")
    first, waiting = e.submit(fc, cost=10), e.submit(fc, cost=10)
    assert e.poll() == [first]  # c's one slot taken: the second waits, suspended
    e.cancel(waiting)
    assert fc not in e.queues["p"].flows
    e.complete(first)
    later = e.submit(fc, cost=10)
    assert e.poll() == [later]


def test_an_idle_flow_at_or_below_v_is_forgotten_and_rejoins_at_v(clock: Clock, core) -> None:
    """Once a flow has nothing waiting or running and ``v`` has reached its meter, nothing is
    kept of it, in the engine or in the core: it would rejoin at ``max(S, v) = v`` anyway,
    and it does."""
    pol = policy(pools=ONE_SLOT, orgs="""
      a: {keys: [ka], classes: [batch]}
      b: {keys: [kb], classes: [batch]}
    """)
    e = engine(pol, clock, core)
    fa, fb = Flow("a", "batch", "p"), Flow("b", "batch", "p")
    ra, rb = e.submit(fa, cost=100), e.submit(fb, cost=300)
    for r in (ra, rb):
        assert e.poll() == [r]
        e.complete(r)
    q = e.queues["p"]
    v = q.sched.virtual_time
    assert v == 300 and ra.start_tag + ra.cost == 100 <= v  # a's meter (its finish tag) is behind v
    assert q.flows == {} and q.sched.known_flows == 0  # nothing kept of a or b
    assert q.sched.meter(fa) == v
    again = e.submit(fa, cost=50)
    assert e.poll() == [again] and again.start_tag == v  # rejoined at max(S, v) = v
