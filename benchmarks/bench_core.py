"""Microbenchmarks of the SFQ core: the compiled ``sfq.Scheduler``, the pure-Python twin
``sfq.ReferenceScheduler``, a full-contract ``heapq`` SFQ (``heapq_sfq.py``), the minimal heapq
SFQ a user would write (``minimal_heapq.py``, steady group only) and the C-loop floor
(``cfloor.pyx``, steady group only), side by side.

Workload (seeded, identical for every implementation): T flows, every flow backlogged with
``DEPTH = 4`` waiting requests, weights drawn from {1, 2, 4, 8}, costs uniform integers in
[1, 1000] (passed as Python floats), and a distinct payload object per request.

Every benchmark times whole loops (pytest-benchmark's pedantic mode); building the scheduler,
warming it up and drawing the random inputs happen outside the timed part. Each benchmark
records in ``extra_info["pairs"]`` how many *pairs* one round performs, where a pair is one
request's life: its enqueue plus its dispatch (or, in the cancel group, its cancel). The report
divides a round's time by that count: **ns per pair**.

Groups
------
steady   ``d = s.dispatch(); s.enqueue(d.flow, cost, d.item)``, K pairs per round. The minimal
         heapq runs ``s.enqueue(s.dispatch(), cost)`` (no payloads); the C floor runs the K
         pairs in one call, on the same weights and costs as the compiled core's run.
burst    on a fresh scheduler (weights set), enqueue N = 4T requests spread over the T flows in
         random order, then drain them all: N pairs per round.
churn    the T backlogged flows plus flows that come and go with fresh keys: each step enqueues
         one request on a never-seen key and dispatches twice; a dispatched backlogged request is
         put back (same cost, same payload). About half the dispatches serve the fresh flows,
         whose idle meters the core must keep until ``v`` passes them, then forget. 2 pairs a step.
cancel   each step dispatches one request and puts it back, enqueues one extra request on a
         random flow, and cancels the extra request enqueued T/4 steps earlier (still waiting):
         half the requests are cancelled while waiting. 2 pairs a step (dispatch or cancel each).
batch    the compiled core's batch API: ``b = s.dispatch_many(n)`` then
         ``s.enqueue_many(b.flows, costs, b.items)``, n = min(1024, T // 4); n pairs per batch.
burst-batch  the burst through the compiled core's batch API: ``enqueue_many`` of all N requests
         (numpy cost array), then ``dispatch_many(N)``.
"""

from __future__ import annotations

import gc
from collections import deque

import numpy as np
import pytest

import sfq
from heapq_sfq import HeapqSFQ
from minimal_heapq import MinimalSFQ

DEPTH = 4
WEIGHTS = np.array([1.0, 2.0, 4.0, 8.0])
MAX_COST = 1000
SEED = 20240601

IMPLS = {"compiled": sfq.Scheduler, "twin": sfq.ReferenceScheduler, "heapq": HeapqSFQ}
FAST = {"compiled", "floor"}
SCHEDULERS = ("compiled", "twin", "heapq")  # the implementations of the whole contract
GROUP_IDS = {"steady": 1, "burst": 2, "churn": 3, "cancel": 4, "batch": 5}


