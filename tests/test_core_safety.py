"""The core never crashes the interpreter: Python code that runs inside a scheduler method
(hashing, comparing, converting a cost, releasing a payload), threads, exceptions mid-way
and reference cycles. Each reproduction is run on both twins through ``make``.

A re-entrant or concurrent call either works as it does in the twin or raises
``SchedulerBusy`` (a RuntimeError) and changes nothing; references the scheduler releases are
released after its state is consistent, so a ``__del__`` calling back in succeeds.
"""

from __future__ import annotations

import gc
import numbers
import sys
import threading
import weakref
from fractions import Fraction

import numpy as np
import pytest
from core_helpers import dispatch_tuple, snapshot

import sfq
from sfq.errors import SchedulerBusy


class Hook:
    """A payload whose ``__del__`` runs ``fn``."""

    def __init__(self, fn):
        self.fn = fn

    def __del__(self):
        self.fn()


class Key:
    """A flow id with a hash of our choosing and an optional hook run on every hash."""

    def __init__(self, h=7, hook=None):
        self.h = h
        self.hook = hook

    def __hash__(self):
        if self.hook is not None:
            self.hook()
        return self.h

    def __eq__(self, other):
        return self is other

    def __repr__(self):
        return f"Key({self.h})"


def drain(s):
    out = []
    while (d := s.dispatch()) is not None:
        out.append(d)
    return out


def consistent(s):
    """Whatever happened, the scheduler still answers and drains cleanly."""
    drain(s)
    assert len(s) == 0 and s.dispatch() is None and s.peek() is None
    t = s.enqueue("after", 1, "x")
    d = s.dispatch()
    assert d.ticket == t and d.item == "x"


# ----------------------------------------------------------------- the reproductions
def test_1_payload_del_dispatches_during_cancel(make):
    s = make()
    got = []
    t = s.enqueue("a", 1, Hook(lambda: got.append(s.dispatch())))
    s.enqueue("b", 2, "b1")
    assert s.cancel(t) is True
    assert [d.item for d in got] == ["b1"], "the __del__ ran after cancel finished, and its dispatch worked"
    assert got[0].ticket == t + 1
    assert len(s) == 0 and s.dispatch() is None
    consistent(s)


def test_2_payload_del_enqueues_many_flows_during_cancel(make):
    s = make()

    def flood():
        for i in range(100):
            s.enqueue(("new", i), 1, i)

    t = s.enqueue("a", 1, Hook(flood))
    assert s.cancel(t)
    assert len(s) == 100 and s.pending("a") == 0 and s.waiting_flows == 100
    assert sorted(d.item for d in drain(s)) == list(range(100))
    consistent(s)


def test_3_hash_calls_pending_while_the_flow_is_forgotten(make):
    s = make()
    refused = []

    def peek_in():
        try:
            s.pending("zzz")
        except SchedulerBusy as exc:
            refused.append(str(exc))

    k = Key(hook=None)
    s.enqueue(k, 1, "p")
    k.hook = peek_in
    d = s.dispatch()  # the flow leaves, the busy period closes, and the idle flow is forgotten
    assert d.item == "p" and d.flow is k
    assert all("re-entrant" in m for m in refused)
    s.enqueue("x", 1, "q")
    assert s.dispatch().item == "q"
    consistent(s)


def test_4_cost_float_dispatches_between_lookup_and_enqueue(make):
    s = make()

    class Cost:
        def __float__(self):
            s.dispatch()
            return 5.0

    numbers.Real.register(Cost)
    s.enqueue("a", 1, "x")
    before = snapshot(s, ["a", "b"])
    with pytest.raises(SchedulerBusy, match="re-entrant"):
        s.enqueue("b", Cost(), "y")
    assert snapshot(s, ["a", "b"]) == before
    assert [d.item for d in drain(s)] == ["x"]
    consistent(s)


