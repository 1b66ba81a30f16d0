"""The simulator's ``sfq`` policy is the request engine (``sfq.engine.PolicyEngine``) on
virtual time: hand-checked cases driven through the discipline protocol with a stand-in
simulator, and the engine's charge modes as the simulator sees them."""

from __future__ import annotations

import types

import pytest

import sfq
from sfq.engine import PolicyEngine
from sfq.sim.adapter import EngineDiscipline, flow_policy
from sfq.sim.model import FlowSpec, Request
from sfq.sim.policies import SeedSFQ, make_policy

CORES = [sfq.ReferenceScheduler] + ([sfq.Scheduler] if sfq.CORE == "compiled" else [])


def fake_sim(n=2, weights=None, w_p=1.0, w_q=2.0):
    weights = weights or [1.0] * n
    flows = tuple(FlowSpec(f"f{i}", weights[i]) for i in range(n))
    return types.SimpleNamespace(flows=flows, w_p=w_p, w_q=w_q, running=[0] * n, running_flows=set(),
                                 left=lambda r: None)


class Run:
    """A bound ``sfq`` discipline and the little of a simulator it reads. Without a run
    estimator the engine prices with ``CostEstimator(w_p, w_q, prior_ratio=0.5)``: a request
    of prompt ``p`` and ``max_tokens`` ``m`` is estimated at ``p + 2 * 0.5 * m = p + m``."""

    def __init__(self, charge, n=2, weights=None, core=sfq.ReferenceScheduler, pol=None):
        self.p = pol if pol is not None else EngineDiscipline.sfq(core=core, charge=charge)
        self.sim = fake_sim(n, weights)
        self.p.bind(self.sim)
        self.rid = 0

    def arrive(self, flow, prompt=10, output=5, t=0):
        r = Request(self.rid, flow, t, prompt, output, output)
        self.rid += 1
        self.p.arrive(r, t)
        return r

    def start(self, t=0, fits=True):
        r = self.p.start(t, lambda r: fits if isinstance(fits, bool) else fits(r))
        if r is not None:
            r.admit = t
            self.sim.running[r.flow] += 1
            self.sim.running_flows.add(r.flow)
        return r

    def finish(self, r, t):
        r.finish = t
        self.p.complete(r, t)
        self.sim.running[r.flow] -= 1
        if not self.sim.running[r.flow]:
            self.sim.running_flows.discard(r.flow)

    def meter(self, f):
        return self.p.queue.meter(self.p.flow_of[f])

    @property
    def core(self):
        return self.p.queue.sched


def test_it_is_the_engine_under_a_one_org_per_flow_policy():
    pol = make_policy("sfq", charge="settle")
    assert isinstance(pol, EngineDiscipline) and pol.charge == "settle" and pol.label == "sfq charge=settle"
    assert make_policy("sfq").charge == "served"  # the library's default
    run = Run("seed", n=3, weights=[2.0, 1.0, 0.5])
    assert isinstance(run.p.engine, PolicyEngine) and run.p.engine.charge == "seed"
    policy, flows = flow_policy([2.0, 1.0, 0.5], charge="seed")
    assert run.p.flow_of == flows and [policy.flow_weight(f.org, f.cls) for f in flows] == [2.0, 1.0, 0.5]
    assert list(policy.pools) == ["sim"] and list(policy.classes) == ["sim"]
    assert policy.classes["sim"].small_cost is None  # no size buckets: a flow's requests in arrival order
    with pytest.raises(ValueError, match="unknown charge mode 'nope'"):
        EngineDiscipline.sfq(charge="nope")


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("charge", ["seed", "settle", "served"])
def test_it_looks_before_it_pops_and_estimates_at_dispatch(charge, core):
    run = Run(charge, core=core)
    a = run.arrive(0, prompt=100, output=50)  # estimated 150
    assert run.start(fits=False) is None  # named, does not fit: not dispatched, not charged
    assert run.meter(0) == 0.0 and len(run.core) == 1 and run.core.in_flight == 0
    assert run.p.queue.stalled.item is a
    assert run.start() is a
    assert a.est == 150.0  # the estimate it was dispatched on, for the report
    assert run.meter(0) == (100.0 if charge == "served" else 150.0)  # served: the prompt at dispatch
    assert run.core.in_flight == 1 and len(run.core) == 0


def test_settle_corrects_the_estimate_to_the_usage_at_completion():
    run = Run("settle")
    a = run.arrive(0, prompt=100, output=50)  # estimated 150, costs 100 + 2 * 50 = 200
    b = run.arrive(1, prompt=100, output=90)  # estimated 190, costs 280; keeps the fleet busy after a
    assert run.start() is a and run.start() is b
    assert (run.meter(0), run.meter(1)) == (150.0, 190.0)
    run.p.advance(0, 50)
    assert run.meter(0) == 150.0  # nothing moves while it runs
    run.finish(a, 50)
    assert run.meter(0) == 200.0 and run.core.in_flight == 1
    run.finish(b, 90)  # the last work done, nothing waiting: the busy period closes, level
    assert run.core.in_flight == 0 and run.meter(0) == run.meter(1) == 280.0


