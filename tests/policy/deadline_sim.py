"""A seeded simulation of one pool under the request engine, to measure how often the early
refusal of a deadline that cannot be met (a class's ``refuse_unmeetable``) is right.

Discrete events on an injected clock, no sleeps: arrivals (Poisson per flow), attempts that
hold a slot for a drawn time, the engine's own timers (``wake_at``: deadlines running out).
Three flows share 8 slots: ``flood`` sends interactive requests far faster than the pool can
serve (deadlines 2-20 s), ``steady`` sends interactive ones at a modest rate (deadlines 2-20 s),
``bulk`` keeps a batch backlog (no deadline). Service times are drawn per request
(log-normal, median 1 s; ``spread``), the same in every run of a seed.

``refuse=False`` (the *shadow* run): nothing is refused; each interactive request's prediction
at arrival (``PolicyQueue.unmeetable``, as the engine would make it) is recorded, and the run
then shows what happened to it: a request predicted unmeetable that started in time is a
**defect** (it would have been refused and would have made it). ``refuse=True``: the class
refuses, and the run counts refusals, drops and requests started in time.

Used by ``tests/policy/test_policy_deadlines.py`` and ``benchmarks/bench_unmeetable.py``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from sfq.engine import PolicyEngine, Request
from sfq.errors import Refused
from sfq.policy import Flow, parse_policy

POLICY = """
pools:
  p:
    models: [m]
    backends: [{{url: "http://127.0.0.1:9", max_in_flight: 8}}]
classes:
  interactive: {{weight: 3, small_cost: null, refuse_unmeetable: {refuse}}}
  batch: {{weight: 1, small_cost: null}}
  probe: {{weight: 1, refuse_unmeetable: true}}   # (the shadow run: keeps the pool's measured service)
orgs:
  flood: {{keys: [kf], classes: [interactive]}}
  steady: {{keys: [ks], classes: [interactive]}}
  bulk: {{keys: [kb], classes: [batch]}}
