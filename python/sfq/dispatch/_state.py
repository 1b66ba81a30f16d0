"""The dispatcher's data: requests (jobs), pools, backends, per-flow counters, and the base
class that declares what the job modules share (so each module type-checks on its own)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..backends.base import Backend
from ..backends.health import BackendMonitor
from ..cost import CostEstimator, Estimate
from ..errors import BackendError
from ..engine import PolicyEngine, Request
from ..policy.charge import CHARGE_MODES
from ..policy.classify import Flow
from ._wake import WakeTimer

log = logging.getLogger("sfq.dispatch")

# job states: WAITING (in the engine: queued, set aside, or between retries), PLACED (sent to a
# backend), then one of DONE, CANCELLED, REJECTED (the dispatcher closed), EXPIRED (no healthy
# backend for ``unavailable_timeout``)
WAITING, PLACED, DONE, CANCELLED, REJECTED, EXPIRED = range(6)
# outcomes of a placed job
OK, FAILED, ABORTED = range(3)
#: the name of the default pool (backends with ``model=None``) in the request engine
DEFAULT_POOL = "(default)"
#: the one class of a dispatcher's flows in the request engine
DEFAULT_CLASS = "default"


class DispatchRecord(NamedTuple):
    """What ``on_dispatch`` receives when a request is sent to a backend.

    ``start``/``finish``: the flow's meter before and after the charge (cost units, the
    scheduler's ``Dispatch``); ``wait``: seconds from submit to send (injected clock).
    """

    flow: Hashable
    ticket: int  # the request's id (increases with every request)
    cost: float
    start: float
    finish: float
    model: str | None
    backend: str
    wait: float


class BState:
    """The dispatcher's view of one backend; its health is its ``monitor``'s
    (``sfq.backends.health.BackendMonitor``, which reports to the request engine)."""

    __slots__ = ("backend", "name", "pool", "index", "max_in_flight", "max_context", "in_flight", "dispatched",
                 "completed", "errors", "aborted", "last_error", "monitor")

    def __init__(self, backend: Backend, pool: Pool, index: int, monitor: BackendMonitor) -> None:
        self.backend = backend
        self.name = backend.name
        self.pool = pool
        self.index = index
        self.max_in_flight = backend.max_in_flight
        self.max_context = backend.max_context
        self.in_flight = 0
        self.dispatched = 0
        self.completed = 0
        self.errors = 0
        self.aborted = 0
        self.last_error: str | None = None
        self.monitor = monitor

    @property
    def healthy(self) -> bool:
        """In rotation."""
        return self.monitor.healthy

    @property
    def saturated(self) -> bool:
        """Full by its saturation probe's reading."""
        return self.monitor.saturated

    @property
    def paused(self) -> bool:
        """After a 429, until its ``Retry-After`` (capped)."""
        return self.monitor.paused


class Pool:
    """Backends serving one model: one pool of the request engine."""

    __slots__ = ("model", "name", "backends", "largest_context")

    def __init__(self, model: str | None) -> None:
        self.model = model
        self.name = DEFAULT_POOL if model is None else model  # the pool's name in the engine
        self.backends: list[BState] = []
        self.largest_context: float = float("inf")


class FlowStats:
    """Counters of one flow (see ``Dispatcher.stats``)."""

    __slots__ = ("flow", "idle", "waiting", "in_flight", "dispatched", "completed", "failed",
                 "cancelled", "aborted", "rejected", "unavailable", "expired", "retried", "charged", "waits")

    def __init__(self, flow: Hashable, window: int) -> None:
        self.flow = flow
        self.idle = False  # in the dispatcher's idle list (nothing waiting or in flight)
        self.waiting = 0  # in the engine (queued, set aside, or between retries)
        self.in_flight = 0  # sent to a backend
        self.dispatched = 0  # dispatched by the scheduler (charged)
        self.completed = 0
        self.failed = 0
        self.cancelled = 0  # given up before dispatch: uncharged
        self.aborted = 0  # given up after dispatch: charged, backend call aborted
        self.rejected = 0  # removed when the dispatcher closed
        self.unavailable = 0  # removed after unavailable_timeout with no healthy backend (NoHealthyBackend)
        self.expired = 0  # ended while waiting: their deadline ran out (``timeout``)
        self.retried = 0  # attempts that failed and were tried again
        self.charged = 0.0  # cost units charged: at dispatch, plus the corrections of the charge mode
        self.waits: deque[float] = deque(maxlen=window)  # seconds from submit to send


