"""Each policy's rule on small hand-checked cases, driven directly through the policy
protocol (bind / arrive / peek / admit / advance) with a stand-in simulator."""

from __future__ import annotations

import types

import pytest

import sfq
from sfq.sim.model import FlowSpec, Request
from sfq.sim.policies import (
    DRR,
    FIFO,
    VTC,
    SeedSFQ,
    WFQ,
    RoundRobin,
    RPMLimitedFIFO,
    StrictPriority,
    context_h,
    make_policy,
)


def fake_sim(n=2, weights=None, priorities=None, w_p=1.0, w_q=2.0):
    weights = weights or [1.0] * n
    priorities = priorities or [0] * n
    flows = tuple(FlowSpec(f"f{i}", weights[i], priority=priorities[i]) for i in range(n))
    return types.SimpleNamespace(
        flows=flows, w_p=w_p, w_q=w_q, running=[0] * n, running_prompt=[0] * n, running_admit=[0] * n,
        running_flows=set(), estimate=lambda r: r.est,
    )


class Feed:
    """Numbered requests for a bound policy."""

    def __init__(self, policy, sim):
        self.p = policy
        self.sim = sim
        self.rid = 0
        policy.bind(sim)

    def arrive(self, flow, est=1.0, prompt=10, t=0, output=5):
        r = Request(self.rid, flow, t, prompt, output, output)
        r.est = est
        self.rid += 1
        self.p.arrive(r, t)
        return r

    def take(self, k=1, t=0):
        out = []
        for _ in range(k):
            r = self.p.peek(t)
            if r is None:
                break
            assert self.p.peek(t) is r  # peeking twice names the same request
            self.p.admit(r, t)
            out.append(r)
        return out

    def order(self, t=0):
        out = []
        while (r := self.p.peek(t)) is not None:
            self.p.admit(r, t)
            out.append(r)
        return out


def flows_of(reqs):
    return [r.flow for r in reqs]


def test_fifo_is_arrival_order_across_flows():
    f = Feed(FIFO(), fake_sim(3))
    for fl in (2, 0, 1, 0, 2):
        f.arrive(fl)
    assert [r.rid for r in f.order()] == [0, 1, 2, 3, 4]


def test_strict_priority_takes_the_most_urgent_class_fifo_inside():
    f = Feed(StrictPriority(), fake_sim(3, priorities=[1, 0, 1]))
    for fl in (0, 2, 1, 0, 1):
        f.arrive(fl)
    assert flows_of(f.order()) == [1, 1, 0, 2, 0]


def test_round_robin_one_request_per_turn_and_rejoin_at_the_tail():
    f = Feed(RoundRobin(), fake_sim(3))
    for fl in (0, 0, 0, 1, 2, 2):
        f.arrive(fl)
    assert flows_of(f.take(2)) == [0, 1]  # flow 1 now empty: leaves the line
    f.arrive(1)  # rejoins behind 2 and 0
    assert flows_of(f.order()) == [2, 0, 1, 2, 0]


def test_drr_quantum_accounting_by_hand():
    # quantum 100; flow 0: three requests of 60; flow 1: one of 150
    pol = DRR(quantum=100)
    f = Feed(pol, fake_sim(2))
    for est in (60, 60, 60):
        f.arrive(0, est)
    f.arrive(1, 150)
    # visit 0: +100 -> send 60 (deficit 40); 60 > 40 ends the visit, deficit kept
    assert flows_of(f.take()) == [0]
    assert pol.deficit == [40.0, 0.0]
    # visit 1: +100 -> 150 > 100, ends, kept;  visit 0: +100 -> 140: 60, 60, empty -> reset
    assert flows_of(f.take(2)) == [0, 0]
    assert pol.deficit == [0.0, 100.0]
    assert list(pol.active) == [1]
    # visit 1: +100 -> 200 -> send 150; empty -> reset
    assert flows_of(f.take()) == [1]
    assert pol.deficit == [0.0, 0.0] and not pol.active


def test_drr_weight_scales_the_quantum():
    f = Feed(DRR(quantum=10), fake_sim(2, weights=[3.0, 1.0]))
    for _ in range(6):
        f.arrive(0, 10)
        f.arrive(1, 10)
    assert flows_of(f.take(8)) == [0, 0, 0, 1, 0, 0, 0, 1]


