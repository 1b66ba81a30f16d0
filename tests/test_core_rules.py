"""The SFQ rules of docs/design.md §2, checked on both twins (the ``make`` fixture)."""

from __future__ import annotations

import random

import pytest
from core_helpers import Watcher

import sfq


def test_seed_table_2_7(make):
    """docs/design.md §2.7, row by row: (v, selected, S_A, S_B) after each dispatch."""
    s = make()
    for k in range(8):  # A enqueues first, so A wins ties (smaller head ticket)
        s.enqueue("A", 3, ("A", k))
    for k in range(8):
        s.enqueue("B", 1, ("B", k))
    table = [
        (0, "A", 3, 0),
        (0, "B", 3, 1),
        (1, "B", 3, 2),
        (2, "B", 3, 3),
        (3, "A", 6, 3),
        (3, "B", 6, 4),
        (4, "B", 6, 5),
        (5, "B", 6, 6),
    ]
    assert (s.virtual_time, s.meter("A"), s.meter("B")) == (0, 0, 0)
    for v, who, SA, SB in table:
        d = s.dispatch()
        assert (s.virtual_time, d.flow, s.meter("A"), s.meter("B")) == (v, who, SA, SB)
        assert d.start == v and d.finish == (SA if who == "A" else SB)
    # both accumulated a total cost of 6: A with 2 dispatches, B with 6


def test_ties_go_to_the_earlier_head_not_the_name(make):
    s = make()
    s.enqueue("zz", 1, "first")
    s.enqueue("aa", 1, "second")
    assert s.dispatch().item == "first"
    assert s.dispatch().item == "second"


def test_tickets_increase_and_dispatch_reports_them(make):
    s = make()
    t = [s.enqueue(f, 1) for f in ("a", "b", "a", 7, ("o", "c", "p"))]
    assert t == sorted(t) and len(set(t)) == 5
    got = []
    while (d := s.dispatch()) is not None:
        got.append(d.ticket)
    assert sorted(got) == t


def test_new_flow_starts_at_v_and_rejoin_keeps_residual(make):
    s = make()
    s.enqueue("A", 10)
    s.enqueue("B", 1)
    s.enqueue("B", 1)
    assert s.dispatch().flow == "A"  # A: S = 10, idle (B waits, so no global idle)
    assert s.meter("A") == 10
    s.dispatch()
    assert s.virtual_time == 0
    # A rejoins: max(S, v) keeps its residual 10 > v
    s.enqueue("A", 1)
    assert s.meter("A") == 10
    s.enqueue("C", 1)  # a new flow starts at v
    assert s.meter("C") == s.virtual_time == 0


def test_global_idle_advances_v_to_largest_finish(make):
    s = make()
    s.enqueue("A", 100)
    s.enqueue("B", 1)
    s.dispatch()
    s.dispatch()
    assert len(s) == 0
    assert s.virtual_time == 100  # max finish tag
    s.enqueue("A", 1)
    s.enqueue("B", 1)
    assert s.meter("A") == s.meter("B") == 100


def test_weights_divide_charges(make):
    s = make()
    s.set_weight("heavy", 4)
    assert s.weight("heavy") == 4.0 and s.weight("other") == 1.0
    for _ in range(50):
        s.enqueue("heavy", 8)
        s.enqueue("light", 8)
    counts = {"heavy": 0, "light": 0}
    for _ in range(50):
        counts[s.dispatch().flow] += 1
    assert counts["heavy"] == 40 and counts["light"] == 10


def test_cancel_is_uncharged_and_reports(make):
    s = make()
    t1 = s.enqueue("A", 5, "a1")
    t2 = s.enqueue("A", 7, "a2")
    t3 = s.enqueue("B", 1, "b1")
    assert s.pending("A") == 2 and len(s) == 3
    assert s.cancel(t1) is True
    assert s.cancel(t1) is False  # already cancelled
    assert s.meter("A") == 0  # uncharged
    assert s.pending("A") == 1 and len(s) == 2
    d = s.dispatch()
    assert d.item == "a2" and d.ticket == t2  # tie at S = 0: A's new head t2 < B's t3
    assert s.cancel(t2) is False  # dispatched
    assert s.cancel(10**30) is False and s.cancel("x") is False and s.cancel(None) is False
    assert s.cancel(-1) is False and s.cancel(0) is False and s.cancel([1]) is False
    assert s.dispatch().item == "b1" and s.cancel(t3) is False


