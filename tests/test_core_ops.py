"""The core operations the policy layer and the delivered-service modes build on:
suspend/resume, peek, adjust, and a busy period held open by work in flight.
Every test runs on both twins (``make``)."""

from __future__ import annotations

import math

import pytest
from core_helpers import Watcher, dispatch_tuple, snapshot

import sfq

FLOWS = ["a", "b", "c"]


def drain(s):
    out = []
    while (d := s.dispatch()) is not None:
        out.append(d)
    return out


# ----------------------------------------------------------------- suspend / resume
def test_a_suspended_flow_is_not_dispatched_but_keeps_its_requests(make):
    s = make()
    ta = s.enqueue("a", 1, "a1")
    s.enqueue("a", 1, "a2")
    s.enqueue("b", 5, "b1")
    s.suspend("a")
    assert s.suspended("a") and not s.suspended("b")
    assert len(s) == 3 and s.pending("a") == 2 and s.waiting_flows == 1
    assert [d.item for d in drain(s)] == ["b1"]
    assert len(s) == 2
    assert s.cancel(ta) is True and s.pending("a") == 1
    s.resume("a")
    assert [d.item for d in drain(s)] == ["a2"]


def test_suspended_flows_bank_nothing(make):
    """A flow held back (say, by its own concurrency limit) rejoins at max(S, v): it gets its
    share from then on, not a burst for the time it was held."""
    s = make()
    for i in range(10):
        s.enqueue("a", 10, i)
        s.enqueue("b", 10, i)
    s.suspend("a")
    for _ in range(5):
        assert s.dispatch().flow == "b"
    s.resume("a")
    assert s.meter("a") == s.virtual_time  # raised to v on rejoining
    order = [d.flow for d in drain(s)][:10]
    assert order.count("a") <= 6, f"a burst for the time it was held: {order}"  # half, give or take one request


def test_enqueue_to_a_suspended_flow_waits(make):
    s = make()
    s.suspend("a")
    s.enqueue("a", 1, "x")
    assert s.dispatch() is None and s.peek() is None and len(s) == 1 and s.waiting_flows == 0
    s.resume("a")
    assert s.dispatch().item == "x"


def test_suspend_resume_are_idempotent_and_unknown_flows_are_fine(make):
    s = make()
    s.resume("nobody")
    assert s.known_flows == 0 and not s.suspended("nobody")
    s.suspend("x")
    s.suspend("x")
    assert s.suspended("x") and s.known_flows == 1
    s.resume("x")
    s.resume("x")
    assert not s.suspended("x") and s.known_flows == 0  # nothing left to remember


def test_suspending_the_last_competitor_closes_the_busy_period(make):
    s = make()
    s.enqueue("a", 100, "a1")
    s.enqueue("a", 100, "a2")
    s.dispatch()
    assert s.virtual_time == 0
    s.suspend("a")  # nothing competes, no work in flight: the system is idle
    assert s.virtual_time == 100
    s.enqueue("b", 1, "b1")
    s.resume("a")
    assert [d.flow for d in drain(s)] == ["a", "b"] or s.meter("a") == s.virtual_time


def test_resume_with_no_requests_forgets_a_flow_with_nothing_to_remember(make):
    s = make()
    s.enqueue("a", 1, 1)
    s.suspend("a")
    t = s.enqueue("a", 1, 2)
    s.cancel(t)
    s.cancel(1)
    assert s.known_flows == 1 and len(s) == 0
    s.resume("a")
    assert s.known_flows == 0


def test_a_weighted_suspended_flow_is_remembered(make):
    s = make()
    s.set_weight("a", 4)
    s.suspend("a")
    s.resume("a")
    assert s.weight("a") == 4 and s.known_flows == 1


# ----------------------------------------------------------------- peek
def test_peek_is_the_next_dispatch_and_changes_nothing(make):
    s = make()
    s.set_weight("b", 2)
    for i, (f, c) in enumerate([("a", 3), ("b", 4), ("a", 1), ("c", 2.5), ("b", 7)]):
        s.enqueue(f, c, i)
    while True:
        before = snapshot(s, FLOWS)
        p = s.peek()
        assert snapshot(s, FLOWS) == before
        d = s.dispatch()
        assert dispatch_tuple(p) == dispatch_tuple(d)
        if d is None:
            break


# ----------------------------------------------------------------- adjust
def test_adjust_charges_more_and_reorders_a_waiting_flow(make):
    s = make()
    s.enqueue("a", 10, "a1")
    s.enqueue("a", 10, "a2")
    s.enqueue("b", 10, "b1")
    s.enqueue("b", 10, "b2")
    assert s.dispatch().item == "a1"  # a: S = 10
    s.adjust("a", 40)  # a1 turned out to cost 50
    assert s.meter("a") == 50
    assert [d.item for d in drain(s)] == ["b1", "b2", "a2"]