# --------------------------------------------------------------------------- helpers
class Payload:
    """A request's payload as a proxy would hold it (the core never looks inside)."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n


def rng_for(group: str, T: int, impl_salt: int = 0) -> np.random.Generator:
    # the same stream for every implementation: columns see identical inputs
    return np.random.default_rng([SEED, GROUP_IDS[group], T, impl_salt])


def costs(rng: np.random.Generator, n: int) -> list[float]:
    """n costs, uniform integers in [1, MAX_COST], as Python floats."""
    return rng.integers(1, MAX_COST + 1, n).astype(np.float64).tolist()


def weights(rng: np.random.Generator, T: int) -> list[float]:
    return rng.choice(WEIGHTS, T).tolist()


def new_scheduler(impl: str, ws: list[float]):
    s = IMPLS[impl]()
    for f, w in enumerate(ws):
        if w != 1.0:
            s.set_weight(f, w)
    return s


def build_backlogged(impl: str, T: int, rng: np.random.Generator):
    """A scheduler with flows 0..T-1, each holding DEPTH waiting requests."""
    s = new_scheduler(impl, weights(rng, T))
    cs = costs(rng, DEPTH * T)
    enqueue = s.enqueue
    i = 0
    for _ in range(DEPTH):
        for f in range(T):
            enqueue(f, cs[i], Payload(i))
            i += 1
    return s


def steady_pairs(s, cs: list[float]) -> None:
    dispatch, enqueue = s.dispatch, s.enqueue
    for c in cs:
        d = dispatch()
        enqueue(d.flow, c, d.item)


def minimal_pairs(s: MinimalSFQ, cs: list[float]) -> None:
    dispatch, enqueue = s.dispatch, s.enqueue
    for c in cs:
        enqueue(dispatch(), c)


def build_minimal(T: int) -> tuple[MinimalSFQ, np.random.Generator]:
    """The steady group's state (same draws as ``test_steady``) on the minimal heapq, warmed up;
    returns it with the generator, positioned where ``test_steady``'s rounds start drawing."""
    rng = rng_for("steady", T)
    s = MinimalSFQ()
    for f, w in enumerate(weights(rng, T)):
        if w != 1.0:
            s.set_weight(f, w)
    cs = costs(rng, DEPTH * T)
    for i, c in enumerate(cs):
        s.enqueue(i % T, c)
    minimal_pairs(s, costs(rng, max(T, 1000)))
    return s, rng


def build_floor(cfloor, T: int):
    """The same for the C floor (``cfloor.Floor``)."""
    rng = rng_for("steady", T)
    ws = weights(rng, T)
    fl = cfloor.Floor(ws, np.asarray(costs(rng, DEPTH * T)))
    fl.steady(np.asarray(costs(rng, max(T, 1000))))
    return fl, rng


