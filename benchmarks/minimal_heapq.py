"""The minimal pure-Python ``heapq`` SFQ: the simplest thing a user would write.

Int flow ids, a ``heapq`` of ``(S, head ticket, flow)`` entries, a ``deque`` of
``(ticket, cost)`` per flow, float meters; no payloads, no cancel, no validation, no result
objects (``dispatch`` returns the flow id). Start-time Fair Queueing (Goyal, Vin and Cheng,
1996): dispatch takes the waiting flow with the smallest meter S, sets v = S and charges
S += cost / weight; a flow that (re)joins starts at max(S, v); when no flow waits, v moves up
to the largest finish tag so far.

The head ticket in the heap key is the one thing beyond "a heap of (S, id)": it breaks ties
between equal meters the way ``sfq.Scheduler`` does (the flow whose head request was enqueued
first), so that this baseline makes the core's decisions. Without it the order differs on ties,
which at 10,000 flows with power-of-two weights are common. It costs one int per heap entry.

``bench_core.py::test_steady_baselines_match_core`` (part of the benchmarks' smoke run in CI)
checks, pair for pair, that this class and the compiled core dispatch the same flows at the same
start tags on the benchmark's steady workload, and ``test_minimal_baseline_matches_core_with_idle_flows``
does the same with flows that leave, rejoin and busy periods that end. The other, full-contract baseline is ``heapq_sfq.py``.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush, heapreplace

__all__ = ["MinimalSFQ"]


class MinimalSFQ:
    """SFQ over int flow ids with ``heapq``; ``dispatch()`` returns the flow id (or None)."""

    __slots__ = ("heap", "queues", "meters", "weights", "v", "max_finish", "ticket")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int]] = []  # (S, head ticket, flow): waiting flows only
        self.queues: dict[int, deque[tuple[int, float]]] = {}  # flow -> (ticket, cost), FIFO
        self.meters: dict[int, float] = {}  # flow -> S
        self.weights: dict[int, float] = {}  # flow -> weight, when not 1
        self.v = 0.0
        self.max_finish = 0.0
        self.ticket = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def set_weight(self, flow: int, weight: float) -> None:
        self.weights[flow] = weight

    def enqueue(self, flow: int, cost: float) -> int:
        self.ticket = t = self.ticket + 1
        q = self.queues.get(flow)
        if q is None:
            q = self.queues[flow] = deque()
        q.append((t, cost))
        if len(q) == 1:  # (re)join: no credit for having been idle
            S = self.meters.get(flow, 0.0)
            if S < self.v:
                S = self.v
            self.meters[flow] = S
            heappush(self.heap, (S, t, flow))
        return t

    def dispatch(self) -> int | None:
        heap = self.heap
        if not heap:
            return None
        S, _, flow = heap[0]
        q = self.queues[flow]
        cost = q.popleft()[1]
        self.v = S
        S += cost / self.weights.get(flow, 1.0)
        self.meters[flow] = S
        if S > self.max_finish:
            self.max_finish = S
        if q:
            heapreplace(heap, (S, q[0][0], flow))
        else:
            heappop(heap)
            if not heap:  # busy period over: the next one starts level
                self.v = self.max_finish
        return flow
