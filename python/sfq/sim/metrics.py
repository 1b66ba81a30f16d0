"""Metrics over a :class:`~sfq.sim.engine.RunResult`.

Definitions (units: steps and weighted tokens ``W = w_p * prompt + w_q * generated``;
docs/simulator.md §4 is the reference). A flow is **backlogged in step** ``t`` when it has a
request waiting at the balancer (arrived, not started) at some moment of the step: at any
sample taken at ``t`` (after that step's arrivals, or after its admissions), or, between
events, at the last sample before ``t``. It is **busy** while it has work waiting *or
running* (``RunResult.busy``).

* **service** of a flow: ``W`` delivered (prefill at admission, decode as generated);
  ``est_cost``: the sum of the estimates of its requests that started.
* **max drift** (``max_drift``): for every pair of flows ``f, g`` and every maximal run of
  consecutive steps ``a .. b`` in each of which both are backlogged, the largest
  ``|W_f(t1,t2)/w_f - W_g(t1,t2)/w_g|`` for ``a <= t1 < t2 <= b + 1``; the maximum over
  pairs and runs. Service is linear between samples, so the gap peaks at a sample or at a
  step boundary (``t + 1`` after the last sample of step ``t``, added where the next sample
  is later): per pair, per run, the spread of the gap over those points. A flow whose only
  request started has nothing waiting until its next one arrives; a closed-loop client that
  tops up every step is backlogged in every step, so the run does not break between its
  requests. Pairwise: ``None`` above ``max_flows`` flows. With ``charged=True`` it is taken
  on the *estimated cost charged* (``max_drift_est``), the quantity the bound of
  docs/design.md §3.2 is about.
* **drift from the start** (``max_drift_from_start``, the earlier form): ``max_t
  max_{f,g in F} |W_f(t0,t)/w_f - W_g(t0,t)/w_g|`` over the flows ``F`` busy for the whole
  window, from the sample from which all of them are. It is 0 when fewer than two flows stay
  busy throughout (FIFO on a run where one client's queue once drains) and it counts a flow
  with work running but nothing waiting as backlogged; kept for comparison only.
* **busy interval drift** (``max_interval_drift``): the interval form over samples,
  restarting whenever either flow of a pair has nothing waiting *or running*
  (``busy=False``: nothing waiting at the sample). It counts a client below its share whose
  requests run long as backlogged, so fair policies show a large gap for it.
* **Jain's index** among busy flows: of each flow's weight-normalised service rate while
  it was busy, over the flows busy at least 10% of the window; ``None`` with fewer than two.
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
    "max_drift_from_start",
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
    """``(F, j0)``: the flows busy for the whole window ``[t0, t1]`` (from their first busy
    sample in it; the drift from the start, see the module docstring) and the sample from
    which all of them are (-1 if ``F`` is empty)."""
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
    """The drift from the start, per sample. ``(times, gap, F)``: from the start of the measured window, the gap
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


def max_drift_from_start(res: RunResult, t0: int | None = None, t1: int | None = None,
                         charged: bool = False) -> float:
    """The drift from the start (the earlier form of the max drift; see the module docstring)
    over the window ``[t0, t1]``; 0 if fewer than two flows are busy for the whole window.
    ``charged``: of the estimated cost of started requests instead of the service delivered."""
    _, gap, _ = drift_curve(res, t0, t1, charged)
    return float(gap.max()) if gap.size else 0.0


def _pair_spread(X: np.ndarray, B: np.ndarray) -> float:
    """The largest spread (max minus min) of ``X[:, i] - X[:, j]`` over the points of one run
    of consecutive segments in which both ``i`` and ``j`` are backlogged, over every pair.

    ``X``: points x flows, values linear between consecutive points; ``B[p, f]``: flow ``f``
    is backlogged on the segment from point ``p`` to ``p + 1`` (the last row is ignored). A
    run of segments covers its points from the start of its first segment to the end of its
    last one; a gap of linear functions peaks at a point, so the points suffice."""
    B = B.copy()
    if B.shape[0]:
        B[-1] = False  # the last point starts no segment
    cols = np.flatnonzero(B.any(axis=0))
    best = 0.0
    for a, i in enumerate(cols):
        bi = B[:, i]
        for j in cols[a + 1:]:
            seg = bi & B[:, j]
            if not seg.any():
                continue
            on = seg.copy()
            on[1:] |= seg[:-1]  # a segment's end point belongs to its run
            pts = np.flatnonzero(on)
            starts = seg & ~np.concatenate(([False], seg[:-1]))
            gstart = np.flatnonzero(starts[pts])
            vals = X[pts, i] - X[pts, j]
            spread = np.maximum.reduceat(vals, gstart) - np.minimum.reduceat(vals, gstart)
            best = max(best, float(spread.max()))
    return best