def test_adjust_refunds_but_never_below_v(make):
    s = make()
    s.enqueue("a", 100, "a1")
    s.enqueue("a", 100, "a2")
    s.enqueue("b", 100, "b1")
    s.enqueue("b", 100, "b2")
    s.dispatch()  # a1: a at 100
    s.dispatch()  # b1: b at 100, v = 0
    s.adjust("a", -90)  # a1 cost only 10
    assert s.meter("a") == 10
    s.adjust("a", -1e6)  # far more than it was charged: clamped at v
    assert s.meter("a") == s.virtual_time == 0
    assert s.dispatch().item == "a2"


def test_adjust_uses_the_flow_weight_and_rounds_away_from_zero(make):
    s = make()
    s.set_weight("a", 4)
    s.enqueue("a", 8, "x")
    s.enqueue("b", 1000, "y")
    s.dispatch()
    assert s.meter("a") == 2
    s.adjust("a", 4)
    assert s.meter("a") == 3
    s.adjust("a", 1e-9)  # tiny corrections are not lost: at least one sub-unit
    assert s.meter("a") > 3


def test_adjust_an_idle_flow_and_an_unknown_flow(make):
    s = make()
    s.enqueue("a", 10, "a1")
    s.enqueue("b", 10, "b1")
    s.enqueue("b", 10, "b2")
    s.dispatch()  # a idle at 10
    s.adjust("a", 5)
    assert s.meter("a") == 15
    s.adjust("new", 7)  # a flow with no state is charged from v
    assert s.meter("new") == s.virtual_time + 7 and s.known_flows == 3
    s.adjust("other", -7)  # a refund to a flow with no state: nothing to remember
    assert s.known_flows == 3
    s.adjust("a", -100)  # back to v: forgotten (default weight, nothing to remember)
    assert s.meter("a") == s.virtual_time
    assert [d.item for d in drain(s)] == ["b1", "b2"]


@pytest.mark.parametrize(
    "delta, exc, text",
    [
        (float("nan"), ValueError, "delta must be a finite number, got nan"),
        (float("inf"), ValueError, "delta must be a finite number, got inf"),
        ("3", TypeError, "delta must be a real number, got '3' of type str"),
        (None, TypeError, "of type NoneType"),
        (True, TypeError, "of type bool"),
        (2.0**31, OverflowError, "delta 2147483648.0 is too large"),
    ],
)
def test_adjust_bad_input_changes_nothing(make, delta, exc, text):
    s = make()
    s.enqueue("a", 1, "x")
    before = snapshot(s, ["a"])
    with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        s.adjust("a", delta)
    assert snapshot(s, ["a"]) == before
    with pytest.raises(TypeError, match="not hashable"):
        s.adjust([1], 1)
    assert snapshot(s, ["a"]) == before


def test_adjust_cannot_run_a_meter_off_the_scale(make):
    s = make()
    s.set_weight("a", 2.0**-10)
    s.enqueue("a", 1, "x")
    for _ in range(2):
        s.adjust("a", 2.0**30)  # 2**60 sub-units each
    before = snapshot(s, ["a"])
    with pytest.raises(OverflowError, match="ahead of v"):
        s.adjust("a", 2.0**30)
    assert snapshot(s, ["a"]) == before


def test_settling_charges_to_actual_cost_keeps_the_seed_bounds(make):
    """Charge an estimate at dispatch, then settle to the true cost: the interval bound then
    holds for the *true* cost, with c_max over both estimates and true costs."""
    import random

    rnd = random.Random(7)
    s = make()
    true = {}
    served = {"a": 0.0, "b": 0.0}
    for f in ("a", "b"):
        for i in range(300):
            c = rnd.randint(1, 100)
            true[(f, i)] = c * rnd.choice([0.5, 1, 3])
            s.enqueue(f, c, (f, i))
    gaps = []
    while (d := s.dispatch()) is not None:
        s.adjust(d.flow, true[d.item] - d.cost)
        served[d.flow] += true[d.item]
        if s.pending("a") and s.pending("b"):
            gaps.append(abs(served["a"] - served["b"]))
    c_max = max(true.values())
    assert max(gaps) <= 2 * c_max + 100, (max(gaps), c_max)


# ----------------------------------------------------------------- the busy period
def test_work_in_flight_keeps_the_busy_period_open(make):
    s = make()
    s.enqueue("a", 100, "a1")
    s.work_started()
    s.dispatch()
    assert s.in_flight == 1
    assert s.virtual_time == 0, "no reset while the fleet still works"
    s.work_done()
    assert s.virtual_time == 100 and s.in_flight == 0


