"""A deterministic discrete-event model of a fleet of continuous-batching engines.

The model (the setting of VTC, Sheng et al., OSDI 2024, extended to a fleet)
-----------------------------------------------------
* ``servers`` engines, each with a KV budget of ``kv_budget`` tokens and at most
  ``max_batch`` running requests (``None``: limited by KV only).
* One **step** is one decode iteration. At the start of step ``t``: requests finished by
  ``t`` leave; requests arriving at ``t`` join the balancer's queue; then, while some
  server has room (a free slot and free KV), the policy names the next request
  (``peek``), the balancer places it on the server with the most free KV, and the policy
  is told it started (``admit``). When the named request does not fit there, admission
  stops until something leaves (the balancer stalls, docs/design.md §5). Then every running
  request generates one token.
* A request admitted with prompt ``p`` occupies ``p + generated`` tokens; it is admitted
  when ``occupancy + p <= kv_budget`` (as in VTC's setting: decode growth is not reserved, no
  preemption), generates its ``output`` tokens in the steps ``admit .. admit+output-1``
  and is gone at step ``admit + output``.
* Service of a flow is ``W = w_p * prompt tokens admitted + w_q * tokens generated``:
  prefill counts at admission, decode as it happens (docs/simulator.md §2). Throughput is what the
  fleet delivered, in weighted tokens per step; nothing about it is assumed.

* Closed-loop clients (``Workload.closed``) top their flow's waiting requests up to
  their ``keep`` at the start of every step of their window (after arrivals).

Event-driven, exactly
---------------------
Between two events (an arrival, a completion, a closed-loop top-up, a policy wake-up, a
mark) free KV only shrinks and the queue does not change, so the request a policy names
can start only at an event, *provided the policy's choice cannot change between events*.
That holds for the balancer-side policies whose order moves only when something is
admitted or completes. It does not hold for policies whose counters move with decode
(lcf, vtc, and sfq charging service as it is delivered): there the stalled policy's
``wakeup`` returns the first step at which another waiting flow could overtake the one it
names (a lower bound; vtc-h: the next step), so the loop re-asks exactly then. The loop
jumps from event to event and advances decode in bulk; per flow it keeps the number of
running requests, their prompt sum and admit-step sum, so the generated tokens at any
step are ``sum(t - admit)`` in O(1). ``tests/sim/test_sim_engine.py`` checks the result
against stepping one step at a time and against a stepped transcription of VTC's admission loop.

Cost per event
--------------
The run records, at every event, only the flows whose state changed there (an arrival,
an admission or a completion), so an event costs the same however many flows are idle;
:class:`RunResult` rebuilds any flow's series from that log.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .estimate import Estimator, RatioEstimator
from .model import FlowSpec, Request, Workload

if TYPE_CHECKING:
    from .policies import Policy

__all__ = ["Fleet", "RunResult", "Simulation", "simulate"]


@dataclass(frozen=True)
class Fleet:
    """``servers`` engines with ``kv_budget`` tokens of KV each and at most ``max_batch``
    running requests each (``None``: no limit but KV)."""

    servers: int = 1
    kv_budget: int = 8192
    max_batch: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) or self.servers < 1:
            raise ValueError(f"servers must be an int >= 1, got {self.servers!r}")
        if isinstance(self.kv_budget, bool) or not isinstance(self.kv_budget, int) or self.kv_budget < 1:
            raise ValueError(f"kv_budget must be an int >= 1 (tokens), got {self.kv_budget!r}")
        if self.max_batch is not None and (
            isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1
        ):
            raise ValueError(f"max_batch must be None or an int >= 1, got {self.max_batch!r}")


@dataclass
class RunResult:
    """What one run recorded.

    Samples: ``times`` (steps); two samples per event, one before admission (the
    admission jump follows) and one after (decode follows). Per flow, a **log** of its
    state at the samples where it changed (``log_k`` the sample index, ``log_flow``), each
    entry holding the state from that sample until the flow's next entry: cumulative
    prefill tokens ``log_pre``, decoded tokens of finished requests ``log_done``, running
    requests ``log_n`` and the sum of their admit steps ``log_sa`` (decoded tokens at a
    sample at step ``t``: ``done + n * t - sa``), requests waiting at the balancer
    ``log_wait``, and ``log_charged``: the estimated cost of the flow's started requests
    (what the balancer-side policies order by). Dense per-sample arrays (``prefill``,
    ``decoded``, ``service``, ``backlog``, ``busy``, ``charged``; shape (samples, flows))
    are built on demand; :meth:`series` builds one flow's.
    Requests (index ``rid``): ``arrival``, ``admit`` (-1: never started), ``finish`` (-1:
    not finished), ``flow``, ``prompt``, ``output``, ``est``, ``server``; ``rejected``
    marks requests whose prompt exceeds the KV budget (they can never run; rejected on
    arrival). Closed-loop requests follow the workload's, numbered in the order made.
    """

    policy: str
    flows: tuple[FlowSpec, ...]
    fleet: Fleet
    w_p: float
    w_q: float
    end: int
    times: np.ndarray
    log_k: np.ndarray
    log_flow: np.ndarray
    log_pre: np.ndarray
    log_done: np.ndarray
    log_n: np.ndarray
    log_sa: np.ndarray
    log_wait: np.ndarray
    log_charged: np.ndarray
    arrival: np.ndarray
    admit: np.ndarray
    finish: np.ndarray
    flow: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    est: np.ndarray
    server: np.ndarray  # the server it ran on, -1 if it never started
    rejected: np.ndarray  # bool per request
    events: int
    _dense: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        nf = len(self.flows)
        order = np.argsort(self.log_flow, kind="stable")  # by flow, then sample
        self._order = order
        self._bounds = np.searchsorted(self.log_flow[order], np.arange(nf + 1), side="left")

    @classmethod
    def from_dense(cls, policy: str, flows: Sequence[FlowSpec], fleet: Fleet, w_p: float, w_q: float, end: int,
                   times: Any, prefill: Any, decoded: Any, waiting: Any, running: Any | None = None,
                   charged: Any | None = None, **requests: Any) -> "RunResult":
        """A record from dense per-sample arrays (shape (samples, flows)); service between
        samples is linear. For tests of the metrics; ``requests``: the request arrays."""
        times = np.asarray(times, dtype=np.int64)
        pre = np.asarray(prefill, dtype=np.int64)
        dec = np.asarray(decoded, dtype=np.int64)
        wait = np.asarray(waiting, dtype=np.int64)
        run = np.zeros_like(wait) if running is None else np.asarray(running, dtype=np.int64)
        ch = pre.astype(float) if charged is None else np.asarray(charged, dtype=float)
        T, nf = pre.shape
        k = np.repeat(np.arange(T), nf)
        fl = np.tile(np.arange(nf), T)
        sa = (run * times[:, None]).ravel()  # done + n*t - sa == decoded at every sample
        return cls(policy, tuple(flows), fleet, w_p, w_q, end, times, k, fl, pre.ravel(), dec.ravel(), run.ravel(), sa,
                   wait.ravel(), ch.ravel(), **requests)

    # ------------------------------------------------------------------ per flow
    def flow_log(self, f: int) -> np.ndarray:
        """Indices into the ``log_*`` arrays of flow ``f``'s entries, in sample order."""
        return self._order[self._bounds[f]:self._bounds[f + 1]]

    def series(self, f: int, what: str = "service", lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Flow ``f``'s ``what`` at samples ``lo .. hi-1``: ``service`` (weighted tokens),
        ``prefill``, ``decoded``, ``charged``, ``waiting``, ``running``, ``busy`` (waiting
        or running, bool) or ``backlog`` (waiting, bool)."""
        hi = self.times.size if hi is None else hi
        e = self.flow_log(f)
        j = np.arange(lo, hi)
        if e.size == 0:  # nothing ever happened to the flow
            zero = np.zeros(j.size, dtype=bool if what in ("busy", "backlog") else np.int64)
            if what not in ("busy", "backlog", "charged", "service"):
                self._check_what(what)
            return zero.astype(float) if what in ("charged", "service") else zero
        idx = np.searchsorted(self.log_k[e], j, side="right") - 1
        has = idx >= 0
        src = e[np.where(has, idx, 0)]

        def col(arr: np.ndarray, dtype: Any = np.int64) -> np.ndarray:
            return np.where(has, arr[src], 0).astype(dtype)

        if what in ("service", "decoded", "prefill"):
            pre = col(self.log_pre)
            dec: np.ndarray = col(self.log_done) + col(self.log_n) * self.times[lo:hi] - col(self.log_sa)
            if what == "prefill":
                return pre
            if what == "decoded":
                return dec
            return self.w_p * pre + self.w_q * dec
        if what == "charged":
            return col(self.log_charged, float)
        if what == "waiting":
            return col(self.log_wait)
        if what == "running":
            return col(self.log_n)
        if what == "backlog":
            return col(self.log_wait) > 0
        if what == "busy":
            return np.asarray((col(self.log_wait) + col(self.log_n)) > 0)
        self._check_what(what)
        raise AssertionError  # pragma: no cover - _check_what raised

    _SERIES = ("service", "prefill", "decoded", "charged", "waiting", "running", "busy", "backlog")

    def _check_what(self, what: str) -> None:
        if what not in self._SERIES:
            raise ValueError(f"unknown series {what!r}; choose from {', '.join(self._SERIES)}")

    def at_sample(self, j: int, what: str = "service") -> np.ndarray:
        """Every flow's ``what`` (see :meth:`series`) at sample ``j``, shape (flows,)."""
        nf = len(self.flows)
        m = self.log_k <= j
        last = np.full(nf, -1, dtype=np.int64)
        idx = np.flatnonzero(m)
        last[self.log_flow[idx]] = idx  # entries are in sample order: the last one wins
        has = last >= 0
        src = np.where(has, last, 0)

        def col(arr: np.ndarray, dtype: Any = np.int64) -> np.ndarray:
            return np.where(has, arr[src], 0).astype(dtype)

        if what == "charged":
            return col(self.log_charged, float)
        if what == "busy":
            return np.asarray((col(self.log_wait) + col(self.log_n)) > 0)
        pre = col(self.log_pre)
        dec: np.ndarray = col(self.log_done) + col(self.log_n) * int(self.times[j]) - col(self.log_sa)
        if what == "prefill":
            return pre
        if what == "decoded":
            return dec
        if what == "service":
            return self.w_p * pre + self.w_q * dec
        raise ValueError(f"unknown quantity {what!r}")

    def final_service(self) -> np.ndarray:
        """Weighted tokens per flow at the end of the run."""
        return self.at_sample(self.times.size - 1)

    # ------------------------------------------------------------------ dense views
    def _dense_of(self, what: str) -> np.ndarray:
        if what not in self._dense:
            cols = [self.series(f, what) for f in range(len(self.flows))]
            self._dense[what] = np.stack(cols, axis=1) if cols else np.zeros((self.times.size, 0))
        return self._dense[what]

    @property
    def prefill(self) -> np.ndarray:
        return self._dense_of("prefill")

    @property
    def decoded(self) -> np.ndarray:
        return self._dense_of("decoded")

    @property
    def backlog(self) -> np.ndarray:
        """A request of the flow waiting at the balancer at the sample."""
        return self._dense_of("backlog")

    @property
    def busy(self) -> np.ndarray:
        """The flow has work waiting or running at the sample."""
        return self._dense_of("busy")

    @property
    def charged(self) -> np.ndarray:
        return self._dense_of("charged")

    @property
    def service(self) -> np.ndarray:
        """Weighted tokens per flow at each sample, shape (samples, flows)."""
        return self._dense_of("service")

    @property
    def weights(self) -> np.ndarray:
        return np.array([f.weight for f in self.flows], dtype=float)


class Simulation:
    """One run of ``policy`` on ``workload`` over ``fleet``.

    ``horizon``: stop at this step (``None``: when every request is done; a workload with
    closed-loop clients that never end needs one). ``marks``: extra steps at which to
    take samples (so windowed metrics are exact there). ``estimator``: the cost estimate
    stamped on each request at arrival (``Request.est``; a policy with
    ``estimate_at_arrival = False`` estimates it itself, through :meth:`estimate`); it
    is told every completion. ``progress(t)`` is called now and then with the step.
    """

    def __init__(
        self,
        workload: Workload,
        policy: Any,
        fleet: Fleet = Fleet(),
        w_p: float = 1.0,
        w_q: float = 2.0,
        horizon: int | None = None,
        marks: Sequence[int] = (),
        estimator: Estimator | None = None,
        progress: Callable[[int], None] | None = None,
    ):
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
            raise ValueError(f"horizon must be None or an int >= 1 (steps), got {horizon!r}")
        for name, v in (("w_p", w_p), ("w_q", w_q)):
            if not (v >= 0.0) or v == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if horizon is None and any(c.end is None for c in workload.closed):
            raise ValueError("a closed-loop client without an end needs a horizon")
        for c in workload.closed:
            if c.prompt[1] > fleet.kv_budget:
                raise ValueError(f"closed-loop client of flow {workload.flows[c.flow].name!r}: prompts up to "
                                 f"{c.prompt[1]} tokens exceed the KV budget {fleet.kv_budget}")
        self.workload = workload
        self.flows = workload.flows
        self.policy = policy
        self.fleet = fleet
        self.w_p = float(w_p)
        self.w_q = float(w_q)
        self.horizon = horizon
        self.marks = sorted({int(m) for m in marks if m >= 0})
        self.estimator = estimator if estimator is not None else RatioEstimator(w_p, w_q)
        self.progress = progress
        nf = len(self.flows)
        # per-flow aggregates of running requests; policies may read them (VTC does)
        self.running = [0] * nf  # running requests
        self.running_prompt = [0] * nf  # sum of their prompts (tokens)
        self.running_admit = [0] * nf  # sum of their admit steps
        self.running_flows: set[int] = set()  # flows with a running request
        self.waiting = [0] * nf  # requests at the balancer (arrived, not started)
        self._ran = False

    def estimate(self, r: Request) -> float:
        """The estimator's cost of ``r`` now (weighted tokens)."""
        return float(self.estimator.estimate(r))

    def run(self) -> RunResult:
        """Run to the horizon (or until nothing is left). A Simulation runs once: the
        policy and the estimator carry state, so make a new one for another run."""
        if self._ran:
            raise RuntimeError("this Simulation has already run; create a new one (with a fresh policy)")
        self._ran = True
        reqs = self.workload.requests()
        policy = self.policy
        est = self.estimator
        stamp = getattr(policy, "estimate_at_arrival", True)
        nf = len(self.flows)
        S = self.fleet.servers
        M = self.fleet.kv_budget
        B = self.fleet.max_batch if self.fleet.max_batch is not None else (1 << 62)
        n_f, sp_f, sa_f, waiting = self.running, self.running_prompt, self.running_admit, self.waiting
        running_flows = self.running_flows
        done_dec = [0] * nf
        pre = [0] * nf
        charged = [0.0] * nf  # estimated cost of started requests
        heaps: list[list[Any]] = [[] for _ in range(S)]
        s_n = [0] * S
        s_p = [0] * S
        s_a = [0] * S
        N = len(reqs)
        rejected: list[int] = []
        closed = [(c, c.sizes()) for c in self.workload.closed]
        policy.bind(self)

        times: list[int] = []
        # the log: one entry per flow whose state changed since the last sample
        lk: list[int] = []
        lf: list[int] = []
        lpre: list[int] = []
        ldone: list[int] = []
        ln: list[int] = []
        lsa: list[int] = []
        lw: list[int] = []
        lc: list[float] = []
        dirty: list[int] = []
        is_dirty = [False] * nf

        def sample(t: int) -> None:
            k = len(times)
            times.append(t)
            for f in dirty:
                lk.append(k)
                lf.append(f)
                lpre.append(pre[f])
                ldone.append(done_dec[f])
                ln.append(n_f[f])
                lsa.append(sa_f[f])
                lw.append(waiting[f])
                lc.append(charged[f])
                is_dirty[f] = False
            dirty.clear()

        marks = list(self.marks)
        horizon = self.horizon
        progress = self.progress
        i = 0
        t = 0
        seq = 0
        events = 0
        heappop, heappush = heapq.heappop, heapq.heappush
        while True:
            events += 1
            if progress is not None and not events & 1023:
                progress(t)
            # 1. completions (the policy hears of one before the running aggregates change)
            for s in range(S):
                h = heaps[s]
                while h and h[0][0] <= t:
                    fin, _, r = heappop(h)
                    f = r.flow
                    r.finish = fin
                    policy.complete(r, t)
                    s_n[s] -= 1
                    s_p[s] -= r.prompt
                    s_a[s] -= r.admit
                    n_f[f] -= 1
                    sp_f[f] -= r.prompt
                    sa_f[f] -= r.admit
                    done_dec[f] += r.output
                    if not n_f[f]:
                        running_flows.discard(f)
                    est.observe(r)
                    if not is_dirty[f]:
                        is_dirty[f] = True
                        dirty.append(f)
            if horizon is not None and t >= horizon:
                sample(t)
                break
            # 2. arrivals, then closed-loop clients top up to their `keep`
            while i < N and reqs[i].arrival <= t:
                r = reqs[i]
                i += 1
                if r.prompt > M:  # can never be placed: rejected, with the reason in the report
                    rejected.append(r.rid)
                    continue
                r.seq = seq
                seq += 1
                if stamp:
                    r.est = est.estimate(r)
                f = r.flow
                waiting[f] += 1
                if not is_dirty[f]:
                    is_dirty[f] = True
                    dirty.append(f)
                policy.arrive(r, t)
            for c, sizes in closed:
                f = c.flow
                if c.active(t) and waiting[f] < c.keep:
                    while waiting[f] < c.keep:
                        p, o = next(sizes)
                        r = Request(len(reqs), f, t, p, o, c.cap)
                        reqs.append(r)
                        r.seq = seq
                        seq += 1
                        if stamp:
                            r.est = est.estimate(r)
                        waiting[f] += 1
                        policy.arrive(r, t)
                    if not is_dirty[f]:
                        is_dirty[f] = True
                        dirty.append(f)
            sample(t)
            # 3. admission: the policy names, the balancer places, or stalls
            while True:
                # the balancer asks for the next request only while some server has room
                # (a free slot and free KV), as a real dispatcher does
                best = -1
                best_free = 0
                for s in range(S):
                    if s_n[s] < B:
                        free = M - (s_p[s] + s_n[s] * t - s_a[s])
                        if free > best_free:
                            best, best_free = s, free
                if best < 0:
                    break
                r = policy.peek(t)
                if r is None:
                    break
                p = r.prompt
                if p > best_free:
                    break  # the named request fits nowhere yet: stall until something leaves
                policy.admit(r, t)
                f = r.flow
                waiting[f] -= 1
                r.admit = t
                r.server = best
                s_n[best] += 1
                s_p[best] += p
                s_a[best] += t
                n_f[f] += 1
                sp_f[f] += p
                sa_f[f] += t
                running_flows.add(f)
                pre[f] += p
                charged[f] += r.est
                if not is_dirty[f]:
                    is_dirty[f] = True
                    dirty.append(f)
                heappush(heaps[best], (t + r.output, r.rid, r))
            sample(t)
            # 4. the next event
            nxt = reqs[i].arrival if i < N else None
            for h in heaps:
                if h and (nxt is None or h[0][0] < nxt):
                    nxt = h[0][0]
            for c, _ in closed:
                # the next top-up: next step if it is short of its keep, else its start
                due = t + 1 if waiting[c.flow] < c.keep or c.start > t else None
                if due is not None:
                    due = max(due, c.start)
                    if (c.end is None or due < c.end) and (nxt is None or due < nxt):
                        nxt = due
            w = policy.wakeup(t)
            if w is not None and w > t and (nxt is None or w < nxt):
                nxt = w
            while marks and marks[0] <= t:
                marks.pop(0)
            if marks and (nxt is None or marks[0] < nxt):
                nxt = marks[0]
            if horizon is not None and (nxt is None or nxt > horizon):
                nxt = horizon
            if nxt is None:
                break  # nothing will ever happen again
            policy.advance(t, nxt)
            t = nxt
        if progress is not None:
            progress(t)

        n_req = len(reqs)
        rej = np.zeros(n_req, dtype=bool)
        rej[rejected] = True
        return RunResult(
            policy=getattr(policy, "label", policy.name),
            flows=self.flows,
            fleet=self.fleet,
            w_p=self.w_p,
            w_q=self.w_q,
            end=t,
            times=np.asarray(times, dtype=np.int64),
            log_k=np.asarray(lk, dtype=np.int64),
            log_flow=np.asarray(lf, dtype=np.int64),
            log_pre=np.asarray(lpre, dtype=np.int64),
            log_done=np.asarray(ldone, dtype=np.int64),
            log_n=np.asarray(ln, dtype=np.int64),
            log_sa=np.asarray(lsa, dtype=np.int64),
            log_wait=np.asarray(lw, dtype=np.int64),
            log_charged=np.asarray(lc, dtype=float),
            arrival=np.fromiter((r.arrival for r in reqs), dtype=np.int64, count=n_req),
            admit=np.fromiter((r.admit for r in reqs), dtype=np.int64, count=n_req),
            finish=np.fromiter((r.finish for r in reqs), dtype=np.int64, count=n_req),
            flow=np.fromiter((r.flow for r in reqs), dtype=np.int64, count=n_req),
            prompt=np.fromiter((r.prompt for r in reqs), dtype=np.int64, count=n_req),
            output=np.fromiter((r.output for r in reqs), dtype=np.int64, count=n_req),
            est=np.fromiter((r.est for r in reqs), dtype=float, count=n_req),
            server=np.fromiter((r.server for r in reqs), dtype=np.int64, count=n_req),
            rejected=rej,
            events=events,
        )


def simulate(workload: Workload, policy: Policy | str, fleet: Fleet = Fleet(), **kwargs: Any) -> RunResult:
    """Run ``policy`` (a :class:`~sfq.sim.policies.Policy` or a policy name) on ``workload``."""
    if isinstance(policy, str):
        from .policies import make_policy

        policy = make_policy(policy)
    return Simulation(workload, policy, fleet, **kwargs).run()