def test_5_flow_id_del_drains_in_the_middle_of_dispatch_many(make):
    s = make()
    drained = []

    class DyingKey(Key):
        def __del__(self):
            drained.extend(drain(s))

    k = DyingKey()
    s.enqueue(k, 1, "k")
    for i in range(5):
        s.enqueue("b", 100, i)
    d = s.dispatch()  # k at 0, then b at 0 in ticket order: k first
    assert d.flow is k
    del d, k  # the scheduler now holds the only reference to the idle flow id
    batch = s.dispatch_many(2)  # v passes k's meter: it is forgotten, its id released after the batch
    assert batch.items == [0, 1]
    # the id's __del__ ran once the batch was done (compiled), or when the twin lets go of it
    gc.collect()
    rest = [d.item for d in drained] + [d.item for d in drain(s)]
    assert rest == [2, 3, 4]
    consistent(s)


@pytest.mark.parametrize("n_new", [1, 100])
def test_6_hash_enqueues_while_the_flow_is_forgotten(make, n_new):
    s = make()
    refused = []

    def enqueue_in():
        for i in range(n_new):
            try:
                s.enqueue(("in-hash", i), 1)
            except SchedulerBusy:
                refused.append(i)

    k = Key()
    s.enqueue(k, 1, "p")
    k.hook = enqueue_in
    assert s.dispatch().item == "p"
    assert len(s) == 0, "a re-entrant enqueue never lands"
    consistent(s)


def test_7_enqueue_many_reentered_from_hash(make):
    s = make()
    k = Key(hook=lambda: s.enqueue("intruder", 1, "i"))
    s.enqueue("a", 1, "a0")
    before = snapshot(s, ["a", "intruder"])
    with pytest.raises(SchedulerBusy):
        s.enqueue_many(["a", k, "a"], [1, 2, 3], ["x", "y", "z"])
    assert snapshot(s, ["a", "intruder"]) == before
    assert [(d.flow, d.item) for d in drain(s)] == [("a", "a0")]
    consistent(s)


def test_8_hash_changes_after_use(make):
    s = make()
    k = Key(h=1)
    s.enqueue(k, 1, "p")
    k.h = 2
    d = s.dispatch()
    assert d.item == "p" and d.flow is k, "the payload is delivered"
    assert len(s) == 0
    s.enqueue(k, 1, "q")  # a new flow as far as hashing can tell, in both twins
    assert s.dispatch().item == "q"
    consistent(s)


def test_8_hash_that_raises_on_a_second_call(make):
    s = make()
    calls = []

    class Flaky(Key):
        def __hash__(self):
            calls.append(1)
            if len(calls) > 1:
                raise ValueError("hash refused")
            return 5

    k = Flaky()
    try:
        s.enqueue(k, 1, "p")  # the compiled core hashes once; the twin twice (lookup, insert)
    except ValueError:
        assert len(s) == 0 and s.known_flows == 0
    consistent(s)
    del s
    gc.collect()


def test_9_two_threads_on_one_scheduler(make):
    s = make()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    enq: list[list[int]] = [[], []]
    got: list[list[int]] = [[], []]
    refused = [0, 0]

    class SlowKey(Key):
        def __hash__(self):
            return sum(range(3)) + self.h  # Python code: the GIL may switch here

    keys = [SlowKey(h) for h in range(8)]

    def worker(w):
        for i in range(3000):
            try:
                t = s.enqueue(keys[(i + w) % 8], np.float64(1 + (i % 7)), Hook(lambda: None))
                enq[w].append(t)
            except SchedulerBusy as exc:
                assert "another thread" in str(exc) or "re-entrant" in str(exc)
                refused[w] += 1
            try:
                d = s.dispatch()
                if d is not None:
                    got[w].append(d.ticket)
            except SchedulerBusy:
                refused[w] += 1

    try:
        ts = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts)
    finally:
        sys.setswitchinterval(old)
    dispatched = got[0] + got[1] + [d.ticket for d in drain(s)]
    assert sorted(dispatched) == sorted(enq[0] + enq[1]), "every accepted request dispatched exactly once"
    consistent(s)