"""
FLOOD, STEADY, BULK = Flow("flood", "interactive", "p"), Flow("steady", "interactive", "p"), Flow("bulk", "batch", "p")


@dataclass
class Result:
    seed: int
    refuse: bool
    submitted: int = 0  # interactive requests sent
    predicted_unmeetable: int = 0  # shadow: predicted at arrival not to make it
    defects: int = 0  # shadow: predicted not to make it, and started in time
    missed: int = 0  # accepted and dropped at its deadline
    caught: int = 0  # shadow: missed, and predicted so
    refused: int = 0  # refuse run: refused at once (deadline_unmeetable)
    refused_by: dict[str, int] = field(default_factory=dict)  # per org
    in_time: int = 0  # started before its deadline
    missed_wait: float = 0.0  # seconds the missed requests waited, in all, before they were dropped
    served_cost: dict[str, float] = field(default_factory=dict)  # per org, what its started requests cost

    @property
    def mean_missed_wait(self) -> float:
        """Seconds a request that missed its deadline waited, on average, before it was told."""
        return self.missed_wait / self.missed if self.missed else 0.0

    @property
    def defect_rate(self) -> float:
        """Defects per request predicted unmeetable (0 when none was)."""
        return self.defects / self.predicted_unmeetable if self.predicted_unmeetable else 0.0


def arrivals_of(rng: random.Random, rates: tuple[tuple[Flow, float], ...], n: int, spread: float,
                deadlines: bool = True) -> tuple[list[tuple[float, int, Flow, float, float]], float]:
    """About ``n`` Poisson arrivals of the flows at their ``rates`` (a second), sorted: ``(time,
    number, flow, seconds it holds a slot, seconds to its deadline or inf)``; and the horizon."""
    arrivals: list[tuple[float, int, Flow, float, float]] = []
    horizon = n / sum(rate for _, rate in rates)
    for f, rate in rates:
        t = rng.expovariate(rate)
        while t < horizon:
            arrivals.append((t, len(arrivals), f, rng.lognormvariate(0.0, spread),
                             rng.uniform(2.0, 20.0) if deadlines else math.inf))
            t += rng.expovariate(rate)
    arrivals.sort()
    return arrivals, horizon


def drive(e: PolicyEngine, clock: list[float], rng: random.Random, arrivals: list[tuple[float, int, Flow, float, float]],
          horizon: float, spread: float, arrive: Callable[[float, Flow, float], Request | None],
          started: Callable[[Request], None] | None = None) -> None:
    """The discrete events both simulations run: a batch backlog (40, one more each time one
    ends, until ``horizon``), the ``arrivals`` (``arrive(now, flow, seconds to its deadline)``
    submits one, or returns ``None``: refused), each started request holding its slot for its
    drawn time (``started(r)`` told), the engine's own timers; until nothing is left."""
    held: dict[int, float] = {}
    running: list[tuple[float, int, Request]] = []
    for _ in range(40):
        r = e.submit(BULK, cost=1)
        held[r.id] = rng.lognormvariate(0.0, spread)
    i = 0
    while i < len(arrivals) or running or e.has_waiting():
        nxt = [x for x in (arrivals[i][0] if i < len(arrivals) else None, running[0][0] if running else None,
                           e.wake_at()) if x is not None]
        if not nxt:
            break
        now = clock[0] = max(clock[0], min(nxt))
        while running and running[0][0] <= now:
            _, _, r = heapq.heappop(running)
            e.complete(r)
            if r.flow == BULK and now < horizon:
                b = e.submit(BULK, cost=1)
                held[b.id] = rng.lognormvariate(0.0, spread)
        while i < len(arrivals) and arrivals[i][0] <= now:
            _, _, f, h, dl = arrivals[i]
            i += 1
            got = arrive(now, f, dl)
            if got is not None:
                held[got.id] = h
        for r in e.poll():
            assert r.started_at is not None
            heapq.heappush(running, (now + held[r.id], r.id, r))
            if started is not None:
                started(r)


def simulate(*, seed: int, n: int = 2000, refuse: bool, spread: float = 0.5, flood_rate: float = 12.0,
             steady_rate: float = 2.0) -> Result:
    """``n`` interactive arrivals (flood and steady) and a batch backlog; see the module."""
    rng = random.Random(seed)
    clock = [0.0]
    e = PolicyEngine(parse_policy(POLICY.format(refuse="true" if refuse else "false")), clock=lambda: clock[0])
    q = e.queues["p"]
    arrivals, horizon = arrivals_of(rng, ((FLOOD, flood_rate), (STEADY, steady_rate)), n, spread)
    res = Result(seed, refuse)
    pred: dict[int, bool] = {}
    tracked: list[Request] = []

    def arrive(now: float, f: Flow, dl: float) -> Request | None:
        res.submitted += 1
        p = not refuse and q.unmeetable(f, 1.0, now + dl, now) is not None
        try:
            r = e.submit(f, cost=1, deadline=now + dl)
        except Refused as exc:
            assert exc.reason == "deadline_unmeetable" and refuse
            res.refused += 1
            res.refused_by[f.org] = res.refused_by.get(f.org, 0) + 1
            return None
        tracked.append(r)
        if not refuse:
            pred[r.id] = p
        return r

    def started(r: Request) -> None:
        res.served_cost[r.flow.org] = res.served_cost.get(r.flow.org, 0.0) + r.cost

    drive(e, clock, rng, arrivals, horizon, spread, arrive, started)
    for r in tracked:
        made = r.started_at is not None
        res.in_time += made
        res.missed += not made
        if not made:
            assert r.reason == "deadline" and r.deadline is not None
            res.missed_wait += r.deadline - r.arrival
        if not refuse and pred[r.id]:
            res.predicted_unmeetable += 1
            res.defects += made
            res.caught += not made
    assert not e.live and math.isfinite(clock[0])
    return res
