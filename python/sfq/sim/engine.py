"""A deterministic discrete-event model of a fleet of continuous-batching engines.

The model (seed 003's simulator, extended to a fleet)
-----------------------------------------------------
* ``servers`` engines, each with a KV budget of ``kv_budget`` tokens and at most
  ``max_batch`` running requests (``None``: limited by KV only).
* One **step** is one decode iteration. At the start of step ``t``: requests finished by
  ``t`` leave; requests arriving at ``t`` join the balancer's queue; then, while some
  server has room (a free slot and free KV), the policy names the next request
  (``peek``), the balancer places it on the server with the most free KV, and the policy
  is told it started (``admit``). When the named request does not fit there, admission
  stops until something leaves (the balancer stalls, seed 000 §5.2). Then every running
  request generates one token.
* A request admitted with prompt ``p`` occupies ``p + generated`` tokens; it is admitted
  when ``occupancy + p <= kv_budget`` (seed 003's rule: decode growth is not reserved, no
  preemption), generates its ``output`` tokens in the steps ``admit .. admit+output-1``
  and is gone at step ``admit + output``.
* Service of a flow is ``W = w_p * prompt tokens admitted + w_q * tokens generated``:
  prefill counts at admission, decode as it happens (seed 003). Throughput is what the
  fleet delivered, in weighted tokens per step; nothing about it is assumed.

Event-driven, exactly
---------------------
Between two events (an arrival, a completion, a policy wake-up, a mark) nothing can be
admitted: occupancy only grows and the queue only changes at events. So the loop jumps
from event to event and advances decode in bulk; per flow it keeps the number of running
requests, their prompt sum and admit-step sum, so that the generated tokens at any step
are ``sum(t - admit)`` in O(1). The result is identical to stepping one step at a time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .estimate import Estimator, RatioEstimator
from .model import FlowSpec, Workload

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

    Samples (one row each): ``times`` (steps), cumulative ``prefill`` and ``decoded``
    tokens per flow, and ``backlog`` (the flow had a request waiting at the balancer
    during the segment that starts at this sample), and ``charged``: the estimated cost
    of the flow's started requests (what the balancer-side policies order by). Two samples per event: before
    admission (the admission jump follows) and after (decode follows).
    Requests: ``arrival``, ``admit`` (-1: never started), ``finish`` (-1: not finished),
    ``flow``, ``prompt``, ``output``, ``est``; ``rejected`` counts requests whose prompt
    exceeds the KV budget (they can never run; rejected on arrival).
    """

    policy: str
    flows: tuple[FlowSpec, ...]
    fleet: Fleet
    w_p: float
    w_q: float
    end: int
    times: np.ndarray
    prefill: np.ndarray
    decoded: np.ndarray
    backlog: np.ndarray
    charged: np.ndarray
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

    @property
    def service(self) -> np.ndarray:
        """Weighted tokens per flow at each sample, shape (samples, flows)."""
        return self.w_p * self.prefill + self.w_q * self.decoded

    @property
    def weights(self) -> np.ndarray:
        return np.array([f.weight for f in self.flows], dtype=float)