def test_10_cycles_through_payloads_and_flow_ids_are_collected(make):
    class Obj:
        pass

    s = make()
    p = Obj()
    p.s = s  # the payload refers back to its scheduler
    k = Key()
    k.s = s  # and so does a flow id
    s.enqueue("a", 1, p)
    s.enqueue(k, 1, "x")
    s.set_weight(Key(9), 2.0)
    ws, wp, wk = weakref.ref(s), weakref.ref(p), weakref.ref(k)
    del s, p, k
    gc.collect()
    assert ws() is None and wp() is None and wk() is None


def test_10_a_collected_scheduler_with_del_hooks_does_not_crash(make):
    s = make()
    seen = []

    def call_back():
        try:
            seen.append(len(s_ref()) if s_ref() is not None else None)
        except SchedulerBusy:
            seen.append("busy")

    s_ref = weakref.ref(s)
    p = Hook(call_back)
    p.s = s
    s.enqueue("a", 1, p)
    del p, s
    gc.collect()
    assert s_ref() is None


def test_11_dispatch_many_counts_agree(make):
    s = make()
    for i in range(3):
        s.enqueue("a", 1, i)
    with pytest.raises(TypeError, match="n must be an integer, got 1.5"):
        s.dispatch_many(1.5)
    assert len(s) == 3
    with pytest.raises(ValueError, match="n must be >= 0"):
        s.dispatch_many(-1)
    b = s.dispatch_many(2**63)
    assert b.items == [0, 1, 2]
    assert len(s.dispatch_many(2**70)) == 0


def test_11_enqueue_many_takes_what_enqueue_takes(make):
    s = make()
    ts = s.enqueue_many(["a", "b"], [Fraction(3, 2), Fraction(5)], ["x", "y"])
    assert ts.tolist() == [1, 2]
    assert [(d.item, d.cost) for d in drain(s)] == [("x", 1.5), ("y", 5.0)]
    with pytest.raises(TypeError, match="cost must be a real number"):
        s.enqueue_many(["a"], ["3"])
    assert len(s) == 0


def test_11_enqueue_many_with_a_raising_eq_enqueues_nothing(make):
    s = make()

    class E:
        def __hash__(self):
            return 1

        def __eq__(self, other):
            raise ValueError("no comparing")

    s.enqueue("x", 1, "x0")
    before = snapshot(s, ["x"])
    with pytest.raises(ValueError, match="no comparing"):
        s.enqueue_many(["x", E(), E()], [1, 1, 1])
    assert snapshot(s, ["x"]) == before and len(s) == 1
    consistent(s)


def test_11_cancel_with_an_index_only_ticket(make):
    class T:
        def __init__(self, t):
            self.t = t

        def __index__(self):
            return self.t

    s = make()
    t = s.enqueue("a", 1, "x")
    s.enqueue("a", 1, "y")
    assert s.cancel(T(t)) is True
    assert [d.item for d in drain(s)] == ["y"]
    consistent(s)


def test_twins_refuse_with_identical_messages():
    msgs = set()
    for cls in (sfq.Scheduler, sfq.ReferenceScheduler):
        s = cls()
        k = Key(hook=lambda: s.dispatch())
        with pytest.raises(SchedulerBusy) as ei:
            s.enqueue(k, 1)
        msgs.add(str(ei.value))
        assert isinstance(ei.value, RuntimeError) and isinstance(ei.value, sfq.SFQError)
    assert len(msgs) == 1


