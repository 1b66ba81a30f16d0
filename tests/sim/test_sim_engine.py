"""The fleet model: hand-checked runs, event skipping equal to stepping, placement."""

from __future__ import annotations

import numpy as np
import pytest

from sfq.sim import metrics as m
from sfq.sim.engine import Fleet, Simulation, simulate
from sfq.sim.model import FlowSpec, Workload
from sfq.sim.policies import make_policy
from sfq.sim.workloads import FlowLoad, Poisson, Sizes, build_workload


def wl(rows, flows=2, weights=None):
    """rows: (arrival, flow, prompt, output)."""
    weights = weights or [1.0] * flows
    specs = [FlowSpec(f"f{i}", weights[i]) for i in range(flows)]
    a, f, p, o = zip(*rows)
    return Workload.from_arrays(specs, a, f, p, o)


def test_hand_checked_run_kv_admission_and_stall():
    # M = 100. t=0: r0 (p50,o3) and r1 (p40,o2) fit (0+50, 50+40). t=1: r2 (p30) does not:
    # occupancy 90 + 2 generated = 92, +30 > 100: stall. t=2: r1 leaves (2 tokens), r0 holds
    # 50 + 2 = 52, +30 fits: r2 starts at 2 and is gone at 3 with r0.
    w = wl([(0, 0, 50, 3), (0, 1, 40, 2), (1, 0, 30, 1)])
    res = simulate(w, "fifo", Fleet(1, 100), w_p=1.0, w_q=2.0)
    assert res.admit.tolist() == [0, 0, 2]
    assert res.finish.tolist() == [3, 2, 3]
    assert res.end == 3
    assert res.service[-1].tolist() == [80 + 2 * 4, 40 + 2 * 2]
    assert m.waits(res).tolist() == [0, 0, 1]
    # service at step 1: prefill 50 and 40, one token each
    assert m.service_at(res, 1).tolist() == [52.0, 42.0]
    # both waited only at t=0, when the prefills 50 and 40 were charged: interval drift 10
    # (waiting at the balancer, or waiting or running: both decode alike until f1 ends)
    assert m.max_interval_drift(res, busy=False) == 10.0
    assert m.max_interval_drift(res) == 10.0
    # the max drift (docs/simulator.md §4): both waited in step 0 only; over [0, 1] the gap is 10
    assert m.max_drift(res) == 10.0 and m.max_drift(res, None, 1) == 10.0
    assert m.max_drift(res, 1) == 0.0  # from step 1 on, only f0 waits (r2, in step 1)
    # the drift from the start (the earlier form): both busy through step 1, gap 10 there
    assert m.drift_set(res, None, 1) == ([0, 1], 0) and m.max_drift_from_start(res, None, 1) == 10.0
    # f1 has nothing left from step 2, f0 from step 3: no flow is busy to the end
    assert m.drift_set(res, None, 2)[0] == [0]
    assert m.drift_set(res)[0] == [] and m.max_drift_from_start(res) == 0.0


def test_decode_growth_is_not_reserved_and_prompt_over_budget_is_rejected():
    # two prompts of 60 never co-reside in M=100; a prompt of 101 can never run
    w = wl([(0, 0, 60, 10), (0, 1, 40, 10), (0, 1, 101, 5)])
    res = simulate(w, "fifo", Fleet(1, 100))
    assert res.admit.tolist() == [0, 0, -1]
    assert res.rejected.tolist() == [False, False, True]
    summary = m.flow_summary(res)
    assert summary["f1"]["rejected"] == 1 and summary["f1"]["completed"] == 1
    assert summary["f1"]["waiting"] == 0  # rejected, not lost or waiting forever


def test_max_batch_and_placement_on_most_free_kv():
    # 2 servers x 1 slot: r0 -> server 0, r1 -> server 1, r2 waits for the first to finish
    w = wl([(0, 0, 10, 5), (0, 1, 10, 3), (0, 0, 10, 1)])
    res = simulate(w, "fifo", Fleet(2, 100, max_batch=1))
    assert res.admit.tolist() == [0, 0, 3]
    assert res.server.tolist() == [0, 1, 1]
    # placement picks the server with the most free KV (ties: the lower index)
    w2 = wl([(0, 0, 70, 10), (1, 1, 10, 3), (1, 0, 20, 3)])
    res2 = simulate(w2, "fifo", Fleet(2, 100))
    assert res2.server.tolist() == [0, 1, 1]  # free at t=1: 100-71=29 vs 100, then 29 vs 90