def plan(impl: str, T: int, quick: bool, fast_pairs: int, slow_pairs: int) -> tuple[int, int]:
    """(pairs per round, rounds): enough work per round to dwarf the timer, few rounds for the
    slow pure-Python columns so the whole suite stays within minutes."""
    if impl in FAST:
        pairs, rounds = fast_pairs, 15
    else:
        pairs, rounds = slow_pairs, (5 if T < 100_000 else 3)
    if quick:
        pairs, rounds = max(100, pairs // 10), 3
    return pairs, rounds


def label(benchmark, group: str, impl: str, T: int, pairs: int, **extra) -> None:
    # pytest-benchmark's tables: the batch pair beside the per-call pairs and the C floor
    benchmark.group = f"{'steady' if group == 'batch' else group} T={T}"
    benchmark.extra_info.update(group=group, impl=impl, T=T, pairs=pairs, core=sfq.CORE, **extra)


def require_batch(impl: str):
    cls = IMPLS[impl]
    if not (hasattr(cls, "enqueue_many") and hasattr(cls, "dispatch_many")):
        pytest.skip(f"{cls.__module__}.{cls.__name__} has no batch API (enqueue_many/dispatch_many) yet")


@pytest.fixture(autouse=True)
def _collect_between_benchmarks():
    """Free the previous benchmark's scheduler before building the next one."""
    gc.collect()
    yield
    gc.collect()


# --------------------------------------------------------------------------- sanity
def test_heapq_baseline_matches_reference():
    """The baseline does the same work: the twin's decisions, event for event (exact floats)."""
    rng = np.random.default_rng(7)
    a, b = sfq.ReferenceScheduler(), HeapqSFQ()
    for f in range(40):
        w = float(rng.choice(WEIGHTS))
        a.set_weight(f, w)
        b.set_weight(f, w)
    tickets: list[int] = []
    for step in range(20_000):
        op = rng.random()
        if op < 0.45:
            f, c = int(rng.integers(0, 50)), float(rng.integers(1, 1001))
            ta, tb = a.enqueue(f, c, step), b.enqueue(f, c, step)
            assert ta == tb
            tickets.append(ta)
        elif op < 0.9:
            da, db = a.dispatch(), b.dispatch()
            if da is None:
                assert db is None
                continue
            assert (da.flow, da.item, da.ticket, da.start, da.finish) == (
                db.flow, db.item, db.ticket, db.start, db.finish,
            ), step
        elif tickets:
            t = tickets[int(rng.integers(0, len(tickets)))]
            assert a.cancel(t) == b.cancel(t)
        assert len(a) == len(b) and a.virtual_time == b.virtual_time


def test_steady_baselines_match_core(T: int, quick: bool, cfloor) -> None:
    """The minimal heapq and the C floor make the compiled core's decisions on the steady
    workload: the same flow dispatched, at the same start tag, pair for pair."""
    n = 2_000 if quick else 20_000
    rng = rng_for("steady", T)
    s = build_backlogged("compiled", T, rng)
    steady_pairs(s, costs(rng, max(T, 1000)))
    cs = costs(rng, n)
    want_flows, want_starts = [], []
    dispatch, enqueue = s.dispatch, s.enqueue
    for c in cs:
        d = dispatch()
        want_flows.append(d.flow)
        want_starts.append(d.start)
        enqueue(d.flow, c, d.item)

    m, rng_m = build_minimal(T)
    got = []
    for c in costs(rng_m, n):
        f = m.dispatch()
        got.append((f, m.v))
        m.enqueue(f, c)
    assert got == list(zip(want_flows, want_starts))

    fl, rng_f = build_floor(cfloor, T)
    flows_out, starts_out = np.empty(n, np.int32), np.empty(n, np.int64)
    fl.steady(np.asarray(costs(rng_f, n)), flows_out, starts_out)
    assert flows_out.tolist() == want_flows
    assert (starts_out / float(2**20)).tolist() == want_starts
    assert s.virtual_time == m.v == fl.virtual_time


def test_minimal_baseline_matches_core_with_idle_flows() -> None:
    """Beyond the steady workload: flows that leave and rejoin, and busy periods that end."""
    rng = np.random.default_rng(11)
    a, b = sfq.Scheduler(), MinimalSFQ()
    for f in range(30):
        w = float(rng.choice(WEIGHTS))
        a.set_weight(f, w)
        b.set_weight(f, w)
    for step in range(20_000):
        if rng.random() < 0.5:
            f, c = int(rng.integers(0, 40)), float(rng.integers(1, 1001))
            a.enqueue(f, c)
            b.enqueue(f, c)
        else:
            da, fb = a.dispatch(), b.dispatch()
            assert (None if da is None else da.flow) == fb, step
        assert a.virtual_time == b.v, step


# --------------------------------------------------------------------------- 1. steady state
def test_steady(benchmark, impl: str, T: int, quick: bool) -> None:
    rng = rng_for("steady", T)
    s = build_backlogged(impl, T, rng)
    steady_pairs(s, costs(rng, max(T, 1000)))  # warm-up: spread the meters out
    K, rounds = plan(impl, T, quick, fast_pairs=200_000, slow_pairs=20_000)

    def setup():
        return (costs(rng, K),), {}

    benchmark.pedantic(lambda cs: steady_pairs(s, cs), setup=setup, rounds=rounds, iterations=1)
    label(benchmark, "steady", impl, T, K)
    assert len(s) == DEPTH * T and s.waiting_flows == T


test_steady.sfq_impls = SCHEDULERS  # type: ignore[attr-defined]


def test_steady_minimal(benchmark, impl: str, T: int, quick: bool) -> None:
    """The steady pair on the minimal heapq SFQ: int flow ids, no payloads."""
    s, rng = build_minimal(T)
    K, rounds = plan(impl, T, quick, fast_pairs=200_000, slow_pairs=20_000)

    def setup():
        return (costs(rng, K),), {}

    benchmark.pedantic(lambda cs: minimal_pairs(s, cs), setup=setup, rounds=rounds, iterations=1)
    label(benchmark, "steady", impl, T, K)
    assert len(s.heap) == T and len(s) == DEPTH * T


test_steady_minimal.sfq_impls = ("minimal",)  # type: ignore[attr-defined]


def test_steady_floor(benchmark, impl: str, T: int, quick: bool, cfloor) -> None:
    """The steady pair as a C loop: one call runs the round's K pairs."""
    fl, rng = build_floor(cfloor, T)
    K, rounds = plan(impl, T, quick, fast_pairs=200_000, slow_pairs=20_000)

    def setup():
        return (np.asarray(costs(rng, K)),), {}

    benchmark.pedantic(fl.steady, setup=setup, rounds=rounds, iterations=1)
    label(benchmark, "steady", impl, T, K)
    assert len(fl) == DEPTH * T and fl.waiting_flows == T


test_steady_floor.sfq_impls = ("floor",)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- 2. burst
def burst_setup(impl: str, T: int, rng: np.random.Generator, ws: list[float], arrays: bool):
    """A fresh scheduler (weights set) and N = DEPTH*T requests over the T flows, random order."""
    N = DEPTH * T
    order = rng.permutation(np.repeat(np.arange(T, dtype=np.int64), DEPTH)).tolist()
    cs = rng.integers(1, MAX_COST + 1, N).astype(np.float64)
    items = [Payload(i) for i in range(N)]
    return (new_scheduler(impl, ws), order, cs if arrays else cs.tolist(), items), {}


def test_burst(benchmark, impl: str, T: int, quick: bool) -> None:
    rng = rng_for("burst", T)
    ws = weights(rng, T)
    N = DEPTH * T
    rounds = plan(impl, T, quick, 0, 0)[1]

    def run(s, flows, cs, items):
        enqueue, dispatch = s.enqueue, s.dispatch
        for f, c, it in zip(flows, cs, items):
            enqueue(f, c, it)
        for _ in range(N):
            dispatch()
        assert len(s) == 0

    benchmark.pedantic(run, setup=lambda: burst_setup(impl, T, rng, ws, False), rounds=rounds, iterations=1)
    label(benchmark, "burst", impl, T, N)


test_burst.sfq_impls = SCHEDULERS  # type: ignore[attr-defined]


def test_burst_batch(benchmark, impl: str, T: int, quick: bool) -> None:
    require_batch(impl)
    rng = rng_for("burst", T)
    ws = weights(rng, T)
    N = DEPTH * T
    rounds = plan(impl, T, quick, 0, 0)[1]

    def run(s, flows, cs, items):
        s.enqueue_many(flows, cs, items)
        s.dispatch_many(N)
        assert len(s) == 0

    benchmark.pedantic(run, setup=lambda: burst_setup(impl, T, rng, ws, True), rounds=rounds, iterations=1)
    label(benchmark, "burst-batch", impl, T, N)


test_burst_batch.sfq_impls = ("compiled",)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- 3. churn
def churn_steps(s, keys: list, cs: list[float]) -> None:
    enqueue, dispatch = s.enqueue, s.dispatch
    for k, c in zip(keys, cs):
        enqueue(k, c, None)  # a flow comes with one request (payload None marks it) ...
        d = dispatch()
        if d.item is not None:  # ... a backlogged flow was served: keep it backlogged
            enqueue(d.flow, d.cost, d.item)
        d = dispatch()
        if d.item is not None:
            enqueue(d.flow, d.cost, d.item)


def test_churn(benchmark, impl: str, T: int, quick: bool) -> None:
    rng = rng_for("churn", T)
    s = build_backlogged(impl, T, rng)
    steady_pairs(s, costs(rng, max(T, 1000)))
    next_key = [1 << 40]  # fresh keys: never used before, never reused

    def fresh(n: int) -> list[int]:
        k = next_key[0]
        next_key[0] += n
        return list(range(k, k + n))

    # warm-up until the idle fresh flows reach their steady count (about 4T of them): a fresh
    # flow is remembered until v passes its meter, i.e. for about 4T steps at these weights
    warm = min(4 * T, 40_000) if quick else 4 * T
    churn_steps(s, fresh(warm), costs(rng, warm))
    K, rounds = plan(impl, T, quick, fast_pairs=100_000, slow_pairs=10_000)

    def setup():
        return (fresh(K), costs(rng, K)), {}

    benchmark.pedantic(lambda keys, cs: churn_steps(s, keys, cs), setup=setup, rounds=rounds, iterations=1)
    known = s.known_flows if hasattr(s, "known_flows") else None
    label(benchmark, "churn", impl, T, 2 * K, known_flows_after=known)
    assert s.waiting_flows >= T


test_churn.sfq_impls = SCHEDULERS  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- 4. cancel-heavy
def cancel_steps(s, extra_flows: list[int], cs: list[float], items: list, victims: deque) -> int:
    enqueue, dispatch, cancel = s.enqueue, s.dispatch, s.cancel
    popleft, append = victims.popleft, victims.append
    cancelled = 0
    for f, c, it in zip(extra_flows, cs, items):
        d = dispatch()
        enqueue(d.flow, d.cost, d.item)
        append(enqueue(f, c, it))
        cancelled += cancel(popleft())
    return cancelled


def test_cancel(benchmark, impl: str, T: int, quick: bool) -> None:
    rng = rng_for("cancel", T)
    s = build_backlogged(impl, T, rng)
    steady_pairs(s, costs(rng, max(T, 1000)))
    lag = max(1, T // 4)
    victims: deque = deque()
    # prime: lag extra requests waiting to be cancelled, then a warm-up of T steps
    for f, c in zip(rng.integers(0, T, lag).tolist(), costs(rng, lag)):
        victims.append(s.enqueue(f, c, Payload(-1)))
    warm = max(T, 1000)
    cancel_steps(s, rng.integers(0, T, warm).tolist(), costs(rng, warm), [Payload(-1)] * warm, victims)
    K, rounds = plan(impl, T, quick, fast_pairs=100_000, slow_pairs=10_000)
    done: list[int] = []

    def setup():
        return (rng.integers(0, T, K).tolist(), costs(rng, K), [Payload(i) for i in range(K)]), {}

    def run(flows, cs, items):
        done.append(cancel_steps(s, flows, cs, items, victims))

    benchmark.pedantic(run, setup=setup, rounds=rounds, iterations=1)
    label(benchmark, "cancel", impl, T, 2 * K, cancelled_fraction=round(sum(done) / (len(done) * K), 4))
    assert sum(done) >= 0.95 * len(done) * K  # the extra requests really were waiting when cancelled


test_cancel.sfq_impls = SCHEDULERS  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- 5. batch steady state
def batch_pairs(s, n: int, cost_blocks: list[np.ndarray]) -> None:
    dispatch_many, enqueue_many = s.dispatch_many, s.enqueue_many
    for cs in cost_blocks:
        b = dispatch_many(n)
        enqueue_many(b.flows, cs, b.items)


def test_batch(benchmark, impl: str, T: int, quick: bool) -> None:
    require_batch(impl)
    rng = rng_for("batch", T)
    s = build_backlogged(impl, T, rng)
    steady_pairs(s, costs(rng, max(T, 1000)))
    n = max(1, min(1024, T // 4))
    K, rounds = plan(impl, T, quick, fast_pairs=200_000, slow_pairs=20_000)
    blocks = max(1, K // n)

    def setup():
        return ([rng.integers(1, MAX_COST + 1, n).astype(np.float64) for _ in range(blocks)],), {}

    benchmark.pedantic(lambda cb: batch_pairs(s, n, cb), setup=setup, rounds=rounds, iterations=1)
    label(benchmark, "batch", impl, T, blocks * n, batch_size=n)
    assert len(s) == DEPTH * T and s.waiting_flows == T


test_batch.sfq_impls = ("compiled", "twin")  # type: ignore[attr-defined]