def test_cancel_head_rekeys_with_next_ticket(make):
    s = make()
    ta = s.enqueue("A", 1, "a0")
    s.enqueue("B", 1, "b0")
    s.enqueue("A", 1, "a1")
    s.cancel(ta)  # A's head is now a1, enqueued after b0: B wins the tie
    assert [s.dispatch().item for _ in range(2)] == ["b0", "a1"]


def test_cancel_last_request_can_end_the_busy_period(make):
    s = make()
    s.enqueue("A", 50)
    t = s.enqueue("B", 1)
    s.dispatch()  # A: S = 50; B waits at 0
    assert s.cancel(t)
    assert s.waiting_flows == 0 and s.virtual_time == 50  # the same idle rule


def test_cancel_middle_then_drain(make):
    s = make()
    ts = [s.enqueue("A", 1, k) for k in range(6)]
    for t in ts[1:5]:
        assert s.cancel(t)
    assert s.pending("A") == 2
    assert [s.dispatch().item for _ in range(2)] == [0, 5]
    assert s.dispatch() is None and len(s) == 0


def test_dispatch_on_empty_is_none(make):
    s = make()
    assert s.dispatch() is None
    assert len(s) == 0 and s.waiting_flows == 0 and s.virtual_time == 0


def test_flow_ids_any_hashable(make):
    s = make()
    ids = ["team-a", 42, ("org", "batch", "pool-1"), frozenset({1}), None, 3.5]
    for f in ids:
        s.enqueue(f, 1, f)
    assert sorted(map(repr, (s.dispatch().flow for _ in ids))) == sorted(map(repr, ids))


def test_items_are_kept_alive_and_released(make):
    import gc
    import weakref

    class Item:
        pass

    s = make()
    it = Item()
    ref = weakref.ref(it)
    t = s.enqueue("A", 1, it)
    del it
    gc.collect()
    assert ref() is not None
    s.cancel(t)
    gc.collect()
    assert ref() is None
    it2 = Item()
    ref2 = weakref.ref(it2)
    s.enqueue("A", 1, it2)
    del it2
    d = s.dispatch()
    assert ref2() is d.item
    del d
    gc.collect()
    assert ref2() is None
    # dropping a scheduler with waiting requests releases them
    it3 = Item()
    ref3 = weakref.ref(it3)
    s.enqueue("B", 1, it3)
    del it3, s
    gc.collect()
    assert ref3() is None


def test_len_waiting_flows_pending(make):
    s = make()
    for k in range(3):
        s.enqueue("A", 1)
    s.enqueue("B", 1)
    assert (len(s), s.waiting_flows, s.pending("A"), s.pending("B"), s.pending("C")) == (4, 2, 3, 1, 0)


# ---------------------------------------------------- docs/design.md §10


def test_property_1_equal_costs_counts_differ_by_at_most_one(make):
    s = make()
    w = Watcher(s, ["A", "B"])
    for _ in range(300):
        w.enqueue("A", 5)
        w.enqueue("B", 5)
    for _ in range(500):
        w.dispatch()
        assert abs(w.count["A"] - w.count["B"]) <= 1


def test_property_2_ten_times_the_cost_one_tenth_the_dispatches(make):
    s = make()
    w = Watcher(s, ["heavy", "light"])
    for _ in range(200):
        w.enqueue("heavy", 10)
    for _ in range(2000):
        w.enqueue("light", 1)
    for _ in range(1100):
        w.dispatch()
    assert abs(w.count["heavy"] - 100) <= 1 and abs(w.count["light"] - 1000) <= 10
    assert abs(w.W["heavy"] - w.W["light"]) <= 2 * 10


