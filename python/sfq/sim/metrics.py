"""Metrics over a :class:`~sfq.sim.engine.RunResult`.

Definitions (units: steps and weighted tokens ``W = w_p * prompt + w_q * generated``).
A flow is **backlogged** while it has work waiting at the balancer *or running* on an
engine (``RunResult.busy``).

* **service** of a flow: ``W`` delivered (prefill at admission, decode as generated);
  ``est_cost``: the sum of the estimates of its requests that started.
* **max drift** (``max_drift``, docs/simulator.md §4): ``max_t max_{f,g in F}
  |W_f(t0,t)/w_f - W_g(t0,t)/w_g|``, the largest gap in weight-normalised service
  accumulated since ``t0``, over the flows ``F`` that are backlogged for the whole
  measured window: from the first sample at which a flow is backlogged it must stay
  backlogged at every sample up to the end of the window; ``t0`` is the latest of those
  first samples, the moment from which all of ``F`` are backlogged (with two clients both
  over their share from the start, it is their first arrival). ``0`` when fewer than two
  flows qualify. Each flow's ``W`` is linear between samples, so the gap (max minus min,
  a convex function between two samples) peaks at a sample: per sample only the largest
  and smallest ``W/w`` over ``F`` are kept, ``O(|F| x samples)``, no pairs.
* **max interval drift** (``max_interval_drift``, the interval form): the largest
  ``|W_f(t1,t2)/w_f - W_g(t1,t2)/w_g|`` over pairs ``f, g`` and times ``t1 < t2`` inside one
  interval during which both were backlogged; it restarts whenever either flow's
  backlog empties. Quadratic in the flows: ``None`` above ``max_flows`` flows. With
  ``busy=False`` "backlogged" means waiting at the balancer, the sense of the bound of docs/design.md §3.2
  on the *charged* cost (``charged=True``), which is what ``max_drift_est`` reports.
* **Jain's index** among backlogged flows: of each flow's weight-normalised service rate
  while it was backlogged, over the flows backlogged at least 10% of the window;
  ``None`` with fewer than two.
* **wait**: steps from arrival to start. A request still waiting at the end counts as
  having waited until the end (a lower bound), so a starved flow is not hidden.
* **throughput**: ``W`` per step over the window; ``tokens_per_step``: raw tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .engine import RunResult

__all__ = [
    "service_at",
    "drift_set",
    "max_drift",
    "drift_curve",
    "max_interval_drift",
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

    def at(j: int) -> np.ndarray:
        if raw:
            return np.asarray((res.at_sample(j, "prefill") + res.at_sample(j, "decoded")).astype(float))
        return res.at_sample(j).astype(float)

    times = res.times
    k = _index_at(res, t)
    if times[k] == t or k == 0:
        return at(k)
    if t > times[-1]:
        return at(times.size - 1)
    t0, t1 = times[k - 1], times[k]
    a = (t - t0) / (t1 - t0)
    v0 = at(k - 1)
    return np.asarray(v0 + a * (at(k) - v0))


def _window(res: RunResult, t0: int | None, t1: int | None) -> slice:
    lo = 0 if t0 is None else _index_at(res, t0)
    hi = res.times.size if t1 is None else int(np.searchsorted(res.times, t1, side="right"))
    return slice(lo, hi)


def drift_set(res: RunResult, t0: int | None = None, t1: int | None = None) -> tuple[list[int], int]:
    """``(F, j0)``: the flows backlogged for the whole window ``[t0, t1]`` (see the module
    docstring) and the sample from which all of them are (-1 if ``F`` is empty)."""
    sl = _window(res, t0, t1)
    lo, hi = sl.start, sl.stop
    F: list[int] = []
    j0 = -1
    for f in range(len(res.flows)):
        e = res.flow_log(f)
        if e.size == 0:
            continue
        k = res.log_k[e]
        busy = (res.log_wait[e] + res.log_n[e]) > 0
        # the state at `lo` is the last entry at or before it; entries after it up to hi-1
        first = int(np.searchsorted(k, lo, side="right")) - 1
        inside = int(np.searchsorted(k, hi, side="left"))
        seg_k = k[max(first, 0):inside]
        seg_b = busy[max(first, 0):inside]
        if seg_k.size == 0:
            continue
        on = np.flatnonzero(seg_b)
        if on.size == 0:
            continue
        start_e = int(on[0])
        if not seg_b[start_e:].all():
            continue  # it went idle after it first had work
        F.append(f)
        j0 = max(j0, max(int(seg_k[start_e]), lo))
    return F, j0


def drift_curve(res: RunResult, t0: int | None = None, t1: int | None = None,
                charged: bool = False) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """``(times, gap, F)``: per sample from the start of the measured window, the gap
    ``max_{f in F} W_f/w_f - min_{f in F} W_f/w_f`` of service accumulated since it
    (``charged``: of the estimated cost of started requests)."""
    F, j0 = drift_set(res, t0, t1)
    hi = _window(res, t0, t1).stop
    if len(F) < 2:
        return res.times[:0], np.zeros(0), F
    what = "charged" if charged else "service"
    hi_v = lo_v = None
    for f in F:
        x = res.series(f, what, j0, hi).astype(float) / res.flows[f].weight
        x -= x[0]
        if hi_v is None or lo_v is None:
            hi_v, lo_v = x.copy(), x.copy()
        else:
            np.maximum(hi_v, x, out=hi_v)
            np.minimum(lo_v, x, out=lo_v)
    assert hi_v is not None and lo_v is not None
    return res.times[j0:hi], hi_v - lo_v, F


def max_drift(res: RunResult, t0: int | None = None, t1: int | None = None, charged: bool = False) -> float:
    """The max drift (docs/simulator.md §4) over the window ``[t0, t1]`` (see the module docstring); 0 if
    fewer than two flows are backlogged for the whole window. ``charged``: of the estimated
    cost of started requests instead of the service delivered."""
    _, gap, _ = drift_curve(res, t0, t1, charged)
    return float(gap.max()) if gap.size else 0.0


def max_interval_drift(res: RunResult, t0: int | None = None, t1: int | None = None, charged: bool = False,
                       busy: bool = True, max_flows: int = 64) -> float | None:
    """The interval drift (see the module docstring) over samples in ``[t0, t1]``; 0 if no
    two flows were ever backlogged together, ``None`` with more than ``max_flows`` flows.
    ``busy=False``: backlogged means waiting at the balancer."""
    nf = len(res.flows)
    if nf > max_flows:
        return None
    sl = _window(res, t0, t1)
    W = (res.charged if charged else res.service)[sl] / res.weights
    BL = (res.busy if busy else res.backlog)[sl]
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
    """Jain's index of the normalised service rates of flows while backlogged. Computed
    from the log: each entry's state holds from its sample to the flow's next entry."""
    sl = _window(res, t0, t1)
    lo, last = sl.start, sl.stop - 1
    times = res.times
    if last - lo < 1:
        return None
    nf = len(res.flows)
    o = res._order
    K, F = res.log_k[o], res.log_flow[o]
    pre, done, n, sa, wait = res.log_pre[o], res.log_done[o], res.log_n[o], res.log_sa[o], res.log_wait[o]
    has_next = np.zeros(K.size, dtype=bool)
    has_next[:-1] = F[1:] == F[:-1]
    nxt = np.minimum(np.arange(K.size) + 1, max(K.size - 1, 0))
    k_next = np.where(has_next, K[nxt], last)
    s_ = np.maximum(K, lo)
    u = np.minimum(k_next, last)
    ok = s_ < u
    if not ok.any():
        return None
    w_p, w_q = res.w_p, res.w_q

    def value(i: np.ndarray, j: np.ndarray) -> np.ndarray:  # entry i's service at sample j
        return np.asarray(w_p * pre[i] + w_q * (done[i] + n[i] * times[j] - sa[i]))

    idx = np.arange(K.size)
    W_s = value(idx, s_)
    W_u = np.where(has_next & (u == k_next), value(nxt, u), value(idx, u))
    bl = ok & ((wait + n) > 0)
    t_bl = np.bincount(F[bl], weights=(times[u] - times[s_])[bl].astype(float), minlength=nf)
    w_bl = np.bincount(F[bl], weights=(W_u - W_s)[bl], minlength=nf)
    span = float(times[last] - times[lo])
    keep = (t_bl >= min_frac * span) & (t_bl > 0)
    if keep.sum() < 2:
        return None
    x = w_bl[keep] / res.weights[keep] / t_bl[keep]
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
    return np.asarray(np.where(started >= 0, started, res.end) - arr)


def wait_quantiles(res: RunResult, flow: int | None = None, qs: Sequence[float] = (50, 95, 99)) -> list[float | None]:
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


def flow_summary(res: RunResult) -> dict[str, dict[str, Any]]:
    """Per flow: weight, service (weighted tokens), est_cost, submitted, started,
    completed, rejected, waiting at the end, and wait p50/p95/p99 (steps)."""
    out: dict[str, dict[str, Any]] = {}
    nf = len(res.flows)
    end_service = res.final_service()
    arrived = res.arrival < res.end
    fl = res.flow

    def count(mask: np.ndarray) -> np.ndarray:
        return np.bincount(fl[mask], minlength=nf)

    started = arrived & (res.admit >= 0)
    est = np.bincount(fl[started], weights=res.est[started], minlength=nf)
    submitted = count(arrived)
    n_started = count(started)
    completed = count(arrived & (res.finish >= 0))
    n_rejected = count(arrived & res.rejected)
    n_waiting = count(arrived & ~res.rejected & (res.admit < 0))
    # waits grouped by flow (the same requests as waits(res, f))
    m = arrived & ~res.rejected
    w = np.where(res.admit[m] >= 0, res.admit[m], res.end) - res.arrival[m]
    wf = fl[m]
    order = np.argsort(wf, kind="stable")
    bounds = np.searchsorted(wf[order], np.arange(nf + 1))
    for f, spec in enumerate(res.flows):
        wk = w[order[bounds[f]:bounds[f + 1]]]
        qs: list[float | None] = [float(x) for x in np.percentile(wk, (50, 95, 99))] if wk.size else [None] * 3
        out[spec.name] = {
            "weight": spec.weight,
            "service": float(end_service[f]),
            "est_cost": float(est[f]),
            "submitted": int(submitted[f]),
            "started": int(n_started[f]),
            "completed": int(completed[f]),
            "rejected": int(n_rejected[f]),
            "waiting": int(n_waiting[f]),
            "wait_p50": qs[0],
            "wait_p95": qs[1],
            "wait_p99": qs[2],
        }
    return out
