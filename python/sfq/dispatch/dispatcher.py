"""``Dispatcher``: the constructor (validation and wiring) and the small public controls; the
work is done by the job modules it combines (see the package docstring)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from .._core import Scheduler
from ..backends.base import Backend
from ..backends.openai import OpenAIBackend
from ..cost import CostEstimator
from .admission import Admission
from .calls import Calls
from .health import Health
from .hooks import DispatchHooks
from .lifecycle import Lifecycle
from .placement import Placement
from ..policy.charge import CHARGE_MODES
from ._state import BState, DispatchRecord, FlowStats, Pool
from .stats import Statistics

__all__ = ["Dispatcher"]


class Dispatcher(Calls, Admission, Placement, Health, Statistics, Lifecycle):
    """Fair dispatch of OpenAI-style requests to a fleet of backends.

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
        what a request is charged (see the package docstring): ``"served"`` (default): a
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
        the scheduler class/factory (default ``sfq.Scheduler``); one per pool. The dispatcher
        uses its ``enqueue``, ``peek``, ``dispatch``, ``cancel``, ``adjust``, ``meter``,
        ``work_started``/``work_done``, ``set_weight``, ``virtual_time``, ``len``, and with
        ``overtake > 0`` ``suspend``/``resume``.
    on_dispatch:
        called with a ``DispatchRecord`` each time a request is sent (synchronously: keep it short).
    hooks:
        a ``DispatchHooks``: the per-pool decisions of a policy layer (whose request goes next,
        concurrency and rate limits); default: plain SFQ order, no limits.
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
        hooks: DispatchHooks | None = None,
        wait_window: int = 10_000,
        close_grace: float = 30.0,
        max_flow_stats: int = 100_000,
        error_window: int = 20,
        error_rate: float = 0.5,
        transport_failures: int = 3,
        unavailable_timeout: float | None = 30.0,
        max_pause: float = 60.0,
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
        if hooks is not None and not isinstance(hooks, DispatchHooks):
            raise TypeError(f"hooks must be a DispatchHooks, got {hooks!r}")
        self._max_flow_stats = max_flow_stats
        self.estimator = estimator if estimator is not None else CostEstimator()
        self.charge = charge
        self._served = charge == "served"
        self._seed = charge == "seed"
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
        self.hooks = hooks
        self._window = wait_window
        make = scheduler if scheduler is not None else Scheduler
        self._pools = {}
        self._bstates = []
        for i, b in enumerate(fleet):
            pool = self._pools.get(b.model)
            if pool is None:
                pool = self._pools[b.model] = Pool(b.model, make())
            bs = BState(b, pool, i, self.backoff, error_window)
            pool.backends.append(bs)
            self._bstates.append(bs)
        for pool in self._pools.values():
            ctx = [bs.max_context for bs in pool.backends]
            pool.limited = any(c is not None for c in ctx)
            sizes = [c for c in ctx if c is not None]
            pool.largest_context = float("inf") if len(sizes) < len(ctx) else float(max(sizes))
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
        pools = list(self._pools.values())
        pools[0].sched.set_weight(flow, weight)  # validates; raises before anything changed
        for pool in pools[1:]:
            pool.sched.set_weight(flow, weight)

    def scheduler_of(self, model: str | None) -> Any:
        """The scheduler of the pool serving ``model`` (``None``: the default pool), for hooks that
        suspend, resume or peek. ``KeyError`` when no pool has that name."""
        try:
            return self._pools[model].sched
        except (KeyError, TypeError):
            raise KeyError(f"no pool serves model {model!r}; pools: {sorted(str(m) for m in self._pools)}") from None
