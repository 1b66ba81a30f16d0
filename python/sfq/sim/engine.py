"""A deterministic discrete-event model of a fleet of continuous-batching engines.

The model (the setting of VTC, Sheng et al., OSDI 2024, extended to a fleet)
-----------------------------------------------------
* ``servers`` engines, each with a KV budget of ``kv_budget`` tokens and at most
  ``max_batch`` running requests (``None``: limited by KV only).
* One **step** is one decode iteration. At the start of step ``t``: requests finished by
  ``t`` leave; requests arriving at ``t`` join the balancer's queue; then, while some
  server has room (a free slot and free KV), the discipline starts the next request if it
  fits the server with the most free KV (``start(t, fits)``: the baselines name it with
  ``peek`` and are told with ``admit``; the request engine looks before it pops itself),
  and the balancer places it there. When the named request does not fit, admission stops
  until something leaves (the balancer stalls, docs/design.md §5). Then every running
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
Between two events (an arrival, a completion, a closed-loop top-up, a discipline's
wake-up, a mark) free KV only shrinks and the queue does not change, so the request a
discipline names can start only at an event, *provided its choice cannot change between
events*. That holds for the balancer-side disciplines whose order moves only when
something is admitted or completes. It does not hold for those whose counters move with
decode (lcf, vtc, and sfq charging service as it is delivered): there the stalled one's
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
    from .policies import Discipline

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


class _Log:
    """What a run records as it goes (see :class:`RunResult`): the sample times and, per
    sample, an entry for each flow whose state changed since the previous one."""

    def __init__(self, nflows: int) -> None:
        self.times: list[int] = []
        self.k: list[int] = []
        self.flow: list[int] = []
        self.pre: list[int] = []
        self.done: list[int] = []
        self.n: list[int] = []
        self.sa: list[int] = []
        self.wait: list[int] = []
        self.charged: list[float] = []
        self.dirty: list[int] = []
        self.is_dirty = [False] * nflows

    def touch(self, f: int) -> None:
        """Flow ``f``'s state changed: the next sample records it."""
        if not self.is_dirty[f]:
            self.is_dirty[f] = True
            self.dirty.append(f)

    def sample(self, t: int, sim: Simulation) -> None:
        k = len(self.times)
        self.times.append(t)
        pre, done, n, sa, wait, charged = (sim.prefilled, sim.decoded_done, sim.running, sim.running_admit,
                                           sim.waiting, sim.charged)
        for f in self.dirty:
            self.k.append(k)
            self.flow.append(f)
            self.pre.append(pre[f])
            self.done.append(done[f])
            self.n.append(n[f])
            self.sa.append(sa[f])
            self.wait.append(wait[f])
            self.charged.append(charged[f])
            self.is_dirty[f] = False
        self.dirty.clear()


