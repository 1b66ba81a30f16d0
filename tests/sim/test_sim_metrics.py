"""Metrics on hand-built run records."""

from __future__ import annotations

import numpy as np
import pytest

from sfq.sim import metrics as m
from sfq.sim.engine import Fleet, RunResult
from sfq.sim.model import FlowSpec


def fake(times, W, backlog, weights=(1.0, 1.0), end=None, requests=(), running=None):
    """Service given directly as prefill (w_p=1, w_q=0); ``backlog``: requests waiting,
    ``running``: requests running, per flow and sample. requests: (flow, arrival, admit)."""
    W = np.asarray(W, dtype=np.int64).T
    req = np.array(requests, dtype=np.int64).reshape(-1, 3)
    n = req.shape[0]
    return RunResult.from_dense(
        "x", tuple(FlowSpec(f"f{i}", w) for i, w in enumerate(weights)), Fleet(1, 100), 1.0, 0.0,
        end if end is not None else times[-1], times, W, np.zeros_like(W), np.asarray(backlog, dtype=np.int64).T,
        None if running is None else np.asarray(running, dtype=np.int64).T,
        arrival=req[:, 1], admit=req[:, 2], finish=np.full(n, -1), flow=req[:, 0],
        prompt=np.ones(n, dtype=np.int64), output=np.ones(n, dtype=np.int64), est=np.ones(n),
        server=np.zeros(n, dtype=np.int64), rejected=np.zeros(n, dtype=bool), events=len(times),
    )


def test_interval_drift_is_the_spread_inside_each_co_backlogged_interval():
    times = [0, 10, 20, 30, 40]
    W0 = [0, 100, 200, 200, 400]
    W1 = [0, 50, 100, 250, 260]
    # segments starting at samples 0, 1 and 3 have both flows waiting; 2 does not
    b0 = [1, 1, 1, 1, 1]
    b1 = [1, 1, 0, 1, 1]
    res = fake(times, [W0, W1], [b0, b1])
    # D = W0 - W1 = [0, 50, 100, -50, 140]; interval [0, 20]: 100; interval [30, 40]: 190
    assert m.max_interval_drift(res) == 190.0
    assert m.max_interval_drift(res, 0, 20) == 100.0
    # a drift that happens while one flow is not backlogged does not count
    res2 = fake(times, [W0, W1], [b0, [0, 0, 0, 0, 0]])
    assert m.max_interval_drift(res2) == 0.0
    # running work counts as backlogged (busy), unless busy=False: waiting only
    # D = [0, -100, -50, 100, 150]: split at sample 2, spreads 100 and 50; whole, 250
    V0, V1 = [0, 0, 50, 200, 250], [0, 100, 100, 100, 100]
    res3 = fake(times, [V0, V1], [b0, b1], running=[[0] * 5, [0, 0, 1, 0, 0]])
    assert m.max_interval_drift(res3) == 250.0
    assert m.max_interval_drift(res3, busy=False) == 100.0
    # above max_flows the pairwise form is not computed
    assert m.max_interval_drift(res, max_flows=1) is None


def test_max_drift_is_over_runs_of_steps_in_which_both_wait():
    """docs/simulator.md §4, by hand. Samples come as the simulator takes them: at each event
    one after the arrivals and one after the admissions (same step), service linear between."""
    times = [0, 0, 1, 1, 4, 4, 6]
    W0 = [0, 10, 20, 30, 60, 70, 90]
    W1 = [0, 0, 5, 5, 5, 5, 5]
    # flow 0 waits throughout; flow 1 has a request waiting in steps 0 and 1 (its request
    # starts at each, leaving nothing after the admissions), none in steps 2-3, again from 4
    wait = [[1] * 7, [1, 0, 1, 0, 1, 1, 1]]
    res = fake(times, [W0, W1], wait)
    # run 1: steps 0-1, to the end of step 1 (t=2, W0 = 30 + 30/3 = 40 interpolated, W1 = 5):
    # D = W0 - W1 = [0, 10, 15, 25, 35], spread 35; run 2: steps 4-5 (to t=6):
    # D = [55, 65, 75 (t=5), 85], spread 30
    assert m.max_drift(res) == 35.0
    assert m.max_drift(res, 4) == 30.0  # steps from 4 on
    assert m.max_drift(res, None, 2) == 35.0  # steps 0 and 1
    assert m.max_drift(res, None, 1) == 15.0  # step 0 only: D = 0, 10, then 15 at t=1
    # on the samples alone (the busy interval form, waiting only) each run breaks after an
    # admission that empties flow 1's queue, though its next request came the next step
    assert m.max_interval_drift(res, busy=False) == 30.0
    # work running does not make a flow backlogged: with flow 1 running in steps 2-3 the
    # busy form joins the runs; the max drift does not
    running = [[0] * 7, [0, 1, 0, 1, 0, 0, 0]]
    busy = fake(times, [W0, W1], wait, running=running)
    assert m.max_drift(busy) == 35.0
    assert m.max_interval_drift(busy) == 90.0 - 5.0
    # above max_flows the pairwise form is not computed
    assert m.max_drift(res, max_flows=1) is None
    # the same on the charged cost
    assert m.max_drift(fake(times, [W0, W1], wait), charged=True) == 35.0


