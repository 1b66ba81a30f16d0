"""Scheduling policies, one interface.

A policy holds the requests waiting at the balancer and names the next one to start.
The simulator calls, for each run on a fresh instance:

* ``bind(sim)`` once (flows, weights, service weights ``w_p``/``w_q``, and the running
  aggregates per flow that in-engine policies read);
* ``arrive(r, t)`` when request ``r`` reaches the balancer at step ``t`` (``r.est`` is
  set: the estimated cost, weighted tokens);
* ``peek(t)``: the request that should start next, or ``None``. Asking twice without an
  ``admit`` in between returns the same request unless the policy's state changed (for
  the in-engine counters it may: they move with decode);
* ``admit(r, t)``: the request returned by the last ``peek`` started;
* ``advance(t0, t1)``: decode steps ``t0 .. t1-1`` ran (counters that charge decode);
* ``complete(r, t)``: ``r`` finished; ``wakeup(t)``: the next step at which the policy
  could start something without any other event (rate-limit windows), or ``None``.

Balancer-side policies order by the estimate: ``fifo``, ``prio`` (strict priority by
class, FIFO inside), ``rr`` (round robin by request), ``drr`` (deficit round robin with a
quantum), ``wfq`` (finish tags), ``sfq`` (the project's core, ``sfq.Scheduler``), and
``fifo`` behind a per-flow RPM gate. In-engine policies charge what is incurred
(seed 003): ``lcf`` (least counter first, no lift), ``vtc`` (with the lift), and
``vtc-h`` (VTC charging ``h(n_p, n_q)`` increments).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any, Callable

__all__ = [
    "Policy",
    "FIFO",
    "StrictPriority",
    "RPMLimitedFIFO",
    "RoundRobin",
    "DRR",
    "WFQ",
    "SFQ",
    "VTC",
    "POLICIES",
    "make_policy",
    "context_h",
]


class Policy:
    """Base class; see the module docstring for the protocol."""

    name = "policy"
    #: True for policies that act inside the engine on incurred service (lcf, vtc)
    in_engine = False

    def bind(self, sim: Any) -> None:
        self.sim = sim
        self.nflows = len(sim.flows)
        self.weights = [f.weight for f in sim.flows]
        self.w_p = sim.w_p
        self.w_q = sim.w_q

    @property
    def label(self) -> str:
        return self.name

    def arrive(self, r, t: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def peek(self, t: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def admit(self, r, t: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def advance(self, t0: int, t1: int) -> None:
        pass

    def complete(self, r, t: int) -> None:
        pass

    def wakeup(self, t: int) -> int | None:
        return None


class FIFO(Policy):
    """First come, first served across all flows (the order of arrival, then ``rid``)."""

    name = "fifo"

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.q: deque = deque()

    def arrive(self, r, t: int) -> None:
        self.q.append(r)

    def peek(self, t: int):
        return self.q[0] if self.q else None

    def admit(self, r, t: int) -> None:
        self.q.popleft()


class StrictPriority(Policy):
    """Always the highest class that has work (``FlowSpec.priority``, 0 first); FIFO
    inside a class. Seed 004's "strict priority": it protects the urgent class and can
    starve the rest."""

    name = "prio"

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.prio_of = [f.priority for f in sim.flows]
        self.levels = sorted(set(self.prio_of))
        self.qs = {p: deque() for p in self.levels}

    def arrive(self, r, t: int) -> None:
        self.qs[self.prio_of[r.flow]].append(r)

    def peek(self, t: int):
        for p in self.levels:
            q = self.qs[p]
            if q:
                return q[0]
        return None

    def admit(self, r, t: int) -> None:
        self.qs[self.prio_of[r.flow]].popleft()


class RPMLimitedFIFO(Policy):
    """FIFO, but a flow may start at most ``rpm`` requests per window of ``window``
    steps (fixed windows ``[k*window, (k+1)*window)``; seed 003's "minute" is 2000
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
        self.qs = [deque() for _ in range(self.nflows)]
        self.used = [0] * self.nflows
        self.win = -1
        self.nwaiting = 0

    def arrive(self, r, t: int) -> None:
        self.qs[r.flow].append(r)
        self.nwaiting += 1

    def peek(self, t: int):
        w = t // self.window
        if w != self.win:
            self.win = w
            self.used = [0] * self.nflows
        best = None
        for f, q in enumerate(self.qs):
            if q and self.used[f] < self.rpm and (best is None or q[0].rid < best.rid):
                best = q[0]
        return best

    def admit(self, r, t: int) -> None:
        self.qs[r.flow].popleft()
        self.used[r.flow] += 1
        self.nwaiting -= 1

    def wakeup(self, t: int) -> int | None:
        return (t // self.window + 1) * self.window if self.nwaiting else None


class RoundRobin(Policy):
    """Round robin by request: flows with work take turns, one request per turn; a flow
    that (re)joins goes to the end of the line. Ignores size and weight."""

    name = "rr"

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.qs = [deque() for _ in range(self.nflows)]
        self.active: deque = deque()

    def arrive(self, r, t: int) -> None:
        q = self.qs[r.flow]
        if not q:
            self.active.append(r.flow)
        q.append(r)

    def peek(self, t: int):
        return self.qs[self.active[0]][0] if self.active else None

    def admit(self, r, t: int) -> None:
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
        self.chosen = None

    def peek(self, t: int):
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

    def admit(self, r, t: int) -> None:
        f = r.flow
        self.qs[f].popleft()
        self.deficit[f] -= r.est
        self.chosen = None
        if not self.qs[f]:
            self.deficit[f] = 0.0
            self.visiting[f] = False
            self.active.popleft()


class WFQ(Policy):
    """Weighted fair queueing with finish tags (seed 004's formula, self-clocked).

    At arrival: ``finish = max(flow_finish, v) + est / weight``; the request with the
    smallest finish tag goes first (ties: earlier ``rid``); after it starts, ``v`` becomes
    its finish tag (the self-clocked virtual time of Golestani's SCFQ).
    """

    name = "wfq"

    def bind(self, sim: Any) -> None:
        super().bind(sim)
        self.heap: list = []
        self.last_finish = [0.0] * self.nflows
        self.v = 0.0

    def arrive(self, r, t: int) -> None:
        f = r.flow
        start = self.last_finish[f] if self.last_finish[f] > self.v else self.v
        r.tag = start + r.est / self.weights[f]
        self.last_finish[f] = r.tag
        heapq.heappush(self.heap, (r.tag, r.rid, r))

    def peek(self, t: int):
        return self.heap[0][2] if self.heap else None

    def admit(self, r, t: int) -> None:
        tag, _, _ = heapq.heappop(self.heap)
        self.v = tag


class SFQ(Policy):
    """Start-time fair queueing: the project's core (``sfq.Scheduler``) orders dispatch.

    Each arrival is enqueued with its estimated cost; ``peek`` dispatches from the core
    when nothing is staged and holds the request until it can be placed (the core charged
    it at dispatch; the balancer stalls, seed 000 §5.2). ``core`` picks the scheduler
    class (default ``sfq.Scheduler``, the compiled core when it is built).
    """

    name = "sfq"

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

    def arrive(self, r, t: int) -> None:
        self.sched.enqueue(r.flow, r.est, r)

    def peek(self, t: int):
        if self.staged is None:
            d = self.sched.dispatch()
            if d is not None:
                self.staged = d.item
        return self.staged

    def admit(self, r, t: int) -> None:
        self.staged = None


def context_h(beta: float) -> Callable[[float, float, int, int], float]:
    """``h(n_p, n_q) = w_p n_p + w_q n_q + beta * sum_{j=1..n_q} (n_p + j)``: decode of
    the j-th token is charged ``w_q + beta * context_len`` (seed 003's bandwidth hook)."""

    def h(w_p: float, w_q: float, n_p: int, n_q: int) -> float:
        return w_p * n_p + w_q * n_q + beta * (n_p * n_q + n_q * (n_q + 1) / 2)

    return h


class VTC(Policy):
    """The virtual token counter (Sheng et al., OSDI '24; seed 003), inside the engine.

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
        self.qs = [deque() for _ in range(self.nflows)]
        self.last_left: int | None = None
        self.h = context_h(self.beta)

    def arrive(self, r, t: int) -> None:
        f = r.flow
        q = self.qs[f]
        if not q and self.lift:
            floor = None
            for g, qg in enumerate(self.qs):
                if qg and (floor is None or self.c[g] < floor):
                    floor = self.c[g]
            if floor is None and self.last_left is not None:
                floor = self.c[self.last_left]
            if floor is not None and floor > self.c[f]:
                self.c[f] = floor
        q.append(r)

    def peek(self, t: int):
        best = None
        bc = 0.0
        c = self.c
        for f, q in enumerate(self.qs):
            if q:
                if best is None or c[f] < bc or (c[f] == bc and q[0].rid < best.rid):
                    best, bc = q[0], c[f]
        return best

    def admit(self, r, t: int) -> None:
        f = r.flow
        self.qs[f].popleft()
        self.c[f] += self.h(self.w_p, self.w_q, r.prompt, 0) / self.weights[f]
        if not self.qs[f]:
            self.last_left = f

    def advance(self, t0: int, t1: int) -> None:
        k = t1 - t0
        sim = self.sim
        n_f, sp_f, sa_f = sim.running, sim.running_prompt, sim.running_admit
        beta = self.beta
        for f in range(self.nflows):
            n = n_f[f]
            if n:
                inc = self.w_q * k * n
                if beta:
                    # sum over running r of h(p, g+k) - h(p, g) - w_q k, with g = t0 - admit
                    inc += beta * (k * (sp_f[f] + n * t0 - sa_f[f]) + n * k * (k + 1) / 2)
                self.c[f] += inc / self.weights[f]


def _rpm_fifo(rpm: int | None = None, window: int = 2000, **_: Any) -> Policy:
    return FIFO() if rpm is None else RPMLimitedFIFO(rpm, window)


#: name -> factory(**options); options: quantum (drr), beta (vtc-h), rpm/window (fifo),
#: core (sfq). Unknown options are ignored by the factories that do not use them.
POLICIES: dict[str, Callable[..., Policy]] = {
    "fifo": _rpm_fifo,
    "prio": lambda **_: StrictPriority(),
    "rr": lambda **_: RoundRobin(),
    "drr": lambda quantum=1024.0, **_: DRR(quantum),
    "wfq": lambda **_: WFQ(),
    "sfq": lambda core=None, **_: SFQ(core),
    "lcf": lambda **_: VTC(lift=False),
    "vtc": lambda **_: VTC(lift=True),
    "vtc-h": lambda beta=0.01, **_: VTC(lift=True, beta=beta),
}


def make_policy(name: str, **options: Any) -> Policy:
    """A fresh policy by name (see :data:`POLICIES`); ``ValueError`` names an unknown one."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return factory(**options)
