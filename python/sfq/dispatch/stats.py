"""Statistics: per-flow counters (bounded in number: idle flows are forgotten, oldest first),
and the ``stats()`` snapshot."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from ._state import DispatcherBase, FlowStats


class Statistics(DispatcherBase):
    def _flow_stats(self, flow: Hashable) -> FlowStats:
        """The counters of ``flow``, created on first use."""
        fs = self._flows.get(flow)
        if fs is None:
            if len(self._flows) >= self._max_flow_stats:
                self._forget_idle_flow_stats()
            fs = self._flows[flow] = FlowStats(self._window)
        return fs

    def _forget_idle_flow_stats(self) -> None:
        """Drop the statistics of idle flows, oldest first, down to 90% of ``max_flow_stats``
        (amortised: one sweep per tenth of the limit of new flows)."""
        excess = len(self._flows) - int(self._max_flow_stats * 0.9)
        idle = [f for f, fs in self._flows.items() if not (fs.waiting or fs.held or fs.in_flight)][:excess]
        for f in idle:
            del self._flows[f]

    def stats(self) -> dict[str, Any]:
        """A snapshot.

        ``flows[flow]``: ``waiting`` (queued), ``held`` (selected, waiting aside for a backend that
        fits), ``in_flight``, ``dispatched`` (charged), ``completed``, ``failed``, ``cancelled``
        (before dispatch, uncharged), ``aborted`` (after dispatch), ``rejected`` (at close),
        ``charged_cost`` (cost units), ``wait_p50``/``wait_p95``/``wait_p99`` (seconds from
        submit to send over the last ``wait_window`` sends; ``None`` before any).
        ``backends[name]``: ``model``, ``in_flight``, ``max_in_flight``, ``healthy``,
        ``saturated``, ``dispatched``, ``completed``, ``errors``, ``aborted``, ``last_error``,
        ``unhealthy_spells``, ``probe`` (the last reading as a dict, or ``None``), ``probe_errors``.
        ``pools[model]``: ``waiting``, ``held``, ``virtual_time``, ``backends`` (names).
        """
        flows = {}
        for flow, fs in self._flows.items():
            p50: float | None
            p95: float | None
            p99: float | None
            if fs.waits:
                p50, p95, p99 = (float(x) for x in np.percentile(np.fromiter(fs.waits, float, len(fs.waits)),
                                                                 (50, 95, 99)))
            else:
                p50 = p95 = p99 = None
            flows[flow] = {
                "waiting": fs.waiting, "held": fs.held, "in_flight": fs.in_flight, "dispatched": fs.dispatched,
                "completed": fs.completed, "failed": fs.failed, "cancelled": fs.cancelled, "aborted": fs.aborted,
                "rejected": fs.rejected, "charged_cost": fs.charged,
                "wait_p50": p50, "wait_p95": p95, "wait_p99": p99,
            }
        backends = {}
        for bs in self._bstates:
            backends[bs.name] = {
                "model": bs.pool.model, "in_flight": bs.in_flight, "max_in_flight": bs.max_in_flight,
                "healthy": bs.healthy, "saturated": bs.saturated, "dispatched": bs.dispatched,
                "completed": bs.completed, "errors": bs.errors, "aborted": bs.aborted, "last_error": bs.last_error,
                "unhealthy_spells": bs.unhealthy_spells,
                "probe": bs.reading._asdict() if bs.reading is not None else None, "probe_errors": bs.probe_errors,
            }
        pools = {
            model: {"waiting": len(p.waiting), "held": len(p.aside), "virtual_time": p.sched.virtual_time,
                    "backends": [bs.name for bs in p.backends]}
            for model, p in self._pools.items()
        }
        return {"flows": flows, "backends": backends, "pools": pools}
