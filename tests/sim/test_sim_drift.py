"""The max drift (docs/simulator.md §4) cannot be gamed: on runs where a policy is unfair, it
says so, and a fair policy is not blamed for a client that asks for less than its share.

Unfair here means what the definition measures: while both flows of a pair have requests
waiting at the balancer, one receives more service than the other (weight-normalised), and
the gap grows with the run instead of staying within the bound ``2 max(w_p L_input, w_q M)``.
"""

from __future__ import annotations

import pytest

from sfq.sim import Fleet, Simulation, make_estimator, make_policy
from sfq.sim import metrics as m
from sfq.sim.model import FlowSpec
from sfq.sim.scenarios import DEFAULT_SIZES, bound_of, drift_workload, run_scenario, Options
from sfq.sim.workloads import Bursts, FlowLoad, Poisson, Sizes, build_workload, capacity

FAIR = ("sfq", "vtc", "wfq", "drr")


def run(wl, policy, steps, fleet=Fleet(1, 8192)):
    return Simulation(wl, make_policy(policy), fleet, horizon=steps, estimator=make_estimator(1.0, 2.0, 0.5)).run()


@pytest.mark.parametrize("seed", [1, 2])
def test_fifo_is_caught_where_the_drift_from_the_start_scored_it_zero(seed):
    """kv-sweep at M = 2,048: one client's queue drains once, so no pair stays busy to the end
    and the drift from the start gives FIFO 0; over the runs of steps in which both wait,
    FIFO's gap is many times the bound, the fair policies' within it."""
    wl = drift_workload(seed, 2048, 20_000)
    fleet = Fleet(1, 2048)
    fifo = run(wl, "fifo", 20_000, fleet)
    assert m.max_drift_from_start(fifo) == 0.0  # the flaw of the earlier form
    bound = bound_of(fifo)
    assert m.max_drift(fifo) > 5 * bound
    for p in ("sfq", "vtc"):
        assert m.max_drift(run(wl, p, 20_000, fleet)) < bound, p


def test_strict_priority_is_caught():
    """The urgent flow (0.9 C) empties its queue now and then, which restarts its pairs'
    intervals; within them the other flow gets nothing, and it shows."""
    c = capacity(8192, DEFAULT_SIZES)
    wl = build_workload(0, [FlowLoad(FlowSpec("urgent", priority=0), Poisson(0.9 * c, 0, 20_000), DEFAULT_SIZES),
                            FlowLoad(FlowSpec("other", priority=1), Poisson(0.6 * c, 0, 20_000), DEFAULT_SIZES)])
    prio = run(wl, "prio", 20_000)
    bound = bound_of(prio)
    assert m.max_drift(prio) > 3 * bound
    for p in FAIR:
        assert m.max_drift(run(wl, p, 20_000)) < m.max_drift(prio) / 5, p
    assert m.max_drift(run(wl, "sfq", 20_000)) < bound


def test_round_robin_under_heavy_requests_is_caught():
    """Round robin counts requests, not their size: the client with requests 20x larger takes
    most of the engine while both wait."""
    heavy = Sizes(prompt=(1500, 2000), output=(600, 1000), max_tokens=1000)
    light = Sizes(prompt=(64, 128), output=(32, 64), max_tokens=64)
    wl = build_workload(0, [FlowLoad(FlowSpec("heavy"), Poisson(0.05, 0, 20_000), heavy),
                            FlowLoad(FlowSpec("light"), Poisson(1.0, 0, 20_000), light)])
    rr = run(wl, "rr", 20_000)
    bound = bound_of(rr)
    assert m.max_drift(rr) > 5 * bound
    for p in ("sfq", "vtc"):
        assert m.max_drift(run(wl, p, 20_000)) < bound, p


def test_fifo_drift_grows_with_the_run():
    wl = drift_workload(0, 8192, 12_000)
    short, long = (m.max_drift(run(wl, "fifo", n)) for n in (4000, 12_000))
    assert long > 2.5 * short


def test_a_bursty_client_below_its_share_is_not_counted_as_a_gap():
    """Eight requests every 2,000 steps against a flooder: the bursty client asks for much
    less than half, so once its burst has started nothing of it waits. The busy interval form
    counts its running requests as a backlog and blames every fair policy for the service it
    did not ask for; the max drift does not, and still catches FIFO."""
    c = capacity(8192, DEFAULT_SIZES)
    wl = build_workload(0, [FlowLoad(FlowSpec("bursty"), Bursts(8, 2000, 0, 20_000), DEFAULT_SIZES),
                            FlowLoad(FlowSpec("flooder"), Poisson(1.2 * c, 0, 20_000), DEFAULT_SIZES)])
    for p in FAIR:
        res = run(wl, p, 20_000)
        d, busy = m.max_drift(res), m.max_interval_drift(res)
        assert d < bound_of(res) / 4, p
        assert busy > 2.5 * d, p
    fifo = run(wl, "fifo", 20_000)
    assert m.max_drift(fifo) > 10 * bound_of(fifo)


def test_scenario_rows_carry_both_forms():
    row = run_scenario("drift", Options(seed=0, steps=3000), ["fifo"]).results[0]
    assert row["max_drift"] > 0 and row["max_drift_from_start"] > 0
    assert row["drift_ratio"] == pytest.approx(row["max_drift"] / row["bound"])
    many = run_scenario("many", Options(seed=0, steps=500), ["fifo"]).results[0]
    assert many["max_drift"] is None and many["drift_ratio"] is None  # pairwise: not for 1,000 flows
