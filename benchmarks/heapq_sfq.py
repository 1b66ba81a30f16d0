"""A natural ``heapq``-based Start-time Fair Queueing scheduler: the benchmarks' baseline.

This is what a competent Python programmer would write in an afternoon from the contract in
``shared/API.md``, without caring about the compiled core: a dict of flow records, a
``heapq`` of ``(S, head ticket, flow)`` entries with lazy invalidation, a ``deque`` per flow,
a dict from ticket to waiting request for ``cancel``, and float meters (cost units).

It exists so that the compiled core's speed-up is measured against an honest pure-Python
competitor rather than a strawman. It makes the same decisions as ``sfq.ReferenceScheduler``
whenever float arithmetic is exact (integer costs and power-of-two weights in the
benchmarks' ranges); ``bench_core.py`` checks that before timing anything.

Not part of the library: no input validation beyond what Python does by itself.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import count
from typing import Any, Hashable

__all__ = ["HeapqSFQ", "HeapqDispatch"]


class HeapqDispatch:
    """One dispatched request (same attribute names as ``sfq.Dispatch``)."""

    __slots__ = ("flow", "item", "cost", "ticket", "start", "finish")

    def __init__(self, flow: Hashable, item: Any, cost: float, ticket: int, start: float, finish: float):
        self.flow = flow
        self.item = item
        self.cost = cost
        self.ticket = ticket
        self.start = start
        self.finish = finish


class _Flow:
    __slots__ = ("key", "S", "weight", "queue", "waiting")

    def __init__(self, key: Hashable, S: float):
        self.key = key
        self.S = S  # meter: the flow's next start tag, cost units
        self.weight = 1.0
        self.queue: deque[list] = deque()  # [ticket, cost, item, flow] entries, FIFO
        self.waiting = False  # has a live request, i.e. competes in the heap


class HeapqSFQ:
    """Start-time Fair Queueing with ``heapq`` (float meters, lazy heap invalidation)."""

    def __init__(self) -> None:
        self._flows: dict[Hashable, _Flow] = {}
        self._heap: list[tuple[float, int, _Flow]] = []  # (S, head ticket, flow), may be stale
        self._requests: dict[int, list] = {}  # ticket -> live queue entry (for cancel)
        self._tickets = count(1)
        self._v = 0.0
        self._max_finish = 0.0
        self._waiting_flows = 0
        self._sweep_at = 1024  # forget idle flows when the dict grows past this

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def virtual_time(self) -> float:
        return self._v

    @property
    def waiting_flows(self) -> int:
        return self._waiting_flows

    @property
    def known_flows(self) -> int:
        return len(self._flows)

    def meter(self, flow: Hashable) -> float:
        f = self._flows.get(flow)
        return self._v if f is None else max(f.S, self._v)

    def set_weight(self, flow: Hashable, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight!r}")
        f = self._flows.get(flow)
        if f is None:
            f = self._flows[flow] = _Flow(flow, self._v)
        f.weight = float(weight)

    def enqueue(self, flow: Hashable, cost: float, item: Any = None) -> int:
        if not cost > 0:
            raise ValueError(f"cost must be > 0, got {cost!r}")
        f = self._flows.get(flow)
        if f is None:
            if len(self._flows) >= self._sweep_at:
                self._sweep()
            f = self._flows[flow] = _Flow(flow, self._v)
        ticket = next(self._tickets)
        entry = [ticket, cost, item, f]  # f is None once cancelled
        f.queue.append(entry)
        self._requests[ticket] = entry
        if not f.waiting:  # (re)join: no credit for having been idle
            if f.S < self._v:
                f.S = self._v
            f.waiting = True
            self._waiting_flows += 1
            heapq.heappush(self._heap, (f.S, ticket, f))
        return ticket

    def dispatch(self) -> HeapqDispatch | None:
        heap = self._heap
        while heap:
            S, head, f = heap[0]
            if f.waiting and f.S == S and f.queue[0][0] == head:
                break
            heapq.heappop(heap)  # stale entry
        else:
            return None
        q = f.queue
        ticket, cost, item, _ = q.popleft()
        del self._requests[ticket]
        self._v = S
        f.S = finish = S + cost / f.weight
        if finish > self._max_finish:
            self._max_finish = finish
        while q and q[0][3] is None:  # drop cancelled requests at the head
            q.popleft()
        if q:
            heapq.heapreplace(heap, (finish, q[0][0], f))
        else:
            heapq.heappop(heap)
            self._leave(f)
        return HeapqDispatch(f.key, item, cost, ticket, S, finish)

    def cancel(self, ticket: int) -> bool:
        entry = self._requests.pop(ticket, None)
        if entry is None:
            return False
        f = entry[3]
        entry[2] = entry[3] = None  # cancelled; let go of the payload now
        q = f.queue
        if q[0] is entry:  # the head changed: re-key the flow (its old heap entry goes stale)
            while q and q[0][3] is None:
                q.popleft()
            if q:
                heapq.heappush(self._heap, (f.S, q[0][0], f))
            else:
                self._leave(f)
        return True

    # ------------------------------------------------------------------ internals
    def _leave(self, f: _Flow) -> None:
        f.waiting = False
        self._waiting_flows -= 1
        if self._waiting_flows == 0:  # everything served: close the busy period
            if self._max_finish > self._v:
                self._v = self._max_finish

    def _sweep(self) -> None:
        """Forget idle flows that carry no information (default weight, meter <= v)."""
        v = self._v
        stale = [k for k, f in self._flows.items() if not f.waiting and f.S <= v and f.weight == 1.0]
        for k in stale:
            del self._flows[k]
        self._sweep_at = max(1024, 2 * len(self._flows))
