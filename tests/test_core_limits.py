"""Bad input, fixed-point limits, renormalisation, bounded memory, and which core loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tracemalloc
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from core_helpers import dispatch_tuple, snapshot

import sfq
from sfq import _scheduler_py as twin
from sfq._common import SCALE

FLOWS = ["a", "b"]

BAD_COSTS = [
    (0, ValueError),
    (-1, ValueError),
    (-0.0, ValueError),
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    (float("-inf"), ValueError),
    ("3", TypeError),
    (None, TypeError),
    (True, TypeError),
    (Decimal("1"), TypeError),
    ([1], TypeError),
    (2**30 + 1, OverflowError),
    (1e300, OverflowError),
    (10**400, OverflowError),
]
BAD_WEIGHTS = [
    (0, ValueError),
    (-1.5, ValueError),
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    (1e-9, ValueError),
    (2.0**21, ValueError),
    ("2", TypeError),
    (None, TypeError),
    (False, TypeError),
    (10**400, OverflowError),
]


def _busy(make):
    s = make()
    s.enqueue("a", 3)
    s.enqueue("b", 1)
    s.dispatch()
    return s


@pytest.mark.parametrize("cost,exc", BAD_COSTS, ids=repr)
def test_bad_cost_raises_naming_it_and_changes_nothing(make, cost, exc):
    s = _busy(make)
    before = snapshot(s, FLOWS)
    with pytest.raises(exc) as info:
        s.enqueue("a", cost)
    assert repr(cost) in str(info.value)
    assert snapshot(s, FLOWS) == before
    assert s.enqueue("a", 1) == 3  # no ticket was consumed by the failed call


@pytest.mark.parametrize("weight,exc", BAD_WEIGHTS, ids=repr)
def test_bad_weight_raises_naming_it_and_changes_nothing(make, weight, exc):
    s = _busy(make)
    before = snapshot(s, FLOWS)
    with pytest.raises(exc) as info:
        s.set_weight("a", weight)
    assert repr(weight) in str(info.value)
    assert snapshot(s, FLOWS) == before


@pytest.mark.parametrize("flow", [[1], {"a": 1}, {1}, ([],)], ids=repr)
def test_unhashable_flow(make, flow):
    s = _busy(make)
    before = snapshot(s, FLOWS)
    for call in (
        lambda: s.enqueue(flow, 1),
        lambda: s.set_weight(flow, 2),
        lambda: s.meter(flow),
        lambda: s.pending(flow),
        lambda: s.enqueue_many(["a", flow], [1, 1]),
    ):
        with pytest.raises(TypeError, match="is not hashable") as info:
            call()
        assert repr(flow) in str(info.value)
    assert snapshot(s, FLOWS) == before


def test_error_messages_identical_in_both_twins():
    msgs = {}
    for cls in (sfq.Scheduler, sfq.ReferenceScheduler):
        s, out = cls(), []
        for cost, _ in BAD_COSTS:
            try:
                s.enqueue("a", cost)
            except Exception as e:
                out.append((type(e).__name__, str(e)))
        for w, _ in BAD_WEIGHTS:
            try:
                s.set_weight("a", w)
            except Exception as e:
                out.append((type(e).__name__, str(e)))
        msgs[cls] = out
    assert len(msgs[sfq.Scheduler]) == len(BAD_COSTS) + len(BAD_WEIGHTS)
    assert msgs[sfq.Scheduler] == msgs[sfq.ReferenceScheduler]


def test_numeric_types_accepted(make):
    s = make()
    for c in (1, 2.5, np.float64(3), np.int32(4), Fraction(1, 3), 2**30):
        s.enqueue("a", c)
    s.set_weight("a", np.float32(2))
    s.set_weight("b", Fraction(1, 2))
    assert len(s) == 6


def test_exact_for_integer_costs_and_power_of_two_weights(make):
    s = make()
    s.set_weight("a", 0.25)
    s.set_weight("b", 8)
    s.enqueue("a", 3)
    s.enqueue("b", 1000001)
    assert s.dispatch().finish == 12.0
    assert s.dispatch().finish == 1000001 / 8


def test_tiny_costs_still_advance_the_meter(make):
    s = make()
    s.set_weight("a", 2.0**20)
    for _ in range(3):
        s.enqueue("a", 1e-12)
        s.enqueue("b", 1e-12)
    finishes = [s.dispatch().finish for _ in range(6)]
    assert all(f > 0 for f in finishes)  # every charge is at least one sub-unit


# ---------------------------------------------------------------- renormalisation


def _huge_run(s, n):
    """Maximal charges (cost 2**30 at weight 2**-10 = 2**60 sub-units each): without
    renormalisation an int64 meter would overflow within 8 dispatches."""
    out = []
    for f in ("a", "b", "c"):
        s.set_weight(f, sfq.MIN_WEIGHT)
    for k in range(n):
        s.enqueue("abc"[k % 3], sfq.MAX_COST, k)
        if k % 3 == 2:
            s.enqueue("c", 1.0, -k)  # a cheap one among the giants
    while len(s):
        out.append(dispatch_tuple(s.dispatch()))
        out.append((s.virtual_time, s.meter("a"), s.meter("b"), s.meter("c")))
    return out


def test_renormalisation_changes_no_decision():
    """The compiled core renormalises; the twin uses unbounded ints and never does.
    Every decision, meter and tag must agree anyway, far past int64's range."""
    c, r = sfq.Scheduler(), sfq.ReferenceScheduler()
    out_c, out_r = _huge_run(c, 600), _huge_run(r, 600)
    assert out_c == out_r
    assert r.virtual_time * SCALE > 2**63 * 10  # far beyond int64 without renormalisation
    if sfq.CORE == "compiled":
        assert c.renormalisations > 50


