"""``Dispatcher``: the constructor (validation and wiring) and the small public controls; the
work is done by the job modules it combines (see the package docstring), the decisions by the
request engine (``sfq.engine``) over a policy made from the fleet."""

from __future__ import annotations

import functools
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .._core import Scheduler
from ..backends.base import Backend
from ..backends.health import BackendMonitor
from ..backends.openai import OpenAIBackend
from ..cost import CostEstimator
from ..engine import NO_METRICS, PolicyEngine
from ..policy.classify import Flow
from ..policy.config import BackendSpec, ClassSpec, CostSpec, OrgSpec, Policy, PoolSpec, RetrySpec
from .admission import Admission
from .calls import Calls
from .health import BackendEvents, Health
from ._wake import WakeTimer
from .lifecycle import Lifecycle
from .placement import Placement
from ..policy.charge import CHARGE_MODES
from ._state import DEFAULT_CLASS, BState, DispatchRecord, FlowStats, Pool
from .stats import Statistics

__all__ = ["Dispatcher"]

#: every flow of a dispatcher: one class, FIFO within the flow
_CLASS = ClassSpec(DEFAULT_CLASS, small_cost=None)
_ANY_ORG = OrgSpec("*", (), (DEFAULT_CLASS,))


@functools.lru_cache(maxsize=1024)
def _weighted(weight: float) -> OrgSpec:
    """The org spec of a flow of ``weight`` (one per weight, not one per call)."""
    return OrgSpec("*", (), (DEFAULT_CLASS,), weight)


@dataclass(frozen=True)
class FleetPolicy(Policy):
    """The policy a ``Dispatcher`` runs its fleet under: one pool per model, one class, and
    every flow id its own org, weighted by ``Dispatcher.set_weight`` (default 1): the
    degenerate case of a policy file, applied by the same request engine."""

    weights: dict[Hashable, float] = field(default_factory=dict, compare=False)

    def org(self, name: str) -> OrgSpec | None:
        w = self.weights.get(name)
        return _ANY_ORG if w is None else _weighted(w)


