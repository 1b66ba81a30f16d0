"""Start-time Fair Queueing, in plain Python: the executable specification.

This twin and the compiled core (``src/csfq/_csfq.pyx``) make identical decisions; the
test suite runs every test against both and Hypothesis compares them event by event.
This one is written to be read.

State
-----
* per flow: a meter ``S`` (its next start tag, in sub-units, see ``_common``), a weight,
  and a FIFO of waiting tickets;
* ``v``, the virtual time: the start tag of the most recent dispatch;
* ``max_finish``, the largest finish tag handed out so far.

Rules (seed 000 §2.6)
---------------------
* enqueue: append to the flow's FIFO; if the flow was not waiting it (re)joins with
  ``S = max(S, v)`` (a new flow starts at ``S = v``);
* dispatch: take the waiting flow with the smallest ``(S, head ticket)``, set ``v = S``,
  pop its head request and charge ``S += ceil(cost * SCALE / weight)``;
* when no flow is waiting any more: ``v = max(v, max_finish)`` (the global-idle reset);
* cancel removes a waiting request uncharged; nothing else ever touches a meter.

Integers here are Python ints, so this twin never renormalises; the compiled core does,
and the parity tests show that renormalisation changes no decision.

Memory: a flow that is idle, has the default weight and ``S <= v`` carries no
information (it would rejoin at ``v`` anyway), so it is forgotten. Idle flows wait in
a min-heap on ``S`` until ``v`` passes them.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import deque
from typing import Any, Hashable

from ._common import DEFAULT_WEIGHT, DispatchBatch, charge, check_batch, check_cost, check_weight, to_units, unhashable_flow

__all__ = ["ReferenceScheduler", "ReferenceDispatch"]


class ReferenceDispatch:
    """One dispatched request: ``flow``, ``item``, ``cost`` (as enqueued), ``ticket``,
    ``start`` (the meter before charging, equal to ``v``) and ``finish`` (after)."""

    __slots__ = ("flow", "item", "cost", "ticket", "start", "finish")

    def __init__(self, flow: Hashable, item: Any, cost: float, ticket: int, start: float, finish: float):
        self.flow = flow
        self.item = item
        self.cost = cost
        self.ticket = ticket
        self.start = start
        self.finish = finish

    def __repr__(self) -> str:
        return (
            f"Dispatch(flow={self.flow!r}, ticket={self.ticket}, cost={self.cost!r}, "
            f"start={self.start!r}, finish={self.finish!r}, item={self.item!r})"
        )


class _Flow:
    __slots__ = ("key", "S", "weight", "queue", "live", "waiting", "idle_gen")

    def __init__(self, key: Hashable, S: int):
        self.key = key
        self.S = S  # meter: next start tag, sub-units
        self.weight = DEFAULT_WEIGHT
        self.queue: deque[int] = deque()  # waiting tickets, FIFO; may hold cancelled ones
        self.live = 0  # waiting (not cancelled) requests
        self.waiting = False  # in the selection heap
        self.idle_gen = 0  # bumps on every idle spell, to invalidate old idle-heap entries


class ReferenceScheduler:
    """Start-time Fair Queueing over flows of waiting requests (pure Python)."""

    def __init__(self) -> None:
        self._flows: dict[Hashable, _Flow] = {}
        self._requests: dict[int, tuple[_Flow, float, Any]] = {}  # ticket -> waiting request
        self._heap: list[tuple[int, int, _Flow]] = []  # (S, head ticket, flow); stale entries skipped
        self._idle: list[tuple[int, int, int, _Flow]] = []  # (S, seq, idle_gen, flow) of idle flows
        self._idle_seq = itertools.count()  # unique second key: flows are never compared
        self._v = 0  # virtual time, sub-units
        self._max_finish = 0  # largest finish tag so far, sub-units
        self._next_ticket = 1
        self._waiting_flows = 0

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._requests)

    @property
    def waiting_flows(self) -> int:
        return self._waiting_flows

    @property
    def virtual_time(self) -> float:
        return to_units(self._v)

    @property
    def known_flows(self) -> int:
        """Flows the scheduler holds state for (waiting, or idle with information)."""
        return len(self._flows)

    def meter(self, flow: Hashable) -> float:
        f = self._get(flow)
        if f is None:
            return to_units(self._v)
        return to_units(max(f.S, self._v))

    def pending(self, flow: Hashable) -> int:
        f = self._get(flow)
        return 0 if f is None else f.live

    def weight(self, flow: Hashable) -> float:
        f = self._get(flow)
        return DEFAULT_WEIGHT if f is None else f.weight

    # ----------------------------------------------------------------- events
    def enqueue(self, flow: Hashable, cost: float, item: Any = None) -> int:
        f = self._get(flow)
        c = check_cost(cost)
        if f is None:
            f = self._flows[flow] = _Flow(flow, self._v)
        ticket = self._next_ticket
        self._next_ticket += 1
        if not f.waiting:  # (re)join: no banking while idle, no escaping a charge
            f.S = max(f.S, self._v)
            f.waiting = True
            f.idle_gen += 1
            self._waiting_flows += 1
            heapq.heappush(self._heap, (f.S, ticket, f))
        f.queue.append(ticket)
        f.live += 1
        self._requests[ticket] = (f, c, item)
        return ticket

    def dispatch(self) -> ReferenceDispatch | None:
        heap = self._heap
        while heap:
            S, head, f = heap[0]
            if f.waiting and f.S == S and f.queue[0] == head:
                break
            heapq.heappop(heap)  # stale: the flow was re-keyed or left
        else:
            return None
        ticket = f.queue.popleft()
        _, cost, item = self._requests.pop(ticket)
        f.live -= 1
        self._v = S
        f.S = S + charge(cost, f.weight)
        if f.S > self._max_finish:
            self._max_finish = f.S
        self._drop_cancelled_heads(f)
        if f.queue:
            heapq.heapreplace(heap, (f.S, f.queue[0], f))
        else:
            heapq.heappop(heap)
            self._leave(f)
        self._forget_idle()
        return ReferenceDispatch(f.key, item, cost, ticket, to_units(S), to_units(f.S))

    def cancel(self, ticket: int) -> bool:
        try:
            req = self._requests.pop(operator.index(ticket), None)  # type: ignore[arg-type]
        except TypeError:
            return False
        if req is None:
            return False
        f = req[0]
        f.live -= 1
        if f.queue[0] == ticket:  # the head changed: re-key (the old heap entry goes stale)
            self._drop_cancelled_heads(f)
            if f.queue:
                heapq.heappush(self._heap, (f.S, f.queue[0], f))
            else:
                self._leave(f)
                self._forget_idle()
        return True

    def set_weight(self, flow: Hashable, weight: float) -> None:
        f = self._get(flow)
        w = check_weight(weight)
        if f is None:
            if w == DEFAULT_WEIGHT:
                return
            f = self._flows[flow] = _Flow(flow, self._v)
        f.weight = w
        if w == DEFAULT_WEIGHT and not f.waiting and f.S <= self._v:
            del self._flows[flow]

    # ----------------------------------------------------------------- batches
    def enqueue_many(self, flows: Any, costs: Any, items: Any = None) -> Any:
        """``enqueue`` for each ``(flows[i], costs[i], items[i])`` in order, all checked
        first (a bad argument enqueues nothing); returns the tickets as an int64 array."""
        import numpy as np

        fl, arr, its = check_batch(flows, costs, items)
        first = self._next_ticket
        for i, flow in enumerate(fl):
            self.enqueue(flow, float(arr[i]), None if its is None else its[i])
        return np.arange(first, self._next_ticket, dtype=np.int64)

    def dispatch_many(self, n: int) -> DispatchBatch:
        """Up to ``n`` dispatches, exactly as ``n`` calls of ``dispatch``, as parallel arrays."""
        import numpy as np

        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        ds: list[ReferenceDispatch] = []
        while len(ds) < n:
            d = self.dispatch()
            if d is None:
                break
            ds.append(d)
        return DispatchBatch(
            [d.flow for d in ds],
            [d.item for d in ds],
            np.array([d.ticket for d in ds], dtype=np.int64),
            np.array([d.cost for d in ds], dtype=np.float64),
            np.array([d.start for d in ds], dtype=np.float64),
            np.array([d.finish for d in ds], dtype=np.float64),
        )

    # ----------------------------------------------------------------- internals
    def _get(self, flow: Hashable) -> _Flow | None:
        """The flow's record, None if it has none; TypeError naming an unhashable flow id."""
        try:
            return self._flows.get(flow)
        except TypeError:
            raise unhashable_flow(flow) from None

    def _drop_cancelled_heads(self, f: _Flow) -> None:
        q, reqs = f.queue, self._requests
        while q and q[0] not in reqs:
            q.popleft()

    def _leave(self, f: _Flow) -> None:
        """``f`` has no waiting request left: it leaves the competition, keeping its meter."""
        f.waiting = False
        self._waiting_flows -= 1
        heapq.heappush(self._idle, (f.S, next(self._idle_seq), f.idle_gen, f))
        if self._waiting_flows == 0:  # global idle: close this busy period
            self._v = max(self._v, self._max_finish)

    def _forget_idle(self) -> None:
        """Forget idle flows whose meter ``v`` has reached: they carry no information."""
        idle, v = self._idle, self._v
        while idle and idle[0][0] <= v:
            _, _, gen, f = heapq.heappop(idle)
            if not f.waiting and f.idle_gen == gen and f.weight == DEFAULT_WEIGHT and self._flows.get(f.key) is f:
                del self._flows[f.key]