def test_drift_from_start_is_the_gap_over_flows_busy_throughout():
    times = [0, 10, 20, 30, 40]
    W0 = [0, 100, 200, 200, 400]
    W1 = [0, 50, 100, 250, 260]
    W2 = [0, 0, 0, 0, 1000]
    # flows 0 and 1 busy throughout; flow 2 idles at sample 2: not in the set
    bl = [[1, 1, 1, 1, 1], [1, 1, 0, 1, 1], [1, 1, 0, 1, 1]]
    run = [[0] * 5, [0, 0, 1, 0, 0], [0] * 5]
    res = fake(times, [W0, W1, W2], bl, weights=(1.0, 1.0, 1.0), running=run)
    assert m.drift_set(res) == ([0, 1], 0)
    # gap W0 - W1 from step 0: [0, 50, 100, -50, 140]: the largest |.| is 140 (not restarted)
    assert m.max_drift_from_start(res) == 140.0
    t, gap, F = m.drift_curve(res)
    assert t.tolist() == times and gap.tolist() == [0, 50, 100, 50, 140] and F == [0, 1]
    assert m.max_drift_from_start(res, None, 30) == 100.0  # window [0, 30]
    # the interval form takes every pair, flow 2 included: in [30, 40], W1 - W2 goes
    # from 250 to -740 (flow 1 runs at sample 2, so flows 0 and 1 are one interval)
    assert m.max_interval_drift(res) == 990.0
    # a flow that joins late is measured from when all of the set are busy
    late = fake(times, [W0, [0, 0, 0, 100, 300]], [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    assert m.drift_set(late) == ([0, 1], 2)
    # from sample 2 (t=20): W0 gains [0, 0, 200], W1 [0, 100, 300]: gap 100
    assert m.max_drift_from_start(late) == 100.0
    # fewer than two flows busy throughout: no drift from the start, whatever happened before
    # flow 1 left (the flaw of this form: FIFO scores 0 on such a run); the max drift sees it
    gone = fake(times, [W0, W1], [[1] * 5, [1, 1, 1, 0, 0]])
    assert m.max_drift_from_start(gone) == 0.0
    assert m.max_drift(gone) == 150.0  # both waited in steps 0 .. 29: D from 100 (t=20) to -50 (t=30)



def test_max_drift_normalises_by_weight():
    res = fake([0, 10], [[0, 200], [0, 100]], [[1, 1], [1, 1]], weights=(2.0, 1.0))
    assert m.max_drift(res) == 0.0
    assert m.max_drift_from_start(res) == 0.0
    assert m.max_interval_drift(res) == 0.0


def test_jain_index_among_backlogged_flows():
    times = [0, 10, 20]
    even = fake(times, [[0, 10, 20], [0, 10, 20]], [[1, 1, 1], [1, 1, 1]])
    assert m.jain_index(even) == pytest.approx(1.0)
    starved = fake(times, [[0, 10, 20], [0, 0, 0]], [[1, 1, 1], [1, 1, 1]])
    assert m.jain_index(starved) == pytest.approx(0.5)
    # a flow that never waits is not counted: one backlogged flow left, no index
    lone = fake(times, [[0, 10, 20], [0, 0, 0]], [[1, 1, 1], [0, 0, 0]])
    assert m.jain_index(lone) is None
    # rates while backlogged: flow 1 waited only during [10, 20] and got 10 then
    part = fake(times, [[0, 10, 20], [0, 0, 10]], [[1, 1, 1], [0, 1, 1]])
    assert m.jain_index(part) == pytest.approx(1.0)


def test_waits_count_unstarted_requests_until_the_end():
    res = fake([0, 100], [[0, 1], [0, 1]], [[0, 0], [0, 0]], end=100,
               requests=[(0, 0, 5), (0, 10, 10), (1, 20, -1), (1, 100, -1)])
    assert m.waits(res).tolist() == [5, 0, 80]  # the request arriving at the end is not counted
    assert m.waits(res, 1).tolist() == [80]
    assert m.wait_quantiles(res, 0, (50,)) == [2.5]


def test_throughput_and_service_at_interpolate_between_samples():
    res = fake([0, 10, 20], [[0, 100, 300], [0, 0, 100]], [[0, 0, 0], [0, 0, 0]])
    assert m.service_at(res, 15).tolist() == [200.0, 50.0]
    assert m.throughput(res) == pytest.approx(400 / 20)
    assert m.throughput(res, 10, 20) == pytest.approx(300 / 10)