class Simulation:
    """One run of ``policy`` on ``workload`` over ``fleet``.

    ``horizon``: stop at this step (``None``: when every request is done). ``marks``:
    extra steps at which to take samples (so windowed metrics are exact there).
    ``estimator``: the cost estimate stamped on each request at arrival (``Request.est``);
    it is told every completion. ``progress(t)`` is called now and then with the step.
    """

    def __init__(
        self,
        workload: Workload,
        policy,
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
        self.waiting = [0] * nf  # requests at the balancer (arrived, not started)
        self._ran = False

    def run(self) -> RunResult:
        """Run to the horizon (or until nothing is left). A Simulation runs once: the
        policy and the estimator carry state, so make a new one for another run."""
        if self._ran:
            raise RuntimeError("this Simulation has already run; create a new one (with a fresh policy)")
        self._ran = True
        reqs = self.workload.requests()
        policy = self.policy
        est = self.estimator
        nf = len(self.flows)
        S = self.fleet.servers
        M = self.fleet.kv_budget
        B = self.fleet.max_batch if self.fleet.max_batch is not None else (1 << 62)
        n_f, sp_f, sa_f, waiting = self.running, self.running_prompt, self.running_admit, self.waiting
        done_dec = [0] * nf
        pre = [0] * nf
        charged = [0.0] * nf  # estimated cost of started requests
        heaps: list[list] = [[] for _ in range(S)]
        s_n = [0] * S
        s_p = [0] * S
        s_a = [0] * S
        rejected = np.zeros(len(reqs), dtype=bool)
        policy.bind(self)

        times: list[int] = []
        rows_p: list[list[int]] = []
        rows_d: list[list[int]] = []
        rows_b: list[list[bool]] = []
        rows_c: list[list[float]] = []

        def sample(t: int) -> None:
            times.append(t)
            rows_p.append(pre[:])
            rows_d.append([done_dec[f] + n_f[f] * t - sa_f[f] for f in range(nf)])
            rows_b.append([w > 0 for w in waiting])
            rows_c.append(charged[:])

        marks = list(self.marks)
        horizon = self.horizon
        progress = self.progress
        N = len(reqs)
        i = 0
        t = 0
        events = 0
        heappop, heappush = heapq.heappop, heapq.heappush
        while True:
            events += 1
            if progress is not None and not events & 1023:
                progress(t)
            # 1. completions
            for s in range(S):
                h = heaps[s]
                while h and h[0][0] <= t:
                    fin, _, r = heappop(h)
                    f = r.flow
                    s_n[s] -= 1
                    s_p[s] -= r.prompt
                    s_a[s] -= r.admit
                    n_f[f] -= 1
                    sp_f[f] -= r.prompt
                    sa_f[f] -= r.admit
                    done_dec[f] += r.output
                    r.finish = fin
                    est.observe(r)
                    policy.complete(r, t)
            if horizon is not None and t >= horizon:
                sample(t)
                break
            # 2. arrivals
            while i < N and reqs[i].arrival <= t:
                r = reqs[i]
                i += 1
                if r.prompt > M:  # can never be placed: rejected, with the reason in the report
                    rejected[r.rid] = True
                    continue
                r.est = est.estimate(r)
                waiting[r.flow] += 1
                policy.arrive(r, t)
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
                pre[f] += p
                charged[f] += r.est
                heappush(heaps[best], (t + r.output, r.rid, r))
            sample(t)
            # 4. the next event
            nxt = reqs[i].arrival if i < N else None
            for h in heaps:
                if h and (nxt is None or h[0][0] < nxt):
                    nxt = h[0][0]
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

        times_a = np.asarray(times, dtype=np.int64)
        res = RunResult(
            policy=getattr(policy, "label", policy.name),
            flows=self.flows,
            fleet=self.fleet,
            w_p=self.w_p,
            w_q=self.w_q,
            end=t,
            times=times_a,
            prefill=np.asarray(rows_p, dtype=np.int64).reshape(len(times), nf),
            decoded=np.asarray(rows_d, dtype=np.int64).reshape(len(times), nf),
            backlog=np.asarray(rows_b, dtype=bool).reshape(len(times), nf),
            charged=np.asarray(rows_c, dtype=float).reshape(len(times), nf),
            arrival=np.fromiter((r.arrival for r in reqs), dtype=np.int64, count=N),
            admit=np.fromiter((r.admit for r in reqs), dtype=np.int64, count=N),
            finish=np.fromiter((r.finish for r in reqs), dtype=np.int64, count=N),
            flow=np.fromiter((r.flow for r in reqs), dtype=np.int64, count=N),
            prompt=np.fromiter((r.prompt for r in reqs), dtype=np.int64, count=N),
            output=np.fromiter((r.output for r in reqs), dtype=np.int64, count=N),
            est=np.fromiter((r.est for r in reqs), dtype=float, count=N),
            server=np.fromiter((r.server for r in reqs), dtype=np.int64, count=N),
            rejected=rejected,
            events=events,
        )
        return res


def simulate(workload: Workload, policy, fleet: Fleet = Fleet(), **kwargs) -> RunResult:
    """Run ``policy`` (a :class:`~sfq.sim.policies.Policy` or a policy name) on ``workload``."""
    if isinstance(policy, str):
        from .policies import make_policy

        policy = make_policy(policy)
    return Simulation(workload, policy, fleet, **kwargs).run()