def test_property_3_no_banking_while_idle(make):
    s = make()
    w = Watcher(s, ["A", "B"])
    w.enqueue("A", 1)
    w.dispatch()
    for _ in range(1000):  # A is idle while B is served alone for a long time
        w.enqueue("B", 1)
    for _ in range(900):
        w.dispatch()
    for _ in range(200):
        w.enqueue("A", 1)
    assert s.meter("A") == s.virtual_time  # rejoins at the baseline
    before = dict(w.count)
    for _ in range(100):
        w.dispatch()
    assert w.count["A"] - before["A"] <= 51  # no burst: about half, like everyone else


def test_property_4_no_reset_abuse(make):
    """A flow that sends one request at a time (draining every time) gets the same share
    as a continuously backlogged one, even with much cheaper requests, never more."""
    s = make()
    w = Watcher(s, ["trickle", "B"])
    for _ in range(3000):
        w.enqueue("B", 10)
    w.enqueue("trickle", 1)
    for _ in range(2000):
        d = w.dispatch()
        if d.flow == "trickle":
            w.enqueue("trickle", 1)  # the next one arrives only after this one left
    assert abs(w.W["trickle"] - w.W["B"]) <= 2 * 10
    assert w.W["trickle"] >= 1000


def test_property_5_global_idle_levels_everyone(make):
    s = make()
    s.enqueue("heavy", 1000)
    s.enqueue("light", 1)
    s.dispatch()
    s.dispatch()
    assert len(s) == 0
    s.enqueue("light", 1)
    s.enqueue("heavy", 1)
    assert s.meter("heavy") == s.meter("light") == s.virtual_time
    assert s.dispatch().flow == "light"  # first come among equals; no handicap carried


@pytest.mark.parametrize("seed", range(4))
def test_long_random_run_keeps_the_invariants(make, seed):
    """Band invariant (§3.1) and interval bounds (§3.2, §3.3) after every event of a long
    random run with drains, rejoins, cancels and weight changes."""
    rnd = random.Random(seed)
    flows = [f"f{k}" for k in range(6)]
    s = make()
    w = Watcher(s, flows)
    tickets: list[int] = []
    for _ in range(2500):
        r = rnd.random()
        if r < 0.45:
            f = rnd.choice(flows)
            cost = rnd.choice([1, 2.5, 7, 50, 300]) if f != "f0" else 300
            tickets.append(w.enqueue(f, cost))
        elif r < 0.9:
            w.dispatch()
        elif r < 0.97 and tickets:
            w.cancel(rnd.choice(tickets))
        else:
            w.set_weight(rnd.choice(flows[1:]), rnd.choice([0.5, 1, 2, 4]))
    assert w.events == 2500


def test_reset_on_return_would_fail_the_watcher():
    """The watcher can fail: a scheduler that resets S = v on every return breaks §3.3."""

    class ResetOnReturn(sfq.ReferenceScheduler):
        def enqueue(self, flow, cost, item=None):
            f = self._flows.get(flow)
            if f is not None and not f.waiting:
                f.S = self._v  # the loophole of docs/design.md §2.4
            return super().enqueue(flow, cost, item)

    s = ResetOnReturn()
    w = Watcher(s, ["trickle", "B"])
    for _ in range(3000):
        w.enqueue("B", 1)
    w.enqueue("trickle", 10)
    with pytest.raises(AssertionError, match="ahead of backlogged"):
        for _ in range(2000):
            d = w.dispatch()
            if d.flow == "trickle":
                w.enqueue("trickle", 10)


def test_cancel_accepts_tickets_from_enqueue_many(make):
    s = make()
    tickets = s.enqueue_many(["a", "b", "a"], [1.0, 2.0, 3.0], ["x", "y", "z"])
    assert s.cancel(tickets[0]) is True  # a numpy int64
    assert s.cancel(int(tickets[2])) is True
    assert s.cancel(tickets[0]) is False
    d = s.dispatch()
    assert (d.item, s.dispatch()) == ("y", None)
