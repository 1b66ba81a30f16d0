"""Start-time Fair Queueing, in plain Python: the executable specification.

This twin and the compiled core (``src/csfq/_csfq.pyx``) make identical decisions; the
test suite runs every test against both and Hypothesis compares them event by event.
This one is written to be read. The derivation and the guarantees are in
``docs/design.md``; the algorithm is Goyal, Vin and Cheng's Start-time Fair Queueing (1996).

State
-----
* per flow: a meter ``S`` (its next start tag, in sub-units, see ``_common``), a weight,
  a FIFO of waiting tickets, and whether the caller has suspended it;
* ``v``, the virtual time: the start tag of the most recent dispatch;
* ``max_finish``, the largest finish tag handed out so far;
* ``in_flight``: work the caller says is still running (it keeps the busy period open).

Rules
-----
* enqueue: append to the flow's FIFO; if the flow was not competing it (re)joins with
  ``S = max(S, v)`` (a new flow starts at ``S = v``), unless the caller reported work of
  the flow still in flight (``work_started(flow)``): such a flow never left the system, so
  it keeps its own meter, lag included (the delivered-service modes);
* dispatch: take the competing flow with the smallest ``(S, head ticket)``, set
  ``v = max(v, S)`` (``v = S`` whenever meters are only charged at dispatch), pop its head
  request and charge ``S += ceil(cost * SCALE / weight)``;
* when no flow competes any more and no work is in flight: ``v = max(v, max_finish)`` (the
  idle rule: the next busy period starts level);
* cancel removes a waiting request uncharged; suspend/resume take a flow out of the
  competition and back (at ``max(S, v)``: nothing is banked while suspended); ``adjust``
  corrects a meter by a measured amount (the delivered-service modes). Nothing else ever
  touches a meter.

Integers here are Python ints, so this twin never renormalises; the compiled core does,
and the parity tests show that renormalisation changes no decision.

Memory: a flow that is idle, has the default weight, is not suspended and has ``S <= v``
carries no information (it would rejoin at ``v`` anyway), so it is forgotten. Idle flows
wait in a min-heap on ``S`` until ``v`` passes them.

Safety (the same contract as the compiled core): one method runs at a time. A call made
while another method of the same scheduler runs (from a ``__hash__``, ``__eq__``,
``__float__`` or ``__del__`` that the scheduler triggered, or from another thread) raises
``sfq.errors.SchedulerBusy`` and changes nothing. References the scheduler lets go of (a
cancelled payload, a forgotten flow id) are released only after the method's state change
is complete, so a ``__del__`` that calls back into the scheduler sees a consistent state and
succeeds. A method that raises leaves the scheduler as it was; a batch is checked whole
before anything changes.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Generic, Hashable

from ._common import (
    CONCURRENT,
    DEFAULT_WEIGHT,
    MAX_LEAD,
    REENTRANT,
    DispatchBatch,
    adjustment,
    charge,
    check_batch,
    check_cost,
    check_count,
    check_delta,
    check_weight,
    lead_overflow,
    to_units,
    unhashable_flow,
)
from .errors import SchedulerBusy

__all__ = ["ReferenceScheduler", "Dispatch", "ReferenceDispatch"]

if TYPE_CHECKING:  # the item's type: Any unless the scheduler is annotated, ReferenceScheduler[Job]
    from typing_extensions import TypeVar

    T = TypeVar("T", default=Any)
else:
    from typing import TypeVar

    T = TypeVar("T")


class Dispatch(Generic[T]):
    """One request as the scheduler hands it out (``dispatch()``, ``peek()``): ``flow``,
    ``item`` (what was enqueued with it), ``cost`` (as enqueued), ``ticket`` (``enqueue``'s),
    ``start`` (the flow's meter before the charge, equal to ``v``) and ``finish`` (after), in
    cost units. Read-only, as the compiled core's."""

    __slots__ = ("_flow", "_item", "_cost", "_ticket", "_start", "_finish")

    def __init__(self, flow: Hashable, item: T, cost: float, ticket: int, start: float, finish: float):
        self._flow = flow
        self._item = item
        self._cost = cost
        self._ticket = ticket
        self._start = start
        self._finish = finish

    @property
    def flow(self) -> Hashable:
        return self._flow

    @property
    def item(self) -> T:
        return self._item

    @property
    def cost(self) -> float:
        return self._cost

    @property
    def ticket(self) -> int:
        return self._ticket

    @property
    def start(self) -> float:
        return self._start

    @property
    def finish(self) -> float:
        return self._finish

    def __repr__(self) -> str:
        return (
            f"Dispatch(flow={self.flow!r}, ticket={self.ticket}, cost={self.cost!r}, "
            f"start={self.start!r}, finish={self.finish!r}, item={self.item!r})"
        )


class _Flow:
    __slots__ = ("key", "S", "weight", "queue", "live", "waiting", "suspended", "running", "idle_gen")

    def __init__(self, key: Hashable, S: int):
        self.key = key
        self.S = S  # meter: next start tag, sub-units
        self.weight = DEFAULT_WEIGHT
        self.queue: deque[int] = deque()  # waiting tickets, FIFO; may hold cancelled ones
        self.live = 0  # waiting (not cancelled) requests
        self.waiting = False  # competing: in the selection heap
        self.suspended = False  # taken out of the competition by the caller
        self.running = 0  # the caller's work of this flow in flight (work_started(flow))
        self.idle_gen = 0  # bumps on every change of idle-heap entry, to invalidate old ones


#: the twin's dispatch type under its older name
ReferenceDispatch = Dispatch


class ReferenceScheduler(Generic[T]):
    """Start-time Fair Queueing in pure Python: the readable twin of :class:`sfq.Scheduler`,
    with the same methods and, call for call, the same decisions (the test suite compares
    them event by event).

    Use it to read or step through the algorithm, on an interpreter the compiled core was not
    built for, or as the oracle of a test; ``sfq.Scheduler`` is this class itself when the
    extension is missing or ``SFQ_NO_EXTENSIONS=1`` is set. Every method is documented on
    :class:`sfq.Scheduler`.
    """

    def __init__(self) -> None:
        self._flows: dict[Hashable, _Flow] = {}
        self._requests: dict[int, tuple[_Flow, float, Any]] = {}  # ticket -> waiting request
        self._heap: list[tuple[int, int, _Flow]] = []  # (S, head ticket, flow); stale entries skipped
        self._idle: list[tuple[int, int, int, _Flow]] = []  # (S, seq, idle_gen, flow) of idle flows
        self._idle_seq = itertools.count()  # unique second key: flows are never compared
        self._v = 0  # virtual time, sub-units
        self._max_finish = 0  # largest finish tag so far, sub-units
        self._next_ticket = 1
        self._waiting_flows = 0  # competing flows
        self._in_flight = 0  # work the caller reported started and not yet done
        self._lock = threading.Lock()  # held while a method runs: re-entry and threads refused
        self._owner = 0  # the thread running a method

    # ----------------------------------------------------------------- the one-at-a-time guard
    def _enter(self) -> None:
        if not self._lock.acquire(False):
            msg = REENTRANT if self._owner == threading.get_ident() else CONCURRENT
            raise SchedulerBusy(msg)
        self._owner = threading.get_ident()

    def _exit(self) -> None:
        self._owner = 0
        self._lock.release()

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._requests)

    @property
    def waiting_flows(self) -> int:
        """Flows with a waiting request that compete for dispatch (suspended ones do not)."""
        return self._waiting_flows

    @property
    def virtual_time(self) -> float:
        return to_units(self._v)

    @property
    def known_flows(self) -> int:
        """Flows the scheduler holds state for (waiting, or idle with information)."""
        return len(self._flows)

    @property
    def in_flight(self) -> int:
        """Work reported by ``work_started()`` and not yet by ``work_done()``."""
        return self._in_flight

    @property
    def renormalisations(self) -> int:
        """How many times meters were renormalised: always 0 here (Python ints never overflow)."""
        return 0

    def meter(self, flow: Hashable) -> float:
        self._enter()
        try:
            f = self._get(flow)
            if f is None:
                return to_units(self._v)
            if f.waiting or (f.running and not f.suspended):
                return to_units(f.S)  # competing, or keeping its lag while its work runs
            return to_units(max(f.S, self._v))
        finally:
            self._exit()

    def pending(self, flow: Hashable) -> int:
        self._enter()
        try:
            f = self._get(flow)
            return 0 if f is None else f.live
        finally:
            self._exit()

    def weight(self, flow: Hashable) -> float:
        self._enter()
        try:
            f = self._get(flow)
            return DEFAULT_WEIGHT if f is None else f.weight
        finally:
            self._exit()

    def running(self, flow: Hashable) -> int:
        """Work of ``flow`` reported by ``work_started(flow)`` and not yet done."""
        self._enter()
        try:
            f = self._get(flow)
            return 0 if f is None else f.running
        finally:
            self._exit()

    def suspended(self, flow: Hashable) -> bool:
        """Whether ``flow`` is suspended (out of the competition)."""
        self._enter()
        try:
            f = self._get(flow)
            return f is not None and f.suspended
        finally:
            self._exit()

    def peek(self) -> Dispatch[T] | None:
        """What ``dispatch()`` would return now, changing nothing; None when nothing competes."""
        self._enter()
        try:
            junk: list[Any] = []
            f = self._top(junk)
            if f is None:
                return None
            ticket = f.queue[0]
            _, cost, item = self._requests[ticket]
            return Dispatch(f.key, item, cost, ticket, to_units(f.S), to_units(f.S + charge(cost, f.weight)))
        finally:
            self._exit()

    # ----------------------------------------------------------------- events
    def enqueue(self, flow: Hashable, cost: float, item: T | None = None) -> int:
        self._enter()
        try:
            f = self._get(flow)
            c = check_cost(cost)
            if f is None:
                f = self._flows[flow] = _Flow(flow, self._v)  # the first change; nothing after it fails
            return self._append(f, c, item)
        finally:
            self._exit()

    def dispatch(self) -> Dispatch[T] | None:
        self._enter()
        try:
            junk: list[Any] = []  # what this call lets go of, released after the state is consistent
            return self._pop(junk)
        finally:
            self._exit()

    def cancel(self, ticket: int) -> bool:
        self._enter()
        try:
            try:
                t = operator.index(ticket)
            except TypeError:
                return False
            req = self._requests.pop(t, None)  # the payload is released when this call returns
            if req is None:
                return False
            junk: list[Any] = [req]
            f = req[0]
            f.live -= 1
            if f.queue[0] == t:  # the head changed: re-key (the old heap entry goes stale)
                self._drop_cancelled_heads(f)
                if f.waiting:
                    if f.queue:
                        heapq.heappush(self._heap, (f.S, f.queue[0], f))
                    else:
                        self._leave(f)
                        self._forget_idle(junk)
            return True
        finally:
            self._exit()

    def set_weight(self, flow: Hashable, weight: float) -> None:
        self._enter()
        try:
            f = self._get(flow)
            w = check_weight(weight)
            if f is None:
                if w == DEFAULT_WEIGHT:
                    return
                f = self._flows[flow] = _Flow(flow, self._v)
            f.weight = w
            if (w == DEFAULT_WEIGHT and not f.waiting and not f.suspended and not f.running
                    and f.S <= self._v and not f.queue):
                self._discard(f)
        finally:
            self._exit()

    def suspend(self, flow: Hashable) -> None:
        """Take ``flow`` out of the competition: its requests keep waiting (``pending``,
        ``cancel`` and ``len`` see them) but no dispatch picks it until ``resume``."""
        self._enter()
        try:
            f = self._get(flow)
            if f is None:
                f = self._flows[flow] = _Flow(flow, self._v)
            if f.suspended:
                return
            junk: list[Any] = []
            f.suspended = True
            f.idle_gen += 1  # out of the idle heap too: a suspended flow is never forgotten
            if f.waiting:
                f.waiting = False  # its heap entry goes stale
                self._waiting_flows -= 1
                self._idle_rule()
                self._forget_idle(junk)
        finally:
            self._exit()

    def resume(self, flow: Hashable) -> None:
        """Put a suspended ``flow`` back: with waiting requests it rejoins at ``S = max(S, v)``."""
        self._enter()
        try:
            f = self._get(flow)
            if f is None or not f.suspended:
                return
            junk: list[Any] = []
            f.suspended = False
            if f.queue:
                self._join(f, f.queue[0], lift=True)  # nothing banked while held back
            elif not f.running:
                self._park(f)
                self._forget_idle(junk)
        finally:
            self._exit()

    def adjust(self, flow: Hashable, delta: float) -> None:
        """Correct ``flow``'s meter by ``delta`` cost units (negative: a refund), divided by
        its weight like a charge. A competing flow is re-keyed and never falls below ``v``."""
        self._enter()
        try:
            f = self._get(flow)
            d = check_delta(delta)
            if d == 0.0:
                return
            sub = adjustment(d, DEFAULT_WEIGHT if f is None else f.weight)
            if f is not None and f.running:
                # work in flight: the flow never left, its meter (lag included) is its own;
                # a refund may take it below v, never more than MAX_LEAD below
                new = max(f.S + sub, self._v - MAX_LEAD)
            else:
                new = max((self._v if f is None else max(f.S, self._v)) + sub, self._v)
            if new - self._v > MAX_LEAD:
                raise lead_overflow(flow, delta)
            if f is None:
                if new <= self._v:
                    return  # a refund to a flow with no state: it would start at v anyway
                f = self._flows[flow] = _Flow(flow, self._v)
            junk: list[Any] = []
            f.S = new
            if new > self._max_finish:
                self._max_finish = new
            if f.waiting:
                heapq.heappush(self._heap, (f.S, f.queue[0], f))  # the old entry goes stale
            elif not f.suspended and not f.running:
                self._park(f)
                self._forget_idle(junk)
        finally:
            self._exit()

    def work_started(self, flow: Hashable = None) -> None:
        """The caller started work (a request went to a server): the busy period stays open
        until the matching ``work_done()``, even when no request waits here. With ``flow``,
        the work is that flow's: until it is done the flow keeps its meter when it rejoins."""
        self._enter()
        try:
            if flow is not None:
                f = self._get(flow)
                if f is None:
                    f = self._flows[flow] = _Flow(flow, self._v)
                if f.running == 0 and not f.waiting and not f.suspended:
                    f.idle_gen += 1  # out of the idle heap: a flow with work in flight is kept
                f.running += 1
            self._in_flight += 1
        finally:
            self._exit()

    def work_done(self, flow: Hashable = None) -> None:
        """Work reported by ``work_started()`` (with the same ``flow``) ended. When it was the
        last and no flow competes, the idle rule closes the busy period."""
        self._enter()
        try:
            junk: list[Any] = []
            if flow is not None:
                f = self._get(flow)
                if f is None or f.running == 0:
                    raise ValueError(f"work_done({flow!r}) without a matching work_started({flow!r})")
                f.running -= 1
                if f.running == 0 and not f.waiting and not f.suspended:
                    self._park(f)
            elif self._in_flight == 0:
                raise ValueError("work_done() without a matching work_started(): no work is in flight")
            self._in_flight -= 1
            self._idle_rule()
            self._forget_idle(junk)
        finally:
            self._exit()

    # ----------------------------------------------------------------- batches
    def enqueue_many(self, flows: Any, costs: Any, items: Any = None) -> Any:
        """``enqueue`` for each ``(flows[i], costs[i], items[i])`` in order, all checked
        first (a bad argument enqueues nothing); returns the tickets as an int64 array."""
        import numpy as np

        self._enter()
        try:
            fl, arr, its = check_batch(flows, costs, items)
            # resolve every flow before any change: hashing and comparing run user code
            new: dict[Hashable, _Flow] = {}
            resolved: list[_Flow] = []
            for flow in fl:
                f = self._get(flow)
                if f is None:
                    f = new.get(flow)
                    if f is None:
                        f = new[flow] = _Flow(flow, self._v)
                resolved.append(f)
            added: list[Hashable] = []
            try:
                for key, f in new.items():
                    self._flows[key] = f
                    added.append(key)
            except BaseException:
                for key in added:  # undo: the batch enqueues nothing
                    self._flows.pop(key, None)
                raise
            first = self._next_ticket
            cl = arr.tolist()
            for i, f in enumerate(resolved):
                self._append(f, cl[i], None if its is None else its[i])
            return np.arange(first, self._next_ticket, dtype=np.int64)
        finally:
            self._exit()

    def dispatch_many(self, n: int) -> DispatchBatch:
        """Up to ``n`` dispatches, exactly as ``n`` calls of ``dispatch``, as parallel arrays."""
        import numpy as np

        self._enter()
        try:
            k = check_count(n)
            junk: list[Any] = []
            ds: list[Dispatch[T]] = []
            while len(ds) < k:
                d = self._pop(junk)
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
        finally:
            self._exit()

    # ----------------------------------------------------------------- internals
    def _get(self, flow: Hashable) -> _Flow | None:
        """The flow's record, None if it has none; TypeError naming an unhashable flow id."""
        try:
            return self._flows.get(flow)
        except TypeError:
            raise unhashable_flow(flow) from None

    def _append(self, f: _Flow, c: float, item: Any) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        f.queue.append(ticket)
        f.live += 1
        self._requests[ticket] = (f, c, item)
        if not f.waiting and not f.suspended:
            self._join(f, f.queue[0], lift=not f.running)
        return ticket

    def _join(self, f: _Flow, head: int, lift: bool) -> None:
        """(Re)join the competition: no banking while away, no escaping a charge. A flow
        whose work is still in flight never went away: it keeps its meter (lift=False)."""
        if lift:
            f.S = max(f.S, self._v)
        f.waiting = True
        f.idle_gen += 1
        self._waiting_flows += 1
        heapq.heappush(self._heap, (f.S, head, f))

    def _top(self, junk: list[Any]) -> _Flow | None:
        """The competing flow with the smallest (S, head ticket), stale heap entries dropped."""
        heap = self._heap
        while heap:
            S, head, f = heap[0]
            if f.waiting and f.S == S and f.queue[0] == head:
                return f
            junk.append(heapq.heappop(heap))  # stale: the flow was re-keyed or left
        return None

    def _pop(self, junk: list[Any]) -> Dispatch[T] | None:
        f = self._top(junk)
        if f is None:
            return None
        S = f.S
        ticket = f.queue.popleft()
        _, cost, item = self._requests.pop(ticket)
        f.live -= 1
        if S > self._v:
            self._v = S
        f.S = S + charge(cost, f.weight)
        if f.S > self._max_finish:
            self._max_finish = f.S
        self._drop_cancelled_heads(f)
        if f.queue:
            junk.append(heapq.heapreplace(self._heap, (f.S, f.queue[0], f)))
        else:
            junk.append(heapq.heappop(self._heap))
            self._leave(f)
        self._forget_idle(junk)
        return Dispatch(f.key, item, cost, ticket, to_units(S), to_units(f.S))

    def _drop_cancelled_heads(self, f: _Flow) -> None:
        q, reqs = f.queue, self._requests
        while q and q[0] not in reqs:
            q.popleft()

    def _leave(self, f: _Flow) -> None:
        """``f`` has no waiting request left: it leaves the competition, keeping its meter."""
        f.waiting = False
        self._waiting_flows -= 1
        if not f.running:  # a flow with work in flight is kept (out of the idle heap)
            self._park(f)
        self._idle_rule()

    def _park(self, f: _Flow) -> None:
        """An idle flow waits in the idle heap until ``v`` passes its meter."""
        f.idle_gen += 1
        heapq.heappush(self._idle, (f.S, next(self._idle_seq), f.idle_gen, f))

    def _idle_rule(self) -> None:
        if self._waiting_flows == 0 and self._in_flight == 0:  # the system is idle: close the busy period
            self._v = max(self._v, self._max_finish)

    def _forget_idle(self, junk: list[Any]) -> None:
        """Forget idle flows whose meter ``v`` has reached: they carry no information."""
        idle, v = self._idle, self._v
        while idle and idle[0][0] <= v:
            entry = heapq.heappop(idle)
            junk.append(entry)
            f = entry[3]
            if (not f.waiting and not f.suspended and not f.running and f.idle_gen == entry[2]
                    and not f.queue and f.weight == DEFAULT_WEIGHT):
                self._discard(f)

    def _discard(self, f: _Flow) -> None:
        # forgetting is only a memory optimisation: a flow id whose __hash__ or __eq__ fails
        # here simply stays known (the compiled core never hashes a flow id to forget it)
        try:
            if self._flows.get(f.key) is f:
                del self._flows[f.key]
        except Exception:
            pass