def test_horizon_stops_and_counts_unstarted_waits_until_the_end():
    w = wl([(0, 0, 50, 100), (1, 1, 60, 5)])
    res = simulate(w, "fifo", Fleet(1, 100), horizon=40)
    assert res.end == 40
    assert res.admit.tolist() == [0, -1]
    assert m.waits(res).tolist() == [0, 39]  # still waiting: counted until the end
    assert m.flow_summary(res)["f1"]["waiting"] == 1


def reference_vtc(workload, M, w_p, w_q, horizon, lift=True):
    """VTC's admission loop, one step at a time, one engine (independent of the engine)."""
    reqs = [dict(rid=i, a=int(a), f=int(f), p=int(p), o=int(o), g=0, admit=-1)
            for i, (a, f, p, o) in enumerate(zip(workload.arrival, workload.flow, workload.prompt, workload.output))]
    nf = len(workload.flows)
    c = [0.0] * nf
    queue, running = [], []
    last_left = None
    i = 0
    for t in range(horizon):
        running = [r for r in running if r["g"] < r["o"]]
        while i < len(reqs) and reqs[i]["a"] <= t:
            r = reqs[i]
            i += 1
            if lift and r["f"] not in {x["f"] for x in queue}:
                active = {x["f"] for x in queue}
                if active:
                    c[r["f"]] = max(c[r["f"]], min(c[k] for k in active))
                elif last_left is not None:
                    c[r["f"]] = max(c[r["f"]], c[last_left])
            queue.append(r)
        occupancy = sum(r["p"] + r["g"] for r in running)
        while queue:
            k = min({r["f"] for r in queue}, key=lambda j: (c[j], min(x["rid"] for x in queue if x["f"] == j)))
            r = next(x for x in queue if x["f"] == k)
            if occupancy + r["p"] > M:
                break
            queue.remove(r)
            running.append(r)
            r["admit"] = t
            occupancy += r["p"]
            c[k] += w_p * r["p"]
            if not any(x["f"] == k for x in queue):
                last_left = k
        for r in running:
            r["g"] += 1
            c[r["f"]] += w_q
    return [r["admit"] for r in reqs], c


@pytest.mark.parametrize("lift", [True, False])
def test_event_skipping_equals_the_stepped_admission_loop(lift):
    sizes = Sizes((20, 120), (5, 60))
    loads = [
        FlowLoad(FlowSpec("a"), Poisson(0.08, 0, 400), sizes),
        FlowLoad(FlowSpec("b"), Poisson(0.05, 0, 150), sizes),
        FlowLoad(FlowSpec("c"), Poisson(0.06, 200, 400), sizes),
    ]
    w = build_workload(7, loads)
    H = 450
    policy = make_policy("vtc" if lift else "lcf")
    res = Simulation(w, policy, Fleet(1, 600), w_p=1.0, w_q=2.0, horizon=H).run()
    admits, counters = reference_vtc(w, 600, 1.0, 2.0, H, lift)
    assert res.admit.tolist() == admits
    assert policy.c == pytest.approx(counters)


@pytest.mark.parametrize("name", ["fifo", "rr", "drr", "wfq", "sfq", "lcf", "vtc", "vtc-h", "prio"])
def test_event_skipping_equals_stepping_every_step(name):
    """Forcing an event at every step (marks) changes nothing but the sample count."""
    sizes = Sizes((20, 200), (5, 80), max_tokens=100)
    loads = [
        FlowLoad(FlowSpec("a", 2.0), Poisson(0.1, 0, 300), sizes),
        FlowLoad(FlowSpec("b", 1.0, priority=1), Poisson(0.07, 50, 300), sizes),
    ]
    w = build_workload(3, loads)
    fleet = Fleet(2, 500, max_batch=4)
    fast = Simulation(w, make_policy(name), fleet, horizon=320).run()
    slow = Simulation(w, make_policy(name), fleet, horizon=320, marks=range(320)).run()
    assert fast.admit.tolist() == slow.admit.tolist()
    assert fast.finish.tolist() == slow.finish.tolist()
    assert np.allclose(m.service_at(fast, 320), m.service_at(slow, 320))
    assert m.max_drift(fast) == pytest.approx(m.max_drift(slow))
    assert slow.times.size > fast.times.size


