"""Seeded workload generators: deterministic, per-flow streams, the shapes they promise."""

from __future__ import annotations

import numpy as np

from sfq.sim.model import FlowSpec
from sfq.sim.workloads import Batch, Bursts, FlowLoad, Mix, OnOff, Periodic, Poisson, Sizes, build_workload, capacity

SIZES = Sizes((10, 20), (1, 5), max_tokens=8)


def test_same_seed_same_workload_and_flows_draw_from_their_own_streams():
    a = [FlowLoad(FlowSpec("a"), Poisson(0.2, 0, 500), SIZES)]
    ab = a + [FlowLoad(FlowSpec("b"), Poisson(0.3, 0, 500), SIZES)]
    w1, w2, w3 = build_workload(1, a), build_workload(1, a), build_workload(1, ab)
    assert np.array_equal(w1.arrival, w2.arrival) and np.array_equal(w1.prompt, w2.prompt)
    only_a = w3.flow == 0
    assert np.array_equal(w3.prompt[only_a], w1.prompt)  # adding a flow changed nothing of a's
    assert not np.array_equal(build_workload(2, a).arrival, w1.arrival)
    assert (np.diff(w3.arrival) >= 0).all()


def test_generator_shapes():
    rng = np.random.default_rng(0)
    assert Batch(5, at=7).times(rng).tolist() == [7] * 5
    assert Periodic(10, 0, 35).times(rng).tolist() == [0, 10, 20, 30]
    b = Bursts(3, 100, start=50, end=300).times(rng)
    assert b.tolist() == [50] * 3 + [150] * 3 + [250] * 3
    j = Bursts(2, 100, start=0, end=300, jitter=50).times(rng)
    assert j.size == 6 and all(0 <= t - 100 * (k // 2) < 50 for k, t in enumerate(j.tolist()))
    on = OnOff(0.5, on=10, off=90, start=0, end=1000).times(rng)
    assert on.size > 0 and ((on % 100) < 10).all()
    p, o, m = Mix(((0.5, Sizes((1, 1), (1, 1))), (0.5, Sizes((100, 100), (50, 50))))).draw(rng, 400)
    assert set(p.tolist()) == {1, 100} and (o[p == 100] == 50).all() and (m >= o).all()
    p, o, m = SIZES.draw(rng, 1000)
    assert p.min() >= 10 and p.max() <= 20 and o.min() >= 1 and o.max() <= 5 and (m == 8).all()


def test_capacity_matches_the_arithmetic():
    # M=8192, prompts U[64,512], outputs U[32,384]: about 19.6 residents, 0.094 completions/step
    c = capacity(8192, Sizes((64, 512), (32, 384)))
    assert 0.090 < c < 0.098
    assert capacity(16384, Sizes((64, 512), (32, 384))) == 2 * c