def test_shallow_queues_do_not_wipe_a_lead(make):
    """Two clients that each keep one request waiting: with the busy period held open by work
    in flight, the queue draining between arrivals does not reset v, so the heavier client
    cannot get ahead; without it, every drain levels the meters."""
    s = make()
    served = {"a": 0, "b": 0}
    for step in range(200):
        for f, c in (("a", 10), ("b", 30)):
            if s.pending(f) == 0:
                s.enqueue(f, c, step)
        d = s.dispatch()
        s.work_started()
        served[d.flow] += d.cost
        s.work_done() if step % 2 else None
        if s.in_flight > 1:
            s.work_done()
    assert abs(served["a"] - served["b"]) <= 2 * 30 + 10, served


def test_work_done_without_work_is_an_error(make):
    s = make()
    with pytest.raises(ValueError, match="no work is in flight"):
        s.work_done()
    assert s.in_flight == 0


def test_watcher_bounds_hold_with_suspend_and_busy_period(make):
    import random

    rnd = random.Random(3)
    s = make()
    w = Watcher(s, FLOWS)
    for _ in range(3000):
        x = rnd.random()
        if x < 0.5:
            w.enqueue(rnd.choice(FLOWS[:2]), rnd.randint(1, 50))
        elif x < 0.9:
            w.dispatch()
        elif x < 0.95:
            s.work_started()
        elif s.in_flight:
            s.work_done()
    assert w.events > 2500 and not math.isnan(s.virtual_time)


# ----------------------------------------------------------------- work of a flow in flight
def test_a_flow_with_work_in_flight_keeps_its_lag_when_it_rejoins(make):
    s = make()
    s.enqueue("a", 10, "a1")
    for i in range(5):
        s.enqueue("b", 10, i)
    d = s.dispatch()  # a1 goes to the fleet: a at 10
    s.work_started("a")
    s.adjust("a", -10)  # charge as served: nothing delivered yet, a is back at 0
    for _ in range(3):
        s.work_started("b")
        s.dispatch()  # b at 10, 20, 30; v = 20
    assert d.item == "a1" and s.virtual_time == 20 and s.running("a") == 1
    s.enqueue("a", 10, "a2")  # a still has work running: it rejoins at its own meter (0), not v
    assert s.meter("a") == 0
    assert s.peek().item == "a2" and s.dispatch().start == 0
    assert s.virtual_time == 20, "v never decreases"


def test_without_work_in_flight_a_flow_is_lifted_as_before(make):
    s = make()
    s.enqueue("a", 10, "a1")
    for i in range(5):
        s.enqueue("b", 10, i)
    s.dispatch()
    s.work_started("a")
    for _ in range(3):
        s.dispatch()
    s.work_done("a")  # a's work ended: it has left the system
    s.enqueue("a", 10, "a2")
    assert s.meter("a") == s.virtual_time


def test_a_running_flow_is_never_forgotten_and_is_parked_when_done(make):
    s = make()
    s.work_started("a")
    assert s.known_flows == 1 and s.running("a") == 1 and s.in_flight == 1
    s.enqueue("b", 5, "b")
    s.dispatch()
    assert s.known_flows == 2
    s.work_done("a")
    # the system is idle: v jumps to the largest finish tag and both flows are forgotten
    assert s.running("a") == 0 and s.in_flight == 0 and s.known_flows == 0 and s.virtual_time == 5
    with pytest.raises(ValueError, match=r"work_done\('a'\) without a matching work_started\('a'\)"):
        s.work_done("a")


def test_shallow_closed_loop_drift_is_bounded_with_charging_as_served(make):
    """Two clients each keep one request waiting; each request runs for a few steps and is
    charged as its tokens are delivered (adjust), the flow's work reported with
    work_started(flow). The gap in delivered service stays bounded however long it runs."""
    import random

    def run(steps):
        rnd = random.Random(5)
        s = make()
        served = {"a": 0.0, "b": 0.0}
        running = []  # [flow, tokens left]
        gap = 0.0
        for _ in range(steps):
            for f in ("a", "b"):
                if s.pending(f) == 0:
                    s.enqueue(f, 1, rnd.randint(5, 40) if f == "a" else rnd.randint(20, 80))
            while len(running) < 3 and (d := s.peek()) is not None:
                d = s.dispatch()
                s.work_started(d.flow)
                s.adjust(d.flow, -1)  # charged as served: refund the placeholder charge
                running.append([d.flow, d.item])
            for job in running:  # one token per running request per step
                s.adjust(job[0], 1)
                served[job[0]] += 1
                job[1] -= 1
            for job in [j for j in running if j[1] == 0]:
                running.remove(job)
                s.work_done(job[0])
            gap = max(gap, abs(served["a"] - served["b"]))
        return gap

    short, long = run(2000), run(8000)
    assert long <= 1.5 * short + 50, (short, long)  # with work_started() alone: 247 then 625