def test_drr_small_quantum_needs_several_rounds():
    f = Feed(DRR(quantum=40), fake_sim(2))
    f.arrive(0, 100)
    f.arrive(1, 30)
    f.arrive(1, 30)
    # round 1: f0 40 < 100; f1 40 -> 30 (10 left), 30 > 10; round 2: f0 80; f1 50 -> 30 (empty)
    # round 3: f0 120 -> 100
    assert flows_of(f.order()) == [1, 1, 0]


def test_wfq_finish_tags_by_hand():
    pol = WFQ()
    f = Feed(pol, fake_sim(3, weights=[1.0, 2.0, 1.0]))
    a = [f.arrive(0, 4), f.arrive(0, 4)]  # tags 4, 8
    b = [f.arrive(1, 4), f.arrive(1, 4), f.arrive(1, 4)]  # tags 2, 4, 6
    assert [r.tag for r in a] == [4.0, 8.0]
    assert [r.tag for r in b] == [2.0, 4.0, 6.0]
    got = f.take(3)  # 2 (b), then the tie at 4: a's request arrived first
    assert [(r.flow, r.tag) for r in got] == [(1, 2.0), (0, 4.0), (1, 4.0)]
    assert pol.v == 4.0  # self-clocked: the finish tag of the last one started
    c = f.arrive(2, 1)  # a new flow starts at v: tag 4 + 1
    assert c.tag == 5.0
    assert [(r.flow, r.tag) for r in f.order()] == [(2, 5.0), (1, 6.0), (0, 8.0)]


@pytest.mark.parametrize("core", ["compiled", "reference"])
def test_sfq_policy_runs_the_cores_worked_example(core):
    """docs/design.md §2.7: A costs 3, B costs 1, A's head enqueued first -> A B B B A B B B."""
    cls = sfq.Scheduler if core == "compiled" else sfq.ReferenceScheduler
    if core == "compiled" and sfq.CORE != "compiled":
        pytest.skip("compiled core not built")
    pol = SeedSFQ(core=cls)
    f = Feed(pol, fake_sim(2))
    for _ in range(4):
        f.arrive(0, 3)
    for _ in range(6):
        f.arrive(1, 1)
    assert flows_of(f.take(8)) == [0, 1, 1, 1, 0, 1, 1, 1]
    assert isinstance(pol.sched, cls)
    assert pol.sched.meter(0) == 6.0 and pol.sched.meter(1) == 6.0


def test_sfq_policy_stages_one_dispatch_until_it_is_admitted():
    pol = SeedSFQ(core=sfq.ReferenceScheduler)
    f = Feed(pol, fake_sim(2))
    r0 = f.arrive(0, 5)
    f.arrive(1, 1)
    assert pol.peek(0) is r0 and pol.peek(1) is r0  # charged at dispatch, held while it does not fit
    assert len(pol.sched) == 1
    pol.admit(r0, 1)
    assert pol.peek(1).flow == 1


def test_sfq_policy_weights_reach_the_core():
    f = Feed(SeedSFQ(core=sfq.ReferenceScheduler), fake_sim(2, weights=[2.0, 1.0]))
    for _ in range(6):
        f.arrive(0, 2)
        f.arrive(1, 2)
    # charges 1 and 2; at the tie (2, 2) flow 1's head was enqueued first (ticket 4 < 5)
    assert flows_of(f.take(6)) == [0, 1, 0, 1, 0, 0]


def test_vtc_least_counter_first_charges_prefill_at_admission():
    pol = VTC()
    sim = fake_sim(2, w_p=1.0, w_q=2.0)
    f = Feed(pol, sim)
    f.arrive(0, prompt=100)
    f.arrive(0, prompt=100)
    f.arrive(1, prompt=30)
    f.arrive(1, prompt=30)
    # tie at 0: the older head (flow 0) first; then flow 1 (0 < 100) twice (30, 60 < 100); then 0
    assert flows_of(f.order()) == [0, 1, 1, 0]
    assert pol.c == [200.0, 60.0]


def test_vtc_decode_charge_per_step_and_weight():
    pol = VTC()
    sim = fake_sim(2, weights=[1.0, 2.0], w_q=2.0)
    pol.bind(sim)
    sim.running[:] = [3, 2]
    sim.running_flows.update({0, 1})
    pol.advance(10, 15)  # 5 steps: flow 0: 3*5*2 = 30; flow 1: 2*5*2 / 2 = 10
    assert pol.c == [30.0, 10.0]


