"""Statistics: per-flow counters (bounded in number: idle flows are forgotten, oldest first,
in O(1) per forgotten flow), and the ``stats()`` snapshot, whose cost does not grow with the
number of flows: ``flows`` is a read-only view that builds a flow's row when it is read."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import numpy as np

from ..policy.classify import Flow
from ._state import DEFAULT_CLASS, DispatcherBase, FlowStats


def flow_row(fs: FlowStats) -> dict[str, Any]:
    """One flow's counters as a plain dict (a snapshot; ``held`` is filled in by ``FlowsView``)."""
    p50: float | None
    p95: float | None
    p99: float | None
    if fs.waits:
        p50, p95, p99 = (float(x) for x in np.percentile(np.fromiter(fs.waits, float, len(fs.waits)),
                                                         (50, 95, 99)))
    else:
        p50 = p95 = p99 = None
    return {
        "waiting": fs.waiting, "held": 0, "in_flight": fs.in_flight, "dispatched": fs.dispatched,
        "completed": fs.completed, "failed": fs.failed, "cancelled": fs.cancelled, "aborted": fs.aborted,
        "rejected": fs.rejected, "unavailable": fs.unavailable, "expired": fs.expired, "retried": fs.retried,
        "charged_cost": fs.charged,
        "wait_p50": p50, "wait_p95": p95, "wait_p99": p99,
    }


class FlowsView(Mapping[Hashable, dict[str, Any]]):
    """``stats()["flows"]``: flow -> its row, built when read (O(1) plus the wait percentiles).

    A live, read-only view of the flows the dispatcher keeps statistics for: each row read is
    a snapshot of that moment. ``len`` is O(1); iterating walks every flow (do it off the
    request path, or read the flows you need)."""

    __slots__ = ("_flows", "_held")

    def __init__(self, flows: dict[Hashable, FlowStats], held: Callable[[Hashable], int]) -> None:
        self._flows = flows
        self._held = held

    def __getitem__(self, flow: Hashable) -> dict[str, Any]:
        fs = self._flows[flow]
        row = flow_row(fs)
        if fs.waiting:
            held = self._held(flow)  # its requests first in line that fit no backend with room
            if held:
                row["waiting"] -= held
                row["held"] = held
        return row

    def __contains__(self, flow: object) -> bool:
        return flow in self._flows

    def __len__(self) -> int:
        return len(self._flows)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._flows))  # keys as of now: the caller may await while iterating

    def __repr__(self) -> str:
        return f"<FlowsView of {len(self._flows)} flows>"


class Statistics(DispatcherBase):
    def _flow_stats(self, flow: Hashable) -> FlowStats:
        """The counters of ``flow``, created on first use; the flow is marked busy (not idle)."""
        fs = self._flows.get(flow)
        if fs is None:
            if len(self._flows) >= self._max_flow_stats:
                self._forget_idle_flow_stats()
            fs = self._flows[flow] = FlowStats(flow, self._window)
        elif fs.idle:
            fs.idle = False
            self._idle.pop(flow, None)
        return fs

    def _maybe_idle(self, fs: FlowStats) -> None:
        """Call after a flow's waiting/held/in-flight count dropped: an idle flow joins the
        idle list (newest last), from which ``max_flow_stats`` forgets the oldest."""
        if not (fs.idle or fs.waiting or fs.in_flight) and fs.flow in self._flows:
            fs.idle = True
            self._idle[fs.flow] = None  # it left the list when it got busy: this appends

    def _forget_idle_flow_stats(self) -> None:
        """Drop the statistics of idle flows, oldest first, down to 90% of ``max_flow_stats``:
        O(flows dropped), never a scan of all flows (when none is idle, nothing is dropped)."""
        target = int(self._max_flow_stats * 0.9)
        idle, flows = self._idle, self._flows
        while len(flows) > target and idle:
            f, _ = idle.popitem(last=False)
            fs = flows.get(f)
            if fs is not None:
                fs.idle = False
                if not (fs.waiting or fs.in_flight):
                    del flows[f]

    def stats(self) -> dict[str, Any]:
        """A snapshot; its cost grows with the number of backends and pools, not of flows.

        ``flows``: a read-only ``Mapping`` flow -> row, each row built when read (see
        ``FlowsView``): ``waiting`` (queued, or between retries), ``held`` (next in line,
        waiting aside, uncharged, for a backend that fits), ``in_flight``, ``dispatched``,
        ``completed``, ``failed`` (after the retries), ``retried`` (attempts tried again),
        ``cancelled`` (before dispatch, uncharged), ``aborted`` (after dispatch), ``rejected``
        (at close), ``unavailable`` (removed after ``unavailable_timeout`` with no healthy
        backend), ``charged_cost`` (cost units: at dispatch plus the
        corrections of the charge mode), ``wait_p50``/``wait_p95``/``wait_p99``
        (seconds from submit to send over the last ``wait_window`` sends; ``None`` before any).
        ``backends[name]``: ``model``, ``in_flight``, ``max_in_flight``, ``healthy``,
        ``saturated``, ``paused`` (after a 429), ``dispatched``, ``completed``, ``errors``,
        ``aborted``, ``rate_limited`` (429s), ``recent_5xx`` (5xx among the last
        ``error_window`` replies), ``last_error``, ``down_reason``, ``unhealthy_spells``,
        ``check_interval`` (seconds between health checks while out of rotation, else ``None``),
        ``probe`` (the last reading as a dict, or ``None``), ``probe_errors``.
        ``pools[model]``: ``waiting``, ``held``, ``in_flight``, ``virtual_time``, ``backends``
        (names), ``healthy`` (count).
        """
        backends = {}
        for bs in self._bstates:
            m = bs.monitor
            backends[bs.name] = {
                "model": bs.pool.model, "in_flight": bs.in_flight, "max_in_flight": bs.max_in_flight,
                "healthy": m.healthy, "saturated": m.saturated, "paused": m.paused,
                "dispatched": bs.dispatched, "completed": bs.completed, "errors": bs.errors,
                "aborted": bs.aborted, "rate_limited": m.rate_limited, "recent_5xx": m.window.errors,
                "last_error": bs.last_error, "down_reason": m.down_reason, "unhealthy_spells": m.unhealthy_spells,
                "check_interval": m.check_delay,
                "probe": m.reading._asdict() if m.reading is not None else None, "probe_errors": m.probe_errors,
            }
        e = self._engine
        pools = {}
        for model, p in self._pools.items():
            q = e.queues[p.name]
            held = len(q.aside) + int(q.stalled is not None and q.stalled.state == "waiting")
            pools[model] = {"waiting": len(q) - held, "held": held,
                            "in_flight": sum(bs.in_flight for bs in p.backends), "virtual_time": q.sched.virtual_time,
                            "backends": [bs.name for bs in p.backends], "healthy": sum(bs.healthy for bs in p.backends)}
        return {"flows": FlowsView(self._flows, self._held_of), "backends": backends, "pools": pools}

    def _held_of(self, flow: Hashable) -> int:
        """Requests of ``flow`` first in line that fit no backend with room, in every pool."""
        n = 0
        for q in self._engine.queues.values():
            n += q.held(Flow(flow, DEFAULT_CLASS, q.name))  # type: ignore[arg-type]
        return n
