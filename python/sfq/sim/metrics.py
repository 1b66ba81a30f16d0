"""Metrics over a :class:`~sfq.sim.engine.RunResult`.

Definitions (units: steps and weighted tokens ``W = w_p * prompt + w_q * generated``)
* **service** of a flow: ``W`` delivered (prefill at admission, decode as generated);
  ``est_cost``: the sum of the estimates of its requests that started.
* **max drift**: the largest ``|W_f(t1,t2)/w_f - W_g(t1,t2)/w_g|`` over flows ``f, g``
  and times ``t1 < t2`` inside one interval during which both had a request waiting at
  the balancer (the quantity seed 003's bound ``2 max(w_p L_input, w_q M)`` bounds). Within
  one such interval it is ``max D - min D`` of ``D = W_f/w_f - W_g/w_g``, which is
  piecewise linear between the recorded events, so the samples give it exactly.
* **Jain's index** among backlogged flows: of each flow's weight-normalised service rate
  while it had work waiting, over the flows that had work waiting at least 10% of the
  window; ``None`` with fewer than two.
* **wait**: steps from arrival to start. A request still waiting at the end counts as
  having waited until the end (a lower bound), so a starved flow is not hidden.
* **throughput**: ``W`` per step over the window; ``tokens_per_step``: raw tokens.
"""

from __future__ import annotations

import numpy as np

from .engine import RunResult

__all__ = [
    "service_at",
    "max_drift",
    "jain_index",
    "waits",
    "wait_quantiles",
    "throughput",
    "flow_summary",
]


def _index_at(res: RunResult, t: int) -> int:
    """First sample at step ``t`` or later (the state before admissions at ``t``)."""
    k = int(np.searchsorted(res.times, t, side="left"))
    return min(k, res.times.size - 1)


def service_at(res: RunResult, t: int, raw: bool = False) -> np.ndarray:
    """Cumulative service per flow at step ``t`` (before that step's admissions),
    linearly interpolated between samples; ``raw``: tokens instead of weighted tokens."""
    vals = (res.prefill + res.decoded) if raw else res.service
    times = res.times
    k = _index_at(res, t)
    if times[k] == t or k == 0:
        return vals[k].astype(float)
    if t > times[-1]:
        return vals[-1].astype(float)
    t0, t1 = times[k - 1], times[k]
    a = (t - t0) / (t1 - t0)
    return vals[k - 1] + a * (vals[k] - vals[k - 1])


def _window(res: RunResult, t0: int | None, t1: int | None) -> slice:
    lo = 0 if t0 is None else _index_at(res, t0)
    hi = res.times.size if t1 is None else int(np.searchsorted(res.times, t1, side="right"))
    return slice(lo, hi)


def max_drift(res: RunResult, t0: int | None = None, t1: int | None = None, charged: bool = False) -> float:
    """Max drift (see the module docstring) over samples in ``[t0, t1]``; 0 if no two
    flows were ever backlogged together. ``charged``: of the estimated cost of started
    requests instead of the service delivered (SFQ's own guarantee is on this one)."""
    sl = _window(res, t0, t1)
    W = (res.charged if charged else res.service)[sl] / res.weights
    BL = res.backlog[sl]
    nf = W.shape[1]
    best = 0.0
    for i in range(nf):
        for j in range(i + 1, nf):
            seg = BL[:, i] & BL[:, j]
            if seg.size:
                seg[-1] = False  # the last sample starts no segment
            if not seg.any():
                continue
            d = W[:, i] - W[:, j]
            on = seg.copy()
            on[1:] |= seg[:-1]  # a segment's end point belongs to its interval
            pts = np.flatnonzero(on)
            starts = seg & ~np.concatenate(([False], seg[:-1]))
            gstart = np.flatnonzero(starts[pts])
            vals = d[pts]
            spread = np.maximum.reduceat(vals, gstart) - np.minimum.reduceat(vals, gstart)
            best = max(best, float(spread.max()))
    return best


def jain_index(res: RunResult, t0: int | None = None, t1: int | None = None, min_frac: float = 0.1) -> float | None:
    """Jain's index of the normalised service rates of flows while backlogged."""
    sl = _window(res, t0, t1)
    times = res.times[sl]
    if times.size < 2:
        return None
    W = res.service[sl] / res.weights
    BL = res.backlog[sl][:-1]
    dt = np.diff(times).astype(float)
    dW = np.diff(W, axis=0)
    span = float(times[-1] - times[0])
    t_bl = (dt[:, None] * BL).sum(axis=0)
    w_bl = (dW * BL).sum(axis=0)
    keep = t_bl >= min_frac * span
    if keep.sum() < 2:
        return None
    x = w_bl[keep] / t_bl[keep]
    denom = keep.sum() * float((x * x).sum())
    return float(x.sum() ** 2 / denom) if denom > 0 else None


def waits(res: RunResult, flow: int | None = None) -> np.ndarray:
    """Waits before start (steps) of requests that arrived before the end; those still
    waiting count as waiting until the end."""
    m = (res.arrival < res.end) & ~res.rejected
    if flow is not None:
        m &= res.flow == flow
    started = res.admit[m]
    arr = res.arrival[m]
    return np.where(started >= 0, started, res.end) - arr


def wait_quantiles(res: RunResult, flow: int | None = None, qs=(50, 95, 99)) -> list[float | None]:
    w = waits(res, flow)
    if w.size == 0:
        return [None for _ in qs]
    return [float(x) for x in np.percentile(w, qs)]


def throughput(res: RunResult, t0: int = 0, t1: int | None = None, raw: bool = False) -> float:
    """Weighted tokens (``raw``: tokens) per step delivered in ``[t0, t1]``."""
    t1 = res.end if t1 is None else t1
    if t1 <= t0:
        return 0.0
    return float((service_at(res, t1, raw).sum() - service_at(res, t0, raw).sum()) / (t1 - t0))


def flow_summary(res: RunResult) -> dict[str, dict]:
    """Per flow: weight, service (weighted tokens), est_cost, submitted, started,
    completed, rejected, waiting at the end, and wait p50/p95/p99 (steps)."""
    out: dict[str, dict] = {}
    end_service = res.service[-1]
    arrived = res.arrival < res.end
    for f, spec in enumerate(res.flows):
        m = (res.flow == f) & arrived
        started = m & (res.admit >= 0)
        p50, p95, p99 = wait_quantiles(res, f)
        out[spec.name] = {
            "weight": spec.weight,
            "service": float(end_service[f]),
            "est_cost": float(res.est[started].sum()),
            "submitted": int(m.sum()),
            "started": int(started.sum()),
            "completed": int((m & (res.finish >= 0)).sum()),
            "rejected": int((m & res.rejected).sum()),
            "waiting": int((m & ~res.rejected & (res.admit < 0)).sum()),
            "wait_p50": p50,
            "wait_p95": p95,
            "wait_p99": p99,
        }
    return out