def _step_timeline(res: RunResult, t0: int | None, t1: int | None,
                   what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(X, B)`` for :func:`_pair_spread` on the step timeline of :func:`max_drift`.

    Points: every sample, plus a virtual point at ``t + 1`` after the last sample at step
    ``t`` when the next sample is later (and at ``t0``/``t1`` inside a gap), its value
    interpolated (service is linear between samples). A segment starting at a sample of
    step ``t`` lies in step ``t``: the flow is backlogged on it if it had a request waiting
    at the balancer at any sample of step ``t``. A segment starting at a virtual point lies
    in the steps up to the next sample, where nothing changes: backlogged if the flow had a
    request waiting at the last sample before it. Only segments of steps in ``[t0, t1)``."""
    times = res.times.astype(np.int64)
    T = times.size
    X0 = (res.charged if what == "charged" else res.service).astype(float) / res.weights
    wait = res.backlog  # requests waiting at the balancer, per sample
    if T == 0:
        return X0, wait
    # samples of one step: any of them with a request waiting makes the step backlogged
    first = np.concatenate(([True], times[1:] != times[:-1]))
    group = np.cumsum(first) - 1
    any_wait = np.maximum.reduceat(wait, np.flatnonzero(first), axis=0)[group]
    # virtual points inside the gaps between samples
    vk: list[np.ndarray] = []
    vt: list[np.ndarray] = []
    gaps = np.flatnonzero(times[1:] > times[:-1] + 1)
    vk.append(gaps)
    vt.append(times[gaps] + 1)
    for w in (t0, t1):
        if w is None:
            continue
        k = int(np.searchsorted(times, w, side="left")) - 1
        if 0 <= k < T - 1 and times[k] + 1 < w < times[k + 1]:
            vk.append(np.array([k]))
            vt.append(np.array([w], dtype=np.int64))
    k_v = np.concatenate(vk).astype(np.int64)
    t_v = np.concatenate(vt).astype(np.int64)
    # all points in time order (a virtual point lies strictly between two samples' times)
    p_time = np.concatenate((times, t_v))
    p_src = np.concatenate((np.arange(T), k_v))
    p_virt = np.concatenate((np.zeros(T, dtype=bool), np.ones(k_v.size, dtype=bool)))
    order = np.lexsort((p_virt, p_src, p_time))
    p_time, p_src, p_virt = p_time[order], p_src[order], p_virt[order]
    nxt = np.minimum(p_src + 1, T - 1)
    span = (times[nxt] - times[p_src]).astype(float)
    frac = np.where(p_virt & (span > 0), (p_time - times[p_src]) / np.where(span > 0, span, 1.0), 0.0)
    X = X0[p_src] + frac[:, None] * (X0[nxt] - X0[p_src])
    B = np.where(p_virt[:, None], wait[p_src], any_wait[p_src]).astype(bool)
    keep = np.ones(p_time.size, dtype=bool)
    if t0 is not None:
        keep &= p_time >= t0
    if t1 is not None:
        keep &= p_time < t1
    B &= keep[:, None]
    return X, B


def max_drift(res: RunResult, t0: int | None = None, t1: int | None = None, charged: bool = False,
              max_flows: int = 64) -> float | None:
    """The max drift (docs/simulator.md §4): the largest ``|W_f(a,b)/w_f - W_g(a,b)/w_g|``
    over pairs ``f, g`` and times ``a < b`` inside one run of consecutive steps in each of which
    both had a request waiting at the balancer, within the steps ``[t0, t1)``. ``charged``: of
    the estimated cost of started requests instead of the service delivered. 0 if no two
    flows ever waited in the same step; ``None`` with more than ``max_flows`` flows (it is
    pairwise)."""
    if len(res.flows) > max_flows:
        return None
    X, B = _step_timeline(res, t0, t1, "charged" if charged else "service")
    return _pair_spread(X, B)


def max_interval_drift(res: RunResult, t0: int | None = None, t1: int | None = None, charged: bool = False,
                       busy: bool = True, max_flows: int = 64) -> float | None:
    """The busy interval drift (see the module docstring) over samples in ``[t0, t1]``: the
    gap restarting whenever either flow of a pair has nothing waiting *or running*
    (``busy=False``: nothing waiting at a sample); 0 if no two flows were ever busy
    together, ``None`` with more than ``max_flows`` flows."""
    nf = len(res.flows)
    if nf > max_flows:
        return None
    sl = _window(res, t0, t1)
    W = (res.charged if charged else res.service)[sl] / res.weights
    BL = (res.busy if busy else res.backlog)[sl]
    return _pair_spread(W, BL)


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
