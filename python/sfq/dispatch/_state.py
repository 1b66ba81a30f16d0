"""The dispatcher's data: requests (jobs), pools, backends, per-flow counters, and the base
class that declares what the job modules share (so each module type-checks on its own)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..backends.base import Backend
from ..backends.probe import ProbeReading
from ..cost import CostEstimator, Estimate
from ..errors import BackendError
from ..policy.charge import CHARGE_MODES

if TYPE_CHECKING:
    from .hooks import DispatchHooks

log = logging.getLogger("sfq.dispatch")

# job states (EXPIRED: removed after ``unavailable_timeout`` with no healthy backend). HELD: still in
# the scheduler, uncharged, named by ``peek()`` but fitting no backend with room (stalled, or set
# aside with its flow suspended so that others may overtake); TAKEN: selected by a hook that
# dispatched another request than ``peek()`` named, charged, waiting for a backend that fits
WAITING, HELD, PLACED, DONE, CANCELLED, REJECTED, EXPIRED, TAKEN = range(8)
# outcomes of a placed job
OK, FAILED, ABORTED = range(3)
#: outcome codes as the hooks see them
OUTCOME_NAMES = {OK: "completed", FAILED: "failed", ABORTED: "aborted"}


class DispatchRecord(NamedTuple):
    """What ``on_dispatch`` (and the hooks) receive when a request is sent to a backend.

    ``start``/``finish``: the flow's meter before and after the charge (cost units, the
    scheduler's ``Dispatch``); ``wait``: seconds from submit to send (injected clock).
    """

    flow: Hashable
    ticket: int
    cost: float
    start: float
    finish: float
    model: str | None
    backend: str
    wait: float


class BState:
    """The dispatcher's view of one backend."""

    __slots__ = ("backend", "name", "pool", "index", "max_in_flight", "max_context", "in_flight", "healthy",
                 "saturated", "dispatched", "completed", "errors", "aborted", "last_error", "backoff",
                 "recover_task", "probe_task", "reading", "probe_errors", "unhealthy_spells", "replies",
                 "reply_errors", "transport_failures", "paused", "pause_handle", "rate_limited", "down_reason",
                 "check_delay")

    def __init__(self, backend: Backend, pool: Pool, index: int, backoff: float, window: int) -> None:
        self.backend = backend
        self.name = backend.name
        self.pool = pool
        self.index = index
        self.max_in_flight = backend.max_in_flight
        self.max_context = backend.max_context
        self.in_flight = 0
        self.healthy = True
        self.saturated = False
        self.dispatched = 0
        self.completed = 0
        self.errors = 0
        self.aborted = 0
        self.last_error: str | None = None
        self.backoff = backoff  # seconds before the next health probe when it next turns unhealthy
        self.recover_task: asyncio.Task[None] | None = None
        self.probe_task: asyncio.Task[None] | None = None
        self.reading: ProbeReading | None = None
        self.probe_errors = 0
        self.unhealthy_spells = 0
        self.replies: deque[tuple[Hashable, bool]] = deque(maxlen=window)  # the last replies: (flow, 5xx?)
        self.reply_errors = 0  # 5xx among ``replies``
        self.transport_failures = 0  # in a row, with no reply in between
        self.paused = False  # after a 429, until its Retry-After
        self.pause_handle: asyncio.TimerHandle | None = None
        self.rate_limited = 0  # 429s received
        self.down_reason: str | None = None
        self.check_delay: float | None = None  # seconds to the next health check while out of rotation


class Pool:
    """Backends serving one model, and the scheduler that orders their requests."""

    __slots__ = ("model", "sched", "backends", "aside", "stalled", "taken", "limited", "largest_context", "waiting",
                 "down_since", "down_timer")

    def __init__(self, model: str | None, sched: Any) -> None:
        self.model = model
        self.sched = sched
        self.backends: list[BState] = []
        self.aside: list[Job] = []  # HELD with their flow suspended (overtake), uncharged, oldest first
        self.stalled: Job | None = None  # HELD, not suspended: the head everything else waits behind
        self.taken: list[Job] = []  # TAKEN: charged by a hook's own selection, waiting for a backend that fits
        self.limited = False  # some backend declares max_context
        self.largest_context: float = float("inf")
        self.waiting: dict[int, Job] = {}  # ticket -> job still in the scheduler (WAITING or HELD; admission order)
        self.down_since: float | None = None  # loop time since which no backend is healthy
        self.down_timer: asyncio.TimerHandle | None = None


