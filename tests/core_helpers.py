"""Helpers for the core tests: state snapshots and an invariant checker that watches a run."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Hashable


def snapshot(s: Any, flows: list[Hashable]) -> tuple:
    """Everything observable about a scheduler, for 'state unchanged' and twin comparisons."""
    return (
        len(s),
        s.waiting_flows,
        s.known_flows,
        s.virtual_time,
        s.in_flight,
        tuple((s.meter(f), s.pending(f), s.weight(f), s.suspended(f), s.running(f)) for f in flows),
    )


def dispatch_tuple(d: Any) -> tuple | None:
    if d is None:
        return None
    return (d.flow, d.item, d.cost, d.ticket, d.start, d.finish)


class Watcher:
    """Drives a scheduler and checks docs/design.md §3 after every event.

    * §3.1: v never decreases; every waiting meter lies in [v, v + c_max];
    * §3.2: two flows backlogged throughout an interval differ in charged (normalised)
      cost by at most 2 c_max;
    * §3.3: a flow that drains and rejoins gets at most 2 c_max ahead of a flow that is
      backlogged throughout.
    ``c_max`` is the largest normalised charge (cost / weight) seen so far.
    """

    def __init__(self, s: Any, flows: list[Hashable]):
        self.s = s
        self.flows = flows
        self.v = s.virtual_time
        self.c_max = 0.0
        self.W: dict[Hashable, float] = defaultdict(float)  # normalised service so far
        self.count: dict[Hashable, int] = defaultdict(int)  # dispatches so far
        # for each backlogged flow j: per other flow i, the running min of W_i - W_j since j
        # became backlogged
        self._mins: dict[Hashable, dict[Hashable, float]] = {}
        self.events = 0

    def enqueue(self, flow: Hashable, cost: float, item: Any = None) -> int:
        w = self.s.weight(flow)
        self.c_max = max(self.c_max, cost / w)
        t = self.s.enqueue(flow, cost, item)
        self._check()
        return t

    def dispatch(self) -> Any:
        waiting = len(self.s)
        d = self.s.dispatch()
        assert (d is None) == (waiting == 0), "work-conserving: a request waits, so one is dispatched"
        if d is not None:
            charged = d.finish - d.start
            self.c_max = max(self.c_max, charged)
            self.W[d.flow] += charged
            self.count[d.flow] += 1
        self._check()
        return d

    def cancel(self, ticket: int) -> bool:
        r = self.s.cancel(ticket)
        self._check()
        return r

    def set_weight(self, flow: Hashable, w: float) -> None:
        self.s.set_weight(flow, w)
        self._check()

    def _check(self) -> None:
        s, eps = self.s, 1e-9 * max(1.0, abs(self.s.virtual_time))
        self.events += 1
        v = s.virtual_time
        assert v >= self.v - eps, f"v went backwards: {self.v} -> {v}"
        self.v = v
        backlogged = [f for f in self.flows if s.pending(f) > 0]
        assert len(backlogged) == s.waiting_flows
        for f in backlogged:
            S = s.meter(f)
            assert v - eps <= S <= v + self.c_max + eps, f"meter of {f!r} = {S} outside [{v}, {v}+{self.c_max}]"
        # interval bounds, against every flow j backlogged throughout
        bset = set(backlogged)
        for j in list(self._mins):
            if j not in bset:
                del self._mins[j]
        for j in backlogged:
            mins = self._mins.setdefault(j, {})
            for i in self.flows:
                if i == j:
                    continue
                d = self.W[i] - self.W[j]
                lo = mins.get(i)
                if lo is None or d < lo:
                    mins[i] = d
                    lo = d
                assert d - lo <= 2 * self.c_max + 1e-6, (
                    f"{i!r} got {d - lo} ahead of backlogged {j!r} (2 c_max = {2 * self.c_max})"
                )
