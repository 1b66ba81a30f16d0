"""The per-flow statistics of a :class:`~sfq.dispatch.Dispatcher` (``stats()["flows"]``):
the engine's observer, told of every request as it queues, starts and ends.

Compiled by mypyc with the engine (``sfq._compiled.MODULES``): the engine calls it three or
four times a request."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

import numpy as np

from ..engine.pool import RUNNING, Request

__all__ = ["FlowTally"]


class _Row:
    """One flow's counters (``Dispatcher.stats()["flows"]``)."""

    __slots__ = ("waiting", "in_flight", "dispatched", "completed", "failed", "cancelled", "aborted", "rejected",
                 "unavailable", "expired", "refused", "retried", "charged", "waits")

    def __init__(self, window: int) -> None:
        self.waiting = 0  # in the engine: queued, or between retries (requests)
        self.in_flight = 0  # on a backend (requests)
        self.dispatched = 0  # attempts started, retries included
        self.completed = 0
        self.failed = 0  # after the retries
        self.cancelled = 0  # given up before start: uncharged
        self.aborted = 0  # given up while running: charged what it was
        self.rejected = 0  # refused or ended as the dispatcher closed
        self.unavailable = 0  # no backend of the pool in rotation for unavailable_timeout
        self.expired = 0  # its deadline (timeout) ran out before it started
        self.refused = 0  # other refusals of an accepted flow (queue_full, too_large, ...)
        self.retried = 0  # attempts that were retries
        self.charged = 0.0  # cost units: at dispatch, plus the charge mode's corrections while running
        self.waits: deque[float] = deque(maxlen=window)  # seconds from arrival to start, the last ``window``


#: the counter of ``stats()["flows"]`` an engine outcome counts in (refusals: by their reason)
_BY_OUTCOME = {"completed": "completed", "failed": "failed", "cancelled_before_start": "cancelled",
               "cancelled_during_execution": "aborted"}
_BY_REASON = {"closed": "rejected", "unavailable": "unavailable", "deadline": "expired", "queue_timeout": "expired"}