def test_every_request_is_accounted_for():
    sizes = Sizes((20, 200), (5, 80))
    w = build_workload(1, [FlowLoad(FlowSpec("a"), Poisson(0.2, 0, 200), sizes),
                           FlowLoad(FlowSpec("b"), Poisson(0.2, 0, 200), sizes)])
    for name in ("fifo", "sfq", "vtc", "drr"):
        res = simulate(w, name, Fleet(1, 400))
        assert (res.finish >= 0).all(), name  # no horizon: everything ran to completion
        s = m.flow_summary(res)
        assert sum(v["completed"] for v in s.values()) == len(w)


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(servers=0), "servers must be"),
        (dict(kv_budget=0), "kv_budget must be"),
        (dict(max_batch=0), "max_batch must be"),
    ],
)
def test_bad_fleet_is_named(kw, err):
    with pytest.raises(ValueError, match=err):
        Fleet(**kw)


def test_bad_workload_is_named():
    with pytest.raises(ValueError, match=r"request 1: prompt 0 must be >= 1"):
        wl([(0, 0, 5, 5), (0, 1, 0, 5)])
    with pytest.raises(ValueError, match="max_tokens 3 must be >= output"):
        Workload.from_arrays([FlowSpec("a")], [0], [0], [5], [4], [3])
    with pytest.raises(ValueError, match="weight of flow 'a'"):
        FlowSpec("a", 0.0)
    with pytest.raises(ValueError, match="horizon must be"):
        Simulation(wl([(0, 0, 5, 5)]), make_policy("fifo"), horizon=0)


def test_a_simulation_runs_once():
    sim = Simulation(wl([(0, 0, 5, 5)]), make_policy("fifo"))
    sim.run()
    with pytest.raises(RuntimeError, match="already run"):
        sim.run()


def test_counter_policies_start_a_request_when_their_order_changes_between_events():
    """The issue's hand-checkable case. M = 1000, w_p = 1, w_q = 2. Step 0: a0 (A, p100,
    o300) and b0 (B, p148, o1) start; A's next, a1 (p950), fits nowhere until a0 leaves at
    300. B's counter stays at 148 + 2 = 150 after b0; A's grows 2 per step from 100 while
    a0 decodes: 100 + 2t passes 150 at t = 26 (at 25 the tie goes to A's older head), so
    b1 (p50, arrived at 1) starts at step 26, not at the next event (300)."""
    w = wl([(0, 0, 100, 300), (0, 1, 148, 1), (0, 0, 950, 10), (1, 1, 50, 5)])
    for name, lift in (("lcf", False), ("vtc", True)):
        res = simulate(w, name, Fleet(1, 1000), w_p=1.0, w_q=2.0)
        assert res.admit.tolist() == [0, 0, 300, 26], name
        assert res.admit.tolist() == reference_vtc(w, 1000, 1.0, 2.0, 400, lift)[0], name
    # sfq charging service as it is delivered moves its meters the same way: same steps
    assert simulate(w, "sfq", Fleet(1, 1000)).admit.tolist() == [0, 0, 300, 26]
    # the plain rule (docs/design.md §2) dispatches (and charges) a1 before it fits: b1 waits behind it
    assert simulate(w, "sfq-seed", Fleet(1, 1000)).admit.tolist() == [0, 0, 300, 300]