class Job:
    """One accepted request, from admission to its outcome; ``req`` is the engine's request."""

    __slots__ = ("flow", "key", "body", "endpoint", "est", "pool", "t_enq", "state", "bs", "fut", "fs", "stream",
                 "req", "sent_charge")

    def __init__(self, flow: Hashable, key: Flow, body: dict[str, Any], endpoint: str, est: Estimate | None,
                 pool: Pool, t_enq: float) -> None:
        self.flow = flow
        self.key = key  # the flow in the engine: (flow, the default class, the pool)
        self.body = body
        self.endpoint = endpoint
        self.est = est
        self.pool = pool
        self.t_enq = t_enq
        self.stream = False
        self.fs: FlowStats = None  # type: ignore[assignment]  # set once admitted
        self.state = WAITING
        self.bs: BState | None = None
        self.fut: asyncio.Future[None] | None = None
        self.req: Request = None  # type: ignore[assignment]  # set once admitted
        self.sent_charge = 0.0  # cost units charged when it was sent (the stats add the corrections)


class DispatcherBase:
    """Attributes and cross-module methods of ``Dispatcher``, declared once.

    Each job module (admission, placement, health, stats, calls, lifecycle) is a mixin over
    this base; ``Dispatcher`` combines them. Nothing here does any work: the decisions are the
    request engine's (``_engine``), the I/O the modules'.
    """

    estimator: CostEstimator
    charge: str
    clock: Callable[[], float]
    overtake: int
    backoff: float
    max_backoff: float
    close_grace: float
    error_window: int
    error_rate: float
    transport_failures: int
    unavailable_timeout: float | None
    max_pause: float
    on_dispatch: Callable[[DispatchRecord], None] | None
    _engine: PolicyEngine
    _window: int
    _max_flow_stats: int
    _pools: dict[str | None, Pool]
    _bstates: list[BState]
    _by_name: dict[str, BState]
    _default: Pool | None
    _only: Pool | None
    _flows: dict[Hashable, FlowStats]
    _idle: OrderedDict[Hashable, None]
    _started: bool
    _closed: bool
    _in_flight: int
    _drained: asyncio.Event | None
    _close_task: asyncio.Task[None] | None
    _timer: WakeTimer
    _pumping: bool

    # admission
    def _admit(self, flow: Hashable, body: Mapping[str, Any], cost: float | None, streaming: bool,
               idempotent: bool, timeout: float | None = None) -> Job:
        raise NotImplementedError

    async def _wait_placed(self, job: Job) -> None:
        raise NotImplementedError

    def _withdraw(self, job: Job) -> None:
        raise NotImplementedError

    # placement
    def _pump(self) -> None:
        raise NotImplementedError

    def _finish(self, job: Job, outcome: int, err: BackendError | None = None,
                usage: Mapping[str, Any] | None = None, text_chars: int | None = None,
                retryable: bool = True) -> float | None:
        raise NotImplementedError

    async def _retry(self, job: Job, delay: float) -> None:
        raise NotImplementedError

    # health
    def _mark_unhealthy(self, bs: BState, reason: str | None = None) -> None:
        raise NotImplementedError

    def _note_reply(self, bs: BState, err: BackendError | None, flow: Hashable = None) -> None:
        raise NotImplementedError

    # statistics
    def _flow_stats(self, flow: Hashable) -> FlowStats:
        raise NotImplementedError

    def _maybe_idle(self, fs: FlowStats) -> None:
        raise NotImplementedError

    # lifecycle
    async def start(self) -> None:
        raise NotImplementedError
