"""``pools.<p>.limits.headroom`` (a prototype, issue 42): the last free slots are kept for flows
with nothing running or below their part of the slots not kept; off by default."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from policy_helpers import Clock, policy

import sfq
from sfq.engine import PolicyEngine
from sfq.policy import Flow
from sfq.policy.config import PolicyError


HEADROOM_TWINS = [sfq.ReferenceScheduler] + ([sfq.Scheduler] if sfq.CORE == "compiled" else [])


def _engine(clock: Clock, core, headroom: int | None) -> PolicyEngine:
    limits = "" if headroom is None else f", limits: {{headroom: {headroom}}}"
    pol = policy(pools=f"""
      p: {{models: [m], backends: [{{url: "http://127.0.0.1:9", max_in_flight: 6}}]{limits}}}
    """, orgs="""
      a: {keys: [ka], classes: [batch]}
      b: {keys: [kb], classes: [batch]}
      q: {keys: [kq], classes: [batch]}
    """)
    return PolicyEngine(pol, clock=clock, scheduler=core)


def _flood(e: PolicyEngine) -> None:
    for _ in range(10):
        e.submit(Flow("a", "batch", "p"), cost=10.0)
        e.submit(Flow("b", "batch", "p"), cost=10.0)


def test_without_headroom_the_flood_takes_every_slot(clock: Clock, core) -> None:
    e = _engine(clock, core, None)
    _flood(e)
    assert len(e.poll()) == 6
    e.submit(Flow("q", "batch", "p"), cost=1.0)
    assert e.poll() == []  # the quiet flow waits for a slot to free


def test_headroom_keeps_the_last_slots_for_a_flow_with_nothing_running(clock: Clock, core) -> None:
    e = _engine(clock, core, 2)
    _flood(e)
    started = e.poll()
    assert len(started) == 4 and {r.flow.org for r in started} == {"a", "b"}  # 2 each: (6 - 2) / 2
    q = e.submit(Flow("q", "batch", "p"), cost=1.0)
    assert e.poll() == [q]  # at once, in a slot kept
    q2 = e.submit(Flow("q", "batch", "p"), cost=1.0)
    assert e.poll() == [q2]  # 1 running < (6 - 2) / 3 flows
    e.complete(q)
    e.complete(q2)
    nxt = e.poll()  # q has nothing left: a and b, at their part (2 each), may not take the kept slots
    assert nxt == []
    e.complete(started[0])  # a slot of the flood's frees: its flow is below its part again
    again = e.poll()
    assert len(again) == 1 and again[0].flow.org == started[0].flow.org
    assert e.stats()["pools"]["p"]["waiting"] == 20 - 5


def test_headroom_must_be_a_positive_integer() -> None:
    with pytest.raises(PolicyError, match="headroom"):
        policy(pools="""
          p: {models: [m], backends: [{url: "http://127.0.0.1:9"}], limits: {headroom: -1}}
        """)


# ---------------------------------------------------------------- what headroom promises
# A pool of ``cap`` slots (one backend's max_in_flight, or the pool's own max_in_flight) with
# ``headroom: K``; ``free`` = cap - running. A weighted flow's next request may start when
#   (a) more than K slots are free, or
#   (b) its flow has nothing running in the pool, or
#   (c) its flow has fewer running than (cap - K) / n, n the flows with work (waiting or
#       running) in the pool: an equal part, whatever the flows' weights.
# So after every poll: (1) never more than cap running; (2) while anything waits, at least
# cap - K run (work conserving up to K: a lone flow gets cap - K, the K kept idle is the cost);
# (3) while a slot is free, no flow waits with nothing running (a quiet flow starts at once);
# (4) a flow that waits while a slot is free runs at least its part; (5) a start into one of
# the last K free slots is always by a flow below its part. Checked on random programs (poll,
# and next_start one at a time), on both twins of the core, which decide every start alike.

HEADROOM_FLOWS = [Flow(o, "batch", "p") for o in ("a", "b", "c", "d")]
HeadroomOp = tuple[Any, ...]  # ("submit", flow) | ("complete", which running) | ("poll",) | ("next",)


def _headroom_engine(core, k: int, backends: int, pool_cap: int | None) -> PolicyEngine:
    limits = f"headroom: {k}" + ("" if pool_cap is None else f", max_in_flight: {pool_cap}")
    pol = policy(pools=f"""
      p: {{models: [m], backends: [{{url: "http://127.0.0.1:9", max_in_flight: {backends}}}], limits: {{{limits}}}}}
    """, orgs="""
      a: {keys: [ka], classes: [batch], weight: 2}
      b: {keys: [kb], classes: [batch]}
      c: {keys: [kc], classes: [batch]}
      d: {keys: [kd], classes: [batch], weight: 3}
    """)
    return PolicyEngine(pol, clock=Clock(), scheduler=core)


def _play(core, k: int, backends: int, pool_cap: int | None, program: list[HeadroomOp]) -> list[str]:
    e = _headroom_engine(core, k, backends, pool_cap)
    cap = backends if pool_cap is None else min(backends, pool_cap)
    running: list[Any] = []
    waiting: Counter[Flow] = Counter()
    trace: list[str] = []
    for op in [*program, ("poll",)]:
        if op[0] == "submit":
            f = HEADROOM_FLOWS[op[1]]
            e.submit(f, cost=float(1 + op[1]))
            waiting[f] += 1
            continue
        if op[0] == "complete":
            if running:
                e.complete(running.pop(op[1] % len(running)))
            continue
        with_work = {f for f in HEADROOM_FLOWS if waiting[f]} | {r.flow for r in running}
        if op[0] == "next":
            one = e.next_start()
            started = [] if one is None else [one]
        else:
            started = e.poll()
        for r in started:  # in the order they started
            if cap - len(running) <= k:  # (5) one of the last K free slots: only a flow below its part
                assert sum(x.flow == r.flow for x in running) < (cap - k) / len(with_work), r.flow
            waiting[r.flow] -= 1
            running.append(r)
        trace.extend(r.flow.org for r in started)
        trace.append("|")
        run_n = Counter(r.flow for r in running)
        free = cap - len(running)
        assert 0 <= free  # (1)
        with_work = {f for f in HEADROOM_FLOWS if waiting[f] or run_n[f]}
        if op[0] == "next":
            continue  # (one start: more may be due)
        if any(waiting.values()):
            assert free <= k, (free, k)  # (2)
        for f in HEADROOM_FLOWS:
            if waiting[f] and free:
                assert run_n[f] >= 1, f  # (3)
                assert run_n[f] >= (cap - k) / len(with_work), (f, run_n[f], cap, k, len(with_work))  # (4)
    return trace


HEADROOM_PROGRAMS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, len(HEADROOM_FLOWS) - 1)),
    st.tuples(st.just("complete"), st.integers(0, 20)),
    st.tuples(st.just("poll")), st.tuples(st.just("next"))), max_size=80)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 5), backends=st.integers(2, 8), pool_cap=st.one_of(st.none(), st.integers(2, 8)),
       program=HEADROOM_PROGRAMS)
def test_headroom_keeps_its_promises(core, k: int, backends: int, pool_cap: int | None,
                                     program: list[HeadroomOp]) -> None:
    cap = backends if pool_cap is None else min(backends, pool_cap)
    assume(k < cap)
    _play(core, k, backends, pool_cap, program)


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 5), program=HEADROOM_PROGRAMS)
def test_the_twins_decide_every_start_alike_under_headroom(k: int, program: list[HeadroomOp]) -> None:
    traces = [_play(make, k, 6, None, program) for make in HEADROOM_TWINS]
    assert all(t == traces[0] for t in traces)


def test_a_lone_flow_gets_the_slots_less_the_headroom(clock: Clock, core) -> None:
    """Headroom is not work conserving: one flow alone runs cap - K, K idle (its cost)."""
    e = _engine(clock, core, 2)
    for _ in range(10):
        e.submit(Flow("a", "batch", "p"), cost=10.0)
    assert len(e.poll()) == 6 - 2
    q = e.submit(Flow("q", "batch", "p"), cost=1.0)
    assert e.poll() == [q]