@pytest.mark.parametrize("charge", ["seed", "settle", "served"])
def test_sfq_charge_modes_event_skipping_equals_stepping(charge):
    sizes = Sizes((20, 200), (5, 80), max_tokens=100)
    loads = [
        FlowLoad(FlowSpec("a", 2.0), Poisson(0.1, 0, 300), sizes),
        FlowLoad(FlowSpec("b"), Poisson(0.07, 50, 300), sizes),
        FlowLoad(FlowSpec("c"), Poisson(0.03, 0, 300), Sizes((300, 400), (50, 100))),
    ]
    w = build_workload(5, loads)
    fleet = Fleet(1, 700)
    fast = Simulation(w, make_policy("sfq", charge=charge), fleet, horizon=320).run()
    slow = Simulation(w, make_policy("sfq", charge=charge), fleet, horizon=320, marks=range(320)).run()
    assert fast.admit.tolist() == slow.admit.tolist()
    assert m.max_drift(fast) == pytest.approx(m.max_drift(slow))


def test_closed_loop_client_keeps_its_requests_waiting():
    from sfq.sim.model import ClosedLoop

    specs = [FlowSpec("c")]
    # one slot: each request runs 5 steps; the client tops up to 1 waiting at every step
    w = Workload.from_arrays(specs, [], [], [], [], closed=[ClosedLoop(0, 1, (10, 10), (5, 5))])
    res = simulate(w, "fifo", Fleet(1, 100, max_batch=1), horizon=23)
    assert res.arrival.tolist() == [0, 1, 6, 11, 16, 21]
    assert res.admit.tolist() == [0, 5, 10, 15, 20, -1]
    waiting = res.series(0, "waiting")
    assert (waiting[0::2] == 1).all()  # before admission, at every event: one waiting
    # a window: tops up from step 3, none after step 12; what it sent still runs
    w2 = Workload.from_arrays(specs, [], [], [], [], closed=[ClosedLoop(0, 1, (10, 10), (5, 5), None, 3, 12)])
    res2 = simulate(w2, "fifo", Fleet(1, 100, max_batch=1))
    assert res2.arrival.tolist() == [3, 4, 9] and res2.admit.tolist() == [3, 8, 13]
    # sizes come from the flow's own seeded stream: the same under every policy
    a = simulate(w, "vtc", Fleet(1, 100), horizon=50)
    b = simulate(w, "sfq", Fleet(1, 100), horizon=50)
    n = min(a.prompt.size, b.prompt.size)
    assert n > 5 and a.prompt[:n].tolist() == b.prompt[:n].tolist()
    with pytest.raises(ValueError, match="needs a horizon"):
        Simulation(w, make_policy("fifo"), Fleet(1, 100))
    with pytest.raises(ValueError, match="exceed the KV budget 50"):
        Simulation(Workload.from_arrays(specs, [], [], [], [], closed=[ClosedLoop(0, 1, (10, 60), (5, 5))]),
                   make_policy("fifo"), Fleet(1, 50), horizon=10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stall_prone_workloads_event_skipping_equals_stepping(seed):
    """Big and small requests mixed on a tight budget: the named request often fits
    nowhere while a smaller one of another flow would. Counter policies (and sfq charging
    as served) must start that one at the step their order changes, as stepping does."""
    from sfq.sim.workloads import Mix

    sizes = Mix(((0.3, Sizes((350, 450), (50, 150))), (0.7, Sizes((10, 60), (5, 40)))))
    loads = [FlowLoad(FlowSpec(n), Poisson(r, 0, 500), sizes) for n, r in (("a", 0.05), ("b", 0.04), ("c", 0.03))]
    w = build_workload(seed, loads)
    for name, lift in (("lcf", False), ("vtc", True)):
        res = Simulation(w, make_policy(name), Fleet(1, 600), horizon=700).run()
        assert res.admit.tolist() == reference_vtc(w, 600, 1.0, 2.0, 700, lift)[0], name
    for name in ("vtc-h", "sfq"):
        fast = Simulation(w, make_policy(name), Fleet(1, 600), horizon=700).run()
        slow = Simulation(w, make_policy(name), Fleet(1, 600), horizon=700, marks=range(700)).run()
        assert fast.admit.tolist() == slow.admit.tolist(), name