class Dispatcher(Calls, Admission, Placement, Health, Statistics, Lifecycle):
    """Shares a fleet of OpenAI-compatible servers fairly between flows you name, on asyncio.

    Every request says whose it is (a flow: any hashable id, e.g. the tenant your own
    authentication found; never read from the body); each flow gets a share of the fleet in
    proportion to its weight, measured in tokens (prompt + output), however many or large its
    requests are. It is the library's driver of sfq's request engine (the same engine as
    ``sfq serve``'s, under a policy made from the fleet: one pool per model, one class, each
    flow its own org): the engine decides whose request goes next and on which backend, and
    what the flow is charged; the dispatcher sends it to that backend, streams or returns the
    reply, and tells the engine what was served::

        async with sfq.Dispatcher(["http://127.0.0.1:8001"]) as d:
            reply = await d.submit("team-a", {"model": "m", "prompt": "hi", "max_tokens": 32})
            async with d.stream("team-b", {"model": "m", "prompt": "hi", "stream": True}) as events:
                async for event in events:
                    ...

    Cancelling the awaiting task before dispatch removes the request uncharged; after, it
    aborts the backend call. Errors are :class:`sfq.SFQError` s (``http_status``,
    ``to_openai()``); a malformed body is :class:`sfq.errors.BadRequest`. For flows under a
    policy file (orgs, classes, limits, retries) use :class:`sfq.PolicyDispatcher`.

    Parameters
    ----------
    backends:
        the fleet: ``Backend`` instances, or URLs (each becomes ``OpenAIBackend(url)``).
        Backends with the same ``model`` form a pool with one scheduler; backends with
        ``model=None`` form the default pool, which takes every model name no other pool
        serves. Names must be unique.
    estimator:
        the ``CostEstimator`` (default: ``CostEstimator()``, cost in tokens). A request is
        estimated at admission (to route it and check its size) and again at dispatch, where
        it is charged: the calibration may have learned in between.
    charge:
        what a request is charged (``sfq.policy.charge``; see the package docstring): ``"served"`` (default): a
        stream its prompt at dispatch and its output tokens as they are delivered, a
        non-streamed request its estimate at dispatch; both reconciled with the server's
        ``usage`` at completion. ``"settle"``: the estimate at dispatch, corrected to the
        ``usage`` at completion. ``"seed"``: the estimate at dispatch, never corrected.
        A request whose ``cost=`` the caller gives is charged that, never corrected.
    clock:
        seconds, for waits (default ``time.monotonic``).
    overtake:
        0 (default): stall when the selected request fits on no backend with room; ``k > 0``:
        up to ``k`` such requests wait aside while later selections go out.
    backoff, max_backoff:
        seconds before the first health check of a backend out of rotation (default 0.25),
        doubling up to ``max_backoff`` (default 2) while checks fail (and across spells until a
        request succeeds there): a recovered backend gets traffic within ``max_backoff`` seconds.
    error_window, error_rate:
        a backend leaves the rotation when at least ``error_rate`` (default 0.5) of its last
        ``error_window`` (default 20) replies were 5xx; an isolated 5xx or any 4xx fails only
        its request.
    transport_failures:
        ... or when this many requests in a row (default 3) were lost in transport (reset,
        read timeout, cut stream, non-JSON reply); a refused connection takes it out at once.
    unavailable_timeout:
        seconds a request waits in a pool with no healthy backend before it is removed with
        ``NoHealthyBackend`` (default 30; uncharged unless it had been selected); ``None``: no bound.
    max_pause:
        a 429 pauses its backend for its ``Retry-After`` (1 s without one), at most this (default 60).
    scheduler:
        the scheduler class/factory (default ``sfq.Scheduler``); one per pool.
    on_dispatch:
        called with a ``DispatchRecord`` each time a request is sent (synchronously: keep it short).
    max_attempts:
        tries per request, the first included (default 3; 1: never retried). A failure before
        any byte of the reply (a connection error, an upstream 408, 409, 429 or 5xx) is tried
        again in the request's own flow, preferably on another backend, after an exponential
        backoff with jitter (never shorter than the upstream's ``Retry-After``), within a retry
        budget of 10 % of the flow's requests over the last minute (one always allowed).
    rng:
        the random source of the retries' jitter (a seeded ``random.Random`` for reproducible runs).
    wait_window:
        the last this-many waits per flow are kept for the percentiles in ``stats()``.
    close_grace:
        seconds ``close()`` waits for requests in flight before closing the backends (aborting them).
    max_flow_stats:
        per-flow statistics are kept for at most about this many flows: beyond it, the flows with
        nothing waiting, held or in flight are forgotten, oldest first (a proxy keyed by API key
        must not grow with every key it ever saw). Flows with work in progress are always kept.
    """

    def __init__(
        self,
        backends: Iterable[Backend | str],
        *,
        estimator: CostEstimator | None = None,
        charge: str = "served",
        clock: Callable[[], float] = time.monotonic,
        overtake: int = 0,
        backoff: float = 0.25,
        max_backoff: float = 2.0,
        scheduler: Callable[[], Any] | None = None,
        on_dispatch: Callable[[DispatchRecord], None] | None = None,
        wait_window: int = 10_000,
        close_grace: float = 30.0,
        max_flow_stats: int = 100_000,
        error_window: int = 20,
        error_rate: float = 0.5,
        transport_failures: int = 3,
        unavailable_timeout: float | None = 30.0,
        max_pause: float = 60.0,
        max_attempts: int = 3,
        rng: random.Random | None = None,
    ) -> None:
        fleet: list[Backend] = [OpenAIBackend(b) if isinstance(b, str) else b for b in backends]
        if not fleet:
            raise ValueError("a Dispatcher needs at least one backend")
        for b in fleet:
            if not isinstance(b, Backend):
                raise TypeError(f"backends must be sfq.backends.Backend instances or URLs, got {b!r}")
        names = [b.name for b in fleet]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"backend names must be unique; repeated: {dup}")
        if not isinstance(charge, str) or charge not in CHARGE_MODES:
            raise ValueError(f"charge must be one of {', '.join(map(repr, CHARGE_MODES))}, got {charge!r}")
        if isinstance(overtake, bool) or not isinstance(overtake, int) or overtake < 0:
            raise ValueError(f"overtake must be an integer >= 0, got {overtake!r}")
        for what, v in (("backoff", backoff), ("max_backoff", max_backoff), ("close_grace", close_grace),
                        ("max_pause", max_pause), ("unavailable_timeout", unavailable_timeout)):
            if what == "unavailable_timeout" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
                raise ValueError(f"{what} must be a finite number > 0, got {v!r}")
        for what, n in (("error_window", error_window), ("transport_failures", transport_failures)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{what} must be an integer >= 1, got {n!r}")
        if isinstance(error_rate, bool) or not isinstance(error_rate, (int, float)) or not 0 < error_rate <= 1:
            raise ValueError(f"error_rate must be a number in (0, 1], got {error_rate!r}")
        if max_backoff < backoff:
            raise ValueError(f"max_backoff ({max_backoff!r}) must be >= backoff ({backoff!r})")
        if isinstance(wait_window, bool) or not isinstance(wait_window, int) or wait_window < 1:
            raise ValueError(f"wait_window must be an integer >= 1, got {wait_window!r}")
        if isinstance(max_flow_stats, bool) or not isinstance(max_flow_stats, int) or max_flow_stats < 1:
            raise ValueError(f"max_flow_stats must be an integer >= 1, got {max_flow_stats!r}")
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {clock!r}")
        if estimator is not None and not isinstance(estimator, CostEstimator):
            raise TypeError(f"estimator must be a CostEstimator, got {estimator!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        self._max_flow_stats = max_flow_stats
        self.estimator = estimator if estimator is not None else CostEstimator()
        self.charge = charge
        self.clock = clock
        self.overtake = overtake
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.close_grace = float(close_grace)
        self.error_window = error_window
        self.error_rate = float(error_rate)
        self.transport_failures = transport_failures
        self.unavailable_timeout = None if unavailable_timeout is None else float(unavailable_timeout)
        self.max_pause = float(max_pause)
        self.on_dispatch = on_dispatch
        self._window = wait_window
        make = scheduler if scheduler is not None else Scheduler
        self._pools = {}
        self._bstates = []
        events, options = BackendEvents(self), self._health_options()
        for i, b in enumerate(fleet):
            pool = self._pools.get(b.model)
            if pool is None:
                pool = self._pools[b.model] = Pool(b.model)
            bs = BState(b, pool, i, BackendMonitor(b, events, options))
            pool.backends.append(bs)
            self._bstates.append(bs)
        self._by_name = {bs.name: bs for bs in self._bstates}
        for pool in self._pools.values():
            ctx = [bs.max_context for bs in pool.backends]
            sizes = [c for c in ctx if c is not None]
            pool.largest_context = float("inf") if len(sizes) < len(ctx) else float(max(sizes))
        e = self.estimator
        self.policy = FleetPolicy(
            pools=MappingProxyType({p.name: PoolSpec(p.name, () if p.model is None else (p.model,), tuple(
                BackendSpec(bs.backend.name, bs.max_in_flight, bs.name, bs.max_context) for bs in p.backends))
                for p in self._pools.values()}),
            classes=MappingProxyType({DEFAULT_CLASS: _CLASS}), orgs=MappingProxyType({}),
            cost=CostSpec(e.input_weight, e.output_weight, e.default_max_tokens, e.prior_ratio, charge),
            retry=RetrySpec(max_attempts=max_attempts), source="<sfq.Dispatcher>")
        self._engine = PolicyEngine(self.policy, clock=clock, scheduler=make, rng=rng, metrics=NO_METRICS,
                                    estimator=e, max_pause=self.max_pause)
        for q in self._engine.queues.values():
            q.overtake = overtake
            q.unavailable_timeout = math.inf if unavailable_timeout is None else float(unavailable_timeout)
        self._timer = WakeTimer(self._pump, clock)
        self._pumping = False
        self._default = self._pools.get(None)
        self._only = self._default if len(self._pools) == 1 else None
        self._flows: dict[Hashable, FlowStats] = {}
        self._idle: OrderedDict[Hashable, None] = OrderedDict()  # flows with nothing in progress, oldest first
        self._started = False
        self._closed = False
        self._in_flight = 0
        self._drained = None
        self._close_task = None

    async def __aenter__(self) -> Dispatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def set_weight(self, flow: Hashable, weight: float) -> None:
        """Set ``flow``'s weight (> 0, default 1) in every pool, for its future charges."""
        queues = list(self._engine.queues.values())
        queues[0].sched.set_weight(Flow(flow, DEFAULT_CLASS, queues[0].name), weight)  # type: ignore[arg-type]
        # (validated: raises before anything changed)
        for q in queues[1:]:
            q.sched.set_weight(Flow(flow, DEFAULT_CLASS, q.name), weight)  # type: ignore[arg-type]
        self.policy.weights[flow] = float(weight)

    def _queue_of(self, model: str | None) -> Any:
        try:
            return self._engine.queues[self._pools[model].name]
        except (KeyError, TypeError):
            raise KeyError(f"no pool serves model {model!r}; pools: {sorted(str(m) for m in self._pools)}") from None

    def scheduler_of(self, model: str | None) -> Any:
        """The SFQ core of the pool serving ``model`` (``None``: the default pool), to look at
        (its flows are ``sfq.Flow(flow, "default", pool)``; :meth:`meter` reads one by the
        caller's id). ``KeyError`` when no pool has that name."""
        return self._queue_of(model).sched

    def flow_key(self, flow: Hashable, model: str | None = None) -> Flow:
        """The engine's (and the core's) id of ``flow`` in the pool serving ``model``."""
        return Flow(flow, DEFAULT_CLASS, self._queue_of(model).name)  # type: ignore[arg-type]

    def meter(self, flow: Hashable, model: str | None = None) -> float:
        """``flow``'s meter (cost units) in the pool serving ``model`` (``None``: the default pool)."""
        q = self._queue_of(model)
        return float(q.sched.meter(Flow(flow, DEFAULT_CLASS, q.name)))  # type: ignore[arg-type]