def test_served_charges_the_prompt_then_each_token_as_it_is_delivered():
    run = Run("served")
    a = run.arrive(0, prompt=100, output=50)
    b = run.arrive(1, prompt=30, output=10)
    assert run.start() is a and run.start() is b
    assert (run.meter(0), run.meter(1)) == (100.0, 30.0)
    run.p.advance(0, 10)  # ten steps: a and b deliver ten tokens each, two per token
    assert (run.meter(0), run.meter(1)) == (120.0, 50.0)
    run.finish(b, 10)  # settled with its usage: nothing left to correct
    assert run.meter(1) == 50.0
    run.p.advance(10, 50)
    assert run.meter(0) == 200.0
    run.finish(a, 50)
    assert run.meter(0) == 200.0 and run.core.in_flight == 0


def test_the_busy_period_is_held_while_work_runs():
    """The flow that is ahead keeps its lead while its work runs, though no request waits:
    the plain rule (docs/design.md §2.5) would reset v to the largest finish tag the moment the queue empties."""
    for make, keeps in ((lambda: EngineDiscipline.sfq(sfq.ReferenceScheduler, "seed"), True),
                        (lambda: SeedSFQ(core=sfq.ReferenceScheduler), False)):
        pol = make()
        if isinstance(pol, SeedSFQ):  # the baseline takes the estimate stamped at arrival
            sim = fake_sim(2)
            pol.bind(sim)
            reqs = []
            for flow, est in ((0, 100.0), (1, 1000.0)):
                r = Request(len(reqs), flow, 0, 10, 5, 5)
                r.est = est
                reqs.append(r)
                pol.arrive(r, 0)
            for r in reqs:
                assert pol.start(0, lambda r: True) is r
            for flow in (1, 0):
                r = Request(len(reqs), flow, 1, 10, 5, 5)
                r.est = 100.0
                reqs.append(r)
                pol.arrive(r, 1)
            first = pol.start(1, lambda r: True)
        else:
            run = Run("seed", pol=pol)
            run.arrive(0, prompt=50, output=50)  # 100
            run.arrive(1, prompt=500, output=500)  # 1000
            assert run.start().flow == 0 and run.start().flow == 1
            assert run.core.waiting_flows == 0
            run.arrive(1, prompt=50, output=50, t=1)  # both come back (flow 1 first) while the work runs
            run.arrive(0, prompt=50, output=50, t=1)
            first = run.start(t=1)
        # flow 0 is 900 behind unless the reset to the largest finish tag wiped that out
        assert (first.flow == 0) == keeps, type(pol).__name__


def test_served_wakes_when_a_running_flow_falls_behind_no_more():
    run = Run("served")
    a = run.arrive(0, prompt=100, output=300)
    c = run.arrive(1, prompt=110, output=20)  # 110 + 2 * 20 = 150 served to flow 1
    assert run.start() is a and run.start() is c
    run.p.advance(0, 20)
    run.finish(c, 20)
    assert (run.meter(0), run.meter(1)) == (140.0, 150.0)
    big = run.arrive(0, prompt=950, t=20)
    small = run.arrive(1, prompt=50, t=20)
    fits = lambda r: r.prompt <= 100  # noqa: E731
    assert run.start(20, fits) is None  # flow 0 (140) is named; its 950 tokens do not fit: stall
    # flow 0's meter grows 2 per step while a decodes: it reaches 150 after 5 steps
    assert run.p.wakeup(20) == 25  # a lower bound: floor((150 - 140) / 2) steps on
    run.p.advance(20, 25)
    assert run.start(25, fits) is None  # a tie at 150: the older entry (flow 0) still named
    assert run.p.wakeup(25) == 26
    run.p.advance(25, 26)
    assert run.start(26, fits) is small
    assert big.admit == -1
    assert run.p.wakeup(26) is None  # nothing else waits to pass anyone


def test_refused_requests_leave_the_run():
    """A request the engine refuses never starts, and the simulator is told it no longer waits."""
    policy, flows = flow_policy([1.0, 1.0])
    import dataclasses
    from types import MappingProxyType

    cls = dataclasses.replace(policy.classes["sim"], max_queue_length=1)
    policy = dataclasses.replace(policy, classes=MappingProxyType({"sim": cls}))
    pol = EngineDiscipline(policy, flows)
    left = []
    sim = fake_sim(2)
    sim.left = left.append
    pol.bind(sim)
    r0, r1 = (Request(k, 0, 0, 10, 5, 5) for k in range(2))
    pol.arrive(r0, 0)
    pol.arrive(r1, 0)  # the class already has one waiting: queue_full
    assert left == [r1] and pol.refused == {"flow-0": 1}
    assert pol.start(0, lambda r: True) is r0