def test_every_method_refuses_reentry(make):
    s = make()
    s.enqueue("a", 1, "a")
    calls = {
        "enqueue": lambda: s.enqueue("z", 1),
        "dispatch": lambda: s.dispatch(),
        "peek": lambda: s.peek(),
        "cancel": lambda: s.cancel(1),
        "set_weight": lambda: s.set_weight("z", 2),
        "meter": lambda: s.meter("a"),
        "pending": lambda: s.pending("a"),
        "weight": lambda: s.weight("a"),
        "suspend": lambda: s.suspend("a"),
        "resume": lambda: s.resume("a"),
        "suspended": lambda: s.suspended("a"),
        "adjust": lambda: s.adjust("a", 1),
        "work_started": lambda: s.work_started(),
        "work_done": lambda: s.work_done(),
        "enqueue_many": lambda: s.enqueue_many(["z"], [1]),
        "dispatch_many": lambda: s.dispatch_many(1),
    }
    for name, call in calls.items():
        results = []

        def hook(call=call):
            try:
                call()
                results.append("ran")
            except SchedulerBusy:
                results.append("refused")

        before = snapshot(s, ["a", "z"])
        s.pending(Key(h=3, hook=hook))
        assert results == ["refused"], name
        assert snapshot(s, ["a", "z"]) == before, name
    consistent(s)


def test_exception_in_eq_during_lookup_changes_nothing(make):
    s = make()

    class BadEq(Key):
        __hash__ = Key.__hash__

        def __eq__(self, other):
            raise KeyError("eq")

    a, b = BadEq(h=4), BadEq(h=4)
    s.enqueue(a, 1, "a")
    before = snapshot(s, [a])
    for call in (lambda: s.enqueue(b, 1), lambda: s.set_weight(b, 2), lambda: s.suspend(b), lambda: s.adjust(b, 3)):
        with pytest.raises(KeyError):
            call()
        assert snapshot(s, [a]) == before
    consistent(s)


# ----------------------------------------------------------------- hooks at random points
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


class _Reentry:
    """Shared by the hooks: the scheduler being driven, and what the hooks saw."""

    def __init__(self):
        self.s = None
        self.log = []  # outcomes of payload hooks, which fire at the same points in both twins
        self.ran_inside = 0  # a hash or cost hook whose re-entrant call was not refused

    def attempt(self, what):
        s = self.s
        try:
            if what == "dispatch":
                s.dispatch()
            elif what == "enqueue":
                s.enqueue("hooked", 1)
            elif what == "pending":
                s.pending("a")
            elif what == "cancel":
                s.cancel(1)
            elif what == "suspend":
                s.suspend("a")
            self.ran_inside += 1
        except SchedulerBusy:
            pass


class HKey:
    def __init__(self, name, ctx, what):
        self.name, self.ctx, self.what = name, ctx, what

    def __hash__(self):
        self.ctx.attempt(self.what)  # always inside a scheduler method here: refused
        return hash(self.name)

    def __eq__(self, other):
        return isinstance(other, HKey) and other.name == self.name

    def __repr__(self):
        return f"HKey({self.name!r})"


class RCost:
    def __init__(self, value, ctx, what, fail):
        self.value, self.ctx, self.what, self.fail = value, ctx, what, fail

    def __float__(self):
        self.ctx.attempt(self.what)
        if self.fail:
            raise SchedulerBusy("a cost that gives up")
        return float(self.value)


numbers.Real.register(RCost)


class DelPayload:
    def __init__(self, ctx, what, tag):
        self.ctx, self.what, self.tag = ctx, what, tag

    def __del__(self):
        s = self.ctx.s
        try:
            if self.what == "dispatch":
                d = s.dispatch()
                self.ctx.log.append((self.tag, "dispatch", None if d is None else (d.flow, d.ticket)))
            elif self.what == "enqueue":
                self.ctx.log.append((self.tag, "enqueue", s.enqueue("from-del", 2, None)))
            else:
                self.ctx.log.append((self.tag, "len", len(s)))
        except SchedulerBusy:
            self.ctx.log.append((self.tag, "refused"))