class Simulation:
    """One run of ``policy`` (a discipline, :mod:`sfq.sim.policies`) on ``workload`` over ``fleet``.

    ``horizon``: stop at this step (``None``: when every request is done; a workload with
    closed-loop clients that never end needs one). ``marks``: extra steps at which to
    take samples (so windowed metrics are exact there). ``estimator``: the cost estimate
    stamped on each request at arrival (``Request.est``; a discipline with
    ``estimate_at_arrival = False`` estimates it itself, through :meth:`estimate`); it
    is told every completion (unless the discipline ``calibrates`` it itself).
    ``progress(t)`` is called now and then with the step.

    Each step of the loop (docs/simulator.md §2) is one method: :meth:`_complete`,
    :meth:`_arrive`, :meth:`_top_up`, :meth:`_admit`, :meth:`_next_event`.
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
        # per-flow aggregates of running requests; disciplines may read them (VTC does)
        self.running = [0] * nf  # running requests
        self.running_prompt = [0] * nf  # sum of their prompts (tokens)
        self.running_admit = [0] * nf  # sum of their admit steps
        self.running_flows: set[int] = set()  # flows with a running request
        self.waiting = [0] * nf  # requests at the balancer (arrived, not started)
        self.prefilled = [0] * nf  # prompt tokens of started requests
        self.decoded_done = [0] * nf  # output tokens of finished requests
        self.charged = [0.0] * nf  # estimated cost of started requests
        S = fleet.servers
        self._heaps: list[list[Any]] = [[] for _ in range(S)]  # per server: (finish, rid, request)
        self._s_n = [0] * S  # per server: running requests, their prompt sum, their admit-step sum
        self._s_p = [0] * S
        self._s_a = [0] * S
        self._log = _Log(nf)
        self._ran = False

    def estimate(self, r: Request) -> float:
        """The estimator's cost of ``r`` now (weighted tokens)."""
        return float(self.estimator.estimate(r))

    def left(self, r: Request) -> None:
        """A discipline tells the run that ``r``, waiting at the balancer, left without
        starting (refused or dropped by the request engine): it no longer waits."""
        self.waiting[r.flow] -= 1
        self._log.touch(r.flow)

    def run(self) -> RunResult:
        """Run to the horizon (or until nothing is left). A Simulation runs once: the
        discipline and the estimator carry state, so make a new one for another run."""
        if self._ran:
            raise RuntimeError("this Simulation has already run; create a new one (with a fresh policy)")
        self._ran = True
        self._reqs = self.workload.requests()
        self._next_arrival = 0  # index into _reqs of the next arrival
        self._seq = 0
        self._rejected: list[int] = []
        self._closed = [(c, c.sizes()) for c in self.workload.closed]
        self._marks = list(self.marks)
        self._stamp = getattr(self.policy, "estimate_at_arrival", True)
        self._observe = not getattr(self.policy, "calibrates", False)
        self.policy.bind(self)
        log, horizon, progress = self._log, self.horizon, self.progress
        t = 0
        events = 0
        while True:
            events += 1
            if progress is not None and not events & 1023:
                progress(t)
            self._complete(t)
            if horizon is not None and t >= horizon:
                log.sample(t, self)
                break
            self._arrive(t)
            self._top_up(t)
            log.sample(t, self)
            self._admit(t)
            log.sample(t, self)
            nxt = self._next_event(t)
            if nxt is None:
                break  # nothing will ever happen again
            self.policy.advance(t, nxt)
            t = nxt
        if progress is not None:
            progress(t)
        return self._result(t, events)

    # ------------------------------------------------------------------ the steps
    def _complete(self, t: int) -> None:
        """Requests finished by ``t`` leave (the discipline hears of each before the running
        aggregates change)."""
        policy, est, log = self.policy, self.estimator, self._log
        n_f, sp_f, sa_f = self.running, self.running_prompt, self.running_admit
        s_n, s_p, s_a = self._s_n, self._s_p, self._s_a
        for s, h in enumerate(self._heaps):
            while h and h[0][0] <= t:
                fin, _, r = heapq.heappop(h)
                f = r.flow
                r.finish = fin
                policy.complete(r, t)
                s_n[s] -= 1
                s_p[s] -= r.prompt
                s_a[s] -= r.admit
                n_f[f] -= 1
                sp_f[f] -= r.prompt
                sa_f[f] -= r.admit
                self.decoded_done[f] += r.output
                if not n_f[f]:
                    self.running_flows.discard(f)
                if self._observe:
                    est.observe(r)
                log.touch(f)

    def _join(self, r: Request, t: int) -> None:
        """``r`` reaches the balancer."""
        r.seq = self._seq
        self._seq += 1
        if self._stamp:
            r.est = self.estimator.estimate(r)
        self.waiting[r.flow] += 1
        self._log.touch(r.flow)
        self.policy.arrive(r, t)

    def _arrive(self, t: int) -> None:
        """The workload's arrivals at ``t`` join the balancer's queue; a prompt larger than
        the KV budget can never be placed: rejected (the report says so)."""
        reqs, M = self._reqs, self.fleet.kv_budget
        n = len(self.workload)
        i = self._next_arrival
        while i < n and reqs[i].arrival <= t:
            r = reqs[i]
            i += 1
            if r.prompt > M:
                self._rejected.append(r.rid)
                continue
            self._join(r, t)
        self._next_arrival = i

    def _top_up(self, t: int) -> None:
        """Closed-loop clients top their waiting requests up to their ``keep``."""
        waiting, reqs = self.waiting, self._reqs
        for c, sizes in self._closed:
            f = c.flow
            if c.active(t) and waiting[f] < c.keep:
                for _ in range(c.keep - waiting[f]):  # a refused request is not retried this step
                    p, o = next(sizes)
                    r = Request(len(reqs), f, t, p, o, c.cap)
                    reqs.append(r)
                    self._join(r, t)

    def _admit(self, t: int) -> None:
        """While some server has room (a free slot and free KV) the discipline starts the
        next request that fits the server with the most free KV; when the one it names fits
        nowhere, admission stops until something leaves (the balancer stalls)."""
        S, M = self.fleet.servers, self.fleet.kv_budget
        B = self.fleet.max_batch if self.fleet.max_batch is not None else (1 << 62)
        s_n, s_p, s_a = self._s_n, self._s_p, self._s_a
        policy = self.policy
        room = [0]

        def fits(r: Request) -> bool:
            return r.prompt <= room[0]

        while True:
            best = -1
            best_free = 0
            for s in range(S):
                if s_n[s] < B:
                    free = M - (s_p[s] + s_n[s] * t - s_a[s])
                    if free > best_free:
                        best, best_free = s, free
            if best < 0:
                break
            room[0] = best_free
            r = policy.start(t, fits)
            if r is None:
                break
            self._place(r, best, t)

    def _place(self, r: Request, s: int, t: int) -> None:
        """``r`` starts on server ``s`` at ``t``: prefill now, decode from now on."""
        f, p = r.flow, r.prompt
        self.waiting[f] -= 1
        r.admit = t
        r.server = s
        self._s_n[s] += 1
        self._s_p[s] += p
        self._s_a[s] += t
        self.running[f] += 1
        self.running_prompt[f] += p
        self.running_admit[f] += t
        self.running_flows.add(f)
        self.prefilled[f] += p
        self.charged[f] += r.est
        self._log.touch(f)
        heapq.heappush(self._heaps[s], (t + r.output, r.rid, r))

    def _next_event(self, t: int) -> int | None:
        """The next step at which something can happen: an arrival, a completion, a
        closed-loop top-up, the discipline's wake-up, a mark, the horizon (``None``: never)."""
        reqs, i = self._reqs, self._next_arrival
        nxt = reqs[i].arrival if i < len(self.workload) else None
        for h in self._heaps:
            if h and (nxt is None or h[0][0] < nxt):
                nxt = h[0][0]
        waiting = self.waiting
        for c, _ in self._closed:
            # the next top-up: next step if it is short of its keep, else its start
            due = t + 1 if waiting[c.flow] < c.keep or c.start > t else None
            if due is not None:
                due = max(due, c.start)
                if (c.end is None or due < c.end) and (nxt is None or due < nxt):
                    nxt = due
        w = self.policy.wakeup(t)
        if w is not None and w > t and (nxt is None or w < nxt):
            nxt = w
        marks = self._marks
        while marks and marks[0] <= t:
            marks.pop(0)
        if marks and (nxt is None or marks[0] < nxt):
            nxt = marks[0]
        if self.horizon is not None and (nxt is None or nxt > self.horizon):
            nxt = self.horizon
        return nxt

    def _result(self, t: int, events: int) -> RunResult:
        reqs, log = self._reqs, self._log
        n_req = len(reqs)
        rej = np.zeros(n_req, dtype=bool)
        rej[self._rejected] = True

        def col(attr: str, dtype: Any) -> np.ndarray:
            return np.fromiter((getattr(r, attr) for r in reqs), dtype=dtype, count=n_req)

        def arr(xs: list[Any], dtype: Any) -> np.ndarray:
            return np.asarray(xs, dtype=dtype)

        return RunResult(
            policy=getattr(self.policy, "label", self.policy.name), flows=self.flows, fleet=self.fleet,
            w_p=self.w_p, w_q=self.w_q, end=t, times=arr(log.times, np.int64), log_k=arr(log.k, np.int64),
            log_flow=arr(log.flow, np.int64), log_pre=arr(log.pre, np.int64), log_done=arr(log.done, np.int64),
            log_n=arr(log.n, np.int64), log_sa=arr(log.sa, np.int64), log_wait=arr(log.wait, np.int64),
            log_charged=arr(log.charged, float), arrival=col("arrival", np.int64), admit=col("admit", np.int64),
            finish=col("finish", np.int64), flow=col("flow", np.int64), prompt=col("prompt", np.int64),
            output=col("output", np.int64), est=col("est", float), server=col("server", np.int64),
            rejected=rej, events=events,
        )


def simulate(workload: Workload, policy: Discipline | str, fleet: Fleet = Fleet(), **kwargs: Any) -> RunResult:
    """Run ``policy`` (a :class:`~sfq.sim.policies.Discipline` or a policy name) on ``workload``."""
    if isinstance(policy, str):
        from .policies import make_policy

        policy = make_policy(policy)
    return Simulation(workload, policy, fleet, **kwargs).run()