def test_renormalisation_with_idle_and_dormant_flows():
    rows = {}
    for cls in (sfq.Scheduler, sfq.ReferenceScheduler):
        s = cls()
        s.set_weight("dormant", 2.0)  # known, never waiting: kept for its weight
        s.set_weight("x", sfq.MIN_WEIGHT)
        log = []
        for k in range(200):
            s.enqueue("x", sfq.MAX_COST)
            s.enqueue("y", 5.0)
            if k % 7 == 0:
                s.enqueue("dormant", 1.0)
            while len(s) > 1:
                log.append(dispatch_tuple(s.dispatch()))
            log.append((s.meter("dormant"), s.meter("x"), s.meter("y"), s.virtual_time, s.known_flows))
        rows[cls] = log
    assert rows[sfq.Scheduler] == rows[sfq.ReferenceScheduler]


# ---------------------------------------------------------------- bounded memory


def _churn(s, n, start=0):
    """One backlogged flow, and n distinct short-lived flows each sending one request.

    (Two dispatches per arrival: if fresh flows arrived exactly at the dispatch rate they
    would all start at v and be served before the backlogged flow, v would never move, and
    every one of them would still be owed a charge: that state is information.)"""
    peak = 0
    for k in range(start, start + n):
        s.enqueue(("churn", k), 1.0 + k % 7)
        while s.pending("bg") < 2:
            s.enqueue("bg", 3.0)
        s.dispatch()
        s.dispatch()
        peak = max(peak, s.known_flows)
    return peak