WHATS = ["dispatch", "enqueue", "pending", "cancel", "suspend"]
hook_ops = st.one_of(
    st.tuples(st.just("enqueue"), st.integers(0, 4), st.integers(1, 50), st.sampled_from(WHATS + ["len"])),
    st.tuples(st.just("enqueue_hcost"), st.integers(0, 4), st.integers(1, 50), st.sampled_from(WHATS), st.booleans()),
    st.tuples(st.just("dispatch")),
    st.tuples(st.just("dispatch")),
    st.tuples(st.just("cancel"), st.integers(1, 40)),
    st.tuples(st.just("dispatch_many"), st.integers(0, 4)),
    st.tuples(st.just("enqueue_many"), st.lists(st.tuples(st.integers(0, 4), st.integers(1, 50)), max_size=4)),
    st.tuples(st.just("suspend"), st.integers(0, 4)),
    st.tuples(st.just("resume"), st.integers(0, 4)),
    st.tuples(st.just("adjust"), st.integers(0, 4), st.integers(-100, 100)),
    st.tuples(st.just("set_weight"), st.integers(0, 4), st.sampled_from([1, 2, 0.5])),
)


def _drive(s, ctx, keys, op, k):
    kind = op[0]
    try:
        if kind == "enqueue":
            return s.enqueue(keys[op[1]], op[2], DelPayload(ctx, op[3], k))
        if kind == "enqueue_hcost":
            return s.enqueue(keys[op[1]], RCost(op[2], ctx, op[3], op[4]), DelPayload(ctx, "len", k))
        if kind == "dispatch":
            return dispatch_tuple(s.dispatch())
        if kind == "cancel":
            return s.cancel(op[1])
        if kind == "dispatch_many":
            b = s.dispatch_many(op[1])
            return (b.flows, b.items, b.tickets.tolist())
        if kind == "enqueue_many":
            return s.enqueue_many([keys[i] for i, _ in op[1]], [c for _, c in op[1]],
                                  [DelPayload(ctx, "dispatch", (k, j)) for j in range(len(op[1]))]).tolist()
        if kind == "suspend":
            return s.suspend(keys[op[1]])
        if kind == "resume":
            return s.resume(keys[op[1]])
        if kind == "adjust":
            return s.adjust(keys[op[1]], op[2])
        if kind == "set_weight":
            return s.set_weight(keys[op[1]], op[2])
    except (SchedulerBusy, TypeError, ValueError, OverflowError) as exc:
        return (type(exc).__name__, str(exc))
    raise AssertionError(op)


def _comparable(out):
    """Results with payload objects replaced by their tags (payloads are per twin)."""
    if isinstance(out, tuple) and len(out) == 6:  # a dispatch tuple
        fl, item, *rest = out
        return (fl.name if isinstance(fl, HKey) else fl, getattr(item, "tag", item), *rest)
    if isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], list):
        return ([getattr(f, "name", f) for f in out[0]], [getattr(i, "tag", i) for i in out[1]], out[2])
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hook_ops, max_size=50))
def test_reentrant_hooks_at_random_points(seq):
    """Hash, cost and payload hooks call back into the scheduler at random points: the process
    survives, re-entrant calls from inside a method are refused, payload hooks (run after the
    method) work, bad input changes nothing, and the two twins stay identical."""
    runs = []
    for cls in (sfq.Scheduler, sfq.ReferenceScheduler):
        ctx = _Reentry()
        s = cls()
        ctx.s = s
        keys = [HKey(f"f{i}", ctx, WHATS[i]) for i in range(5)]
        outs, snaps = [], []
        for k, op in enumerate(seq):
            out = _drive(s, ctx, keys, op, k)
            outs.append(_comparable(out))
            del out
            snaps.append(snapshot(s, keys))
        for f in keys:
            s.resume(f)
        rest = []
        for _ in range(3):  # payload hooks run as the drained results are dropped, and may enqueue
            rest += [_comparable(dispatch_tuple(d)) for d in drain(s)]
        assert len(s) == 0
        assert ctx.ran_inside == 0, "a re-entrant call from inside a method was let through"
        runs.append((outs, [_snap_names(x) for x in snaps], rest, ctx.log))
        del s, keys
        ctx.s = None
    if sfq.CORE == "compiled":
        assert runs[0][0] == runs[1][0]
        assert runs[0][1] == runs[1][1]
        assert runs[0][2] == runs[1][2]
        assert runs[0][3] == runs[1][3]


def _snap_names(snap):
    return snap
