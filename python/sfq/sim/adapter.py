"""The request engine in the simulator: :class:`EngineDiscipline`.

The simulator's ``sfq`` policy and ``sfq simulate teams --config FILE`` run the engine that
``sfq serve`` runs (:class:`sfq.engine.PolicyEngine`), on virtual time; this module only
translates. What the engine decides (the order, look-before-pop, the estimate at dispatch,
the charge mode, settlement from usage, the busy period held with the flow, limits and
queue ages) it decides here as it does in the gateway; the simulated fleet stands for the
pool's backends.

Translation:

* **Time**: the engine's clock is the step over :data:`STEPS_PER_SECOND` (the simulator's
  minute is 2,000 decode steps), so the policy's per-minute rates and queue ages keep their
  meaning in steps.
* **Requests**: a simulated request arrives as ``engine.submit(flow, estimate=..., streaming=True)``,
  priced by the engine's :class:`sfq.CostEstimator` from its token counts
  (``estimate_tokens(prompt, max_tokens)``); the engine re-estimates it at dispatch.
* **Placement**: the pool has one virtual backend without a slot limit; the simulator asks
  the engine for the next start with its own capacity check (``next_start(fits)``: the
  request's prompt fits the free KV of the server with the most), so a request is started,
  and charged, only when the fleet can place it (look before you pop). When it does not
  fit, the balancer stalls.
* **Delivery**: every decode step each running request passes one token to its client:
  ``engine.delivered(r, k)`` for ``k`` steps, in bulk between events (``served`` mode
  charges them as they pass); a finished request completes with its usage
  (``engine.complete(r, usage)``), which settles its charge and calibrates the estimator.
* **Wake-ups** (simulator time-stepping, not a scheduling rule): while the balancer stalls
  on the request the engine names (``PolicyQueue.stalled``), meters of flows with running
  requests move with decode in ``served`` mode; :meth:`EngineDiscipline.wakeup` returns the first step at which
  another waiting flow could overtake the named one, or the engine's own ``wake_at()``
  (a bucket refills, a queue age runs out).

:func:`flow_policy` is the degenerate policy the ``sfq`` policy runs: one pool, one
weighted class, one org per simulated flow with the flow's weight, the charge mode and the
estimator's weights and prior from the run.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ..cost import CostEstimator
from ..engine import PolicyEngine
from ..engine.engine import NO_METRICS
from ..engine.pool import Request as EngineRequest
from ..errors import Refused
from ..policy.charge import CHARGE_MODES, DEFAULT_CHARGE
from ..policy.classify import Flow
from ..policy.config import BackendSpec, ClassSpec, CostSpec, OrgSpec, Policy, PoolSpec
from .model import Request
from .policies import Discipline, _first_overtake

__all__ = ["EngineDiscipline", "STEPS_PER_SECOND", "flow_policy", "sim_policy"]

#: decode steps per second of policy time (the simulator's minute is 2,000 steps)
STEPS_PER_SECOND = 2000.0 / 60.0
#: the model name simulated requests ask for (the engine's estimator calibrates per model)
SIM_MODEL = "sim"
_SIM_BACKEND = BackendSpec("sim-fleet", max_in_flight=1 << 30, name="simulated-fleet")
_POOL = "sim"
_CLASS = "sim"


def sim_policy(policy: Policy) -> Policy:
    """``policy`` with every pool's backends replaced by one virtual backend without a slot
    limit (the simulated fleet does the placement)."""
    pools = {name: dataclasses.replace(p, backends=(_SIM_BACKEND,)) for name, p in policy.pools.items()}
    return dataclasses.replace(policy, pools=MappingProxyType(pools))


def flow_policy(weights: Sequence[float], *, charge: str = DEFAULT_CHARGE, input_weight: float = 1.0,
                output_weight: float = 2.0, prior_ratio: float = 0.5) -> tuple[Policy, list[Flow]]:
    """The degenerate policy of the ``sfq`` policy: one pool (one virtual backend), one
    weighted class without size buckets (a flow's requests go in arrival order), and one org
    per simulated flow ``k`` (``flow-k``) with weight ``weights[k]``; the cost section holds
    the charge mode and the estimator's weights and prior. Returns the policy and the
    engine flow of each simulated flow."""
    if charge not in CHARGE_MODES:
        raise ValueError(f"unknown charge mode {charge!r}; choose from {', '.join(CHARGE_MODES)}")
    orgs = {f"flow-{k}": OrgSpec(f"flow-{k}", (), (_CLASS,), weight=float(w)) for k, w in enumerate(weights)}
    policy = Policy(
        pools=MappingProxyType({_POOL: PoolSpec(_POOL, (SIM_MODEL,), (_SIM_BACKEND,))}),
        classes=MappingProxyType({_CLASS: ClassSpec(_CLASS, small_cost=None)}),
        orgs=MappingProxyType(orgs),
        cost=CostSpec(input_weight=float(input_weight), output_weight=float(output_weight),
                      prior_ratio=float(prior_ratio), charge=charge),
        source="<the simulator's flows>",
    )
    return policy, [Flow(name, _CLASS, _POOL) for name in orgs]


class EngineDiscipline(Discipline):
    """A simulator discipline that is a :class:`PolicyEngine` (see the module docstring).

    ``policy``: the policy in force (its pools' backends are replaced by the simulated
    fleet, :func:`sim_policy`); ``flows``: the engine flow (org, class, pool) of each
    simulated flow, in the simulator's order; ``scheduler``: the core factory (default
    ``sfq.Scheduler``); ``estimator``: the engine's estimator (default: one from the
    policy's ``cost`` section, as ``sfq serve`` makes it).
    Requests the engine refuses or drops never start; :attr:`refused` and :attr:`dropped`
    count them per org. Use :meth:`sfq` for the simulator's ``sfq`` policy.
    """

    name = "policy-file"
    estimate_at_arrival = False  # the engine prices a request itself, and again at dispatch
    calibrates = True  # engine.complete() feeds the estimator: the run must not feed it twice

    def __init__(self, policy: Policy | None, flows: Sequence[Flow] = (), *,
                 scheduler: Callable[[], Any] | None = None, estimator: CostEstimator | None = None,
                 label: str | None = None, charge: str | None = None, run_estimator: bool = False,
                 deadlines: Mapping[int, float] | None = None) -> None:
        self._charge = DEFAULT_CHARGE if charge is None else str(charge)
        if self._charge not in CHARGE_MODES:
            raise ValueError(f"unknown charge mode {self._charge!r}; choose from {', '.join(CHARGE_MODES)}")
        # None: the degenerate policy of the run's flows (flow_policy), made by bind()
        self.policy: Policy | None = None if policy is None else sim_policy(policy)
        self.flow_of = list(flows)
        if self.policy is not None:
            for f in self.flow_of:
                if not self.policy.allows(f):
                    raise ValueError(f"flow {tuple(f)!r} is not allowed by the policy")
        self.scheduler = scheduler
        self._estimator = estimator
        self._run_estimator = run_estimator
        self._label = label
        #: simulator rid -> seconds from arrival to the request's own deadline (as if it sent
        #: ``X-SFQ-Timeout``); requests not named state none (their class's default applies)
        self.deadlines: Mapping[int, float] = deadlines if deadlines is not None else {}
        self.t = 0
        self.refused: dict[str, int] = {}
        self.dropped: dict[str, int] = {}

    @classmethod
    def sfq(cls, core: Callable[[], Any] | None = None, charge: str | None = None) -> EngineDiscipline:
        """The simulator's ``sfq`` policy: the engine under :func:`flow_policy` (built when
        it is bound to a run, from the run's flows and service weights) in charge mode
        ``charge`` (default ``served``), pricing with the run's estimator when it is the
        project's :class:`~sfq.CostEstimator` (:func:`sfq.sim.make_estimator`), else with one
        of the run's weights and prior."""
        charge = DEFAULT_CHARGE if charge is None else str(charge)
        return cls(None, scheduler=core, charge=charge, label=f"sfq charge={charge}", run_estimator=True)

    @property
    def label(self) -> str:
        return self._label if self._label is not None else self.name

    @property
    def charge(self) -> str:
        """The charge mode: the policy's ``cost.charge`` (the one asked for, until the
        degenerate policy is made)."""
        return str(self.policy.cost.charge) if self.policy is not None else self._charge

    def _clock(self) -> float:
        return self.t / STEPS_PER_SECOND

    # ------------------------------------------------------------ protocol
    def bind(self, sim: Any) -> None:
        super().bind(sim)
        run_est = getattr(getattr(sim, "estimator", None), "inner", None)
        run_est = run_est if isinstance(run_est, CostEstimator) else None
        if self.policy is None:  # the sfq policy: the degenerate policy of the run's flows
            prior = getattr(getattr(sim, "estimator", None), "prior", None)
            prior = run_est.prior_ratio if run_est is not None else 0.5 if prior is None else prior
            self.policy, self.flow_of = flow_policy(self.weights, charge=self._charge, input_weight=self.w_p,
                                                    output_weight=self.w_q, prior_ratio=prior)
        if len(self.flow_of) != self.nflows:
            raise ValueError(f"{len(self.flow_of)} policy flows for {self.nflows} simulated flows")
        estimator = self._estimator if self._estimator is not None else run_est if self._run_estimator else None
        policy = self.policy
        self.engine = PolicyEngine(policy, clock=self._clock, scheduler=self.scheduler, estimator=estimator,
                                   metrics=NO_METRICS,  # the run keeps its own record
                                   wall_clock=self._clock)  # budgets: simulated UTC days from the epoch
        self.estimator = self.engine.estimator
        pool = self.flow_of[0].pool if self.flow_of else next(iter(policy.pools))
        models = policy.pools[pool].models
        self.model = models[0] if models else SIM_MODEL
        self.served = self.engine.charge == "served"
        self.queue = self.engine.queues[pool]
        self._req: dict[int, EngineRequest] = {}  # simulator rid -> the engine's request, while it runs
        self.waiting = [0] * self.nflows  # requests of each flow waiting in the engine
        self.active: set[int] = set()  # flows with a request waiting
        # served: waiting flows with nothing running keep their meter, so for wakeup() they
        # sit in a heap on it; those with running requests (at most the batch) are scanned
        self.heap: list[tuple[float, int, int]] = []
        self.ver = [0] * self.nflows
        self.hot: set[int] = set()
        self.index = {f: k for k, f in enumerate(self.flow_of)}  # engine flow -> simulated flow

    def _place(self, f: int, running: bool) -> None:
        """Keep flow ``f`` where :meth:`wakeup` looks for it (``served`` only)."""
        if not self.served:
            return
        self.ver[f] += 1
        if not self.waiting[f]:
            self.hot.discard(f)
        elif running:
            self.hot.add(f)
        else:
            self.hot.discard(f)
            heapq.heappush(self.heap, (self.queue.meter(self.flow_of[f]), f, self.ver[f]))

    def _cold_top(self) -> int | None:
        heap, ver = self.heap, self.ver
        while heap:
            _, f, v = heap[0]
            if v == ver[f]:
                return f
            heapq.heappop(heap)
        return None

    def _count_drops(self) -> None:
        if not self.engine.dropped:
            return
        for d in self.engine.dropped:
            self.dropped[d.flow.org] = self.dropped.get(d.flow.org, 0) + 1
            r = d.item
            self._left(r.flow)
            left = getattr(self.sim, "left", None)
            if left is not None:
                left(r)
        self.engine.dropped = []

    def _left(self, f: int) -> None:
        self.waiting[f] -= 1
        if not self.waiting[f]:
            self.active.discard(f)
        self._place(f, self.sim.running[f] > 0)

    def arrive(self, r: Request, t: int) -> None:
        self.t = t
        flow = self.flow_of[r.flow]
        est = self.estimator.estimate_tokens(int(r.prompt), int(r.max_tokens), model=self.model, flow=flow)
        try:
            own = self.deadlines.get(r.rid)
            deadline = None if own is None else self._clock() + own
            self.engine.submit(flow, estimate=est, streaming=True, item=r, deadline=deadline)
        except Refused:
            self.refused[flow.org] = self.refused.get(flow.org, 0) + 1
            left = getattr(self.sim, "left", None)
            if left is not None:
                left(r)
            return
        f = r.flow
        self.waiting[f] += 1
        if self.waiting[f] == 1:
            self.active.add(f)
            self._place(f, self.sim.running[f] > 0)

    def start(self, t: int, fits: Callable[[Request], bool]) -> Request | None:
        self.t = t
        pr = self.engine.next_start(lambda p, _backend: fits(p.item))
        self._count_drops()
        if pr is None:
            return None
        r: Request = pr.item
        r.est = pr.est.cost if pr.est is not None else pr.cost  # the estimate it was dispatched on
        self._req[r.rid] = pr
        f = r.flow
        self.waiting[f] -= 1
        if not self.waiting[f]:
            self.active.discard(f)
        self._place(f, True)  # r runs from now
        return r

    def peek(self, t: int) -> Request | None:  # pragma: no cover - start() is the engine's only entry
        raise TypeError("the engine starts requests through start(t, fits) only (it looks before it pops)")

    def admit(self, r: Request, t: int) -> None:  # pragma: no cover - see peek()
        raise TypeError("the engine starts requests through start(t, fits) only (it looks before it pops)")

    def advance(self, t0: int, t1: int) -> None:
        if not self.served:
            return
        k = float(t1 - t0)
        delivered = self.engine.delivered
        for pr in self._req.values():
            delivered(pr, k)

    def complete(self, r: Request, t: int) -> None:
        self.t = t
        pr = self._req.pop(r.rid)
        self.engine.complete(pr, {"prompt_tokens": int(r.prompt), "completion_tokens": int(r.output)})
        if self.sim.running[r.flow] == 1:  # its last running request: the meter stops
            self._place(r.flow, False)

    def wakeup(self, t: int) -> int | None:
        at = self.engine.wake_at()
        w = None if at is None else max(t + 1, math.ceil(at * STEPS_PER_SECOND - 1e-9))
        o = self._overtake(t) if self.served and len(self.active) >= 2 else None
        if o is not None and (w is None or o < w):
            w = o
        return w

    def _overtake(self, t: int) -> int | None:
        """While the balancer stalls on the request the engine names (``PolicyQueue.stalled``):
        the first step at which another waiting flow could overtake its flow, meters of flows
        with running requests growing by ``w_q`` per running request per step
        (weight-normalised). A lower bound: counting a flow that could not overtake (a strict
        class's, one at its limit) only wakes the run earlier."""
        st = self.queue.stalled
        if st is None or self.policy is None or self.policy.classes[st.flow.cls].strict:
            return None  # nothing named, or a strict class's request: meters do not order it
        named = self.index.get(st.flow)
        if named is None or named not in self.hot:
            return None  # its meter stands still: no waiting flow can pass it
        others = list(self.hot)
        top = self._cold_top()
        if top is not None:
            others.append(top)  # of the flows whose meters stand still, the lowest
        meter, flow_of = self.queue.meter, self.flow_of
        n_f, w_q, weights = self.sim.running, self.w_q, self.weights
        return _first_overtake(t, named, lambda g: w_q * n_f[g] / weights[g], lambda g: meter(flow_of[g]), others)