class FlowTally:
    """The engine's observer for a ``Dispatcher``: counters per flow id, across pools, for at
    most about ``limit`` flows (beyond it, flows with nothing waiting or running are forgotten,
    oldest first, in O(1) each); a refusal of a flow it does not know leaves nothing but a
    count in ``refused_other`` (refused flows leave no state). Keeps no Prometheus series."""

    registry = None

    def __init__(self, limit: int, window: int, clock: Any = None) -> None:
        self.limit = limit
        self.window = window
        #: seconds (the Dispatcher's clock): when a flow went idle, for :meth:`forget_idle`
        self.clock: Any = clock
        self.rows: dict[Hashable, _Row] = {}
        #: flows with nothing in progress, oldest first, with the clock time each went idle
        self.idle: OrderedDict[Hashable, float] = OrderedDict()
        self.forgotten = 0  # rows forgotten so far (beyond the limit, or idle too long)
        #: refusals of flows with no row, by reason
        self.refused_other: dict[str, int] = {}

    def _row(self, flow: Hashable) -> _Row:
        row = self.rows.get(flow)
        if row is None:
            if len(self.rows) >= self.limit:
                self._forget()
            row = self.rows[flow] = _Row(self.window)
        else:
            self.idle.pop(flow, None)
        return row

    def _forget(self) -> None:
        target = int(self.limit * 0.9)
        rows, idle = self.rows, self.idle
        while len(rows) > target and idle:
            f, _ = idle.popitem(last=False)
            rows.pop(f, None)
            self.forgotten += 1

    def forget_idle(self, before: float) -> int:
        """Forget the rows of flows idle (nothing waiting or running) since before ``before``
        (clock time); returns how many. O(rows forgotten)."""
        rows, idle = self.rows, self.idle
        n = 0
        while idle:
            f = next(iter(idle))
            if idle[f] >= before:
                break
            del idle[f]
            rows.pop(f, None)
            n += 1
        self.forgotten += n
        if n > len(rows):  # (a dict keeps its size after deletions: a new one is compact)
            self.rows = dict(rows)
            self.idle = OrderedDict(idle)
        return n

    def _now(self) -> float:
        c = self.clock
        return 0.0 if c is None else float(c())

    def _maybe_idle(self, flow: Hashable, row: _Row) -> None:
        if not (row.waiting or row.in_flight):
            self.idle[flow] = self._now()
            self.idle.move_to_end(flow)

    # the engine's metrics interface (keys are (org, class, pool); the org is the flow id)
    def _get(self, key: Any) -> None:
        return None

    def queued(self, key: Any, n: int = 1) -> None:
        self._row(key[0]).waiting += n

    def started(self, key: Any, wait: float, cost: float, retry: bool) -> None:
        row = self._row(key[0])
        row.waiting -= 1
        row.in_flight += 1
        row.dispatched += 1
        row.charged += cost
        row.waits.append(wait)
        if retry:
            row.retried += 1

    def began(self, key: Any, cost: float) -> None:
        """A request queued and started at once (``queued`` and ``started`` after 0 s, in one)."""
        flow = key[0]
        row = self.rows.get(flow)
        if row is None:
            row = self._row(flow)
        else:
            self.idle.pop(flow, None)
        row.in_flight += 1
        row.dispatched += 1
        row.charged += cost
        row.waits.append(0.0)

    def charged(self, r: Request, delta: float) -> None:
        """A correction of a running request's charge (the queue's ``on_charge``)."""
        if r.state == RUNNING:
            row = self.rows.get(r.flow.org)
            if row is not None:
                row.charged += delta

    def attempt_ended(self, key: Any, *, served_cost: float | None = None, upstream_429: bool = False,
                      timeout: bool = False, charged: float | None = None) -> None:
        row = self.rows.get(key[0])
        if row is not None:
            row.in_flight -= 1

    def completed(self, key: Any, served_cost: float | None, charged: float) -> None:
        """An attempt ended and its request completed (``attempt_ended`` + ``ended``, in one)."""
        flow = key[0]
        row = self.rows.get(flow)
        if row is not None:
            row.in_flight -= 1
            row.completed += 1
            if not (row.waiting or row.in_flight):
                self.idle[flow] = self._now()
                self.idle.move_to_end(flow)

    def left_queue(self, key: Any) -> None:
        row = self.rows.get(key[0])
        if row is not None:
            row.waiting -= 1

    def timeout(self, key: Any) -> None:
        return None

    def cancelled_work_tokens(self, key: Any, tokens: float) -> None:
        return None

    def ended(self, key: Any, outcome: str, reason: str | None = None) -> None:
        flow = key[0]
        row = self.rows.get(flow)
        if row is None:
            if outcome == "refused":
                self.refused_other[reason or ""] = self.refused_other.get(reason or "", 0) + 1
            return
        field = _BY_OUTCOME.get(outcome) or _BY_REASON.get(reason or "", "refused")
        setattr(row, field, getattr(row, field) + 1)
        self._maybe_idle(flow, row)

    def snapshot(self) -> dict[Any, dict[str, Any]]:
        return {}

    def row(self, flow: Hashable, held: int) -> dict[str, Any]:
        """One flow's counters as a plain dict."""
        fs = self.rows[flow]
        p50: float | None
        p95: float | None
        p99: float | None
        w = fs.waits
        if len(w) > 64:
            p50, p95, p99 = (float(x) for x in np.percentile(np.fromiter(w, float, len(w)), (50, 95, 99)))
        elif w:  # (numpy's own linear interpolation, without its per-call cost for a few waits)
            p50, p95, p99 = (_quantile(sorted(w), q) for q in (0.50, 0.95, 0.99))
        else:
            p50 = p95 = p99 = None
        return {
            "waiting": fs.waiting - held, "held": held, "in_flight": fs.in_flight, "dispatched": fs.dispatched,
            "completed": fs.completed, "failed": fs.failed, "cancelled": fs.cancelled, "aborted": fs.aborted,
            "rejected": fs.rejected, "unavailable": fs.unavailable, "expired": fs.expired, "refused": fs.refused,
            "retried": fs.retried, "charged_cost": fs.charged, "wait_p50": p50, "wait_p95": p95, "wait_p99": p99,
        }


def _quantile(xs: list[float], q: float) -> float:
    """``np.percentile(xs, 100 * q)`` (linear interpolation) of the sorted ``xs``."""
    pos = (len(xs) - 1) * q
    i = int(pos)
    j = min(i + 1, len(xs) - 1)
    return float(xs[i] + (xs[j] - xs[i]) * (pos - i))
