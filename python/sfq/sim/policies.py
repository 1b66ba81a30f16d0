"""Scheduling disciplines, one interface.

A discipline holds the requests waiting at the balancer and names the next one to start.
(The policy file's type is ``sfq.policy.Policy``; the simulator's ``sfq`` discipline runs one,
see :mod:`sfq.sim.adapter`.) The simulator calls, for each run on a fresh instance:

* ``bind(sim)`` once (flows, weights, service weights ``w_p``/``w_q``, and the running
  aggregates per flow that in-engine policies read);
* ``arrive(r, t)`` when request ``r`` reaches the balancer at step ``t`` (``r.est`` is
  set: the estimated cost, weighted tokens; unless the policy sets
  ``estimate_at_arrival = False`` and estimates at dispatch with ``sim.estimate(r)``);
* ``start(t, fits)``: start the request that should start next if ``fits(r)`` (a server
  can take it now) and return it; ``None`` when nothing waits or the one it names does not
  fit (the balancer stalls). The base class does it with the two calls below, which the
  baselines implement; the request engine (:mod:`sfq.sim.adapter`) looks before it pops
  itself;
* ``peek(t)``: the request that should start next, or ``None``. Asking twice without an
  ``admit`` in between returns the same request unless the policy's state changed (for
  the in-engine counters it may: they move with decode);
* ``admit(r, t)``: the request returned by the last ``peek`` started;
* ``advance(t0, t1)``: decode steps ``t0 .. t1-1`` ran (counters that charge decode);
* ``complete(r, t)``: ``r`` finished (told before the running aggregates drop it);
  ``wakeup(t)``: the next step at which the policy could start something without any
  other event (rate-limit windows; for policies whose counters move with decode, the
  first step at which another waiting flow could overtake the one named while the
  balancer stalls), or ``None``.

"First come" in every tie rule is ``r.seq``, the order requests reached the balancer.

Balancer-side policies order by the estimate: ``fifo``, ``prio`` (strict priority by
class, FIFO inside), ``rr`` (round robin by request), ``drr`` (deficit round robin with a
quantum), ``wfq`` (finish tags), ``sfq`` (the project's request engine,
:class:`sfq.engine.PolicyEngine`, the one ``sfq serve`` runs, in one of its charge modes:
:class:`sfq.sim.adapter.EngineDiscipline`), ``sfq-seed`` (the bare core, ``sfq.Scheduler``,
under the plain rule of docs/design.md §2, for comparison), and ``fifo`` behind a per-flow
RPM gate. In-engine policies charge what is incurred
(as VTC does, Sheng et al., OSDI 2024): ``lcf`` (least counter first, no lift), ``vtc`` (with the lift), and
``vtc-h`` (VTC charging ``h(n_p, n_q)`` increments).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, Callable

from ..policy.charge import CHARGE_MODES, DEFAULT_CHARGE
from .model import Request

__all__ = [
    "Discipline",
    "FIFO",
    "StrictPriority",
    "RPMLimitedFIFO",
    "RoundRobin",
    "DRR",
    "WFQ",
    "SeedSFQ",
    "CHARGE_MODES",
    "DEFAULT_CHARGE",
    "VTC",
    "POLICIES",
    "make_policy",
    "context_h",
]


class Discipline:
    """Base class; see the module docstring for the protocol."""

    name = "discipline"
    #: True for disciplines that act inside the engine on incurred service (lcf, vtc)
    in_engine = False
    #: the simulator stamps ``r.est`` at arrival (False: the discipline estimates at dispatch)
    estimate_at_arrival = True
    #: the discipline feeds the estimator its completions itself (the simulator must not)
    calibrates = False

    def bind(self, sim: Any) -> None:
        self.sim = sim
        self.nflows = len(sim.flows)
        self.weights = [f.weight for f in sim.flows]
        self.w_p = sim.w_p
        self.w_q = sim.w_q

    @property
    def label(self) -> str:
        return self.name

    def arrive(self, r: Request, t: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def start(self, t: int, fits: Callable[[Request], bool]) -> Request | None:
        """Start the next request if it fits (``fits(r)``) and return it; ``None`` when
        nothing waits or the named request does not fit."""
        r = self.peek(t)
        if r is None or not fits(r):
            return None
        self.admit(r, t)
        return r

    def peek(self, t: int) -> Request | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def admit(self, r: Request, t: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def advance(self, t0: int, t1: int) -> None:
        pass

    def complete(self, r: Request, t: int) -> None:
        pass

    def wakeup(self, t: int) -> int | None:
        return None


class FIFO(Discipline):
    """First come, first served across all flows (the order of arrival, then ``rid``)."""

    name = "fifo"

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.q: deque[Request] = deque()

    def arrive(self, r: Request, t: int) -> None:
        self.q.append(r)

    def peek(self, t: int) -> Request | None:
        return self.q[0] if self.q else None

    def admit(self, r: Request, t: int) -> None:
        self.q.popleft()


class StrictPriority(Discipline):
    """Always the highest class that has work (``FlowSpec.priority``, 0 first); FIFO
    inside a class. Strict priority as a multi-team pool meets it: it protects the urgent class and can
    starve the rest."""

    name = "prio"

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.prio_of = [f.priority for f in sim.flows]
        self.levels = sorted(set(self.prio_of))
        self.qs: dict[int, deque[Request]] = {p: deque() for p in self.levels}

    def arrive(self, r: Request, t: int) -> None:
        self.qs[self.prio_of[r.flow]].append(r)

    def peek(self, t: int) -> Request | None:
        for p in self.levels:
            q = self.qs[p]
            if q:
                return q[0]
        return None

    def admit(self, r: Request, t: int) -> None:
        self.qs[self.prio_of[r.flow]].popleft()


class RPMLimitedFIFO(Discipline):
    """FIFO, but a flow may start at most ``rpm`` requests per window of ``window``
    steps (fixed windows ``[k*window, (k+1)*window)``; the simulator's "minute" is 2000
    steps). Requests over the limit wait for the next window."""

    name = "fifo"

    def __init__(self, rpm: int, window: int = 2000):
        if isinstance(rpm, bool) or not isinstance(rpm, int) or rpm < 1:
            raise ValueError(f"rpm must be an int >= 1, got {rpm!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (steps), got {window!r}")
        self.rpm = rpm
        self.window = window

    @property
    def label(self) -> str:
        return f"fifo rpm={self.rpm}"

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.qs: list[deque[Request]] = [deque() for _ in range(self.nflows)]
        self.used: dict[int, int] = {}  # starts per flow in the current window
        self.active: set[int] = set()  # flows with a request waiting
        self.win = -1
        self.nwaiting = 0

    def arrive(self, r: Request, t: int) -> None:
        self.qs[r.flow].append(r)
        self.active.add(r.flow)
        self.nwaiting += 1

    def peek(self, t: int) -> Request | None:
        w = t // self.window
        if w != self.win:
            self.win = w
            self.used.clear()
        best = None
        used, rpm = self.used, self.rpm
        for f in self.active:
            head = self.qs[f][0]
            if used.get(f, 0) < rpm and (best is None or head.seq < best.seq):
                best = head
        return best

    def admit(self, r: Request, t: int) -> None:
        q = self.qs[r.flow]
        q.popleft()
        if not q:
            self.active.discard(r.flow)
        self.used[r.flow] = self.used.get(r.flow, 0) + 1
        self.nwaiting -= 1

    def wakeup(self, t: int) -> int | None:
        return (t // self.window + 1) * self.window if self.nwaiting else None


class RoundRobin(Discipline):
    """Round robin by request: flows with work take turns, one request per turn; a flow
    that (re)joins goes to the end of the line. Ignores size and weight."""

    name = "rr"

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.qs: list[deque[Request]] = [deque() for _ in range(self.nflows)]
        self.active: deque[int] = deque()

    def arrive(self, r: Request, t: int) -> None:
        q = self.qs[r.flow]
        if not q:
            self.active.append(r.flow)
        q.append(r)

    def peek(self, t: int) -> Request | None:
        return self.qs[self.active[0]][0] if self.active else None

    def admit(self, r: Request, t: int) -> None:
        f = self.active.popleft()
        q = self.qs[f]
        q.popleft()
        if q:
            self.active.append(f)


class DRR(RoundRobin):
    """Deficit round robin (Shreedhar & Varghese) on the estimated cost.

    Active flows sit in a circular list. A visit to a flow adds ``quantum * weight`` to
    its deficit; while the head request's cost fits the deficit it is sent and its cost
    deducted; when it does not, the flow goes to the tail keeping its deficit. A flow
    whose queue empties leaves the list with its deficit reset to 0; a (re)joining flow
    enters at the tail with deficit 0. ``quantum`` is in weighted tokens.
    """

    name = "drr"

    def __init__(self, quantum: float = 1024.0):
        if not (quantum > 0) or quantum == float("inf"):
            raise ValueError(f"quantum must be a finite number > 0 (weighted tokens), got {quantum!r}")
        self.quantum = float(quantum)

    def bind(self, sim: Any) -> None:
        super().bind(sim)  # round robin's per-flow queues and circular list of active flows
        self.deficit = [0.0] * self.nflows
        self.visiting = [False] * self.nflows  # the current visit's quantum was granted
        self.chosen: Request | None = None

    def peek(self, t: int) -> Request | None:
        if self.chosen is not None:
            return self.chosen
        active, deficit, visiting = self.active, self.deficit, self.visiting
        while active:
            f = active[0]
            if not visiting[f]:
                deficit[f] += self.quantum * self.weights[f]
                visiting[f] = True
            head = self.qs[f][0]
            if head.est <= deficit[f]:
                self.chosen = head
                return head
            visiting[f] = False  # the visit ends; the deficit is kept
            active.rotate(-1)
        return None

    def admit(self, r: Request, t: int) -> None:
        f = r.flow
        self.qs[f].popleft()
        self.deficit[f] -= r.est
        self.chosen = None
        if not self.qs[f]:
            self.deficit[f] = 0.0
            self.visiting[f] = False
            self.active.popleft()


class WFQ(Discipline):
    """Weighted fair queueing with finish tags (``max(last finish, v) + cost / weight``, self-clocked).

    At arrival: ``finish = max(flow_finish, v) + est / weight``; the request with the
    smallest finish tag goes first (ties: earlier ``rid``); after it starts, ``v`` becomes
    its finish tag (the self-clocked virtual time of Golestani's SCFQ).
    """

    name = "wfq"

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.heap: list[tuple[float, int, Request]] = []
        self.last_finish = [0.0] * self.nflows
        self.v = 0.0

    def arrive(self, r: Request, t: int) -> None:
        f = r.flow
        start = self.last_finish[f] if self.last_finish[f] > self.v else self.v
        r.tag = start + r.est / self.weights[f]
        self.last_finish[f] = r.tag
        heapq.heappush(self.heap, (r.tag, r.seq, r))

    def peek(self, t: int) -> Request | None:
        return self.heap[0][2] if self.heap else None

    def admit(self, r: Request, t: int) -> None:
        tag, _, _ = heapq.heappop(self.heap)
        self.v = tag


def _first_overtake(t: int, named: int, rate: Callable[[int], float], value: Callable[[int], float],
                    others: Any) -> int | None:
    """The first step after ``t`` at which one of ``others`` could overtake the flow
    ``named`` (the smallest key wins) when keys grow linearly, ``value(f) + rate(f) * d``:
    a lower bound (``floor`` of the crossing, at least ``t + 1``). ``None``: none can."""
    vf, rf = value(named), rate(named)
    best: int | None = None
    for g in others:
        if g == named:
            continue
        rg = rate(g)
        if rf <= rg:
            continue  # the gap never closes
        d = (value(g) - vf) / (rf - rg)
        step = t + max(1, math.floor(d))
        if best is None or step < best:
            best = step
    return best


class SeedSFQ(Discipline):
    """Start-time fair queueing under the plain rule of docs/design.md §2 (``sfq-seed``), for comparison.

    Each arrival is enqueued with its estimate, stamped at arrival and never corrected;
    ``peek`` dispatches from the core when nothing is staged and holds the request until
    it can be placed (the core charged it at dispatch; the balancer stalls,
    docs/design.md §5); the busy period ends when the core's queue empties (its idle rule). ``core``
    picks the scheduler class (default ``sfq.Scheduler``, the compiled core when built).

    A baseline on the bare core, not the request engine (the ``sfq`` policy is the engine,
    :mod:`sfq.sim.adapter`): it shows what the plain rule does without the engine's driving
    (look before you pop, the estimate at dispatch, the charge modes), so it uses the core's
    ``enqueue`` and ``dispatch`` only.
    """

    name = "sfq-seed"

    def __init__(self, core: Callable[[], Any] | None = None):
        if core is None:
            import sfq

            core = sfq.Scheduler
        self.core = core

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.sched = self.core()
        for f, w in enumerate(self.weights):
            if w != 1.0:
                self.sched.set_weight(f, w)
        self.staged = None

    def arrive(self, r: Request, t: int) -> None:
        self.sched.enqueue(r.flow, r.est, r)

    def peek(self, t: int) -> Request | None:
        if self.staged is None:
            d = self.sched.dispatch()
            if d is not None:
                self.staged = d.item
        return self.staged

    def admit(self, r: Request, t: int) -> None:
        self.staged = None




def context_h(beta: float) -> Callable[[float, float, int, int], float]:
    """``h(n_p, n_q) = w_p n_p + w_q n_q + beta * sum_{j=1..n_q} (n_p + j)``: decode of
    the j-th token is charged ``w_q + beta * context_len`` (VTC's generalised cost h, Sheng et al., OSDI 2024)."""

    def h(w_p: float, w_q: float, n_p: int, n_q: int) -> float:
        return w_p * n_p + w_q * n_q + beta * (n_p * n_q + n_q * (n_q + 1) / 2)

    return h


class VTC(Discipline):
    """The virtual token counter (Sheng et al., OSDI 2024), inside the engine.

    Each flow has a counter ``c`` (in weighted tokens / weight). The waiting flow with the
    smallest counter starts its oldest request (ties: the older head); admission charges
    ``h(p, 0)`` (``w_p * p``), each decode step ``h(p, g) - h(p, g-1)`` (``w_q``).

    ``lift`` (VTC): a flow with nothing waiting that gets a request is lifted to
    ``max(c, min counter of the waiting flows)``, or, when none waits, to the counter of
    the flow that left the queue last: no banking while idle. Without it (``lcf``, seed
    003's strawman) a returning flow cashes in its idle time. ``beta > 0`` charges decode
    ``w_q + beta * context_len`` (``vtc-h``, the h(n_p, n_q) generalisation).
    """

    name = "vtc"
    in_engine = True

    def __init__(self, lift: bool = True, beta: float = 0.0):
        if not (beta >= 0) or beta == float("inf"):
            raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
        self.lift = lift
        self.beta = float(beta)
        self.name = ("vtc" if lift else "lcf") + ("-h" if beta else "")

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.c = [0.0] * self.nflows
        self.qs: list[deque[Request]] = [deque() for _ in range(self.nflows)]
        self.active: set[int] = set()  # flows with a request waiting
        self.last_left: int | None = None
        self.h = context_h(self.beta)
        self.named: Request | None = None
        # Waiting flows with nothing running keep their counter until they start something,
        # so they sit in a heap on (counter, head seq); waiting flows with running requests
        # (counters moving with decode; at most the batch) are scanned. Per event this costs
        # O(running flows + log waiting flows), whatever the number of idle flows.
        self.heap: list[tuple[float, int, int, int]] = []
        self.ver = [0] * self.nflows
        self.hot: set[int] = set()

    def _place(self, f: int, running: bool) -> None:
        self.ver[f] += 1
        if not self.qs[f]:
            self.hot.discard(f)
        elif running:
            self.hot.add(f)
        else:
            self.hot.discard(f)
            heapq.heappush(self.heap, (self.c[f], self.qs[f][0].seq, f, self.ver[f]))

    def rekey(self) -> None:
        """Re-sort the waiting flows after their counters were changed from outside."""
        for f in list(self.active):
            self._place(f, self.sim.running[f] > 0)

    def _cold_top(self) -> int | None:
        heap, ver = self.heap, self.ver
        while heap:
            _, _, f, v = heap[0]
            if v == ver[f]:
                return f
            heapq.heappop(heap)
        return None

    def _floor(self) -> float | None:
        """The smallest counter of the waiting flows."""
        c = self.c
        top = self._cold_top()
        floor = None if top is None else c[top]
        for g in self.hot:
            if floor is None or c[g] < floor:
                floor = c[g]
        return floor

    def arrive(self, r: Request, t: int) -> None:
        f = r.flow
        q = self.qs[f]
        if not q:
            if self.lift:
                c = self.c
                floor = self._floor()
                if floor is None and self.last_left is not None:
                    floor = c[self.last_left]
                if floor is not None and floor > c[f]:
                    c[f] = floor
            self.active.add(f)
            q.append(r)
            self._place(f, self.sim.running[f] > 0)
        else:
            q.append(r)

    def peek(self, t: int) -> Request | None:
        c, qs = self.c, self.qs
        top = self._cold_top()
        best = None if top is None else qs[top][0]
        bc = 0.0 if top is None else c[top]
        for f in self.hot:
            head = qs[f][0]
            cf = c[f]
            if best is None or cf < bc or (cf == bc and head.seq < best.seq):
                best, bc = head, cf
        self.named = best
        return best

    def admit(self, r: Request, t: int) -> None:
        f = r.flow
        q = self.qs[f]
        q.popleft()
        self.c[f] += self.h(self.w_p, self.w_q, r.prompt, 0) / self.weights[f]
        if not q:
            self.active.discard(f)
            self.last_left = f
        self._place(f, True)  # r runs from now
        self.named = None

    def complete(self, r: Request, t: int) -> None:
        f = r.flow
        if self.sim.running[f] == 1 and self.qs[f]:  # its last running request: the counter stops
            self._place(f, False)

    def advance(self, t0: int, t1: int) -> None:
        self.named = None
        k = t1 - t0
        sim = self.sim
        n_f, sp_f, sa_f = sim.running, sim.running_prompt, sim.running_admit
        beta = self.beta
        for f in sim.running_flows:
            n = n_f[f]
            if n:
                inc = self.w_q * k * n
                if beta:
                    # sum over running r of h(p, g+k) - h(p, g) - w_q k, with g = t0 - admit
                    inc += beta * (k * (sp_f[f] + n * t0 - sa_f[f]) + n * k * (k + 1) / 2)
                self.c[f] += inc / self.weights[f]

    def wakeup(self, t: int) -> int | None:
        """While the balancer stalls on the named request, the first step at which another
        waiting flow's counter could pass the named one's (counters of running flows grow
        with decode): from there a smaller request may start."""
        if self.named is None or len(self.active) < 2:
            return None
        f = self.named.flow
        if f not in self.hot:
            return None  # its counter stands still: no waiting flow can pass it
        if self.beta:
            return t + 1  # quadratic counters: re-ask every step
        others = list(self.hot)
        top = self._cold_top()
        if top is not None:
            others.append(top)  # of the flows whose counters stand still, the lowest
        n_f, w_q, weights, c = self.sim.running, self.w_q, self.weights, self.c
        return _first_overtake(t, f, lambda g: w_q * n_f[g] / weights[g], c.__getitem__, others)


#: the earlier name of :class:`Discipline` (not exported: the policy file's type is ``sfq.policy.Policy``)
Policy = Discipline


def _rpm_fifo(rpm: int | None = None, window: int = 2000, **_: Any) -> Discipline:
    return FIFO() if rpm is None else RPMLimitedFIFO(rpm, window)


def _sfq(core: Callable[[], Any] | None = None, charge: str | None = None, **_: Any) -> Discipline:
    from .adapter import EngineDiscipline

    return EngineDiscipline.sfq(core, charge)


#: name -> factory(**options); options: quantum (drr), beta (vtc-h), rpm/window (fifo),
#: core and charge (sfq; core for sfq-seed). Unknown options are ignored by the factories that do not use them.
POLICIES: dict[str, Callable[..., Discipline]] = {
    "fifo": _rpm_fifo,
    "prio": lambda **_: StrictPriority(),
    "rr": lambda **_: RoundRobin(),
    "drr": lambda quantum=1024.0, **_: DRR(quantum),
    "wfq": lambda **_: WFQ(),
    "sfq": _sfq,
    "sfq-seed": lambda core=None, **_: SeedSFQ(core),
    "lcf": lambda **_: VTC(lift=False),
    "vtc": lambda **_: VTC(lift=True),
    "vtc-h": lambda beta=0.01, **_: VTC(lift=True, beta=beta),
}


def make_policy(name: str, **options: Any) -> Discipline:
    """A fresh discipline by name (see :data:`POLICIES`); ``ValueError`` names an unknown one."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return factory(**options)