class FlowStats:
    """Counters of one flow (see ``Dispatcher.stats``)."""

    __slots__ = ("flow", "idle", "waiting", "held", "in_flight", "dispatched", "completed", "failed",
                 "cancelled", "aborted", "rejected", "unavailable", "charged", "waits")

    def __init__(self, flow: Hashable, window: int) -> None:
        self.flow = flow
        self.idle = False  # in the dispatcher's idle list (nothing waiting, held or in flight)
        self.waiting = 0  # in the scheduler
        self.held = 0  # next in line but fitting no backend with room: waiting aside, uncharged
        self.in_flight = 0  # sent to a backend
        self.dispatched = 0  # dispatched by the scheduler (charged)
        self.completed = 0
        self.failed = 0
        self.cancelled = 0  # given up before dispatch: uncharged
        self.aborted = 0  # given up after dispatch: charged, backend call aborted
        self.rejected = 0  # removed when the dispatcher closed
        self.unavailable = 0  # removed after unavailable_timeout with no healthy backend (NoHealthyBackend)
        self.charged = 0.0  # cost units charged: at dispatch, plus the corrections of the charge mode
        self.waits: deque[float] = deque(maxlen=window)  # seconds from submit to send


class Job:
    """One accepted request, from admission to its outcome."""

    __slots__ = ("flow", "body", "endpoint", "est", "cost", "pool", "ticket", "t_enq", "t_loop", "state", "bs",
                 "fut", "need", "start", "finish", "fs", "record", "idempotent", "fixed", "charged", "working",
                 "tokens", "stream", "epoch")

    def __init__(self, flow: Hashable, body: dict[str, Any], endpoint: str, est: Estimate | None, cost: float,
                 pool: Pool, t_enq: float, need: float) -> None:
        self.flow = flow
        self.body = body
        self.endpoint = endpoint
        self.est = est
        self.cost = cost
        self.pool = pool
        self.t_enq = t_enq
        self.t_loop = 0.0  # loop time at admission when its pool was down (for unavailable_timeout)
        self.need = need
        self.idempotent = False
        self.fixed = False  # the caller gave the cost: charged as given, never re-estimated or corrected
        self.charged = 0.0  # cost units charged for this request so far (once dispatched)
        self.working = False  # reported to the scheduler with work_started() and not yet work_done()
        self.tokens = 0.0  # output tokens counted so far (charge="served", streams)
        self.stream = False
        self.epoch = -1  # the estimator's calibration epoch of ``est``
        self.fs: FlowStats = None  # type: ignore[assignment]  # set once enqueued
        self.ticket = 0
        self.state = WAITING
        self.bs: BState | None = None
        self.fut: asyncio.Future[None] | None = None
        self.start = 0.0
        self.finish = 0.0
        self.record: DispatchRecord | None = None  # made at send when a hook wants it


class DispatcherBase:
    """Attributes and cross-module methods of ``Dispatcher``, declared once.

    Each job module (admission, placement, health, stats, calls, lifecycle) is a mixin over
    this base; ``Dispatcher`` combines them. Nothing here does any work.
    """

    estimator: CostEstimator
    charge: str
    _served: bool
    _seed: bool
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
    hooks: DispatchHooks | None
    _window: int
    _max_flow_stats: int
    _pools: dict[str | None, Pool]
    _bstates: list[BState]
    _default: Pool | None
    _only: Pool | None
    _flows: dict[Hashable, FlowStats]
    _idle: OrderedDict[Hashable, None]
    _started: bool
    _closed: bool
    _in_flight: int
    _drained: asyncio.Event | None
    _close_task: asyncio.Task[None] | None

    # admission
    def _admit(self, flow: Hashable, body: Mapping[str, Any], cost: float | None, streaming: bool) -> Job:
        raise NotImplementedError

    async def _wait_placed(self, job: Job) -> None:
        raise NotImplementedError

    def _withdraw(self, job: Job) -> None:
        raise NotImplementedError

    # placement
    def _pump(self, pool: Pool) -> None:
        raise NotImplementedError

    def _finish(self, job: Job, outcome: int, err: BackendError | None = None,
                usage: Mapping[str, Any] | None = None) -> None:
        raise NotImplementedError

    def _unhold(self, job: Job) -> None:
        raise NotImplementedError

    def _work_over(self, job: Job) -> None:
        raise NotImplementedError

    def _served_tokens(self, job: Job, event: Mapping[str, Any]) -> None:
        raise NotImplementedError

    # health
    def _mark_unhealthy(self, bs: BState, reason: str | None = None) -> None:
        raise NotImplementedError

    async def _probe_loop(self, bs: BState) -> None:
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