def test_memory_does_not_grow_with_distinct_flow_keys(make):
    s = make()
    n = 200_000 if s.__class__ is sfq.Scheduler and sfq.CORE == "compiled" else 50_000
    _churn(s, n // 10)
    tracemalloc.start()
    try:
        _churn(s, 2000, start=10**7)
        base, _ = tracemalloc.get_traced_memory()
        peak_flows = _churn(s, n, start=2 * 10**7)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_flows <= 16, peak_flows  # idle flows are forgotten once v passes them
    assert s.known_flows <= 16
    assert after - base < 64 * 1024, (base, after)  # flat, not O(n)


def test_a_million_distinct_flows_compiled():
    if sfq.CORE != "compiled":
        pytest.skip("the compiled core is not loaded")
    s = sfq.Scheduler()
    assert _churn(s, 1_000_000) <= 16
    while len(s):
        s.dispatch()
    for k in range(1000):  # and with nothing else waiting: the global-idle path
        s.enqueue(("solo", k), 2.0)
        s.dispatch()
    assert s.known_flows <= 16


def test_flows_with_weights_are_remembered(make):
    s = make()
    s.set_weight("w", 4)
    s.enqueue("w", 1)
    s.dispatch()
    s.enqueue("z", 100)
    s.dispatch()
    assert s.weight("w") == 4.0 and s.known_flows >= 1
    s.set_weight("w", 1)
    assert s.weight("w") == 1.0


# ---------------------------------------------------------------- batch API


def test_batch_api_matches_single_calls(make):
    rnd = np.random.default_rng(5)
    flows = rnd.integers(0, 50, size=3000)
    costs = rnd.uniform(1, 1000, size=3000)
    a, b = make(), make()
    ta = a.enqueue_many(flows, costs, list(range(3000)))
    tb = [b.enqueue(int(f), float(c), k) for k, (f, c) in enumerate(zip(flows, costs))]
    assert ta.dtype == np.int64 and ta.tolist() == tb
    for n in (1, 7, 500, 10_000):
        batch = a.dispatch_many(n)
        singles = [b.dispatch() for _ in range(len(batch))]
        assert batch.flows == [d.flow for d in singles]
        assert batch.items == [d.item for d in singles]
        assert batch.tickets.tolist() == [d.ticket for d in singles]
        assert batch.costs.tolist() == [d.cost for d in singles]
        assert batch.starts.tolist() == [d.start for d in singles]
        assert batch.finishes.tolist() == [d.finish for d in singles]
        assert snapshot(a, list(range(50))) == snapshot(b, list(range(50)))
    assert len(a) == 0 and len(a.dispatch_many(10)) == 0


def test_batch_bad_input_enqueues_nothing(make):
    s = make()
    s.enqueue("a", 1)
    before = snapshot(s, FLOWS)
    with pytest.raises(ValueError, match="-5.0"):
        s.enqueue_many(["a", "b", "a"], [1.0, -5.0, 2.0])
    with pytest.raises(ValueError, match="nan"):
        s.enqueue_many(["a", "b"], np.array([1.0, np.nan]))
    with pytest.raises(TypeError):
        s.enqueue_many(["a", "b"], ["1", "2"])
    with pytest.raises(ValueError, match="one per flow"):
        s.enqueue_many(["a", "b"], [1.0])
    with pytest.raises(ValueError, match="one entry per flow"):
        s.enqueue_many(["a", "b"], [1.0, 2.0], items=[1])
    with pytest.raises(OverflowError):
        s.enqueue_many(["a"], [2.0**31])
    with pytest.raises(ValueError):
        s.dispatch_many(-1)
    assert snapshot(s, FLOWS) == before


# ---------------------------------------------------------------- which core


@pytest.mark.skipif(os.environ.get("SFQ_NO_EXTENSIONS", "") not in ("", "0"), reason="twin forced")
def test_compiled_extension_really_loaded():
    """Fails when the build silently fell back to the twin."""
    assert sfq.CORE == "compiled"
    assert sfq.Scheduler is not sfq.ReferenceScheduler
    assert type(sfq.Scheduler()).__module__ == "sfq._csfq"
    assert sfq.Dispatch is not twin.Dispatch
    assert sfq.Dispatch.__name__ == "Dispatch"


def _run(code, **env):
    e = dict(os.environ)
    e.pop("SFQ_NO_EXTENSIONS", None)
    e.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True)


def test_env_var_forces_the_twin():
    p = _run("import sfq; s = sfq.Scheduler(); s.enqueue('a', 1); d = s.dispatch()\n"
             "print(sfq.CORE, sfq.Scheduler.__name__, sfq.Dispatch.__name__, type(d) is sfq.Dispatch)",
             SFQ_NO_EXTENSIONS="1")
    assert p.returncode == 0, p.stderr
    # the scheduler is the twin by its name; what it hands out is the one Dispatch
    assert p.stdout.split() == ["reference", "ReferenceScheduler", "Dispatch", "True"]


def test_missing_extension_falls_back_with_one_warning():
    code = """
        import sys, warnings
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "sfq._csfq":
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import sfq
            import sfq._core
        ws = [x for x in w if issubclass(x.category, RuntimeWarning)]
        print(sfq.CORE, len(ws), "pure-Python" in str(ws[0].message))
        s = sfq.Scheduler(); s.enqueue("a", 1); print(s.dispatch().flow)
    """
    p = _run(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["reference", "1", "True", "a"]


def test_renormalisation_inside_batches():
    outs = []
    for cls in (sfq.Scheduler, sfq.ReferenceScheduler):
        s = cls()
        s.set_weight("a", sfq.MIN_WEIGHT)
        s.set_weight("b", sfq.MIN_WEIGHT)
        s.enqueue_many(["a", "b", "c"] * 100, [sfq.MAX_COST, sfq.MAX_COST, 1.0] * 100, list(range(300)))
        out = []
        while len(s):
            b = s.dispatch_many(7)
            out.append((b.flows, b.items, b.tickets.tolist(), b.starts.tolist(), b.finishes.tolist()))
        outs.append(out)
        if cls is sfq.Scheduler and sfq.CORE == "compiled":
            assert s.renormalisations > 10
    assert outs[0] == outs[1]