def test_vtc_lift_to_min_active_counter():
    pol = VTC()
    f = Feed(pol, fake_sim(3))
    f.arrive(0)
    f.arrive(1)
    pol.c[:] = [500.0, 300.0, 50.0]
    pol.rekey()
    f.arrive(2)  # 2 was not waiting: lifted to min(500, 300) = 300, not to the max
    assert pol.c[2] == 300.0
    pol.c[2] = 400.0
    f.arrive(2)  # already waiting: no lift
    assert pol.c[2] == 400.0


def test_vtc_lift_never_lowers_a_counter():
    pol = VTC()
    f = Feed(pol, fake_sim(2))
    f.arrive(0)
    pol.c[:] = [100.0, 900.0]
    pol.rekey()
    f.arrive(1)
    assert pol.c[1] == 900.0  # deficits are preserved


def test_vtc_lift_with_empty_queue_uses_the_last_flow_that_left():
    pol = VTC()
    f = Feed(pol, fake_sim(3))
    f.arrive(1, prompt=70)
    f.order()  # flow 1 leaves the queue last, counter 70
    assert pol.last_left == 1
    f.arrive(0)
    assert pol.c[0] == 70.0


def test_lcf_banks_credit_while_idle():
    """Without the lift, a returning flow keeps its stale low counter and wins repeatedly."""
    lcf, vtc = VTC(lift=False), VTC(lift=True)
    assert make_policy("lcf").name == "lcf" and make_policy("vtc").name == "vtc"
    for pol in (lcf, vtc):
        f = Feed(pol, fake_sim(2))
        for _ in range(5):
            f.arrive(1, prompt=100)
        pol.c[:] = [0.0, 1000.0]  # flow 1 has been served a lot while flow 0 was away
        pol.rekey()
        f.arrive(1, prompt=100)
        for _ in range(5):
            f.arrive(0, prompt=100)
        f.take(5)
    assert lcf.c[0] == 500.0  # all five went to the returning flow
    # VTC lifted it to 1000: from there the two alternate (ties go to the older head, flow 1)
    assert vtc.c[0] == 1200.0 and vtc.c[1] == 1300.0


def test_vtc_h_charges_context_increments():
    """vtc-h: over k steps a running request is charged h(p, g+k) - h(p, g) exactly."""
    beta, w_p, w_q = 0.5, 1.0, 2.0
    h = context_h(beta)
    pol = VTC(beta=beta)
    sim = fake_sim(1, w_p=w_p, w_q=w_q)
    pol.bind(sim)
    # two running requests: (prompt 10, admitted at 3) and (prompt 20, admitted at 5)
    sim.running[0], sim.running_prompt[0], sim.running_admit[0] = 2, 30, 8
    sim.running_flows.add(0)
    pol.advance(7, 11)
    expect = sum(h(w_p, w_q, p, 11 - a) - h(w_p, w_q, p, 7 - a) for p, a in ((10, 3), (20, 5)))
    assert pol.c[0] == pytest.approx(expect)
    # one step at a time gives the same
    pol2 = VTC(beta=beta)
    pol2.bind(sim)
    for t in range(7, 11):
        pol2.advance(t, t + 1)
    assert pol2.c[0] == pytest.approx(expect)
    # h's per-step increment is w_q + beta * context length
    assert h(w_p, w_q, 10, 4) - h(w_p, w_q, 10, 3) == w_q + beta * (10 + 4)


def test_rpm_fifo_caps_each_flow_per_window():
    pol = RPMLimitedFIFO(rpm=2, window=100)
    f = Feed(pol, fake_sim(2))
    for fl in (0, 0, 0, 1, 1, 1):
        f.arrive(fl)
    assert [r.rid for r in f.order(t=5)] == [0, 1, 3, 4]
    assert pol.wakeup(5) == 100
    assert [r.rid for r in f.order(t=100)] == [2, 5]
    assert pol.wakeup(100) is None


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(name="nope"), "unknown policy 'nope'"),
        (dict(name="drr", quantum=0), "quantum must be"),
        (dict(name="fifo", rpm=0), "rpm must be"),
        (dict(name="vtc-h", beta=-1.0), "beta must be"),
    ],
)
def test_bad_policy_options_are_named(kw, err):
    with pytest.raises(ValueError, match=err):
        make_policy(kw.pop("name"), **kw)
